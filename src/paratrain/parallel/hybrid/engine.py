"""Model parallelism on one device mesh: tensor (inside layers) x pipeline (across layers) x
context (across each sequence) x data.

Strategies "tp", "pp" and "hybrid" are this one engine; the config decides the degrees (tp, pp and
cp from parallel.tp / parallel.pp / parallel.cp, dp from the world size). Construction, on every
rank: the (pp, dp, cp, tp) mesh (comm/grid.py) and rank 0's initial weights everywhere, then
hybrid/parallelize.py's steps in their documented order: decide_cut -> (the model's attention made
a ring over the cp group: parallel/context/) -> apply_tp -> cut_pipeline -> wrap_dp.
A step cuts the replica's batch into microbatches, each to this rank's chunks of its sequences
under cp, and runs the schedule (pipeline/schedules.py); each chunk's reducer communicates during
that chunk's last backward, overlapped with the rest.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sized
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from paratrain import checkpoint as ckpt
from paratrain.comm import collectives
from paratrain.comm.grid import build_mesh
from paratrain.comm.lockstep import BACKWARD
from paratrain.comm.scalars import broadcast_tree
from paratrain.config import Config, microbatch_count, virtual_stages
from paratrain.data.batch import join, num_samples, split_batch, tensors_in
from paratrain.errors import ConfigError, note
from paratrain.models.hf_pipeline import labels_apart, own_loss
from paratrain.models.layers import boundary_shape_fn, layers_of, meta_copy, pipeline_layers
from paratrain.optim import build_optimizer, output_logits, rebuild_optimizer
from paratrain.parallel.base import (
    Strategy,
    broadcast_tensors,
    clip_factor,
    eval_sums,
    refuse,
    said_by_one,
    unique_parameters,
)
from paratrain.parallel.context.attention import context_parallel
from paratrain.parallel.dp.batchnorm import BatchNormPolicy
from paratrain.parallel.hybrid.parallelize import (
    apply_tp,
    cut_pipeline,
    decide_cut,
    stage_of_keys,
    sync_ties,
    tie_groups,
    tie_names,
    wrap_dp,
)
from paratrain.parallel.hybrid.split_params import SplitParams
from paratrain.parallel.hybrid.state import load_resharded, model_chunks
from paratrain.parallel.hybrid.user_model import UserModel
from paratrain.parallel.pipeline.cut import parameters_outside, splittable_layers, tied_spans
from paratrain.parallel.pipeline.runner import PipelineRunner
from paratrain.parallel.pipeline.schedules import SCHEDULES, forward_only, one_f_one_b
from paratrain.parallel.pipeline.verify import check_cuts
from paratrain.parallel.tensor.comm import gather_from_tp
from paratrain.parallel.tensor.experts import packed_shards
from paratrain.parallel.tensor.layers import check_plan, full_width, output_is_sharded, parallel_loss, plan_for
from paratrain.parallel.tensor.verify import PlanVerifier


def check_model(cfg: Config, model: nn.Module) -> None:
    """Preflight (on a meta-device model): the plan fits the model and the model has enough layers."""
    p = cfg.parallel
    plan = plan_for(model, p.tp_plan) if p.tp > 1 else {}
    if p.tp > 1:
        check_plan(model, plan, p.tp, user=bool(p.tp_plan), own_loss=cfg.train.loss == "model")
    if p.pp > 1:
        if cfg.train.loss == "model" and own_loss(model) is None:
            # the last stage ends at the model's logits: only a loss_function the model names is run there
            raise ConfigError(
                "train.loss",
                f"'model' under pp takes a transformers model's own loss_function, which "
                f"{type(model).__name__} has not: name a loss (cross_entropy, mse or module:function)",
            )
        check_layers(cfg, model, plan)


def check_layers(cfg: Config, model: nn.Module, plan: dict) -> None:
    """Under pp: the model can be cut into enough layers, each trainable parameter in one of them."""
    p = cfg.parallel
    if p.pp == 1:
        return
    if pipeline_layers(model) is None:
        raise ConfigError(
            "parallel.pp",
            f"pp = {p.pp} needs a model that can be cut into layers: an "
            f"nn.Sequential or a module with pipeline_layers()",
        )
    outside = parameters_outside(model, layers_of(model))
    if outside:
        raise ConfigError(
            "parallel.pp",
            f"no pipeline stage would train {', '.join(outside[:3])}{' ...' if len(outside) > 3 else ''}: "
            f"every trainable parameter must belong to one of the model's pipeline layers",
        )
    stages, layers = p.pp * virtual_stages(cfg), splittable_layers(model, plan, sync_ties(cfg))
    if stages > layers:
        tied = "".join(
            f"; layers {a}-{b} share {name} (tied weights) and stay in one stage"
            for a, b, name in tied_spans(model, layers_of(model), sync_ties(cfg))
        )
        raise ConfigError(
            "parallel.pp",
            f"{stages} pipeline stages (pp {p.pp} x {virtual_stages(cfg)} virtual) "
            f"but the model has only {layers} layer{'' if layers == 1 else 's'} to split{tied}",
        )


class ModelParallel(Strategy):
    name = "hybrid"
    check_model = staticmethod(check_model)

    def __init__(self, model, loss_fn, cfg, rt):
        super().__init__(model.to(rt.device), loss_fn, cfg, rt)
        p = cfg.parallel
        self.mesh = mesh = build_mesh(p.tp, p.pp, rt.device.type, p.cp)
        self.dp_rank, self.dp_size = mesh.dp_rank, mesh.dp
        # every cp rank of the last stage reports its chunks' loss: the ranks' mean is the sequences'
        # (equal chunks; a model's own loss is made so by context/hf.py's count), as under dp
        self.reports_loss = mesh.pp_rank == mesh.pp - 1 and mesh.tp_rank == 0
        broadcast_tensors(list(model.parameters()) + list(model.buffers()), src=0)
        self.full_meta = meta_copy(model)  # the unsplit model's keys, shapes and dtypes
        self.user_model: UserModel | None = None  # the Python API's view of the model (user_model.py)
        self.split_params: SplitParams | None = None  # and of its split parameters under tp (pp = 1)
        self.m = self.eval_microbatches = microbatch_count(cfg)
        self.v = virtual_stages(cfg)
        self.n_stages = p.pp * self.v
        self.tie_names = tie_names(model)
        plan = plan_for(model, p.tp_plan) if p.tp > 1 else {}
        # the Python API brings its model here unchecked (a run's preflight checked it)
        if p.tp > 1:
            check_plan(model, plan, p.tp, user=bool(p.tp_plan))
        check_layers(cfg, model, plan)
        # by the parameters the user's model had before tp replaced some: what their optimizer holds
        self.name_of = {id(t): n for n, t in unique_parameters(model)}
        # hybrid/parallelize.py's steps, in its order
        self.bounds = decide_cut(model, cfg, plan, self._sample_input, self.autocast, rt.device, rt.is_main)
        if p.pp > 1 and p.verify_plan:  # the cuts against the model's own forward, while it is whole
            self._check_cuts(model)
        # parallel.cp's ring: after the cut, whose timing and check run the whole model on one rank (a
        # ring would wait for its peers), and after the meta copy, which must not copy the hooks;
        # before tp, whose shards sit inside the hooked attention modules (each tp rank's ring carries
        # its heads). The ring is checked on the first step; under pp, whose stages run different
        # blocks at different times, the world agrees on the stages' checks after the step (_verify_once)
        verify = cfg.train.precision if p.verify_plan else None
        self.context = context_parallel(model, mesh, verify, verdict_after_step=p.pp > 1)
        stage_of_key = stage_of_keys(model, cfg, self.bounds)
        self.shard_dims = apply_tp(model, mesh, plan)
        self.shard_packs = packed_shards(model)  # tensors split as a fused gate and up (tensor/experts.py)
        self.stage_ids, self.chunks = cut_pipeline(model, mesh, cfg, self.bounds)
        if self.context is not None:  # a transformers decoder's stages wrap its modules (models/hf_pipeline.py)
            self.context.position_stages(self.chunks)
        self.reducers, self.param_names, self.params = wrap_dp(model, self.chunks, mesh, cfg, rt.device)
        # parallel.verify_plan: the first step's blocks checked against themselves whole (tensor/verify.py);
        # a block whose sharded forward crashes is said by the first rank of its stage
        first_of_stage = mesh.tp_rank == 0 and mesh.dp_rank == 0 and mesh.cp_rank == 0
        self.verifier = (
            PlanVerifier(model, plan, mesh.tp_group, cfg.train.precision, rt.device, speaks=first_of_stage)
            if p.tp > 1 and p.verify_plan
            else None
        )
        self.optimizer_names = self.param_names  # in the optimizer's param_groups order
        # within a pipeline, over each microbatch of the dp ranks' samples (docs/models.md)
        self.batchnorm = BatchNormPolicy(model, p.sync_batchnorm, mesh.replica_group)
        self.owned_keys = [k for k, s in stage_of_key.items() if s in self.stage_ids]
        self.optimizer: torch.optim.Optimizer = build_optimizer(self.params, cfg.train)
        self.tied = (
            tie_groups(model, self.full_meta, mesh, self.bounds, rt.rank, rt.is_main)
            if p.pp > 1 and sync_ties(cfg)
            else []
        )

        # train.loss = "model" under pp: the last stage runs the model's own loss on its logits and
        # the labels split_labels takes out of each dict sample (models/hf_pipeline.py)
        self.labels_apart = p.pp > 1 and cfg.train.loss == "model"
        if self.labels_apart:
            loss_fn = self.loss_fn = own_loss(model)
        self.sharded_output = p.tp > 1 and output_is_sharded(model)
        if self.sharded_output:
            width = full_width(model)
            self.train_loss = parallel_loss(loss_fn, mesh.tp_group, width)
            self.full_output = lambda out: gather_from_tp(out, mesh.tp_group, width)
        else:
            self.train_loss, self.full_output = loss_fn, (lambda out: out)
        self._build_engine()

    # -- construction helpers -------------------------------------------------------------------
    def _build_engine(self) -> None:
        """The engine that runs this rank's chunks, and its part of the schedule."""
        p, mesh, rt = self.cfg.parallel, self.mesh, self.rt
        meta_layers = layers_of(self.full_meta) if p.pp > 1 else [self.full_meta]
        shapes = boundary_shape_fn([meta_layers[self.bounds[s] : self.bounds[s + 1]] for s in range(self.n_stages)])
        self.engine = PipelineRunner(
            self.chunks,
            self.stage_ids,
            self.n_stages,
            lambda s: mesh.stage_rank(s % p.pp),
            mesh.pp_group,
            shapes,
            rt.device,
            p.timeout_s,
        )
        if rt.is_main and p.pp > 1:
            shm = sorted(self.engine.p2p.shm_senders)
            print(
                f"pipeline messages of rank 0: shared memory with ranks {shm}, torch.distributed otherwise"
                if shm
                else "pipeline messages: torch.distributed",
                flush=True,
            )
        schedule = SCHEDULES[p.schedule] if p.pp > 1 else one_f_one_b
        self.actions = schedule(p.pp, mesh.pp_rank, self.m, self.v)
        self.last_backward = {a.chunk: a.mb for a in self.actions if a.kind == "B"}  # each chunk's last backward

    def _check_cuts(self, model: nn.Module) -> None:
        """pipeline/verify.py on [data]'s first microbatch. Under the Python API [data] is not the
        data the user's loop brings: where the model cannot run on it, the cuts go unchecked, said
        once (a cut that differs still exits 2)."""
        try:
            check_cuts(model, layers_of(model), self.bounds, self._sample_input())
        except ConfigError:
            raise
        except Exception as exc:  # the model's own forward on data that is not its own
            if self.rt.is_main:
                note(
                    f"parallel.verify_plan: the pipeline's cuts were not checked: the model does not run on "
                    f"[data]'s first batch ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
                )

    def _sample_input(self) -> torch.Tensor:
        """The first microbatch of the training data: what the per-layer timing runs on."""
        from paratrain.data import build_dataset, load_batch

        dataset = build_dataset(self.cfg, "train")
        rows = max(self.cfg.data.batch_size // self.dp_size // self.m, 1)
        x, _ = load_batch(dataset, torch.arange(min(rows, len(cast(Sized, dataset)))))
        if isinstance(x, dict):  # a dict sample: the token ids a transformers model's first layer takes
            x = x["input_ids"] if "input_ids" in x else tensors_in(x)[0]
        return x.to(self.rt.device)

    def _sum_tied_grads(self) -> torch.Tensor:
        """Sum each tied parameter's gradient over the stages holding a copy, so that every copy
        takes the step the one parameter of the unsplit model takes. Returns the change to this
        rank's share of the squared gradient norm: its copy's part out, the sum in, once (on the
        tie's first stage)."""
        change = torch.zeros((), dtype=torch.float64, device=self.rt.device)
        for param, group, first in self.tied:
            if param.grad is None:
                continue
            change -= param.grad.double().pow(2).sum()
            collectives.all_reduce(param.grad, "tied-weight-grad", group)
            if first:
                change += param.grad.double().pow(2).sum()
        return change

    # -- the step -------------------------------------------------------------------------------
    @property
    def profiler(self):
        return self.engine.profiler

    @profiler.setter
    def profiler(self, profiler) -> None:  # the engine times the microbatches, the reducers their codecs
        self.engine.profiler = profiler
        for r in self.reducers:
            r.profiler = profiler

    def train_step(self, batch) -> torch.Tensor:
        for r in self.reducers:
            r.zero_grad()
        self.batchnorm.before_step()
        micro = self._labels_apart(self._local(split_batch(batch, self.m)))

        def before_backward(a):
            self.reducers[a.chunk].prepare(sync=self.last_backward[a.chunk] == a.mb)

        losses = self.engine.run(
            self.actions,
            [x for x, _ in micro],
            [y for _, y in micro],
            self.train_loss,
            self.autocast,
            train=True,
            before_backward=before_backward,
        )
        chunk_norms = [r.finish() for r in self.reducers]
        self._verify_once()
        with self.profiler.phase("optimizer"):
            norm = self._global_grad_norm(chunk_norms, self._sum_tied_grads())
            self.skipped_step = not math.isfinite(norm)  # the same norm, so the same decision, on every rank
            if not self.skipped_step:
                if self.cfg.train.clip_grad_norm > 0:
                    self._clip(norm, self.cfg.train.clip_grad_norm)
                self.optimizer.step()
        if self.stage_ids[-1] == self.n_stages - 1:
            return torch.stack([loss.detach().float() for loss in losses]).mean()
        return torch.zeros((), device=self.rt.device)

    def _verify_once(self) -> None:
        """parallel.verify_plan on the first step, after its forward and before the optimizer moves
        the weights that forward used (train_step, and the Python API's first backward). A mismatch:
        ConfigError, which `paratrain run` says; in the user's own loop its one line, exit 2."""
        try:
            if self.context is not None:
                self.context.verdict_after_step(self.rt.device)
            if self.verifier is not None:
                # it reads and swaps the planned modules' real slices
                with self.split_params.real() if self.split_params is not None else contextlib.nullcontext():
                    self.verifier.check(self.autocast)
                self.verifier = None
        except ConfigError as exc:
            if self.user_model is None:
                raise
            refuse(f"{exc}", said_by_one())  # every rank has the agreed line

    def _local(self, micro: list[tuple]) -> list[tuple]:
        """Under parallel.cp each microbatch cut to this rank's chunks of its sequences, the model told
        their global positions (all microbatches share them) and, for a model that shifts its own
        labels, the labels shifted over the whole sequence first (context/attention.py)."""
        return micro if self.context is None else [self.context.local_batch(part) for part in micro]

    def _labels_apart(self, micro: list[tuple]) -> list[tuple]:
        """Under pp with the model's own loss: each dict microbatch's labels (and under cp their shift
        and count) as its target, the rest its input (the first stage takes the ids, the last the
        labels)."""
        if not self.labels_apart:
            return micro
        return [labels_apart(x) for x, _ in micro]

    def _clip(self, norm: float, max_norm: float) -> None:
        factor = clip_factor(torch.tensor(norm, device=self.rt.device), max_norm)
        for t in self.params:
            if t.grad is not None:
                t.grad.mul_(factor)

    def _global_grad_norm(self, chunk_norms: list[torch.Tensor], tied_change: torch.Tensor) -> float:
        """The norm over all shards of the model. The dp x cp replicas hold equal gradients, so the
        world-wide sum of squares is divided by dp x cp. Without tp the reducers' norms of their chunks
        are exact (corrected for tied copies: `tied_change`); with tp a replicated tensor (layer
        norms, row-parallel biases) counts once, on tp rank 0, and a tied tensor (its copies
        already summed) once, on its first stage."""
        if self.mesh.tp == 1:
            squares = tied_change + sum(n.double() ** 2 for n in chunk_norms)
        else:
            squares = torch.zeros((), dtype=torch.float64, device=self.rt.device)
            later_copies = {id(param) for param, _, first in self.tied if not first}
            grads = [
                t.grad
                for name, t in zip(self.param_names, self.params)
                if t.grad is not None
                and id(t) not in later_copies
                and (name in self.shard_dims or self.mesh.tp_rank == 0)
            ]
            if grads:
                squares += torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        if dist.get_world_size() > 1:
            collectives.all_reduce(squares, "grad-norm")
        return math.sqrt(squares.item() / (self.mesh.dp * self.mesh.cp))

    # -- the Python API's own loop: tp (and dp) without pp, whose model runs whole on every rank ----
    @classmethod
    def adopts_optimizers(cls, cfg) -> bool:
        return cfg.parallel.pp == 1

    def calls_check(self):
        return self.user_model.lockstep if self.user_model is not None else None

    def adopt_optimizer(self, optimizer):
        """The user's optimizer class, hyper-parameters and param groups over the tensors this rank
        trains (a tp shard in place of each split parameter); the model returns its whole output
        from now on (gathered where the last layer is column-parallel), which the user's loss reads
        as the unsplit model's, and so do train_step's and evaluation's."""
        if self.rt.world_size > 1:
            self.user_model = UserModel(self)
        if self.adopts_optimizers(self.cfg):
            self.optimizer = rebuild_optimizer(optimizer, self.name_of, dict(zip(self.param_names, self.params)))
        if self.rt.world_size > 1:  # its state is this rank's slices, this stage's parameters
            self.optimizer.state_dict = self.optimizer.load_state_dict = self._refuse_optimizer_state  # type: ignore[method-assign]
        if self.mesh.tp > 1 and self.user_model is not None:  # each split parameter shown unsplit (split_params.py)
            shapes = self.full_meta.state_dict()
            held = dict(self.model.named_parameters())  # under pp, the other stages' on the meta device too
            split = {n: (t, shapes[n].shape) for n, t in held.items() if n in self.shard_dims}
            self.split_params = SplitParams(self.model, split, self.cfg.parallel.strategy, self.mesh.tp_group)
            self.user_model.split = self.split_params
        if not self.adopts_optimizers(self.cfg):
            return self.optimizer
        name_of = {id(t): n for n, t in zip(self.param_names, self.params)}
        self.optimizer_names = [name_of[id(t)] for g in self.optimizer.param_groups for t in g["params"]]
        if self.sharded_output:
            gather = self.full_output
            self.model.register_forward_hook(lambda module, args, out: gather(out))
            self.train_loss, self.full_output = self.loss_fn, (lambda out: out)
        return self.optimizer

    def _refuse_optimizer_state(self, *_):
        refuse(
            f"optimizer.state_dict() / load_state_dict() under {self.cfg.parallel.strategy}: the optimizer holds this "
            f"rank's part of the state (its tp slices, its pipeline stage's parameters); save and resume it with "
            f"pt.save / pt.load (at any layout)"
        )

    def trained_params(self) -> list[nn.Parameter]:
        return self.params

    def backward_starts(self) -> None:
        """Every backward all-reduces over the dp ranks (a second one before a zero_grad adds to the
        first: accumulation); tp's own all-reduces run inside it."""
        if self.user_model is not None:
            self.user_model.lockstep.check(BACKWARD)
        split = self.split_params
        # the user's optimizer.zero_grad() let them go, or model.zero_grad() those of the SplitParams
        if any(t.grad is None for t in self.params) or (split is not None and split.grads_let_go()):
            self.reducers[0].zero_grad(rebind=True)
        self.reducers[0].prepare(sync=True)

    def backward_ended(self) -> None:
        self.grad_norm = self.reducers[0].finish()
        self._verify_once()
        if self.split_params is not None:
            self.split_params.show_grads()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if not self.adopts_optimizers(self.cfg):
            return super().clip_grad_norm_(max_norm)  # raises, as backward
        norm = self._global_grad_norm([self.grad_norm], torch.zeros((), dtype=torch.float64, device=self.rt.device))
        self._clip(norm, max_norm)
        if self.split_params is not None:
            self.split_params.grads_changed()
        return torch.tensor(norm)

    @torch.no_grad()
    def eval_step(self, inputs, targets, outputs: list | None = None) -> torch.Tensor:
        """The schedule forward only; `outputs` (where given) gets the whole model's output on
        every stage of the replica: the microbatches' joined on the last stage, sent to the others."""
        for chunk in self.chunks:
            chunk.eval()

        def score(out, y):
            out = self.full_output(out)
            if outputs is not None:
                outputs.append(out)
            return eval_sums(self.loss_fn, out, y, num_samples(output_logits(out)))

        try:
            micro = self._labels_apart(self._local(split_batch((inputs, targets), self.m)))
            xs, ys = (list(part) for part in zip(*micro))
            actions = forward_only(self.cfg.parallel.pp, self.mesh.pp_rank, len(xs), self.v)
            sums = self.engine.run(actions, xs, ys, score, self.autocast, train=False)
        finally:
            for chunk in self.chunks:
                chunk.train()
        if outputs is not None and self.mesh.pp > 1:
            outputs[:] = [self._from_last_stage(join(outputs) if outputs else None)]
        if self.reports_loss:
            return torch.stack(sums).sum(dim=0)
        return torch.zeros(4, dtype=torch.float64)

    def _from_last_stage(self, output):
        """Collective over the pp group: the last stage's `output` (any structure), on every stage."""
        last = self.mesh.stage_rank(self.mesh.pp - 1)
        return broadcast_tree(output, last, self.rt.device, "eval-output", group=self.mesh.pp_group)

    # -- state ----------------------------------------------------------------------------------
    def _local_state(self) -> dict[str, torch.Tensor]:
        with self.user_model.shards() if self.user_model is not None else contextlib.nullcontext():
            own = self.model.state_dict()
        return {k: own[k] for k in self.owned_keys}

    def state_dict(self):
        """dp rank 0 (cp rank 0) of every (pp, tp) position writes its shards under the unsplit
        model's names, with the dimension each sharded tensor is split along."""
        if self.mesh.dp_rank != 0 or self.mesh.cp_rank != 0:
            return {}, {}
        tensors = {f"model.{k}": v for k, v in self._local_state().items()}
        opt_tensors, opt_meta = ckpt.optimizer_to_tensors(self.optimizer, self.optimizer_names)
        tensors.update(opt_tensors)
        return tensors, {"optimizer": opt_meta, "shard_dims": self.shard_dims}

    def load_state_dict(self, reader) -> None:
        load_resharded(self, reader)

    def model_layout(self):
        return {k: (v.dtype, v.shape) for k, v in self.full_meta.state_dict().items()}

    def model_chunks(self):
        return model_chunks(self)
