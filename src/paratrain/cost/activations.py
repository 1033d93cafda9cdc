"""One microbatch through the model in fake tensors (FakeRun): the activations autograd saves for
backward, the bytes a pipeline stage sends on, the payloads of tensor parallelism's all-reduces.
`paratrain plan` counts memory and messages with them, its step-time prediction times them."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from paratrain.config import Config
from paratrain.cost.planned_batch import context_chunks, cut_batch
from paratrain.cost.played import RealTensors, plays_in_fake_tensors, without_peers
from paratrain.cost.ranks import RankPlan
from paratrain.data.batch import feed, tensors_in, tree_map
from paratrain.errors import ConfigError
from paratrain.models.recompute import blocks, run_layers, watch_decisions


@dataclass
class TensorSharding:
    """How tensor parallelism changes a model the planner plays (the tensor layers give it: this
    module sits below the strategies and names none)."""

    shard: Callable[[nn.Module], object]  # make the planned modules tp rank 0's shards, in place
    loss: Callable[[nn.Module, Callable], Callable | None]  # the loss on its output; None: not modelled


def _fake_model(cfg: Config, dataset, mode) -> nn.Module:
    """The model in fake tensors: built under `mode`, or, where its construction reads values (an
    initialisation that samples until a value fits: torch 2.13's trunc_normal_, ViT's) or swaps
    a module's tensors for others (peft's LoRA layers moved where their base layer is), built on
    the meta device and its tensors replaced by fake CPU tensors of the same shapes and dtypes (the
    planner never reads their values; ties kept). A model that neither builds exits 2 in one line."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    from paratrain.models import build_model

    try:
        with mode:
            return build_model(cfg, dataset)
    except (DataDependentOutputException, DynamicOutputShapeException):
        pass
    except RuntimeError as exc:  # a swap of fake tensors is refused (torch.utils.swap_tensors)
        if "swap" not in str(exc):
            raise
    try:
        with torch.device("meta"):
            model = build_model(cfg, dataset)
    except RuntimeError as exc:
        raise ConfigError("model.factory", f"plan cannot build the model in fake tensors: {exc}") from None
    fakes: dict[int, torch.Tensor] = {}
    with mode:
        for module in model.modules():
            for kind in ("_parameters", "_buffers"):
                tensors = getattr(module, kind)
                for name, t in tensors.items():
                    if t is not None and id(t) not in fakes:
                        fake = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                        fakes[id(t)] = nn.Parameter(fake, t.requires_grad) if kind == "_parameters" else fake
                    if t is not None:
                        tensors[name] = fakes[id(t)]
    return model


@dataclass
class FakeRun:
    """The model and one microbatch in fake tensors (torch's FakeTensorMode: shapes, dtypes and the
    CPU's own choice of kernels, no memory and no arithmetic; the meta device would run attention by
    its math path, which saves other tensors than the CPU's flash attention), cut into stages."""

    mode: contextlib.AbstractContextManager
    model: nn.Module
    stages: list[list[nn.Module]]
    x: Any  # the batch's inputs and targets, of any structure (data/batch.py)
    y: Any
    # the strategies' own autocast for train.precision = "bf16" (on the CPU, like the tensors)
    autocast: contextlib.AbstractContextManager
    recompute: str  # train.recompute: "full" keeps each block's input, "selective" its products' outputs too
    loss_fn: Callable  # train.loss as the engine computes it on the last stage (cut_batch)

    def block_starts(self, s: int) -> list[nn.Module]:
        """The first layer of each recomputed block of stage s (whose input the block keeps)."""
        layers = self.stages[s]
        if layers == [self.model]:
            from paratrain.models.layers import pipeline_layers

            layers = pipeline_layers(self.model) or [self.model]
        return [block[0] for block in blocks(layers)]

    @classmethod
    def build(
        cls,
        cfg: Config,
        rows: int,
        bounds: list[int] | None,
        tp_plan: dict | None = None,
        tp: int = 1,
        working: torch.dtype | None = None,
        sharding: TensorSharding | None = None,
    ) -> FakeRun:
        """`bounds` over pipeline_layers; None: the whole model as one stage. With tp > 1 the
        planned modules are tp rank 0's shards (the largest: shard_sizes), as `sharding` makes them. `working`: the dtype of
        the trainable parameters the strategy computes with, where not the model's own (mixed-precision
        ZeRO's bf16 working copies)."""
        played = cls.assemble(cfg, rows, bounds, tp, working, sharding, real=False)
        if plays_in_fake_tensors(cfg, played):
            return played
        return cls.assemble(cfg, rows, bounds, tp, working, sharding, real=True)

    @classmethod
    def assemble(cls, cfg, rows, bounds, tp, working, sharding, real: bool) -> FakeRun:
        """build's run in fake tensors, or (`real`) in real ones on the CPU: a model whose forward
        reads its tensors' values (`.item()` for control flow, numpy) measured on a real batch."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from paratrain.data import build_dataset, load_batch
        from paratrain.models import build_model
        from paratrain.models.layers import layers_of

        dataset = build_dataset(cfg, "train")
        x, y = context_chunks(cfg, *load_batch(dataset, torch.arange(rows)))
        mode = RealTensors() if real else FakeTensorMode()
        model = build_model(cfg, dataset) if real else _fake_model(cfg, dataset, mode)
        x, y, loss_fn = cut_batch(cfg, model, x, y, cut=bounds is not None)
        with mode:
            if tp > 1:
                assert sharding is not None  # given with tp > 1
                sharding.shard(model)
            for p in model.parameters() if working is not None else ():
                if p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(working)
        if bounds is None:
            stages = [[model]]
        else:
            layers = layers_of(model)
            stages = [layers[a:b] for a, b in zip(bounds, bounds[1:])]
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16) if cfg.train.precision == "bf16" else contextlib.nullcontext()
        )
        x, y = tree_map(mode.from_tensor, (x, y))
        return cls(mode, model, stages, x, y, autocast, cfg.train.recompute, loss_fn)

    def held(self) -> list[torch.Tensor]:
        """The batch's tensors: the data, held anyway; with the tensors they are views of (a
        token row's inputs and targets are both views of it, which autograd may save)."""
        batch = tensors_in((self.x, self.y))
        return batch + [t._base for t in batch if t._base is not None]

    def run_stage(self, s: int, layers: list[nn.Module], x):
        """Stage s on its input. A batch that is not one tensor goes to the first layer as the
        model takes it (model(**x) for a dict), which recomputes by its own switch if at all."""
        if layers == [self.model]:  # the whole model, as dp and zero run it: it recomputes by its own switch
            return feed(self.model, x)
        if s == 0 and not isinstance(x, torch.Tensor):
            x, layers = feed(layers[0], x), layers[1:]
        return run_layers(layers, x, self.recompute)

    def forward(self, loss_fn=None, around_stage=lambda s: contextlib.nullcontext()) -> None:
        """One forward through the stages as the pipeline engine runs them: a stage after the first
        starts from a detached input that needs its gradient; the loss (if given) in the last
        stage. `around_stage(s)` is a context each stage's compute runs in."""
        with self.mode, self.autocast:
            act = self.x
            for s, layers in enumerate(self.stages):
                act = act if s == 0 else act.detach().requires_grad_(act.is_floating_point())
                with around_stage(s):
                    act = self.run_stage(s, layers, act)
                    if loss_fn is not None and s == len(self.stages) - 1:
                        loss_fn(act, self.y)


def saved_activation_bytes(
    cfg: Config, rows: int, bounds: list[int] | None = None, working: torch.dtype | None = None
) -> list[int]:
    """Bytes autograd saves for backward in the forward of one microbatch of `rows` samples through
    each pipeline stage, the loss in the last stage's; each tensor once (views count as their
    base), parameters and the batch never (the batch is the data, held anyway)."""

    run = FakeRun.build(cfg, rows, bounds, working=working)
    params = {id(t) for t in [*run.model.parameters(), *run.held()]}
    out: list[int] = []

    @contextlib.contextmanager
    def counting(s: int):
        seen: dict[int, torch.Tensor] = {}  # keeps what it counted alive, so no id is reused

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t._base if t._base is not None else t
            if id(base) not in params and id(base) not in seen:
                seen[id(base)] = base
            return t

        def keep_block_input(module, args):
            pack(args[0])

        # under recompute autograd's hooks never see a checkpointed block's tensors: the block keeps
        # its input instead, counted as its first layer receives it, and under selective recompute
        # the outputs its policy keeps besides (models/recompute.py)
        recomputed = run.recompute != "none"
        handles = [m.register_forward_pre_hook(keep_block_input) for m in run.block_starts(s)] if recomputed else []

        def keep_product(func, keep: bool, output) -> None:
            for t in tree_leaves(output) if keep else ():
                if isinstance(t, torch.Tensor):
                    pack(t)

        kept = watch_decisions(keep_product) if run.recompute == "selective" else contextlib.nullcontext()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kept:
                yield
        finally:
            for h in handles:
                h.remove()
        out.append(sum(t.numel() * t.element_size() for t in seen.values()))

    run.forward(run.loss_fn, counting)
    return out


def boundary_bytes(cfg: Config, model: nn.Module, bounds: list[int], rows: int) -> list[int]:
    """Bytes of one microbatch's activation entering each stage, as the engine sends it (its dtype
    from the same meta-device pass the engine uses; under parallel.cp, of this rank's chunks)."""
    from paratrain.data import build_dataset, load_batch
    from paratrain.models.layers import boundary_shape_fn, layers_of, meta_copy

    meta = layers_of(meta_copy(model))
    x, _ = context_chunks(cfg, *load_batch(build_dataset(cfg, "train"), torch.arange(rows)))
    x, _, _ = cut_batch(cfg, model, x, None, cut=True)
    shapes = boundary_shape_fn([meta[a:b] for a, b in zip(bounds, bounds[1:])])(x)
    return [shape.numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in shapes]


def tp_all_reduces(cfg: Config, rows: int, bounds: list[int] | None, tp_plan: dict) -> list[list[int]] | None:
    """Per stage, the payloads of the all-reduces tensor parallelism runs for one microbatch
    (tensor/comm.py's paired operators): a row-parallel layer's output in forward, a column-parallel
    layer's input gradient in backward (when that input needs one), a vocabulary-parallel
    embedding's rows, and the vocabulary-parallel cross-entropy's per-token max and sums. Their
    shapes and dtypes are the unsplit layers' own, from one forward in fake tensors. None when a
    user loss takes a sharded output (it gathers the output first; not modelled)."""
    from paratrain.optim import build_loss, cross_entropy

    run = FakeRun.build(cfg, rows, bounds)
    modules = dict(run.model.named_modules())
    last_linear = [n for n, m in modules.items() if isinstance(m, nn.Linear)][-1]
    sharded_output = tp_plan.get(last_linear) == "colwise"
    if sharded_output and build_loss(cfg) is not cross_entropy:
        return None
    stage_of = {id(m): s for s, layers in enumerate(run.stages) for layer in layers for m in layer.modules()}
    payloads: list[list[int]] = [[] for _ in run.stages]

    def record(style: str):
        def hook(module, args, out):
            if style in ("rowwise", "vocab", "moe_tp_experts", "all_reduce"):
                payloads[stage_of[id(module)]].append(out.numel() * out.element_size())
            elif args[0].requires_grad:
                payloads[stage_of[id(module)]].append(args[0].numel() * args[0].element_size())

        return hook

    # a planned parameter (an experts' stack) communicates through its module's entry
    planned = [
        (n, style)
        for n, style in tp_plan.items()
        if n in modules and style not in ("mla_kv_a_proj", "moe_identity_expert")
    ]
    handles = [modules[name].register_forward_hook(record(style)) for name, style in planned]
    try:
        run.forward()
    finally:
        for h in handles:
            h.remove()
    if sharded_output:  # the vocabulary-parallel cross-entropy: max, then (sum of exp, target logit)
        tokens = run.y.numel()
        payloads[-1] += [tokens * 4, 2 * tokens * 4]
    return payloads


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage an op creates while it is alive (a weak reference to each
    storage tells when it goes), and their peak: the memory a step of fake tensors would hold.
    Storages made before (parameters, gradients, the batch) are not counted."""

    def __init__(self, made_before=()):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref | None] = {}  # None: seen, no longer tracked
        self._before = [t.untyped_storage() for t in made_before]  # views of them are not new memory
        for storage in self._before:
            self._refs[id(storage)] = None

    def mark(self) -> int:
        """Starts a new peak from what is alive now; returns it."""
        self.peak = self.live
        return self.live

    def forget(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s storage is counted elsewhere (a pipeline's receive buffer): not here, from now on."""
        key = id(t.untyped_storage())
        if self._refs.get(key) is not None:
            self._refs[key] = None  # its weak reference goes, and with it the callback
            self.live -= t.untyped_storage().nbytes()
        return t

    def _gone(self, key: int, size: int, _ref: object = None) -> None:  # _ref: weakref's callback argument
        self._refs.pop(key, None)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._refs:
                    size = storage.nbytes()
                    self._refs[key] = weakref.ref(storage, functools.partial(self._gone, key, size))
                    self.live += size
                    self.peak = max(self.peak, self.live)
        return out


@dataclass
class StageMemory:
    """One microbatch through one pipeline stage (the whole model without pp), in bytes over what
    was alive before its forward: parameters and gradients (kept by the strategy) not included."""

    forward_peak: int  # the most alive at once during its forward (and loss)
    kept: int  # what its forward leaves alive until its backward: saved activations, its input and output
    backward_peak: int  # the most alive at once during its backward, its kept bytes included


def step_memory(
    cfg: Config,
    rows: int,
    bounds: list[int] | None = None,
    tp_plan: dict | None = None,
    tp: int = 1,
    working: torch.dtype | None = None,
    sharding: TensorSharding | None = None,
) -> list[StageMemory] | None:
    """Each stage's memory over one microbatch's forward and backward, played in fake tensors with
    every storage counted while alive: saved activations, the temporaries of each op, the logits and
    the loss, activation gradients in backward, each parameter's incoming gradient before it is
    added to the one the strategy keeps (present, as after the first step), and a later stage's
    input gradient. Stage by stage, each from a fresh input as the engine receives it; what the
    engine receives is not counted here (it keeps a pool of receive buffers: pipeline/footprint.receive_buffers).
    Under tp (`tp_plan` over `tp` ranks) tp rank 0's shards and the loss the engine computes on
    them, as `sharding` (the tensor layers') makes them; None where that loss is not modelled."""

    run = FakeRun.build(cfg, rows, bounds, tp_plan, tp, working, sharding)
    loss_fn = run.loss_fn
    if tp > 1:
        sharded_loss = cast(TensorSharding, sharding).loss(run.model, loss_fn)  # given with tp > 1
        if sharded_loss is None:
            return None
        loss_fn = sharded_loss
    with run.mode:
        for p in run.model.parameters():
            if p.grad is None:  # the strategy's gradients, kept between steps (a shared run may have them)
                p.grad = torch.zeros_like(p)
    held = [t for p in run.model.parameters() for t in (p, p.grad)] + run.held()
    out: list[StageMemory] = []
    shape_in = run.x
    for s, layers in enumerate(run.stages):
        if run.recompute != "none" and layers == [run.model]:  # recomputed block by block, as the engines run it
            from paratrain.models.layers import pipeline_layers

            layers = pipeline_layers(run.model) or layers
        chain = repeated_layers(layers, s == 0)
        memory = None
        if chain is not None:  # a deep stage: its identical layers played twice and three times
            start, n = chain
            (two, _), (three, three_out) = (
                _stage_memory(run, s, [*layers[: start + j], *layers[start + n :]], shape_in, loss_fn, held)
                for j in (2, 3)
            )
            memory = extrapolated(two, three, n)
        if memory is not None:
            shape_in = three_out  # identical layers keep their input's shape: the stage's output
        else:
            memory, shape_in = _stage_memory(run, s, layers, shape_in, loss_fn, held)
        out.append(memory)
    return out


MIN_REPEATS = 5  # identical layers in a row from which a stage is extrapolated, not played whole


def repeated_layers(layers: list[nn.Module], first_stage: bool) -> tuple[int, int] | None:
    """(start, count) of the longest run of identical layers (the same modules, parameters of the
    same shapes: a transformer's blocks), each with parameters (so each its own recomputed block);
    None below MIN_REPEATS. The first stage's first layer takes the batch as the model does: not
    counted in a run."""

    def signature(layer: nn.Module):
        params = tuple((n, t.shape, t.dtype, t.requires_grad) for n, t in layer.named_parameters())
        return (repr(layer), params) if params else None

    signatures = [signature(layer) for layer in layers]
    best, start = None, int(first_stage)
    while start < len(layers):
        end = start + 1
        while end < len(layers) and signatures[end] == signatures[start]:
            end += 1
        if signatures[start] is not None and end - start >= MIN_REPEATS and (best is None or end - start > best[1]):
            best = (start, end - start)
        start = end
    return best


def extrapolated(two: StageMemory, three: StageMemory, n: int) -> StageMemory | None:
    """A stage of n identical layers in a row from the same stage with two and with three of them.
    Each identical layer plays the same allocations on a level raised by what each earlier one keeps
    (k, the kept bytes' step from two to three); every moment's level is so a + b n with b <= k (what
    a layer leaves after its backward is no more than what it kept), and a peak is the most of them.
    Where a peak grows by k from two to three, the moment that sets it is one of slope k, which no
    other overtakes: the peak at n is its value at three, k (n - 3) higher. Otherwise (a moment of
    another slope sets it) None: the stage is played whole."""
    k = three.kept - two.kept
    peaks = (two.forward_peak, three.forward_peak), (two.backward_peak, three.backward_peak)
    if k < 0 or any(b - a != k for a, b in peaks):
        return None
    return StageMemory(*(x + k * (n - 3) for x in (three.forward_peak, three.kept, three.backward_peak)))


def _stage_memory(run: FakeRun, s: int, layers: list[nn.Module], shape_in, loss_fn, held: list):
    """Stage s's memory over a microbatch through `layers`, and its output (the next stage's input; None
    after the last)."""
    with run.mode, run.autocast, without_peers(), LiveBytes(held) as count:
        start = count.mark()
        # what the pipeline engine receives (this stage's input, its output's gradient) lies
        # in its pool of receive buffers, counted apart (pipeline/footprint.receive_buffers)
        if s > 0:
            x = count.forget(torch.empty_like(shape_in))
            x.requires_grad_(x.is_floating_point())
        else:
            x = shape_in
        y = run.run_stage(s, layers, x)
        last = s == len(run.stages) - 1
        loss = loss_fn(y, run.y) if last else None
        forward_peak, kept = count.peak - start, count.live - start
        count.mark()
        if last:  # the model's output, of any structure: no stage takes it
            assert loss is not None
            loss.backward()
            out = None
        else:
            y.backward(count.forget(torch.empty_like(y)))
            out = y.detach()
        backward_peak = count.peak - start
        del x, y, loss
    return StageMemory(forward_peak, kept, backward_peak), out


def whole_model_activations(cfg: Config, ranks: list[RankPlan], rows: int, working: torch.dtype | None = None) -> int:
    """Every rank runs one microbatch through the whole model at a time: its saved activations on
    each rank; returns the most a microbatch's forward and backward hold at once."""
    activations = saved_activation_bytes(cfg, rows, working=working)[0]
    for r in ranks:
        r.activation_bytes = activations
    memory = step_memory(cfg, rows, working=working)
    assert memory is not None  # None only under tp
    (m,) = memory
    return max(m.forward_peak, m.backward_peak)
