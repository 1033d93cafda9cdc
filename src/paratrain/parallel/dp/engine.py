"""Data parallelism: every rank holds the whole model; gradients are averaged across ranks.

How the all-reduce hides behind backward:
  * gradients live in flat bucket buffers (p.grad is a view into its bucket, so no copy in or out);
  * buckets are filled in reverse registration order, roughly the order backward produces them;
  * a post-accumulate-grad hook counts each bucket down; when a bucket's last gradient lands, its
    all-reduce starts asynchronously while backward carries on with earlier layers;
  * buckets are launched strictly in index order on every rank (gloo and NCCL match collectives by
    order), so a bucket with a parameter that got no gradient this step simply waits until
    backward ends and goes then, its unused slice still zero: no hang, no corruption;
  * with gradient accumulation the hooks stay quiet until the last micro-batch: gradients add up
    locally and only the final backward communicates;
  * what a bucket's communication is belongs to the codec (parallel/codecs/base.py): a plain
    all-reduce, or a compressed one (parallel.compression).

Profiled phases: forward, backward, comm (blocked waiting in finish()), compress (codec arithmetic),
optimizer (the finite check, clipping and the step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from paratrain import checkpoint as ckpt
from paratrain.data.batch import feed
from paratrain.optim import build_optimizer
from paratrain.parallel.base import Strategy, broadcast_tensors, clip_factor, unique_parameters, whole_model_chunks
from paratrain.parallel.codecs.base import Codec
from paratrain.parallel.codecs.basic import Uncompressed, build_codec
from paratrain.parallel.dp.batchnorm import BatchNormPolicy
from paratrain.parallel.expert.weights import keep_local_experts
from paratrain.profile import NULL_PROFILER


class Bucket:
    """Parameters whose gradients travel together in one flat buffer.

    `numel` is padded up to a multiple of `pad_to` so that ZeRO can cut the buffer into equal shards;
    the buffer itself is allocated by `allocate()` (dp keeps it for good, ZeRO stage 2 only briefly).
    """

    def __init__(self, index: int, params: list[torch.Tensor], device: torch.device, pad_to: int = 1):
        self.index = index
        self.params = params
        self.shapes = [p.shape for p in params]
        self.device = device
        self.dtype = params[0].dtype
        used = sum(p.numel() for p in params)
        self.numel = -(-used // pad_to) * pad_to
        self.buffer: torch.Tensor | None = None
        self.bound: torch.Tensor | None = None  # the buffer the parameters' .grad views point into
        self.pending = len(params)
        self.work = None

    def allocate(self) -> torch.Tensor:
        self.buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return self.buffer

    def bind_grads(self, flat: torch.Tensor | None = None) -> None:
        """Point every parameter's .grad at its slice of `flat` (default: the bucket's buffer)."""
        flat = self.buffer if flat is None else flat
        assert flat is not None  # allocated before any gradient
        if flat is self.bound:
            return
        offset = 0
        for p in self.params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.bound = flat


def make_buckets(
    params: Sequence[torch.Tensor], bucket_bytes: int, device: torch.device, pad_to: int = 1
) -> list[Bucket]:
    """Reverse registration order, cut when a bucket passes `bucket_bytes` or the dtype changes."""
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in reversed(params):
        current = groups[-1]
        if current and (size + p.numel() * p.element_size() > bucket_bytes or current[0].dtype != p.dtype):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    return [Bucket(i, g, device, pad_to) for i, g in enumerate(groups) if g]


class GradientReducer:
    """Bucketed, backward-overlapped gradient averaging over a process group."""

    def __init__(
        self,
        params: list[nn.Parameter],
        bucket_mb: float,
        device: torch.device,
        group=None,
        codec=None,
        pad_to: int = 1,
    ):
        self.group = group
        self.device = device
        self.codec = codec or Uncompressed()
        self.profiler = NULL_PROFILER
        self.world = dist.get_world_size(group)
        self.buckets = make_buckets(params, int(bucket_mb * 2**20), device, pad_to)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.next_to_launch = 0
        self.sync = False
        for b in self.buckets:
            b.allocate()
            b.bind_grads()
        if self.world > 1:  # alone, nothing overlaps backward: finish() does the little there is
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def zero_grad(self, rebind: bool = False) -> None:
        """`rebind`: point .grad at the buckets again even where it already was (the user's
        optimizer.zero_grad() set it to None)."""
        for b in self.buckets:
            assert b.buffer is not None  # dp allocates every bucket's buffer for good
            self.codec.reset(b.index, b.buffer, b.shapes)
            if rebind:
                b.bound = None
            b.bind_grads()  # backward accumulates into the buffer (finish may have pointed elsewhere)

    def prepare(self, sync: bool) -> None:
        """Before a backward: `sync` says whether this backward should communicate."""
        self.sync = sync
        if sync:
            self.next_to_launch = 0
            for b in self.buckets:
                b.pending, b.work = len(b.params), None

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket = self.bucket_of[id(p)]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(until=len(self.buckets), only_ready=True)

    def _launch(self, until: int, only_ready: bool) -> None:
        while self.next_to_launch < until:
            b = self.buckets[self.next_to_launch]
            if only_ready and b.pending:
                return
            if self.world > 1:
                b.work = self._communicate(b)
            self.next_to_launch += 1

    def _communicate(self, b: Bucket):
        """Start the averaging of one bucket (through the compression codec); returns its work."""
        assert b.buffer is not None
        return self.codec.launch(b.index, b.buffer, b.shapes, self.group, self.profiler)

    def finish(self) -> torch.Tensor:
        """After the syncing backward: launch what is left (unused parameters), wait for all, and
        return the global gradient norm. Each bucket's norm is taken while later buckets are still
        on the wire; every rank holds the same averaged gradients, so every rank gets the same norm
        and takes the same decisions from it (clip, skip a non-finite step) without talking."""
        self._launch(until=len(self.buckets), only_ready=False)
        for b in self.buckets:  # a codec's second round of communication starts for every bucket
            if b.work is not None:
                b.work.advance()
        norms = []
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            assert b.buffer is not None
            b.bind_grads(self.codec.result(b.index, b.buffer))  # the optimizer reads the average
            norm = self.codec.result_norm(b.index)
            norms.append(torch.linalg.vector_norm(b.bound) if norm is None else norm)
        self.sync = False
        if not norms:  # no parameters here (a pipeline chunk of activations alone)
            return torch.zeros((), device=self.device)
        return torch.linalg.vector_norm(torch.stack(norms))

    def discard(self) -> None:
        """After a skipped step: forget this step's gradients and the codec's memory of them."""
        for b in self.buckets:
            assert b.buffer is not None
            b.buffer.zero_()
            self.codec.discard(b.index)

    def scale_(self, factor: torch.Tensor) -> None:
        for b in self.buckets:
            assert b.bound is not None  # bound to the parameters' .grad
            b.bound.mul_(factor)


class LoneReducer:
    """dp in a group of one: nothing to average, so no buckets. Gradients are what backward makes
    (set to None between steps: no zeroing pass, and the first gradient is taken, not added into a
    bucket), as in a plain loop; finish() only takes the norm, for clipping and the skip of a
    non-finite step. Measured on an 8.7M-parameter MLP at one thread: the buckets' zeroing,
    accumulation and norm made the step 17% slower than a plain loop's."""

    def __init__(self, params: list[nn.Parameter], device: torch.device, codec):
        self.params, self.device, self.codec = params, device, codec  # the codec: only its (empty) state
        self.profiler = NULL_PROFILER

    def zero_grad(self, rebind: bool = False) -> None:
        """`rebind` (the Python API, after the user's own zero_grad): nothing to point back at."""
        if not rebind:
            for p in self.params:
                p.grad = None

    def prepare(self, sync: bool) -> None:
        pass

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def finish(self) -> torch.Tensor:
        grads = self._grads()
        if not grads:
            return torch.zeros((), device=self.device)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def discard(self) -> None:
        self.zero_grad()

    def scale_(self, factor: torch.Tensor) -> None:
        torch._foreach_mul_(self._grads(), factor)


class DataParallel(Strategy):
    name = "dp"
    splits_expert_weights = True

    def __init__(self, model, loss_fn, cfg, rt, group=None, own_loop: bool = False):
        """`own_loop`: the Python API's, whose user holds the model and an optimizer over all of its
        parameters: every rank keeps every expert there."""
        super().__init__(model.to(rt.device), loss_fn, cfg, rt)
        self.group = group
        src = 0 if group is None else dist.get_global_rank(group, 0)  # the group's first rank
        broadcast_tensors(list(model.parameters()) + list(model.buffers()), src=src, group=group)
        self.batchnorm = BatchNormPolicy(model, cfg.parallel.sync_batchnorm, group)
        self.split_sequences_and_experts(model)
        codec = build_codec(cfg.parallel, seed=cfg.train.seed)
        self.local_experts = None  # parallel.ep: the experts' weights this rank keeps (expert/weights.py)
        if self.experts is not None and group is None and not own_loop and type(codec) is Uncompressed:
            self.local_experts = keep_local_experts(model, self.experts.mesh)
        named = unique_parameters(model)
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.reducer = self._reducer(named, codec)
        # alone, no gradient hook waits for its bucket: backward may be one compiled graph
        self.compiles_whole = dist.get_world_size(group) == 1
        self.optimizer: torch.optim.Optimizer = build_optimizer(self.params, cfg.train)

    def _reducer(self, named: list[tuple[str, nn.Parameter]], codec):
        cfg, device = self.cfg, self.rt.device
        if self.local_experts is not None:
            from paratrain.parallel.dp.experts import SplitExpertsReducer

            mesh, kept = self.experts.mesh, self.local_experts.kept
            dense = GradientReducer([p for n, p in named if n not in kept], cfg.parallel.bucket_mb, device, None, codec)
            experts = [p for n, p in named if n in kept]
            return SplitExpertsReducer(
                dense,
                GradientReducer(experts, cfg.parallel.bucket_mb, device, mesh.expert_replicas, Uncompressed())
                if mesh.expert_replicas is not None
                else LoneReducer(experts, device, Uncompressed()),
                mesh,
            )
        if dist.get_world_size(self.group) > 1:
            return GradientReducer(self.params, cfg.parallel.bucket_mb, device, self.group, codec)
        return LoneReducer(self.params, device, codec)

    @property
    def profiler(self):
        return self.reducer.profiler

    @profiler.setter
    def profiler(self, profiler) -> None:  # the reducer reports its collectives too
        self.reducer.profiler = profiler

    def train_step(self, batch) -> torch.Tensor:
        prof = self.profiler
        self.reducer.zero_grad()
        self.batchnorm.before_step()
        micro = self.micro_batches(batch)
        losses = []
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            self.reducer.prepare(sync=last)
            with prof.phase("forward"), self.autocast():
                loss = self.loss_fn(feed(self.model, x), y)
            with prof.phase("backward"):
                (loss / len(micro) if len(micro) > 1 else loss).backward()
            losses.append(loss.detach())
        mean = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        # finish(): waits count as "comm" and codec arithmetic as "compress" (inside the codec)
        norm = self.reducer.finish()
        with prof.phase("optimizer"):
            # a codec that remembers gradients (error feedback) must forget a skipped step's: the
            # host decides; without one the next step's zero_grad drops them, and the device decides
            remembers = type(self.reducer.codec).discard is not Codec.discard
            self.skipped_step = self.step_if_finite(
                norm, self.reducer.scale_, self.reducer.discard if remembers else None
            )
        return mean

    # -- the Python API's own loop ----------------------------------------------------------------
    @classmethod
    def adopts_optimizers(cls, cfg) -> bool:
        return True

    def adopt_optimizer(self, optimizer):
        """The user's optimizer as it is: it holds the model's own parameters, whose .grad are
        views into the buckets."""
        self.optimizer = optimizer
        return optimizer

    def trained_params(self) -> list[nn.Parameter]:
        return self.params

    def backward_starts(self) -> None:
        """Every backward communicates (a second one before a zero_grad adds the next average to
        the first: gradient accumulation, as under DDP without no_sync)."""
        if any(p.grad is None for p in self.params):  # the user's zero_grad() let them go
            self.reducer.zero_grad(rebind=True)
        self.reducer.prepare(sync=True)

    def backward_ended(self) -> None:
        self.grad_norm = self.reducer.finish()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        self.reducer.scale_(clip_factor(self.grad_norm, max_norm))
        return self.grad_norm

    # -- state: every rank holds the same model and optimizer, so rank 0 writes them ----------
    # (and each rank its own compression memory: error feedback differs per rank). With the
    # experts split (parallel.ep), ranks 1..E-1 of the first ep group add their experts and those
    # experts' optimizer state, every name the dense model's: together the dense model.
    def state_dict(self):
        codec = {f"compression.{k}": v for k, v in self.reducer.codec.state_dict().items()}
        keeps = self.local_experts
        if self.rt.rank != 0 and (keeps is None or self.rt.rank >= keeps.mesh.ep):
            return codec, {}
        tensors = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        opt_tensors, opt_meta = ckpt.optimizer_to_tensors(self.optimizer, self._optimizer_names())
        tensors.update(opt_tensors)
        meta: dict = {"optimizer": opt_meta}
        if keeps is not None:  # a Hugging Face model's stacks whole on rank 0
            tensors = keeps.gather_stacks(tensors)
        if keeps is not None and self.rt.rank == 0:
            meta["expert_ranks"] = keeps.mesh.ep
        elif keeps is not None:  # an expert rank: its experts alone (rank 0 wrote the rest)
            tensors = {k: v for k, v in tensors.items() if k.split(".", 1)[1] in keeps.kept or _optim_of(k, keeps.kept)}
        tensors.update(codec)
        return tensors, meta

    def load_state_dict(self, reader) -> None:
        tensors, meta = reader.load(rank=0)
        scalars = dict(meta["optimizer"]["scalars"])
        for rank in range(1, meta.get("expert_ranks", 1)):  # the other experts of a split (above)
            theirs, their_meta = reader.load(rank=rank)
            tensors.update({k: v for k, v in theirs.items() if not k.startswith("compression.")})
            scalars.update(their_meta["optimizer"]["scalars"])
        dropped = self.local_experts.dropped if self.local_experts is not None else set()
        if self.local_experts is not None:  # a Hugging Face model's whole stacks: this rank's slices
            tensors = self.local_experts.local_slices(tensors)
        model_state = {
            k[len("model.") :]: v
            for k, v in tensors.items()
            if k.startswith("model.") and k[len("model.") :] not in dropped
        }
        ckpt.load_model_state(self.model, model_state)
        opt_meta = dict(meta["optimizer"], scalars=scalars)
        ckpt.optimizer_from_tensors(self.optimizer, self._optimizer_names(), tensors, opt_meta)
        if reader.world_size == self.rt.world_size:  # at another world size the memory starts empty
            own = tensors if self.rt.rank == 0 else reader.load(rank=self.rt.rank)[0]
            self.reducer.codec.load_state_dict(
                {k[len("compression.") :]: v.to(self.rt.device) for k, v in own.items() if k.startswith("compression.")}
            )

    def _optimizer_names(self) -> list[str]:
        """The names of the optimizer's parameters in its param_groups order (a user's optimizer
        may group them otherwise than the model registers them)."""
        name_of = {id(p): n for n, p in zip(self.param_names, self.params)}
        return [name_of[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def model_layout(self):
        if self.local_experts is not None:
            return dict(self.local_experts.layout)
        return super().model_layout()

    def model_chunks(self):
        if self.local_experts is not None:  # each expert from the rank keeping it
            return self.local_experts.chunks()
        return whole_model_chunks(self.model) if self.rt.rank == 0 else iter(())


def _optim_of(key: str, names: set[str]) -> bool:
    """Whether `key` (optim.NAME.STATE) is the optimizer state of one of `names`."""
    return key.startswith("optim.") and key[len("optim.") :].rsplit(".", 1)[0] in names
