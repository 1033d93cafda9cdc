"""The training loop, run by every worker process: data -> strategy.train_step -> metrics -> checkpoints.

Entry point of each worker: `forked_worker` for `paratrain run`, or `python -m paratrain.trainer
CONFIG --run-dir DIR`, which also runs under a plain `torchrun -m paratrain.trainer ...` since it
only reads the standard environment. The trainer never asks which strategy it holds.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Sized
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from paratrain import checkpoint as ckpt
from paratrain import preflight
from paratrain.checkpoint.train_state import NonFiniteError, load_train_state, save_train_state
from paratrain.comm import collectives
from paratrain.comm.scalars import all_reduce_sum, barrier, broadcast_str, reduce_loss_checking_sequences
from paratrain.config import Config
from paratrain.data import build_dataset, build_sampler, load_batch, tokenizer_files
from paratrain.data.batch import take, to_device
from paratrain.errors import ConfigError, error, say
from paratrain.fault import guard, stop, survive
from paratrain.metrics import MetricsLog, keep_stdout_when_its_reader_leaves, keep_steps_up_to, summary_line
from paratrain.models import build_model_to_place
from paratrain.models.hf import model_files
from paratrain.models.lora import adapter_exports
from paratrain.optim import build_loss, lr_factor
from paratrain.parallel import registry
from paratrain.parallel.registry import build_for_training
from paratrain.profile import MemoryTracker, Profiler
from paratrain.run_dir import write_config_toml
from paratrain.runtime import fault_points, process
from paratrain.token_mean import global_token_count, over_global_batch


@dataclass
class _Tally:
    """What the steps since the last logged one add up to."""

    first_step: int
    t_start: float = field(default_factory=time.perf_counter)
    t_last: float = field(default_factory=time.perf_counter)
    steps_since: int = 0
    bad_in_a_row: int = 0
    skipped: int = 0
    losses: list = field(default_factory=list)  # reported steps' losses, summed when logged: no copy per step
    # steps whose skip decision stayed on the device: (step, lr, flag, loss), counted when logged
    unsettled: list = field(default_factory=list)
    compile_s: float = 0.0  # train.compile: the first step's time, which compiled, out of samples/s

    def restart(self) -> None:
        self.t_last, self.steps_since, self.skipped = time.perf_counter(), 0, 0
        self.losses, self.compile_s = [], 0.0

    def compiled(self, is_main: bool) -> float:
        """After the first step under train.compile: its time is compiling's, reported once."""
        from paratrain.models.compiled import report_graph_breaks

        now = time.perf_counter()
        self.compile_s, self.t_last, self.steps_since = now - self.t_last, now, -1  # _account counts it next
        report_graph_breaks(is_main, self.compile_s)
        return self.compile_s


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, rt: process.Runtime, membership=None):
        self.cfg, self.run_dir, self.rt, self.membership = cfg, Path(run_dir), rt, membership  # (survive.py)
        process.seed_everything(cfg.train.seed)  # identical initial weights on every rank
        self.train_set = build_dataset(cfg, "train")
        self.val_set = build_dataset(cfg, "val")
        # made before the model: what exists now (the datasets) is not counted, as on a GPU
        self.memory = MemoryTracker(rt.device) if cfg.train.track_memory else None
        self.build_model_and_strategy()
        self.sampler = build_sampler(self.train_set, cfg)
        self.lr_at = lr_factor(cfg.train)
        self.step = 0

    def build_model_and_strategy(self) -> None:
        """The model and the strategy over the process group (again after a change of membership)."""
        cfg, rt = self.cfg, self.rt
        model = build_model_to_place(cfg, self.train_set, registry.spec(cfg.parallel.strategy).materializes_models)
        process.seed_everything(cfg.train.seed + 1 + rt.rank)  # per-rank stream for dropout and the like
        counts = registry.spec(cfg.parallel.strategy).counts_global_batch and len(cast(Sized, self.train_set))
        self.token_count = global_token_count(cfg, model, self.train_set[0]) if counts else None
        self.strategy = build_for_training(model, build_loss(cfg), cfg, rt)
        self.strategy.run_dir = self.run_dir
        self.dp_rank, self.dp_size = self.strategy.dp_rank, self.strategy.dp_size

    # -- resume ---------------------------------------------------------------------------------
    def resume(self, how: str) -> None:
        """`how`: none | auto | PATH. An elastic restart goes on from the newest checkpoint in the
        run directory, or from PATH while the run has saved none past it (the launcher moved any
        other run's later checkpoints aside: run_dir.prepare_run_dir)."""
        if self.membership and self.membership.joining:  # the state of a live replica instead
            return self.membership.settle(self, -1)
        restarted = self.rt.restart_count > 0
        if how == "none" and not restarted:
            return
        path = how
        if how == "auto" or restarted:
            if self.rt.is_main:
                reader = ckpt.latest_valid(self.run_dir, log=say)
                path = str(reader.path) if reader else ""
                if how not in ("none", "auto") and (reader is None or reader.step <= _step_of(how)):
                    path = how
            path = broadcast_str(path, self.rt)
            if not path:
                if self.rt.is_main:  # nor any step an earlier run or attempt logged here
                    keep_steps_up_to(self.run_dir / "metrics.jsonl", 0)
                    print("no checkpoint to resume from: starting fresh", flush=True)
                return
        reader = ckpt.CheckpointReader(path)
        resumes = (self.cfg.parallel.strategy, self.cfg.train.optimizer, "resume", registry.checkpoint_family)
        self._continue_at(load_train_state(self.strategy, reader, self.rt, resumes=resumes), path)
        if self.rt.is_main:
            # the steps after the checkpoint are redone: forget what the lost attempt logged of them
            keep_steps_up_to(self.run_dir / "metrics.jsonl", self.step)
            print(f"resumed from {path} at step {self.step} (saved by {reader.world_size} ranks)", flush=True)

    def take_state(self, reader) -> None:
        """The strategy's state, step and data position from a live replica's (fault/survive.py)."""
        self.strategy.load_state_dict(reader)
        _, meta0 = reader.load(rank=0)
        self._continue_at(meta0["trainer"], reader.path)

    def _continue_at(self, loop: dict, where) -> None:
        """Go on after the step `loop` saved, at the sample after its data position."""
        self.step = int(loop["step"])
        try:
            self.sampler.resume_at(self.step, loop.get("data"))
        except ValueError as exc:
            raise ConfigError("--resume", f"{where}: {exc}") from None

    def save_checkpoint(self) -> None:
        save_train_state(
            self.strategy,
            self.rt,
            self.run_dir,
            {"step": self.step, "data": self.sampler.position(self.step)},
            strategy_name=self.cfg.parallel.strategy,
            config=self.cfg.to_dict(),
            keep=self.cfg.checkpoint.keep,
        )

    # -- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss (and accuracy for classification), each dp rank taking a shard."""
        if not self.val_set:  # none, or empty
            return {}
        per_rank = max(4 * self.cfg.data.batch_size // self.dp_size, 1)  # no activations kept: bigger batches
        order = torch.arange(self.dp_rank, len(cast(Sized, self.val_set)), self.dp_size)
        # Every dp rank goes through the same number of chunks (the first rank's): where a forward
        # is a collective (zero3 gathers each unit from every rank) a rank with one chunk fewer
        # would leave the others waiting; it runs an empty one. Elsewhere empty chunks are skipped.
        most = -(-len(cast(Sized, self.val_set)) // self.dp_size)  # dp rank 0's share, the largest
        n_chunks = -(-most // per_rank)
        chunks = [order[i * per_rank : (i + 1) * per_rank] for i in range(n_chunks)] if self.strategy.evaluates else []
        sums = torch.zeros(4, dtype=torch.float64)  # loss*n, n, correct, counted
        self.strategy.before_eval()
        for chunk in chunks:
            if len(chunk):
                x, y = load_batch(self.val_set, chunk)
            elif self.strategy.collective_forward:  # sample 0 cut to none: a collate cannot make an empty batch
                x, y = take(load_batch(self.val_set, torch.zeros(1, dtype=torch.long)), 0)
            else:
                continue
            batch, counts = (to_device(x, self.rt.device), to_device(y, self.rt.device)), self.token_count
            # a token-mean loss: the validation set's token mean
            sums += counts.evaluate(self.strategy, batch, self.cfg) if counts else self.strategy.eval_step(*batch)
        sums = all_reduce_sum(sums, self.rt, "eval-sums", self.strategy.trainer_group)
        out = {"val_loss": sums[0].item() / max(sums[1].item(), 1)}
        if hasattr(self.val_set, "vocab_size"):  # a language model's: a mean over tokens
            out["val_perplexity"] = math.exp(out["val_loss"]) if out["val_loss"] < 709 else math.inf  # exp's range
        if sums[3] > 0:
            out["val_acc"] = sums[2].item() / sums[3].item()
        return out

    # -- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train from self.step to train.steps: each step, then its accounting, logging and
        checkpoint; on SIGTERM stop at the step every rank agrees on, after a checkpoint there."""
        cfg, rt = self.cfg, self.rt
        log = MetricsLog(self.run_dir, cfg, self.step, enabled=rt.is_main)
        prof = Profiler(
            self.run_dir,
            rt.rank,
            rt.world_size,
            rt.device,
            start_step=self.step,
            torch_profiler=cfg.train.torch_profiler,
            memory=self.memory,
        )
        self.strategy.profiler = prof
        tally = _Tally(first_step=self.step)
        last, stopped_by, compile_s = {}, 0, 0.0
        timeout = timedelta(seconds=cfg.parallel.timeout_s)
        agreed = self.strategy.lockstep and not self.membership  # (its group would not outlive a regroup)
        stops = stop.StopAgreement(rt.world_size, self.step, timeout, cfg.train.log_every) if agreed else None
        stops = self.membership.stops(self) if self.membership else stops  # (after the step's all-reduce)
        failed = True  # until the loop and the export end without an error: the trackers' runs say so
        try:
            try:
                while self.step < cfg.train.steps:
                    lr, loss = self._step(prof)
                    if cfg.train.compile and self.step == tally.first_step + 1:
                        compile_s = tally.compiled(rt.is_main)
                    self._account(loss, lr, tally, log)
                    done = self.step == cfg.train.steps
                    # preempted: log, save, leave (the last step finishes the run as usual instead)
                    stopped_by = stops.after_step(self.step) if stops and not done else 0
                    evaluate = bool(done or (cfg.train.eval_every and self.step % cfg.train.eval_every == 0))
                    if done or stopped_by or evaluate or self.step % cfg.train.log_every == 0:
                        last = self._log(lr, tally, log, prof, evaluate, final=bool(done or stopped_by))
                    if stopped_by or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
                        self._settle(tally, log)  # (too many non-finite steps end the run before it saves)
                        self.save_checkpoint()
                    if stopped_by:  # without the final export: the run is not over
                        break
                if stops:
                    stops.close()
            finally:
                prof.close()
            elapsed = time.perf_counter() - tally.t_start
            if not stopped_by:
                self.export()
                log.artifact(self.run_dir / "final")
            failed = False
        finally:
            log.close(failed)
        return {
            **last,
            "elapsed": elapsed,
            "compile_s": compile_s,
            "first_step": tally.first_step,
            "last_step": self.step,
            "stopped_by": stopped_by,
        }

    def _step(self, prof) -> tuple[float, torch.Tensor]:
        """One optimizer step, through any change of membership: (its learning rate, the local loss)."""
        collectives.LOG.step = self.step
        fault_points.at_step_start(rank=self.rt.rank, step=self.step, attempt=self.rt.restart_count)
        lr = self.cfg.train.lr * self.lr_at(self.step)
        with prof.step(self.step + 1, drain=self._logs(self.step + 1)):
            run = lambda: self._train_step(lr, prof)  # noqa: E731
            loss = self.membership.step(self, run) if self.membership else run()
        return lr, loss

    def _logs(self, step: int) -> bool:
        """Whether step `step` is logged (or may be: a stop agreed after it is logged too)."""
        train = self.cfg.train
        return (
            step >= train.steps
            or step % train.log_every == 0
            or bool(train.eval_every and step % train.eval_every == 0)
        )

    def _train_step(self, lr: float, prof) -> torch.Tensor:
        with prof.phase("data"):
            self.strategy.set_lr(lr)
            self.strategy.rng_step = self.step
            batch = None
            if self.strategy.reads_data:
                idx = self.sampler.rank_indices(self.step, self.dp_rank, self.dp_size)
                batch = to_device(load_batch(self.train_set, idx), self.rt.device, non_blocking=True)
        # a token-mean loss: over the label tokens of the global batch, not each micro-batch's
        with over_global_batch(self.token_count, batch, self.cfg, self.strategy.trainer_group) as batch:
            loss = self.strategy.train_step(batch)
        self.step += 1
        return loss

    def _account(self, loss: torch.Tensor, lr: float, tally: _Tally, log: MetricsLog) -> None:
        """Count the step: its loss towards the next logged mean, or a skipped update (a non-finite
        loss or gradient, agreed by every rank), too many of which in a row end the run. Where
        the strategy decided on the device (its skipped_step a tensor), the step is counted at the
        next logged step or checkpoint (_settle), with one copy to the host for all the steps since."""
        tally.steps_since += 1
        skipped = self.strategy.skipped_step
        if isinstance(skipped, torch.Tensor):
            tally.unsettled.append((self.step, lr, skipped, loss.detach()))
        else:
            self._settle(tally, log)
            self._count(self.step, lr, bool(skipped), loss, tally, log)
        log.advance()

    def _settle(self, tally: _Tally, log: MetricsLog) -> None:
        """Count the steps whose skip decision stayed on the device, in order, as at their step."""
        if not tally.unsettled:
            return
        unsettled, tally.unsettled = tally.unsettled, []
        flags = torch.stack([flag for _, _, flag, _ in unsettled]).tolist()
        for (step, lr, _, loss), skipped in zip(unsettled, flags):
            self._count(step, lr, bool(skipped), loss, tally, log)

    def _count(self, step: int, lr: float, skipped: bool, loss: torch.Tensor, tally: _Tally, log: MetricsLog) -> None:
        limit = self.cfg.train.max_bad_steps
        if skipped:
            tally.bad_in_a_row += 1
            tally.skipped += 1
            log.print(
                f"step {step}: non-finite loss or gradient, update skipped ({tally.bad_in_a_row} in a row, at most {limit})"
            )
            if tally.bad_in_a_row > limit:
                raise NonFiniteError(
                    f"{tally.bad_in_a_row} steps in a row had a non-finite loss or gradient "
                    f"(train.max_bad_steps = {limit}); last at step "
                    f"{step}, lr {lr:.3e}: lower train.lr or clip gradients"
                )
        else:
            tally.bad_in_a_row = 0
            if self.strategy.reports_loss:
                tally.losses.append(loss.detach())

    def _log(self, lr: float, tally: _Tally, log: MetricsLog, prof, evaluate: bool, final: bool) -> dict:
        """The logged step's metrics.jsonl entry (the loss averaged over the steps since the last
        one and over the ranks that report it), written; the tally starts again."""
        self._settle(tally, log)
        losses = torch.stack(tally.losses).double().cpu() if tally.losses else torch.zeros(0, dtype=torch.float64)
        loss_sum = torch.tensor([losses.sum().item(), len(losses)], dtype=torch.float64)
        reduced = self.strategy.reduce_loss(loss_sum)
        total_loss, reports = reduce_loss_checking_sequences(loss_sum, self.rt) if reduced is None else reduced.tolist()
        now = time.perf_counter()
        entry = {
            "step": self.step,
            "loss": total_loss / reports if reports else float("nan"),
            "lr": lr,
            "samples_per_s": tally.steps_since * self.cfg.data.batch_size / (now - tally.t_last),
            **({"compile_s": tally.compile_s} if tally.compile_s else {}),
            "time": now - tally.t_start,
            "wall": time.time(),
            **self.strategy.step_metrics(),
        }
        # A strategy that reduces its own loss (async ps) has ranks that do not meet at every
        # logged step: its profile travels once, at the end, where they all meet.
        if reduced is None or final:
            entry.update(prof.flush(self.strategy.trainer_group))
        if tally.skipped:
            entry["skipped_steps"] = tally.skipped
        if evaluate:
            entry.update(self.evaluate())
        log.record(entry)
        tally.restart()
        return entry

    def export(self) -> None:
        chunks = self.strategy.model_chunks()  # every rank takes part in gathering each unit
        if self.rt.is_main:
            ckpt.export_final(
                self.run_dir,
                self.strategy.model_layout(),
                chunks,
                step=self.step,
                config=self.cfg.to_dict(),
                extra={
                    "strategy": self.cfg.parallel.strategy,
                    "world_size": self.rt.world_size,
                },
                files={**model_files(self.strategy.model), **tokenizer_files(self.train_set)},
                derived=adapter_exports(self.strategy.model),
            )
        else:
            for _ in chunks:
                pass
        barrier(self.rt, "export", self.strategy.trainer_group)


def _step_of(path: str) -> int:
    """The step of checkpoint `path`; -1 if it is gone: pruned (checkpoint.keep) because this run
    saved that many newer ones into the same directory."""
    try:
        return ckpt.CheckpointReader(path).step
    except ckpt.CheckpointError:
        return -1


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="paratrain-worker", description="one paratrain worker process")
    p.add_argument("config", nargs="?", help="TOML config (default: the built-in default job)")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--resume", default="none")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return p.parse_args(argv)


@record
def main(argv=None) -> int:
    args = parse_args(argv)
    keep_stdout_when_its_reader_leaves()
    if args.config:
        os.environ.setdefault("PARATRAIN_CONFIG_DIR", str(Path(args.config).resolve().parent))
    try:
        cfg = preflight.load(args.config, args.overrides)
        rank = int(os.environ.get("RANK", 0))
        if registry.spec(cfg.parallel.strategy).expendable(cfg, rank) and not guard.is_guarded_child():
            return guard.run_guarded(functools.partial(run_worker, argv), f"worker rank {rank}")
        run_dir = Path(args.run_dir or Path("runs") / cfg.name)
        if survive.continuing():
            return survive.train_through_failures(cfg, run_dir, args.resume, train, registry.check_world)
        rt = process.init(cfg.train.device, cfg.parallel.timeout_s)
        return train(cfg, run_dir, rt, args.resume)
    except ConfigError as exc:
        error(f"{exc}")
        return 2
    except (ckpt.CheckpointWriteFailed, OSError) as exc:  # a full disk, a read-only folder: one line
        return ckpt.write_failed_exit(exc)
    finally:
        process.shutdown()


def train(cfg: Config, run_dir: Path, rt: process.Runtime, resume: str = "none", membership=None) -> int:
    """One run on a process group that has met: what every worker does between process.init and
    shutdown (the fast test tier calls it in workers that stay up between runs). Returns the exit
    code: 0, or 128 + the signal that stopped the run after a checkpoint. Raises ConfigError."""
    cfg.train.device = rt.device.type  # 'auto' resolved, as the run dir's config records it
    registry.check_world(cfg, rt.world_size)
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_config_toml(run_dir, cfg)
    if not (membership and membership.joining):  # a joiner's peers are mid-run (fault/survive.py)
        barrier(rt, "start")
    trainer = Trainer(cfg, run_dir, rt, membership)
    trainer.resume(resume)
    result = trainer.fit()
    if result["stopped_by"]:
        if rt.is_main:
            step = result["last_step"]
            print(
                f"{signal.Signals(result['stopped_by']).name}: stopped after step {step}, "
                f"saved as {run_dir / 'checkpoints' / f'step-{step}'}",
                flush=True,
            )
        return 128 + result["stopped_by"]
    if rt.is_main:
        print(summary_line(result, cfg, run_dir), flush=True)
    return 0


def _interrupt_once(signum, frame) -> None:
    """Ctrl-C, once. The same SIGINT often comes twice (the terminal's to the whole process group,
    then the agent's or an async worker's guard's passing it on), and a second KeyboardInterrupt
    would break the way out with a traceback. The later ones go to a handler that does nothing:
    with SIG_IGN instead, one already pending raises "Signal 2 ignored due to race condition"."""
    signal.signal(signal.SIGINT, lambda *_: None)
    raise KeyboardInterrupt


def run_worker(argv: list[str] | None = None) -> int:
    """main(), with the exit code an expendable rank's guard expects when the run itself failed."""
    # A worker forked from the worker server inherits the fork server's ignored SIGINT and SIGTERM:
    # without this it trained on after Ctrl-C until the agent's SIGKILL 30 s later. (SIGTERM stops
    # a worker at once until its training loop begins, then after a checkpoint: fault/stop.py.)
    signal.signal(signal.SIGINT, _interrupt_once)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return main(argv)  # type: ignore[return-value]  # torch types @record's result Optional; it re-raises instead
    except KeyboardInterrupt:  # Ctrl-C (or the agent passing it on): `paratrain run` says what happened
        return 128 + signal.SIGINT
    except guard.FailsRun:  # an expendable rank whose failure must fail the run: tell its guard
        traceback.print_exc()
        return guard.FAILS_RUN_EXIT if guard.is_guarded_child() else 1
    except Exception:
        if stop.received():  # asked to stop, and a peer left first (the agent stopping a failed group)
            return 128 + stop.received()
        raise


def forked_worker(*argv: str) -> None:
    """The entry point `paratrain run` hands the elastic agent: a worker forked from the worker
    server (see launch.py), which exits like `python -m paratrain.trainer ARGV` would."""
    from paratrain.runtime.launch import prepare_forked_worker

    prepare_forked_worker(f"paratrain-r{os.environ.get('RANK', '?')}")
    code = run_worker(list(argv))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    process.leave(run_worker())
