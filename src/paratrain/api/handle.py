"""The Python API: your own training loop under paratrain's strategies (docs/own-loop.md).

    pt = paratrain.init(strategy="zero2")          # joins the launcher's process group, or world 1
    model, optimizer = pt.setup(model, optimizer)  # the strategy around your model and optimizer
    loader = pt.setup_dataloader(loader)           # batch_size = the GLOBAL batch
    for x, y in loader:
        pt.backward(loss_fn(model(x), y))          # gradients end as the global batch's mean (so
        optimizer.step(); optimizer.zero_grad()    # does a plain loss.backward(), as under DDP)
    loss = pt.eval_step(batch); pt.gather_for_metrics(predictions)   # on every rank, any strategy
    pt.save(path, step=step); pt.load(path); pt.export(path); pt.log(step, loss=...)

The handle never asks which strategy it holds: it calls the strategy's own-loop methods
(parallel/base.py: adopt_optimizer, watch_backward, backward, clip_grad_norm_), which a strategy
whose schedule owns forward and backward (pp, hybrid, ps, federated) answers with one error naming
train_step; a step of the user's own optimizer there is refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from paratrain import checkpoint as ckpt
from paratrain import config as config_mod
from paratrain.api.loader import GlobalBatchLoader, to_device
from paratrain.checkpoint.train_state import load_train_state, save_train_state
from paratrain.comm import collectives
from paratrain.comm.lockstep import EXPORT, LOAD, LOG, SAVE, LockstepCheck
from paratrain.comm.scalars import all_reduce_sum, barrier, broadcast_str
from paratrain.config import Config
from paratrain.data.batch import as_pair, join, tree_map
from paratrain.errors import ConfigError, error, say
from paratrain.metrics import MetricsLog
from paratrain.models.lora import adapter_exports, check_strategy
from paratrain.optim import build_loss
from paratrain.parallel import registry
from paratrain.parallel.base import Strategy, broadcast_tensors, refuse, said_by_one
from paratrain.runtime import process, schedulers

SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name != "name")


def init(strategy: str | None = None, *, config: str | Path | None = None, run_dir=None, **keys) -> Paratrain:
    """Join the process group of the launcher's environment (paratrain launch, torchrun, srun's
    tasks), or run alone at world 1. `keys`: any [parallel] key (bucket_mb=..., tp=...), or a section's table
    (train={"seed": 1}); `config`: a TOML file they override. `run_dir` (default runs/NAME):
    where pt.log writes metrics.jsonl. Bad input: one line naming the key, exit 2."""
    try:
        cfg = _config(strategy, config, keys)
        os.environ.update(schedulers.slurm_task(os.environ) or {})
        rt = process.init(cfg.train.device, cfg.parallel.timeout_s)
        registry.spec(cfg.parallel.strategy).check_layout(cfg, rt.world_size)
        if cfg.parallel.cp > 1:  # the user's loss would meet whole targets with a chunk's output
            raise ConfigError("parallel.cp", "runs under `paratrain run` only, not in your own loop (yet)")
    except ConfigError as exc:
        error(f"{exc}")
        process.mark_failing()
        raise SystemExit(2) from None
    collectives.LOG.step = 0
    return Paratrain(cfg, rt, Path(run_dir or Path("runs") / cfg.name))


def _config(strategy: str | None, path, keys: dict) -> Config:
    raw = config_mod.read_toml(path) if path is not None else {}
    for key, value in keys.items():
        if key in SECTIONS and isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw.setdefault("parallel", {})[key] = value
    if strategy is not None:
        raw.setdefault("parallel", {})["strategy"] = strategy
    # a pipeline cut by measured layer times would time them on [data]'s dataset: the API has none
    raw.setdefault("parallel", {}).setdefault("balance", "params")
    cfg = config_mod.from_dict(raw)
    registry.check_config(cfg)
    return cfg


class Paratrain:
    """What init returns: this process's place (rank, world_size, device, is_main) and the calls."""

    def __init__(self, cfg: Config, rt: process.Runtime, run_dir: Path):
        self.cfg, self.rt, self.run_dir = cfg, rt, run_dir
        self.rank, self.world_size, self.device, self.is_main = rt.rank, rt.world_size, rt.device, rt.is_main
        self.strategy: Strategy | None = None
        self._calls: LockstepCheck | None = None  # the check of calls every rank makes (setup)
        self.loaders: list[GlobalBatchLoader] = []
        # this rank's share of a global batch, times the dp size: of the batch last handed out, and
        # of the one the last training forward ran on (a loop may fetch the next before backward)
        self._weight = self._forward_weight = 1.0
        self._items_share: float | None = None  # pt.backward(loss, weight=n)'s, while it runs
        self._metrics: MetricsLog | None = None
        self._t0 = time.perf_counter()

    # -- setting up -------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, loss=None):
        """The strategy around `model` and `optimizer` (built over model.parameters()); `loss(output,
        target)` for train_step (default: the config's train.loss). Returns (model, optimizer):
        step the returned optimizer (under ZeRO a new one of your class over this rank's shards)."""
        if self.strategy is not None:
            refuse("pt.setup: called once per pt (one model and its optimizer)", said_by_one())
        try:
            check_strategy(model, self.cfg.parallel.strategy)
        except ConfigError as exc:
            error(f"{exc}")
            process.mark_failing()
            raise SystemExit(2) from None
        cls = registry.strategy_class(self.cfg.parallel.strategy)
        if optimizer is not None:
            self._take_optimizer_keys(optimizer, cls.adopts_optimizers(self.cfg))
        model.to(self.device)
        if self.world_size > 1:  # every rank starts from rank 0's weights, as one process would
            broadcast_tensors(list(model.parameters()) + list(model.buffers()))
        try:
            self.strategy = registry.build_for_training(
                model, loss or build_loss(self.cfg), self.cfg, self.rt, own_loop=True
            )
        except ConfigError as exc:  # what the model cannot take (a tp plan), on every rank alike
            error(f"{exc}")
            process.mark_failing()
            raise SystemExit(2) from None
        if optimizer is not None:
            optimizer = self.strategy.adopt_optimizer(optimizer)
        optimizer = optimizer or self.strategy.optimizer
        assert optimizer is not None  # the strategy built one from [train]
        if not cls.adopts_optimizers(self.cfg):
            optimizer.register_step_pre_hook(self._refuse_own_step)
        optimizer.register_step_post_hook(self._stepped)
        self.strategy.model.register_forward_pre_hook(self._forward_started)
        self.strategy.watch_backward(self._gradient_scale, self._backward_ran)
        # pt.save, load, export and log meet the other ranks: checked in the sequence the model's
        # own calls are (a state_dict on rank 0 alone meets the others' pt.save, and is named at
        # once), on a group of the API's own where the strategy checks none (dp, zero1-2)
        self._calls = self.strategy.calls_check()
        if self._calls is None and self.world_size > 1 and self.strategy.lockstep:
            self._calls = LockstepCheck(self.cfg.parallel.strategy, self.cfg.parallel.timeout_s)
        return self.strategy.model, optimizer

    def _check_call(self, kind: int) -> None:
        """Before an API call that meets the other ranks: every rank is at the same call (lockstep.py)."""
        if self._calls is not None:
            self._calls.check(kind)

    def _forward_started(self, module, args) -> None:
        """A training forward: the batches handed out so far are those its backward will have
        trained on, and the last of them is the one whose share weights its loss."""
        if torch.is_grad_enabled():
            self._forward_weight = self._weight
            for loader in self.loaders:
                loader.forward_ran()

    def _backward_ran(self) -> None:
        """A training backward has run (pt.backward or the user's loss.backward()): the loaders'
        saved positions move to what its forward was given (a batch fetched since is served again
        after a resume: loader.py)."""
        for loader in self.loaders:
            loader.backward_ran()

    def _refuse_own_step(self, *_) -> None:
        """A step of the user's own loop under a strategy whose schedule runs forward and backward:
        whatever loss.backward() came before it trained nothing right."""
        if self.strategy is not None and not self.strategy.in_schedule:
            refuse(
                f"optimizer.step() under {self.cfg.parallel.strategy!r}: its schedule runs forward and backward "
                f"(a loss.backward() of yours is not reduced); use pt.setup(model, optimizer, loss=fn) and "
                f"loss = pt.train_step(batch)",
                said_by_one(),
            )

    @staticmethod
    def _stepped(*_) -> None:
        """Collectives are logged with the number of optimizer steps taken, as in `paratrain run`: a
        hang's report names the step (pt.log's and pt.load's step numbers set it too)."""
        collectives.LOG.step += 1

    def _take_optimizer_keys(self, optimizer: torch.optim.Optimizer, adopted: bool) -> None:
        """Checkpoints name the optimizer (a resume with another is refused); a strategy that builds
        its own from [train] takes its hyper-parameters, which must be ones [train] can say."""
        kind = type(optimizer).__name__.lower()
        if adopted:
            self.cfg.train.optimizer = kind
            return
        d = optimizer.defaults
        plain: dict[str, dict[str, object]] = {
            "sgd": dict(dampening=0, nesterov=False),
            "adamw": dict(betas=(0.9, 0.999), eps=1e-8, amsgrad=False),
        }
        if kind not in plain or len(optimizer.param_groups) > 1 or any(d.get(k) != v for k, v in plain[kind].items()):
            refuse(
                f"pt.setup: strategy {self.cfg.parallel.strategy!r} builds its optimizer from [train]: pass "
                f"torch.optim.SGD(lr, momentum, weight_decay) or AdamW(lr, weight_decay) with one param group",
                said_by_one(),
            )
        options = self.cfg.train
        options.optimizer, options.lr, options.weight_decay = kind, float(d["lr"]), float(d["weight_decay"])
        options.momentum = float(d.get("momentum", 0.0))

    def setup_dataloader(self, loader, even_batches: bool = True) -> GlobalBatchLoader:
        """`loader.batch_size` is the global batch: this rank gets its share of each (see loader.py).
        `even_batches=False`: a last batch of fewer samples than data-parallel ranks is served too,
        some shares empty (an evaluation set of any size, whole: pt.gather_for_metrics)."""
        wrapped = GlobalBatchLoader(loader, self.cfg.train.seed, self._place, self._share, even_batches)
        self.loaders.append(wrapped)
        return wrapped

    def _share(self) -> tuple[int, int, bool]:
        s = self.strategy
        return (s.dp_rank, s.dp_size, s.reads_data) if s is not None else (self.rank, self.world_size, True)

    def _place(self, batch, weight: float):
        self._weight = weight
        return to_device(batch, self.device)

    # -- the step ---------------------------------------------------------------------------------
    def _strategy(self, call: str):
        if self.strategy is None:
            refuse(f"pt.{call}: call pt.setup(model, optimizer) first", said_by_one())
        return self.strategy

    def backward(self, loss: torch.Tensor, weight: float | None = None) -> None:
        """loss: the mean over this rank's share, or over `weight` items of it (label tokens, say);
        afterwards every rank's gradients are the mean over the global batch's samples (shares of
        unequal size weighted by theirs), or over its items: each rank's loss weighted by its
        items over the mean number of items per rank (a collective). A plain loss.backward() is
        pt.backward(loss): the strategy's watch (watch_backward) reduces every backward."""
        strategy = self._strategy("backward")
        if weight is not None:
            total = float(
                all_reduce_sum(torch.tensor([float(weight)], dtype=torch.float64), self.rt, "backward-weight")
            )
            self._items_share = float(weight) * self.world_size / total if total else 0.0  # no items: no gradient
        try:
            strategy.backward(loss)
        finally:
            self._items_share = None

    def _gradient_scale(self) -> float:
        """What a training backward's gradients are multiplied by (watch_backward): this rank's
        weight in the global batch's mean, 1.0 where every rank's share is alike."""
        return self._forward_weight if self._items_share is None else self._items_share

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (over every rank's shards) to max_norm; returns the norm."""
        return self._strategy("clip_grad_norm_").clip_grad_norm_(float(max_norm))

    def train_step(self, batch) -> torch.Tensor:
        """One optimizer step of the strategy's own schedule (forward, backward, step) on this
        rank's share; returns the global batch's mean loss on every rank (a strategy whose ranks
        run at their own pace, async ps or federated: the rank's own). Needs equal shares: every
        global batch full, divisible by D."""
        strategy = self._strategy("train_step")
        if self._weight != 1.0:
            # (where one rank's share differs from the mean, every rank's does: rank 0 says it)
            refuse("pt.train_step: a global batch not shared equally (set drop_last=True on the loader)", said_by_one())
        strategy.in_schedule = True  # the schedule's own backward: not the user's (watch_backward)
        try:
            loss = strategy.train_step(batch)
        finally:
            strategy.in_schedule = False
        for loader in self.loaders:  # trained on what was handed out (its forward may not be the model's)
            loader.forward_ran()
            loader.backward_ran()
        return self._reported_mean(strategy, loss)

    def _reported_mean(self, strategy: Strategy, loss: torch.Tensor) -> torch.Tensor:
        """The mean of the losses of the ranks that report one (one per replica: e.g. a pipeline's
        last stage; shares are equal), on every rank, without a host sync. Where no rank reports
        (a parameter server's workers) or the ranks are not in step, the rank's own loss."""
        if self.world_size == 1 or not strategy.lockstep:
            return loss
        reports = float(strategy.reports_loss)
        sums = torch.stack([loss.detach().double() * reports, loss.new_tensor(reports, dtype=torch.float64)])
        sums = sums.to(self.device)
        collectives.all_reduce(sums, "train-step-loss", group=strategy.trainer_group)
        mean = (sums[0] / sums[1].clamp_min(1)).to(loss.dtype)
        return torch.where(sums[1] > 0, mean, loss.detach().to(mean.device))

    def eval_step(self, batch, outputs: bool = False):
        """Collective: the batch's loss (under the loss setup was given, or [train]'s), on every
        rank under every strategy: the mean over the global batch, each rank's share weighted by
        its samples (a pipeline runs its stages forward only). `batch`: this rank's share, as the
        loader served it (None on a rank that reads no data, a parameter server: it scores
        nothing). `outputs=True`: (loss, the model's output on this rank's share), the output
        gathered whole under tp and sent from the last stage under pp."""
        strategy = self._strategy("eval_step")
        kept: list | None = [] if outputs else None
        if batch is None:
            sums = torch.zeros(4, dtype=torch.float64)
        else:
            sums = strategy.eval_step(*as_pair(batch), kept)
        sums = all_reduce_sum(sums, self.rt, "eval-step-sums", strategy.trainer_group)
        loss = (sums[0] / sums[1]).float()
        if kept is None:
            return loss
        return loss, join(kept) if kept else None

    def gather_for_metrics(self, value):
        """Collective: `value` (a tensor, or a dict, tuple or list of them) of this rank's share of
        a batch, from every data-parallel rank: each sample's once, in the loader's order, on every
        rank (the ranks of one replica, tp or pp, hold the same samples: one of them counts). A
        scalar counts as one sample."""
        if self.world_size == 1:
            return value
        return tree_map(self._gather_samples, value)

    def _gather_samples(self, t: torch.Tensor) -> torch.Tensor:
        dp_rank, _, reads = self._share()
        t = t.detach().reshape(1) if t.dim() == 0 else t.detach()
        mine = torch.tensor([len(t), dp_rank, int(reads)], device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        collectives.all_gather(rows, mine, "gather-for-metrics-sizes")
        table = torch.stack(rows).tolist()
        padded = t.new_zeros((max(n for n, _, _ in table), *t.shape[1:]), device=self.device)
        padded[: len(t)] = t
        parts = [torch.empty_like(padded) for _ in rows]
        collectives.all_gather(parts, padded, "gather-for-metrics")
        # each data-parallel share from the first rank that read it; shares are contiguous in
        # the global batch, so dp rank order is the loader's
        first: dict[int, torch.Tensor] = {}
        for part, (n, share, read) in zip(parts, table):
            if read:
                first.setdefault(share, part[:n])
        return torch.cat([first[share] for share in sorted(first)])

    # -- checkpoints and the model ------------------------------------------------------------------
    def save(self, path, step: int, **extras) -> Path | None:
        """Collective: PATH/checkpoints/step-N in `paratrain run`'s sharded format (the newest
        checkpoint.keep kept), with the loaders' positions and `extras` (JSON values)."""
        strategy = self._strategy("save")
        self._check_call(SAVE)
        try:
            json.dumps(extras)
        except TypeError as exc:
            refuse(f"pt.save: extras must be JSON values ({exc})", said_by_one())
        loop = {"step": int(step), "loaders": [loader.position() for loader in self.loaders], "extras": extras}
        return save_train_state(
            strategy,
            self.rt,
            Path(path),
            loop,
            strategy_name=self.cfg.parallel.strategy,
            config=self.cfg.to_dict(),
            keep=self.cfg.checkpoint.keep,
        )

    def load(self, path) -> dict | None:
        """Collective: resume from checkpoint PATH, or from the newest valid one in PATH (a folder
        pt.save wrote), at any world size; the loaders go on at their next batch. Returns
        {"step": N, **extras}, or None where PATH holds no checkpoint yet (a fresh start)."""
        strategy = self._strategy("load")
        self._check_call(LOAD)
        path = Path(path)
        if not (path / "manifest.json").exists():
            found = ""
            if self.is_main:
                reader = ckpt.latest_valid(path, log=say) if path.is_dir() else None
                found = str(reader.path) if reader else ""
            found = broadcast_str(found, self.rt)
            if not found:
                return None
            path = Path(found)
        resumes = (self.cfg.parallel.strategy, self.cfg.train.optimizer, "pt.load", registry.checkpoint_family)
        try:
            loop = load_train_state(strategy, ckpt.CheckpointReader(path), self.rt, resumes=resumes)
        except ConfigError as exc:  # another strategy's or optimizer's checkpoint, on every rank alike
            refuse(f"{exc}", said_by_one())
        collectives.LOG.step = int(loop["step"])
        for loader, position in zip(self.loaders, loop.get("loaders", [])):
            loader.resume_at(position)
        return {"step": int(loop["step"]), **loop.get("extras", {})}

    def export(self, path, step: int = 0) -> Path | None:
        """Collective: PATH/model.safetensors (keyed like model.state_dict()) and its manifest."""
        strategy = self._strategy("export")
        self._check_call(EXPORT)
        chunks = strategy.model_chunks()  # every rank takes part in gathering each unit
        out = None
        if self.is_main:
            extra = {"strategy": self.cfg.parallel.strategy, "world_size": self.world_size}
            layout = strategy.model_layout()
            derived = adapter_exports(strategy.model)
            out = ckpt.export_model(
                Path(path), layout, chunks, step=step, config=self.cfg.to_dict(), extra=extra, derived=derived
            )
            if self._metrics is not None:  # a run that pt.log reports to trackers: the model too
                self._metrics.artifact(Path(path))
        else:
            for _ in chunks:
                pass
        barrier(self.rt, "export", strategy.trainer_group)
        return out

    # -- metrics ----------------------------------------------------------------------------------
    def log(self, step: int, **values) -> None:
        """One line of RUN_DIR/metrics.jsonl, as `paratrain run` writes it, with TensorBoard, MLflow
        and wandb where log.tensorboard, log.mlflow and log.wandb are on. Collective where a value is a tensor (call it on every rank): a
        tensor's mean over the ranks, rank 0's other values."""
        if self._metrics is None:
            if self.is_main:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            self._metrics = MetricsLog(self.run_dir, self.cfg, 0, self.is_main)
        collectives.LOG.step = int(step)
        numbers = {**values, **self._means_over_ranks(values)}
        now = time.perf_counter()
        self._metrics.record({"step": int(step), **numbers, "time": now - self._t0, "wall": time.time()})

    def _means_over_ranks(self, values: dict) -> dict[str, float]:
        """Each one-element tensor among `values`, as its mean over the ranks (one all-reduce; the
        rank's own where the strategy's ranks are not in step)."""
        names = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
        if not names:
            return {}
        stacked = torch.stack([values[k].detach().double().reshape(()).to(self.device) for k in names])
        strategy = self.strategy
        if self.world_size > 1 and (strategy is None or strategy.lockstep):
            self._check_call(LOG)
            group = strategy.trainer_group if strategy is not None else None
            collectives.all_reduce(stacked, "log-values", group=group)
            stacked /= dist.get_world_size(group)
        return dict(zip(names, stacked.tolist()))

    def close(self) -> None:
        """Leave the process group, every rank together (optional: the process's end leaves it too)."""
        if self._metrics is not None:
            self._metrics.close()
        process.shutdown(together=True)
