"""ZeRO's footprint for `paratrain plan`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from torch import nn

from paratrain.config import Config
from paratrain.cost.activations import saved_activation_bytes, step_memory, whole_model_activations
from paratrain.cost.ranks import MIB, RankPlan, optimizer_slots, padded_bytes, padded_numel
from paratrain.parallel.base import unique_parameters
from paratrain.parallel.dp.footprint import Planned, split_experts, splits_experts, wire_bytes
from paratrain.parallel.zero.comm import bucket_groups, from_primitives, working_dtype
from paratrain.parallel.zero.gather import module_units


class StagedSpec(Protocol):
    """zero/spec.py's ZeroSpec, as these functions read it (not imported: it names this module)."""

    name: str
    stage: int


def zero_state(cfg: Config, stage: int, model: nn.Module, params: list[nn.Parameter], world: int):
    """(parameter, gradient and optimizer bytes, a note on what comes on top for a while, and what
    does at most: (during backward, after it)) of a rank at `stage`. During backward, besides what a
    step of the whole model holds (activations.step_memory, which counts each incoming gradient until
    it is added to the one kept): stage 2, one unit's full gradients, which zero/comm.py's
    StreamingShardReducer holds while it reduces them; stage 3, the root unit, gathered through
    forward and backward, and the unit whose forward or backward runs (the ParameterGatherer allows
    twice the largest unit besides the root for a prefetch and the gradients in flight, but a step
    peaks where backward starts: the most activations, no gradient in flight yet; under stages 2 and
    3 no gradient shard either: they are made as backward reduces into them). After it, the
    gradient norm squares each unit's gradient shard into a temporary (zero/comm.py: sharded_grad_norm).

    Mixed precision (every stage under bf16, zero/engine.py): working parameters and gradients in
    bf16 (stage 3: its units gathered in bf16), and the parameters' full-precision master copy in
    the rank's shard (counted with its parameters); the norm casts a gradient shard up before squaring it, and the step holds the
    rank's whole gradient shard cast up to full precision."""
    bucket_bytes = int(cfg.parallel.bucket_mb * MIB)
    units = module_units(model, params, bucket_bytes) if stage == 3 else []
    groups = [g for _, g in units] if stage == 3 else bucket_groups(params, cfg, world)
    whole, shard = padded_bytes(groups, world)  # in the parameters' own precision
    mixed = mixed_working_dtype(cfg, params, stage) is not None
    work = working_dtype(cfg, params[0].dtype, stage).itemsize / params[0].element_size()
    biggest = max(padded_bytes([g], world)[0] for g in groups)
    root = sum(padded_bytes([g], world)[0] for module, g in units if module is model)
    largest = max((padded_bytes([g], world)[0] for module, g in units if module is not model), default=0)
    backward = {1: 0, 2: int(biggest * work), 3: int((largest + root) * work)}[stage]
    # the norm's temporary (under mixed precision a gradient shard cast up too), or the step's
    # gradient shard in full precision (mixed precision)
    norm = max(padded_bytes([g], world)[1] for g in groups) * (2 if mixed else 1)
    after = max(norm, shard if mixed else 0)
    # the working parameters (stage 3: its shard) and, under mixed precision, the shard's master
    param_bytes = int((whole if stage < 3 else shard) * work) + (shard if mixed else 0)
    grad_bytes = int((whole if stage == 1 else shard) * work)
    transient = {
        1: "",
        2: f"state plus one unit's full gradients while reduced (at most {biggest / MIB:.3g} MiB), counted in the "
        "step's peak",
        3: f"state plus units gathered for their forward and backward and their full gradients while reduced, "
        f"at most twice the largest unit ({biggest / MIB:.3g} MiB) at once; the step's peak counts the root "
        "unit and the running one",
    }[stage]
    # stages 2 and 3 let the gradient shards go from the step's start until backward reduces into
    # them again (zero/comm.py: StreamingShardReducer.zero_grad): not there where backward starts
    released = grad_bytes if stage >= 2 else 0
    return param_bytes, grad_bytes, shard * optimizer_slots(cfg), transient, (backward - released, after)


def mixed_working_dtype(cfg: Config, params: list[nn.Parameter], stage: int):
    """The working parameters' dtype under mixed precision (they are what the step computes with),
    else None: the model's own."""
    working = working_dtype(cfg, params[0].dtype, stage) if params else None
    return working if params and working != params[0].dtype else None


def zero_peak(step: int, on_top: tuple[int, int]) -> int:
    """What a ZeRO rank holds over its state at its peak: the step's own (activations.step_memory)
    with what comes on top during backward, or the gradient norm's temporary after it."""
    during_backward, after = on_top
    return max(step + during_backward, after)


@contextlib.contextmanager
def kept_experts(cfg: Config, model: nn.Module) -> Iterator[tuple[list, list]]:
    """(the dense parameters, one rank's kept experts) as zero/experts.py splits them: dp's split
    (1/E of the gpt's experts, a Hugging Face experts module's stacks' slices), in units of their
    own, the model holding ep rank 0's slices of the stacks meanwhile, as a rank's does (stage 3's
    units are the modules holding them)."""
    from paratrain.parallel.expert.weights import stacks_cut

    named = unique_parameters(model)
    if not splits_experts(cfg):
        yield [p for _, p in named], []
        return
    with stacks_cut(model, cfg.parallel.ep):
        yield split_experts(cfg, model, unique_parameters(model))


def model_state(cfg: Config, stage: int, model: nn.Module, world: int, dense: list, experts: list):
    """zero_state of the `dense` units over the `world` ranks of a replica, plus the kept `experts`'
    over its world / E ranks keeping the same experts (kept_experts, whose model they are): the bytes
    summed, what comes on top the larger of the two."""
    param_b, grad_b, opt_b, transient, on_top = zero_state(cfg, stage, model, dense, world)
    if experts:
        p_e, g_e, o_e, _, (backward, after) = zero_state(cfg, stage, model, experts, world // cfg.parallel.ep)
        param_b, grad_b, opt_b = param_b + p_e, grad_b + g_e, opt_b + o_e
        on_top = (max(on_top[0], backward), max(on_top[1], after))
    return param_b, grad_b, opt_b, transient, on_top


def zero(spec: StagedSpec, cfg: Config, model: nn.Module, ranks: list[RankPlan], rows: int, device: str) -> Planned:
    params = [t for _, t in unique_parameters(model)]
    world = len(ranks) // cfg.parallel.replicas  # the ranks of one replica, which shard the state
    step = whole_model_activations(cfg, ranks, rows, mixed_working_dtype(cfg, params, spec.stage))
    backend = "nccl" if device == "cuda" else "gloo"
    with kept_experts(cfg, model) as (dense, experts):
        param_b, grad_b, opt_b, transient, on_top = model_state(cfg, spec.stage, model, world, dense, experts)
        for r in ranks:
            (r.dp, r.cp), r.param_bytes = divmod(r.rank, cfg.parallel.cp), param_b  # comm/grid.py's DataMesh
            r.grad_bytes, r.optimizer_bytes = grad_b, opt_b
            r.peak_bytes = r.model_state_bytes + zero_peak(step, on_top)
            zero_messages(r, cfg, spec.stage, model, dense, world, backend)
            if experts:  # over the ranks keeping the same experts
                zero_messages(r, cfg, spec.stage, model, experts, world // cfg.parallel.ep, backend)
    return [], [f"{spec.name}: {transient}"] if transient else []


def zero_messages(
    r: RankPlan, cfg: Config, stage: int, model: nn.Module, params: list[nn.Parameter], world: int, backend: str
) -> None:
    """Per unit: its gradients reduce-scattered (stage 1 once a step, 2 and 3 every microbatch) and
    its parameters all-gathered (stages 1 and 2 after the step; stage 3 before each module's forward
    and again before its backward, the root unit, kept gathered through both, once); plus the
    squared gradient norm, one float32 all-reduced. On gloo, as zero/comm.py builds them: each
    reduce-scatter an all-reduce of the whole unit (stage 3: of each gradient), each all-gather a
    broadcast from every rank. `world`: the ranks of one replica; with parallel.replicas, each
    gradient shard is then all-reduced with the same shard of the other replicas (engine.py)."""
    replicas = cfg.parallel.replicas
    if world * replicas == 1:
        return
    micro = cfg.train.grad_accum
    bucket_bytes = int(cfg.parallel.bucket_mb * MIB)
    if stage == 3:
        units = [(g, 1 if module is model else 2) for module, g in module_units(model, params, bucket_bytes)]
    else:
        units = [(g, 0) for g in bucket_groups(params, cfg, world)]
    primitives = from_primitives(backend)
    for group, gathers in units:
        numel = padded_numel(group, world)
        size = working_dtype(cfg, group[0].dtype, stage).itemsize
        if replicas > 1:
            r.add_comm("all_reduce", numel // world * size, replicas)
        if world == 1:
            continue
        reduces, gathers = 1 if stage == 1 else micro, gathers * micro if stage == 3 else 1
        wire = wire_bytes(numel, size, cfg)
        if primitives:
            # stage 3 all-reduces each gradient where autograd left it, stages 1-2 the flat unit
            for n in [p.numel() for p in group] if stage == 3 else [numel]:
                r.add_comm("all_reduce", wire_bytes(n, size, cfg), world, times=reduces)
            r.add_comm("broadcast", numel // world * size, world, times=gathers * world)
        else:
            r.add_comm("reduce_scatter", wire, world, times=reduces)
            r.add_comm("all_gather", numel * size, world, times=gathers)
    if world > 1:
        r.add_comm("all_reduce", 4, world)


def replica(
    spec: StagedSpec, cfg: Config, model: nn.Module, world: int, rows: int, cluster
) -> tuple[list[RankPlan], list]:
    """Replica 0 for `plan --search`: rank 0's shard of the state (every rank holds the same)."""
    params = [t for _, t in unique_parameters(model)]
    working = mixed_working_dtype(cfg, params, spec.stage)
    one = RankPlan(0, 0, 0, "worker", activation_bytes=saved_activation_bytes(cfg, rows, working=working)[0])
    memory = step_memory(cfg, rows, working=working)
    assert memory is not None  # None only under tp
    (step,) = memory
    shards = world // cfg.parallel.replicas
    with kept_experts(cfg, model) as (dense, experts):
        state = model_state(cfg, spec.stage, model, shards, dense, experts)
    one.param_bytes, one.grad_bytes, one.optimizer_bytes, _, on_top = state
    one.peak_bytes = one.model_state_bytes + zero_peak(max(step.forward_peak, step.backward_peak), on_top)
    return [one], []
