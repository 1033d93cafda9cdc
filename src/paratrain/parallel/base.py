"""What every strategy shares: the contract the trainer relies on, and small common pieces.

A strategy owns the (possibly split) model and its optimizer. The trainer only calls:
    set_lr(lr); train_step((inputs, targets)) -> local mean loss; before_eval(); eval_step(...) ->
    the share's loss and accuracy sums (and the model's output, for the Python API);
    state_dict() -> (tensors, json) for this rank's checkpoint file; load_state_dict(reader);
    model_layout() -> on rank 0, every tensor of the consolidated model: (dtype, shape) by name;
    model_chunks() -> the consolidated model, a piece at a time on rank 0 (a collective: one unit
                      gathered at a time, so the export never holds the whole model beside the
                      training state); full_model_state() joins them (None off rank 0).
and reads three attributes:
    dp_rank, dp_size  which share of each global batch this rank reads (ranks of one model replica,
                      e.g. the tp or pp ranks of it, read the same share);
    reports_loss      whether this rank's train_step loss and eval_step sums count: exactly one rank
                      per replica reports (e.g. the last pipeline stage), the others return zeros;
    skipped_step      set by train_step when a loss or gradient was not finite and the optimizer
                      step was skipped; every rank must agree on it. A bool, or a device tensor
                      (1.0: skipped) where the decision stayed on the device (step_if_finite): the
                      trainer reads those at its next logged step, so a step needs no host sync.
Hooks with defaults that fit strategies whose ranks run in lockstep (override where they do not):
    reads_data        False on a rank that takes no batches (e.g. a parameter server): the trainer
                      passes train_step None and skips its evaluation shard;
    evaluates         whether this rank takes a share of the validation set (default: reads_data);
    run_dir           set by the trainer: the run directory, for a strategy's own reports;
    trainer_group     the process group of the trainer's own collectives (None: every rank); a
                      strategy that drops dead ranks narrows it to the live ones;
    reduce_loss(sums) None (default): the trainer all-gathers the reporting ranks' loss sums at a
                      logged step, checking every rank's collective sequence with them; a strategy
                      whose ranks do not run in lockstep returns the total on rank 0 itself;
    step_metrics()    extra entries for metrics.jsonl, called on every rank at each logged step
                      (rank 0's dict is logged; default: none);
    compiles_whole    False (default): train.compile compiles the model block by block, the
                      strategy's hooks between blocks; True where nothing runs between them (dp
                      alone): the whole model as one graph (models/compiled.py);
    collective_forward
                      False (default); True where a forward meets the other dp ranks (zero3 gathers
                      parameters): then every dp rank evaluates the same number of chunks, some empty;
    lockstep          True (default) when every rank runs every step, meeting its peers in each:
                      then a SIGTERM stops the run at an agreed step with a checkpoint
                      (fault/stop.py); False for ranks that run at their own pace;
    checkpoint_ranks, checkpoint_group
                      ranks 0..checkpoint_ranks-1 write a checkpoint, meeting in checkpoint_group
                      (default: every rank, the world group); a strategy whose other ranks hold
                      nothing to save (async ps workers) lets them run on instead of waiting.
Collectives go through `paratrain.comm.collectives` so that a hang names the rank, operation and step.

and sets one: `profiler` (paratrain/profile.py), which a strategy reports to from train_step; the
default does nothing, so a strategy calls it unconditionally:
    with self.profiler.phase("forward"): ...     # phases: forward | backward | compress | comm |
                                                 # optimizer | idle (pipeline bubbles); "comm" is
                                                 # time BLOCKED on communication
    self.profiler.comm("send", buffer, group)    # a message's payload, for byte accounting
                                                 # (all_reduce | reduce_scatter | all_gather |
                                                 #  broadcast | all_to_all | send | recv)
Collectives issued through `paratrain.comm.collectives` need neither: it counts each one's payload and
times waits on it (and blocking calls) as "comm" itself. Phases nest (an inner phase's time is
taken out of the outer one); `phase(name, index=i)` labels a span (e.g. micro-batch i) on the
trace's timeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from paratrain.checkpoint.reader import check_model_shapes
from paratrain.comm import collectives
from paratrain.config import Config
from paratrain.data.batch import feed, num_samples, split_batch
from paratrain.errors import error
from paratrain.models.moe import with_auxiliary_losses
from paratrain.optim import accuracy_counts, set_lr, skips_on_device, step_unless
from paratrain.profile import NULL_PROFILER, NullProfiler, Profiler
from paratrain.runtime.process import Runtime, SeededMicroBatches, mark_failing


class Strategy:
    name = "base"
    profiler: NullProfiler | Profiler = NULL_PROFILER
    collective_forward = False
    compiles_whole = False
    run_dir: Path | None = None
    splits_expert_weights = False  # parallel.ep keeps each expert on its ranks alone (dp: own_loop=)
    eval_microbatches = 1  # the pieces eval_step cuts a chunk into, as split_batch (token_mean.py)

    def __init__(self, model: nn.Module, loss_fn: Callable, cfg: Config, rt: Runtime):
        self.model = model
        self.loss_fn = with_auxiliary_losses(loss_fn, model)  # an MoE layer's load balancing
        self.cfg = cfg
        self.rt = rt
        self.grad_accum = cfg.train.grad_accum
        self.optimizer: torch.optim.Optimizer | None = None
        self.dp_rank, self.dp_size = rt.rank, rt.world_size
        self.reports_loss = True
        # set by train_step; the same on every rank (an agreed decision): a bool, or a device flag
        # (1.0: skipped) where the optimizer skipped on the device (step_if_finite)
        self.skipped_step: bool | torch.Tensor = False
        self.reads_data = True
        self.trainer_group = None
        self.lockstep = True
        self.checkpoint_ranks = rt.world_size
        self.checkpoint_group: torch.distributed.ProcessGroup | None = None
        self.rng_step: int | None = None  # set by the trainer: micro-batches reseed the RNG (micro_batches)
        self.batchnorm: Any = None  # a data-parallel strategy's BatchNormPolicy (parallel/dp/batchnorm.py)
        self.context: Any = None  # parallel.cp: cuts each batch to this rank's chunks (parallel/context/)
        self.experts: Any = None  # parallel.ep: sends MoE layers' tokens to their experts (parallel/expert/)
        self.in_schedule = False  # the Python API: in train_step, whose schedule runs its own backward

    @property
    def evaluates(self) -> bool:
        return self.reads_data

    def split_sequences_and_experts(self, model: nn.Module) -> None:
        """parallel.cp and parallel.ep (dp, zero1-3) on the world as a (dp, cp) grid
        (comm/grid.py): each cp group reads one dp share of the batch, the model's attention a ring
        over it (parallel/context/); each MoE layer's experts computed on the ranks of an ep group,
        tokens sent there by all-to-all (parallel/expert/). The dense parameters' gradients average
        over every rank; the engines keep each rank's experts alone (dp/experts.py, zero/experts.py)."""
        cp, ep = self.cfg.parallel.cp, self.cfg.parallel.ep
        if cp == 1 and ep == 1:
            return
        from paratrain.comm.grid import build_data_mesh
        from paratrain.parallel.context.attention import context_parallel
        from paratrain.parallel.expert.experts import expert_parallel

        mesh = build_data_mesh(cp, ep)
        # parallel.verify_plan: the first training step checks the ring and the dispatch against
        # the same layer whole (context/verify.py, expert/verify.py), within train.precision's tolerance
        verify = self.cfg.train.precision if self.cfg.parallel.verify_plan else None
        self.context = context_parallel(model, mesh, verify)
        self.experts = expert_parallel(model, mesh, verify)
        self.dp_rank, self.dp_size = mesh.dp_rank, mesh.dp

    # -- before any worker starts (the CLI's preflight; `model` on the meta device) -------------------
    @staticmethod
    def check_model(cfg: Config, model: nn.Module) -> None:
        """The strategy's own checks of the model (ConfigError)."""

    @staticmethod
    def check_checkpoint(reader, model: nn.Module) -> None:
        """The checkpoint to resume from holds this model's parameter names and shapes
        (CheckpointMismatch naming --resume)."""
        check_model_shapes(reader, model, "--resume")

    # -- the step -------------------------------------------------------------------------------
    def autocast(self):
        if self.cfg.train.precision == "bf16":
            return torch.autocast(self.rt.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def micro_batches(self, batch):
        """The rank's batch for one optimizer step, cut into train.grad_accum equal micro-batches;
        with rng_step set, each is computed on an RNG seeded from its place in the global batch."""
        parts = split_batch(batch, self.grad_accum)
        if self.context is not None:  # each micro-batch's own: a loss may count its tokens (context/hf.py)
            parts = [self.context.local_batch(part) for part in parts]
        if self.rng_step is None:
            return parts
        return SeededMicroBatches(parts, self.cfg.train.seed, self.rng_step, self.dp_rank * len(parts))

    def step_if_finite(
        self, norm: torch.Tensor, scale_grads: Callable, discard: Callable | None = None
    ) -> bool | torch.Tensor:
        """The optimizer step of a train_step (after clipping to train.clip_grad_norm), skipped
        where the global gradient `norm` (the same on every rank) is not finite; the value for
        `skipped_step`. An optimizer that skips on the device (optim.skips_on_device) decides
        there: no host sync, the flag tensor returned. Otherwise the host reads the norm now, and a
        skipped step calls `discard` (gradients a strategy keeps beyond the step, e.g. a codec's
        error feedback, which a device-side skip cannot drop: such strategies pass it)."""
        clip = self.cfg.train.clip_grad_norm
        assert self.optimizer is not None  # a strategy that steps one has built it
        if discard is None and skips_on_device(self.optimizer):
            nonfinite = torch.isfinite(norm).logical_not().to(torch.float32)
            if clip > 0:  # a non-finite norm makes the factor 0 or NaN: the step is skipped anyway
                scale_grads(clip_factor(norm, clip))
            step_unless(self.optimizer, nonfinite)
            return nonfinite
        if not bool(torch.isfinite(norm)):
            if discard is not None:
                discard()
            return True
        if clip > 0:
            scale_grads(clip_factor(norm, clip))
        self.optimizer.step()
        return False

    def set_lr(self, lr: float) -> None:
        assert self.optimizer is not None  # a strategy that has none overrides this
        set_lr(self.optimizer, lr)

    def reduce_loss(self, sums: torch.Tensor) -> torch.Tensor | None:
        return None

    def step_metrics(self) -> dict:
        return {}

    def train_step(self, batch) -> torch.Tensor:
        raise NotImplementedError

    def before_eval(self) -> None:
        """Once before the validation loop, on every rank that runs it. Under sync_batchnorm = false
        each rank's running statistics moved with its own samples since the step's broadcast: rank
        0's go to every rank first, as DDP broadcasts buffers before an eval forward that follows a
        training step, so every rank scores the model `final/` holds."""
        if self.batchnorm is not None:
            self.batchnorm.before_step()

    @torch.no_grad()
    def eval_step(self, inputs, targets, outputs: list | None = None) -> torch.Tensor:
        """[loss * n, n, correct, counted] for this rank's share of a validation batch; the model's
        output appended to `outputs` where given (the Python API's eval_step(outputs=True))."""
        if self.context is not None:
            inputs, targets = self.context.local_batch((inputs, targets))
        self.model.eval()
        try:
            with self.autocast():
                output = feed(self.model, inputs)
            if outputs is not None:
                outputs.append(output)
            return eval_sums(self.loss_fn, output, targets, num_samples(inputs))
        finally:
            self.model.train()

    # -- the Python API's own loop (paratrain/api) ---------------------------------------------
    # A strategy whose schedule owns forward and backward keeps these defaults: the user's loop
    # calls train_step, and the engine's optimizer is built from the [train] keys the API set.
    @classmethod
    def adopts_optimizers(cls, cfg: Config) -> bool:
        """Whether adopt_optimizer takes any torch.optim optimizer (asked before the engine is built:
        one that does not builds its own from [train], which the API fills from the user's). The
        strategies that do serve the own loop: the user's backward and optimizer step."""
        return False

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Train with the user's optimizer (its class, hyper-parameters and param groups, built
        over the model's parameters as the user passed it); returns the one to step."""
        assert self.optimizer is not None  # built from [train] by the engine
        return self.optimizer

    def calls_check(self):
        """The LockstepCheck (comm/lockstep.py) of this strategy's model calls that meet the other
        ranks, or None where its model calls meet no one (dp, zero1-2): the Python API checks its
        own collective calls in the same sequence."""
        return None

    def watch_backward(self, scale: Callable[[], float], ended: Callable[[], None]) -> None:
        """The Python API's setup: from now on every backward that reaches the model (a plain
        loss.backward() as well as pt.backward) leaves every rank's gradients the global batch's
        mean, as DDP and FSDP2 do inside loss.backward(): backward_starts() before its first
        gradient, each gradient multiplied by `scale()` (this rank's weight in the mean: 1.0 for
        equal shares), backward_ended() and then `ended()` once autograd has finished it. A
        strategy whose schedule owns backward watches nothing (the API refuses the user's step)."""
        if self.adopts_optimizers(self.cfg):
            BackwardWatch(self, scale, ended)

    def trained_params(self) -> list[nn.Parameter]:
        """The tensors autograd accumulates the model's gradients into (a strategy that watches)."""
        raise NotImplementedError

    def backward_starts(self) -> None:
        """Before a watched backward's first gradient is accumulated: where it must go."""
        raise NotImplementedError

    def backward_ended(self) -> None:
        """After a watched backward: its gradients reduced, each parameter's .grad holding its own."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        """The user's own loop: leaves every rank's gradients the global batch's mean (the watch
        reduces them, watch_backward)."""
        if not self.adopts_optimizers(self.cfg):
            refuse_own_loop(self.name, "backward")
        loss.backward()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (over every rank's gradients) to max_norm; returns it."""
        refuse_own_loop(self.name, "clip_grad_norm_")

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        raise NotImplementedError

    def load_state_dict(self, reader) -> None:
        raise NotImplementedError

    def model_layout(self) -> dict[str, tuple[torch.dtype, torch.Size]]:
        """What the export's header needs before any value: the dtype and shape of every tensor,
        keyed like the user's model.state_dict()."""
        return {k: (v.dtype, v.shape) for k, v in self.model.state_dict().items()}

    def model_chunks(self) -> Iterator[dict[str, torch.Tensor]]:
        """Collective: {name: tensor} pieces that together are the consolidated model, yielded on
        rank 0 (nothing elsewhere). A piece's memory may be reused once the next is asked for."""
        raise NotImplementedError

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """The consolidated state dict on rank 0 (None elsewhere; a collective)."""
        state = {k: v.detach().cpu().clone() for chunk in self.model_chunks() for k, v in chunk.items()}
        return state if self.rt.rank == 0 else None


def whole_model_chunks(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """The chunks of a model this rank holds whole: a tensor at a time, no copy."""
    for k, v in model.state_dict().items():
        yield {k: v}


class BackwardWatch:
    """Strategy.watch_backward's hooks on the strategy's trained_params(): tensor hooks, which see
    each gradient before autograd accumulates it into .grad (once per backward, a shared
    parameter's uses summed). The first of a backward calls the strategy's backward_starts(), reads
    `scale()` and queues the end on autograd's engine, which runs it once the whole backward has
    finished (as DDP's reducer finishes its buckets); each gradient is multiplied by the scale
    (linear: as if the loss had been). Quiet while `strategy.in_schedule` (its train_step prepares
    and finishes its own backward), and in a torch.autograd.grad(), which returns gradients
    without accumulating them (a gradient penalty's)."""

    def __init__(self, strategy: Strategy, scale: Callable[[], float], ended: Callable[[], None]):
        self.strategy, self.scale, self.ended = strategy, scale, ended
        self.running, self.factor = False, 1.0
        # each parameter's AccumulateGrad node, held: autograd makes a new one once none is
        self.accumulators = []
        for p in strategy.trained_params():
            view = p.view_as(p).grad_fn
            assert view is not None  # a trained parameter requires grad
            node = view.next_functions[0][0]
            self.accumulators.append(node)
            p.register_hook(lambda grad, node=node: self._gradient_arrives(grad, node))

    def _gradient_arrives(self, grad: torch.Tensor, accumulator) -> torch.Tensor | None:
        if self.strategy.in_schedule:
            return None
        if not self.running:
            if not accumulates(accumulator):
                return None
            self.running, self.factor = True, self.scale()
            self.strategy.backward_starts()
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)
        return None if self.factor == 1.0 else grad * self.factor

    def _backward_finished(self) -> None:
        self.running = False
        self.strategy.backward_ended()
        self.ended()


def accumulates(node) -> bool:
    """Whether the backward under way runs a parameter's AccumulateGrad `node` (into its .grad)."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a torch.autograd.grad(), of which torch does not say it for a leaf: it returns
        return False


def refuse_own_loop(strategy: str, call: str) -> NoReturn:
    """An own-loop call under a strategy whose schedule owns forward and backward."""
    refuse(
        f"pt.{call}: strategy {strategy!r} runs forward and backward in its own schedule; "
        f"use pt.setup(model, optimizer, loss=fn) and loss = pt.train_step(batch)",
        said_by_one(),
    )


@torch.no_grad()
def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0, group=None) -> None:
    """Broadcast many tensors in one message per dtype (not one per tensor: latency adds up)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
        collectives.broadcast(flat, src, "initial-weights", group=group)
        offset = 0
        for t in group_tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor torch.nn.utils.clip_grad_norm_ multiplies gradients by."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def unique_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters in registration order, each once (shared weights appear once)."""
    seen, out = set(), []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def eval_sums(loss_fn, output, targets, n: int) -> torch.Tensor:
    """[loss * n, n, correct, counted] of n samples' output (targets None: the model's own loss)."""
    if n == 0:  # a rank's empty share (its mean loss would be NaN and poison the sum)
        return torch.zeros(4, dtype=torch.float64)
    correct, counted = accuracy_counts(output, targets) or (0, 0)
    return torch.tensor([float(loss_fn(output, targets)) * n, n, correct, counted], dtype=torch.float64)


def refuse(line: str, said_here: bool = True) -> NoReturn:
    """Stop the user's program at a call paratrain cannot make right: its one line (naming the
    call to use instead), no traceback, exit 2 as for any usage error (a launch reports it as the
    worker's own line, without the agent's traceback); never a silently wrong answer. Where every
    rank refuses the same call, one of them says it (`said_here`): the run's output has one line."""
    if said_here:
        error(line)
    mark_failing()
    raise SystemExit(2)


def said_by_one() -> bool:
    """Every rank runs the user's same code into the same refusal: rank 0 says it."""
    return not dist.is_initialized() or dist.get_rank() == 0
