"""What every rank's strategy really holds, built one rank at a time in this one process on torch's
fake process group (collectives do nothing, so no peers are needed): the oracle for `paratrain plan`.

    python tests/fake_ranks.py CASES_JSON   ->  JSON on stdout: for each case, a list with each rank's counts

where CASES_JSON is a list of [world size, [KEY=VALUE overrides of the default job]].

Counted by storage, so a view (a parameter inside a flat bucket) counts its whole buffer once.
The optimizer takes one step on whatever the gradients hold, so that its state exists. Activations:
the peak of what autograd keeps saved for backward during one train_step (each storage once,
parameters and the batch excluded), the data being whatever the fake collectives leave in the buffers.
Codec: the storages a gradient codec holds after two steps, besides the gradients.
Communication: what a second train_step hands the profiler (every collective through
paratrain.comm.collectives, every pipeline message), by op, with the profiler's own minimum; on the fake
backend ZeRO takes the native collectives, NCCL's path."""

from __future__ import annotations

import contextlib
import json
import sys
import weakref

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from paratrain import config as config_mod
from paratrain.comm import collectives
from paratrain.data import build_dataset, load_batch
from paratrain.models import build_model
from paratrain.optim import build_loss
from paratrain.parallel import registry
from paratrain.parallel.registry import build_strategy, data_parallel_degree
from paratrain.profile import min_bytes_sent
from paratrain.runtime.process import Runtime


def storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


_new_group = dist.new_group


def _new_group_any_backend(*args, backend=None, **kwargs):
    """The parameter server asks for gloo groups by name; the fake backend is the only one here."""
    return _new_group(*args, **kwargs)


dist.new_group = _new_group_any_backend


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedPeak:
    """Peak bytes of the storages autograd holds for backward, each storage once."""

    def __init__(self, model, batch):
        self.model = model
        self.data = {t.untyped_storage().data_ptr() for t in batch}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.data or key in {p.untyped_storage().data_ptr() for p in self.model.parameters()}:
            return t  # the batch, a parameter, or a view of a gathered flat of parameters
        if not self.refs.get(key):
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        holder = _Saved(t)
        weakref.finalize(holder, self._unref, key, storage.nbytes())
        return holder

    def _unref(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= nbytes

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda x: x.tensor if isinstance(x, _Saved) else x)


class CommRecorder:
    """Stands in for the profiler: sums each op's payload and minimum bytes, as profile.py does."""

    def __init__(self):
        self.ops: dict[str, list] = {}

    def phase(self, name, index=None):
        return contextlib.nullcontext()

    def comm(self, op: str, data, group=None) -> None:
        nbytes = data if isinstance(data, int) else data.numel() * data.element_size()
        entry = self.ops.setdefault(op, [0, 0.0])
        entry[0] += nbytes
        entry[1] += min_bytes_sent(op, nbytes, dist.get_world_size(group))

    def result(self) -> dict:
        return {op: {"payload": n, "min_sent": int(m)} for op, (n, m) in self.ops.items()}


def tensors_in(obj, depth: int = 0):
    """Every tensor reachable from `obj` through attributes, dicts, lists and tuples."""
    if torch.is_tensor(obj):
        yield obj
    elif depth < 4:
        children = (
            obj.values()
            if isinstance(obj, dict)
            else obj
            if isinstance(obj, (list, tuple))
            else vars(obj).values()
            if hasattr(obj, "__dict__")
            else ()
        )
        for child in children:
            yield from tensors_in(child, depth + 1)


def held(world: int, rank: int, cfg) -> dict:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        rt = Runtime(rank, world, rank, torch.device("cpu"), "gloo", 0)
        torch.manual_seed(cfg.train.seed)
        on_meta = registry.spec(cfg.parallel.strategy).materializes_models
        with torch.device("meta") if on_meta else torch.device("cpu"):
            model = build_model(cfg, build_dataset(cfg, "train"))
        s = build_strategy(model, build_loss(cfg), cfg, rt)
        opt_params = [p for g in s.optimizer.param_groups for p in g["params"]] if s.optimizer else []
        params = opt_params + list(s.model.parameters())
        seen: set = set()
        out = {"rank": rank, "param_bytes": storage_bytes(params, seen)}
        # a parameter server's receive buffers hold its workers' gradients; ZeRO's gradient shards
        # are its optimizer's (under mixed precision the bf16 working ones: the fp32 copy is the step's)
        shards = [u.shard.grad for u in getattr(s, "units", [])]
        grads = [p.grad for p in params] + list(getattr(s, "recv_bufs", {}).values()) + shards
        out["grad_bytes"] = storage_bytes(grads, seen)
        if s.optimizer:
            s.optimizer.step()
        state = [
            t
            for st in (s.optimizer.state.values() if s.optimizer else [])
            for t in st.values()
            if torch.is_tensor(t) and t.dim() > 0
        ]
        out["optimizer_bytes"] = storage_bytes(state, seen)
        if cfg.parallel.strategy != "ps":  # ps workers need live servers to step
            train_set = build_dataset(cfg, "train")
            x, y = load_batch(train_set, torch.arange(cfg.data.batch_size // data_parallel_degree(cfg, world)))
            saved = SavedPeak(s.model, (x, y))
            with saved.hooks():
                s.train_step((x, y))
            out["activation_bytes"] = saved.peak
            recorder = CommRecorder()
            collectives.PROFILER = s.profiler = recorder
            try:
                s.train_step((x, y))
            finally:
                collectives.PROFILER = None
            out["comm"] = recorder.result()
            codec = getattr(getattr(s, "reducer", None), "codec", None)
            out["codec_bytes"] = storage_bytes([t for t in tensors_in(codec) if t.dim() > 0], seen)
        mesh = getattr(s, "mesh", None)
        if mesh is not None:
            out.update(pp=mesh.pp_rank, dp=mesh.dp_rank, tp=mesh.tp_rank, stages=list(s.stage_ids))
        return out
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    # one thread: the ranks' tensors are small, and a second thread only spins (half the CPU
    # time measured here, the counts the same) and, on a loaded machine, waits for a core
    torch.set_num_threads(1)
    results = []
    for world, sets in json.loads(sys.argv[1]):
        # the fake collectives gather nothing, so a plan's first-step check would compare zeros
        cfg = config_mod.load(None, [*sets, "parallel.verify_plan=false"])
        results.append([held(world, r, cfg) for r in range(world)])
    print(json.dumps(results))
