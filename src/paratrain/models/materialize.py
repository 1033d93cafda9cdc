"""Turn a model built on the meta device into real values one module at a time.

A sharded strategy builds the model under `torch.device("meta")` (shapes only, no memory) and then
asks for the values module by module, keeping only its shard of each before the next one is made,
so no rank ever holds the whole model. The values must be exactly those of a normal build with the
same seed, so the construction's random-number stream is replayed in the same order:

  phase 1  every module's `reset_parameters()`, in construction (registration, pre-order) order:
           this is all the initialisation of mlp and cnn;
  phase 2  the model's own pass after construction, if it has one: gpt re-initialises its Linear and
           Embedding weights with `self.apply(self._init_weights)` (post-order). A tensor that the pass
           leaves alone keeps its phase-1 value; which ones it touched is seen by pre-filling with NaN.

This holds for models whose initialisation is made of such steps, the built-ins. A user's factory
may initialise in any way, so its construction itself is replayed (record_on_meta):

  record   the factory runs on the meta device under a dispatch mode that notes every aten op, and
           for every tensor storage (numbered in the order first seen) the last op that touches it;
  replay   the factory runs again for real, from the random-number state the meta build started
           from, so every op draws exactly what a normal build draws. After the last op that touches
           a storage of the model's parameters or buffers, its value is final: it is handed to
           `keep` and the storage freed, so only the tensors still being built are ever whole.

A replay whose ops differ from the recording (code that branches on values, which meta tensors do
not have) is abandoned for a normal build from the same state, whose values are then all kept.
"""

from __future__ import annotations

import functools
import random
import sys
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from paratrain.checkpoint.weights import Weights

# keep(meta_tensor, value): called for every parameter and buffer of the meta model (identified by
# its meta tensor) as soon as its value is final; called again for a tensor that phase 2 overwrites.
Keep = Callable[[torch.Tensor, torch.Tensor], None]


def _direct_tensors(module: nn.Module) -> dict[str, dict]:
    return {
        "_parameters": {k: v for k, v in module._parameters.items() if v is not None},
        "_buffers": {k: v for k, v in module._buffers.items() if v is not None},
    }


def _with_real_tensors(
    module: nn.Module, fill: float | None, device: torch.device, run: Callable[[], None], keep: Keep, only_changed: bool
) -> None:
    """Give `module` real (empty or `fill`ed) direct tensors, `run`, hand the values to `keep`, undo."""
    originals = _direct_tensors(module)
    for kind, tensors in originals.items():
        for name, t in tensors.items():
            real = torch.empty(t.shape, dtype=t.dtype, device=device)
            if fill is not None and real.is_floating_point():
                real.fill_(fill)
            getattr(module, kind)[name] = nn.Parameter(real, t.requires_grad) if kind == "_parameters" else real
    try:
        with torch.no_grad():
            run()
        for kind, tensors in originals.items():
            for name, meta_tensor in tensors.items():
                value = getattr(module, kind)[name].detach()
                if only_changed and value.is_floating_point() and torch.isnan(value).all():
                    continue
                keep(meta_tensor, value)
    finally:
        for kind, tensors in originals.items():
            getattr(module, kind).update(tensors)


def _rng_state() -> tuple:
    numpy = sys.modules.get("numpy")
    return torch.get_rng_state(), random.getstate(), numpy.random.get_state() if numpy else None


def _set_rng_state(state: tuple) -> None:
    torch_state, python_state, numpy_state = state
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)


class _StorageNumbers:
    """Numbers storages in the order they are first seen alive (a storage freed and another made
    at its address gets a new number), identically in the meta build and its real replay."""

    def __init__(self):
        self.known: dict[int, tuple[int, StorageWeakRef]] = {}
        self.count = 0

    def lookup(self, t: torch.Tensor) -> int | None:
        storage = t.untyped_storage()
        known = self.known.get(storage._cdata)
        return None if known is None or known[1].expired() else known[0]

    def number(self, t: torch.Tensor) -> int:
        found = self.lookup(t)
        if found is None:
            found, self.count = self.count, self.count + 1
            self.known[t.untyped_storage()._cdata] = (found, StorageWeakRef(t.untyped_storage()))
        return found


class _OnEveryOp(TorchDispatchMode):
    """Calls `coming(op)` before each aten op runs (it may refuse it by raising), then
    `seen(op, tensors it read or made)`."""

    def __init__(
        self, seen: Callable[[object, list[torch.Tensor]], None], coming: Callable[[object], None] = lambda func: None
    ):
        super().__init__()
        self.seen, self.coming = seen, coming

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.coming(func)
        out = func(*args, **(kwargs or {}))
        self.seen(func, [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)])
        return out


class _Diverged(Exception):
    """The replay ran other ops than the recording."""


def _direct_pairs(meta_model: nn.Module, real_model: nn.Module):
    """(meta tensor, real tensor) for every direct parameter and buffer of two builds of one model."""
    for meta, real in zip(meta_model.modules(), real_model.modules()):
        for kind, tensors in _direct_tensors(meta).items():
            for name, t in tensors.items():
                yield t, getattr(real, kind)[name].detach()


class _Recording:
    """A factory's meta-device construction: its ops, each storage's last op, and which storages
    hold the model's parameters and buffers."""

    def __init__(self, build: Callable[[], nn.Module]):
        self.build, self.rng = build, _rng_state()
        self.ops: list = []
        self.last_op: dict[int, int] = {}
        self.numbers = _StorageNumbers()

    def _seen(self, func, tensors) -> None:
        for t in tensors:
            self.last_op[self.numbers.number(t)] = len(self.ops)
        self.ops.append(func)

    def record(self) -> nn.Module:
        with torch.device("meta"), _OnEveryOp(self._seen):
            model = self.build()
        self.held: dict[int, list[torch.Tensor]] = {}  # storage number -> the model's meta tensors on it
        self.unnumbered: list[torch.Tensor] = []  # made where no op saw them: kept after the replay
        for module in model.modules():
            for tensors in _direct_tensors(module).values():
                for t in tensors.values():
                    number = self.numbers.lookup(t)
                    if number is None:
                        self.unnumbered.append(t)
                    else:
                        self.held.setdefault(number, []).append(t)
        del self.numbers  # the replay numbers afresh
        return model

    def replay(self, meta_model: nn.Module, keep: Keep, device: torch.device) -> None:
        numbers, done, at = _StorageNumbers(), set(), 0

        def coming(func) -> None:  # before it runs: an op the recording lacks may touch a freed storage
            if at >= len(self.ops) or self.ops[at] != func:
                raise _Diverged(f"op {at}: {func}, recorded {self.ops[at] if at < len(self.ops) else 'none'}")

        def seen(func, tensors) -> None:
            nonlocal at
            for t in tensors:
                number = numbers.number(t)
                if self.last_op.get(number) != at or number not in self.held or number in done:
                    continue
                done.add(number)
                storage = t.untyped_storage()
                for meta in self.held[number]:  # a copy: `keep` may hold on to it, the storage goes
                    value = torch.empty(0, dtype=meta.dtype).set_(
                        storage, meta.storage_offset(), meta.shape, meta.stride()
                    )
                    keep(meta, value.to(device, copy=True))
                storage.resize_(0)
            at += 1

        before = _rng_state()
        _set_rng_state(self.rng)
        try:
            with _OnEveryOp(seen, coming):
                real = self.build()
            if at != len(self.ops):
                raise _Diverged(f"{at} ops, recorded {len(self.ops)}")
            unnumbered = {id(t) for t in self.unnumbered}
            for meta, value in _direct_pairs(meta_model, real):
                if id(meta) in unnumbered:
                    keep(meta, value.to(device))
        except _Diverged:
            _set_rng_state(self.rng)
            real = self.build()
            for meta, value in _direct_pairs(meta_model, real):
                keep(meta, value.to(device))
        finally:
            _set_rng_state(before)


# Models built by record_on_meta, with their recording (dropped with the model).
_RECORDED: weakref.WeakKeyDictionary[nn.Module, _Recording] = weakref.WeakKeyDictionary()
# Models whose values materialize then reads from pretrained weights (models/pretrained.py).
_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, Weights] = weakref.WeakKeyDictionary()


def tensor_names(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model by its full name (a tied tensor under each name),
    as a state dict and its safetensors name them."""
    return {
        f"{prefix}{'.' if prefix else ''}{name}": t
        for prefix, module in model.named_modules(remove_duplicate=False)
        for tensors in _direct_tensors(module).values()
        for name, t in tensors.items()
    }


def read_on_materialize(model: nn.Module, weights: Weights) -> None:
    """After its initialisation, materialize() hands `keep` the values `weights` hold for the meta
    model's tensors, a tensor at a time, each cast to the model's dtype."""
    _WEIGHTS[model] = weights


def _read_weights(model: nn.Module, weights: Weights, keep: Keep, device: torch.device) -> None:
    names = tensor_names(model)
    for name, value in weights.tensors():
        meta = names[name]
        keep(meta, value.to(device=device, dtype=meta.dtype))


def record_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` on the meta device, recorded so that materialize() can replay it for real a tensor
    at a time, with the random-number state (torch, random, numpy) `build` started from."""
    recording = _Recording(build)
    model = recording.record()
    _RECORDED[model] = recording
    return model


def materialize(model: nn.Module, seed: int, keep: Keep, device: torch.device | str = "cpu") -> None:
    """Replay the initialisation of the meta-device `model`: the recording of record_on_meta, or
    else that of a built-in model built with `seed`; then the values of the weights
    read_on_materialize gave it, where it did. `model` stays on meta."""
    device = torch.device(device)
    recording = _RECORDED.get(model)
    if recording is not None:
        recording.replay(model, keep, device)
    else:
        _replay_builtin(model, seed, keep, device)
    weights = _WEIGHTS.get(model)
    if weights is not None:
        _read_weights(model, weights, keep, device)


def _replay_builtin(model: nn.Module, seed: int, keep: Keep, device: torch.device) -> None:
    """The initialisation of a built-in model built with `seed`, in the module docstring's phases."""
    post_init = getattr(model, "_init_weights", None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():  # phase 1
            if any(_direct_tensors(module).values()):
                reset = getattr(module, "reset_parameters", None) or (lambda: None)
                _with_real_tensors(module, None, device, reset, keep, only_changed=False)
        if post_init is not None:  # phase 2, in the order of nn.Module.apply (children first)
            order: list[nn.Module] = []
            model.apply(order.append)
            for module in order:
                if any(_direct_tensors(module).values()):
                    _with_real_tensors(
                        module, float("nan"), device, functools.partial(post_init, module), keep, only_changed=True
                    )
