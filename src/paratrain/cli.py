"""The `paratrain` command."""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

from . import config as config_mod
from .config import ConfigError
from .errors import report as _error
from .extras import MissingExtra
from .metrics import keep_stdout_when_its_reader_leaves
from .preflight import load_config, preflight


def prepare_run_dir(
    run_dir: Path, cfg: config_mod.Config, resume: str, node_rank: int, resume_step: int | None = None
) -> None:
    """Make the run directory (writable, with room), write its config.toml, and put earlier work
    that this run must not mix with aside: every checkpoint for a fresh start, and those past
    `resume_step` for --resume PATH, which are another run's future. Elastic restarts and a later
    --resume auto go on from the newest checkpoint here, so it must be this run's own."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # A probe file of this process's own: the nodes of a multi-node run may share this
        # folder, and one node's unlink must not pull a shared name from under another.
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-") as probe:
            probe.write(b"ok")
    except OSError as exc:
        raise ConfigError("--run-dir", f"{run_dir} is not writable: {exc.strerror or exc}") from None
    if shutil.disk_usage(run_dir).free < 64 * 2**20:
        raise ConfigError("--run-dir", f"{run_dir} has less than 64 MiB free")
    # Written aside and renamed into place, so a node reading it never sees another's half-write.
    aside = run_dir / f".config-{uuid.uuid4().hex}.toml"
    aside.write_text(config_mod.to_toml(cfg))
    os.replace(aside, run_dir / "config.toml")
    if node_rank != 0:  # node 0 tidies a folder the nodes share
        return
    from .checkpoint import remove_unfinished

    old = run_dir / "checkpoints"
    for unfinished in (run_dir, old):  # saves and exports a crash cut short
        remove_unfinished(unfinished)
    if resume == "none":
        if old.is_dir() and any(old.iterdir()):
            aside = new_aside_dir(run_dir)
            old.rename(aside)
            print(f"paratrain: starting fresh; checkpoints of the earlier run moved to {aside}", flush=True)
        if (run_dir / "final").exists():  # it verifies, and would pass for this run's until its export
            aside = new_aside_dir(run_dir, "final")
            (run_dir / "final").rename(aside)
            print(f"paratrain: starting fresh; the earlier run's final export moved to {aside}", flush=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    elif resume_step is not None:
        from .checkpoint import list_checkpoints

        later = [(step, path) for step, path in list_checkpoints(old) if step > resume_step]
        if later:
            aside = new_aside_dir(run_dir)
            aside.mkdir()
            for _, path in later:
                path.rename(aside / path.name)
            print(
                f"paratrain: resuming from step {resume_step}; the checkpoints past it here "
                f"(step {', '.join(str(step) for step, _ in later)}) moved to {aside}",
                flush=True,
            )


_RUN_DIR_LOCKS: list[int] = []  # held until the run ends


def lock_run_dir(run_dir: Path) -> None:
    """Take RUN_DIR/.lock until the run ends; ConfigError if another run holds it.

    Two runs in one folder each put the other's checkpoints aside, prune them and write one
    metrics file. The lock is the kernel's (flock): it goes with the process, also when it is killed."""
    import fcntl

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError("--run-dir", f"{run_dir} is not writable: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            "--run-dir",
            f"{run_dir} is in use by another paratrain run (it holds {run_dir / '.lock'}); "
            f"wait for it, or give this run another name or --run-dir",
        ) from None
    _RUN_DIR_LOCKS.append(fd)


def new_aside_dir(run_dir: Path, what: str = "checkpoints") -> Path:
    """WHAT.prev-TIME, a name not taken yet (two runs may put checkpoints aside in one second)."""
    stamp = int(time.time())
    for n in itertools.count(1):
        aside = run_dir / (f"{what}.prev-{stamp}" + (f"-{n}" if n > 1 else ""))
        if not aside.exists():
            return aside


def check_resume(resume: str, cfg: config_mod.Config, run_dir: Path) -> int | None:
    """Check the checkpoint the run will resume from before any worker starts, and return its step.

    --resume PATH: that checkpoint, files and headers verified. auto: the newest in the run
    directory whose manifest and headers read; the workers verify its files and fall back to an
    older one if they fail, but all of them were written by one run, under one strategy and
    optimizer. None when there is nothing to resume from. ConfigError (exit 2) for a checkpoint this
    run cannot resume."""
    if resume == "none":
        return None
    import torch

    from .checkpoint import CheckpointError, CheckpointReader, check_resumable, list_checkpoints
    from .data import build_dataset
    from .models import build_model
    from .parallel import strategy_class

    def check(reader: CheckpointReader) -> None:
        check_resumable(reader, cfg.parallel.strategy, cfg.train.optimizer, "--resume")
        with torch.device("meta"):  # names and shapes against the model, built on meta (no memory)
            model = build_model(cfg, build_dataset(cfg, "train"))
        strategy_class(cfg.parallel.strategy).check_checkpoint(reader, model)

    if resume != "auto":
        try:
            reader = CheckpointReader(resume)
            reader.verify()
            check(reader)
        except CheckpointError as exc:
            raise ConfigError("--resume", str(exc)) from None
        return reader.step
    for _, path in reversed(list_checkpoints(run_dir / "checkpoints")):
        try:
            reader = CheckpointReader(path)
            check(reader)
            return reader.step
        except CheckpointError:
            continue  # the workers say why, as they skip it
    return None


def place(cfg: config_mod.Config, args) -> tuple[int, str | None]:
    """Processes per node and the device (set in cfg, with a note when `auto` fell back to CPU),
    then every check that needs the world size. ConfigError if the run cannot start."""
    from .launch import default_nproc
    from .runtime import resolve_device

    nproc = args.nproc or default_nproc(cfg.train.device)
    cfg.train.device, device_note = resolve_device(cfg.train.device, nproc)  # the run dir's config names it
    preflight(cfg, nproc * args.nnodes)
    return nproc, device_note


def check_launch(args) -> None:
    """The multi-node options, which no config check sees."""
    if args.nnodes > 1 and args.rdzv is None:
        raise ConfigError("--rdzv", f"required with --nnodes {args.nnodes}: HOST:PORT of node 0, where the nodes meet")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(
            "--node-rank", f"must be in [0, {args.nnodes}) for --nnodes {args.nnodes}, got {args.node_rank}"
        )
    if args.rdzv is not None:
        host, _, port = args.rdzv.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("--rdzv", f"expected HOST:PORT, got {args.rdzv!r}")
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts", f"must be >= 0, got {args.max_restarts}")


def check_faults() -> None:
    """PARATRAIN_FAULTS, which makes ranks fail on purpose (tests, benchmarks): malformed, it
    failed at the first collective in every worker; well-formed, it must never pass unnoticed."""
    from .testing import faults

    text = os.environ.get(faults.ENV)
    if not text:
        return
    try:
        unknown = sorted(set(faults.parse(text)) - set(faults.KNOWN))
    except ValueError as exc:
        raise ConfigError(faults.ENV, str(exc)) from None
    never = f"; {', '.join(unknown)} never fire{'s' * (len(unknown) == 1)} (known: {', '.join(faults.KNOWN)})"
    print(
        f"paratrain: warning: {faults.ENV} is set ({text}): these ranks will fail on purpose{never if unknown else ''}",
        file=sys.stderr,
        flush=True,
    )


def cmd_run(args) -> int:
    try:
        return train(args)
    finally:  # an in-process caller (tests) may start another run in the same folder next
        while _RUN_DIR_LOCKS:
            os.close(_RUN_DIR_LOCKS.pop())


def train(args) -> int:
    from .engines import place_from_environment
    from .jobs.preflight import check_nodes, node_facts
    from .launch import STOPPED_EXITS, Interrupted, WorkerFailure, launch, start_worker_server

    try:
        check_faults()
        engine = place_from_environment(args, os.environ)
        check_launch(args)
        cfg = load_config(args)
        run_dir = Path(args.run_dir or Path("runs") / cfg.name)
        if args.node_rank == 0:  # the other nodes of this run share the folder
            lock_run_dir(run_dir)
        start_worker_server()  # its imports overlap the checks below and the rendezvous
        nproc, device_note = place(cfg, args)
        if engine is not None:
            print(f"paratrain: {engine.describe(nproc)}", file=sys.stderr, flush=True)
        if args.nnodes > 1:  # every node the same software and config, before anyone waits on a collective
            print(
                f"paratrain: node {args.node_rank} of {args.nnodes}: waiting for the others at {args.rdzv}",
                file=sys.stderr,
                flush=True,
            )
            check_nodes(args.rdzv, args.nnodes, args.node_rank, node_facts(nproc, config_mod.to_toml(cfg)))
        resume_step = check_resume(args.resume, cfg, run_dir)
        prepare_run_dir(
            run_dir, cfg, args.resume, args.node_rank, resume_step if args.resume not in ("none", "auto") else None
        )
    except ConfigError as exc:
        return _error(str(exc), 2)
    if device_note:  # after the checks, so that a bad config still gets its one line
        print(f"paratrain: {device_note}", file=sys.stderr)
    worker_args = [
        str(run_dir / "config.toml"),
        "--run-dir",
        str(run_dir),
        "--resume",
        str(Path(args.resume).resolve()) if args.resume not in ("none", "auto") else args.resume,
    ]
    try:
        from .trainer import forked_worker

        launch(
            forked_worker,
            worker_args,
            nproc=nproc,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv=args.rdzv,
            max_restarts=args.max_restarts,
            run_id=cfg.name,
        )
    except ConfigError as exc:  # the rendezvous address cannot be used
        return _error(str(exc), 2)
    except Interrupted as exc:
        return _error(
            f"stopped by {exc}; the workers were stopped. {newest_checkpoint_note(run_dir)}", 128 + exc.signum
        )
    except WorkerFailure as exc:
        if exc.own_exitcodes == {2}:
            return 2  # the worker printed which key was wrong
        if exc.own_exitcodes and exc.own_exitcodes <= STOPPED_EXITS:  # the workers were sent the signal
            signum = max(exc.own_exitcodes) - 128
            return _error(
                f"stopped by {signal.Signals(signum).name} (sent to the workers). {newest_checkpoint_note(run_dir)}",
                128 + signum,
            )
        return _error(f"training failed: {exc} [rank {exc.rank} was a {config_mod.role_of(cfg, exc.rank)}]", 1)
    return 0


def newest_checkpoint_note(run_dir: Path) -> str:
    from .checkpoint import list_checkpoints

    found = list_checkpoints(run_dir / "checkpoints")
    if not found:
        return "No checkpoint was written (checkpoint.every sets how often)."
    return f"The newest checkpoint is {found[-1][1]}: go on from it with --resume auto."


def cmd_plan(args) -> int:
    import torch

    from .cluster import load_cluster
    from .data import build_dataset
    from .models import build_model
    from .plan import emit, make_plan

    try:
        cfg = load_config(args)
        if args.calibrate and args.cluster:
            raise ConfigError("--calibrate", "writes the cluster file it plans for: drop --cluster")
        cluster = load_cluster(args.cluster) if args.cluster else None
        if args.calibrate:
            from .cluster import calibrate

            cluster = calibrate(args.calibrate, args.nproc or 2)
            print(f"paratrain: this machine measured into {args.calibrate} (reuse it with --cluster)", file=sys.stderr)
        if cluster is not None:  # the cluster's shape replaces --nproc / --nnodes
            args.nproc, args.nnodes = cluster.devices_per_node, cluster.nodes
        nproc, device_note = place(cfg, args)
        with torch.device("meta"):  # shapes only: no memory, no time
            model = build_model(cfg, build_dataset(cfg, "train"))
        device = "cuda" if cluster is not None and cluster.is_gpu else cfg.train.device
        plan = make_plan(cfg, model, nproc, args.nnodes, device, cluster)
    except ConfigError as exc:
        return _error(str(exc), 2)
    if device_note and cluster is None:
        print(f"paratrain: {device_note}", file=sys.stderr)
    layouts = []
    if args.search:
        from .cluster import this_machine
        from .search import render_search, search

        plan["layouts"] = search(args.config, args.overrides, cluster or this_machine(args.nnodes, nproc), args.top)
        layouts = render_search(plan["layouts"])
    emit(plan, args.json, layouts)
    return 0


def cmd_inspect(args) -> int:
    from .inspect_checkpoint import inspect

    return inspect(args.checkpoint, show_tensors=args.tensors)


def cmd_report(args) -> int:
    from .report import NotARun, write_report

    try:
        path = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    except NotARun as exc:
        return _error(f"report: {exc}", 2)
    print(f"report: {path} (plots beside it)")
    return 0


def add_job_options(p) -> None:
    """What `run` and `plan` share: the job and where it runs."""
    p.add_argument("config", nargs="?", help="TOML config (default: the built-in default job)")
    p.add_argument("--nproc", type=int, default=None, help="processes per node (default: 2 on CPU, one per GPU)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.lr=0.01",
    )


def build_parser(with_benchmarks: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paratrain", description="Distributed training of PyTorch models.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train: one TOML file picks model, data and parallel strategy")
    add_job_options(r)
    # Unset, these three come from a cluster engine's environment (paratrain.engines), else 1, 0, none.
    r.set_defaults(nnodes=None)
    r.add_argument("--node-rank", type=int, default=None)
    r.add_argument("--rdzv", default=None, metavar="HOST:PORT", help="c10d rendezvous endpoint (multi-node)")
    r.add_argument("--max-restarts", type=int, default=0)
    r.add_argument("--run-dir", default=None, help="default: runs/NAME")
    r.add_argument("--resume", default="none", help="auto | none | PATH")
    r.set_defaults(func=cmd_run)

    pl = sub.add_parser(
        "plan",
        help="the layout of a run before it starts: rank grid, pipeline cut, "
        "per-rank bytes of parameters, gradients and optimizer state",
    )
    add_job_options(pl)
    pl.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="also write the plan as JSON (to stdout alone without PATH)",
    )
    pl.add_argument(
        "--cluster",
        default=None,
        metavar="FILE",
        help="a TOML [cluster] table: plan and predict for those machines (docs/planning.md)",
    )
    pl.add_argument(
        "--calibrate",
        nargs="?",
        const="cluster.toml",
        default=None,
        metavar="FILE",
        help="measure this machine (matmul, memory, gloo all-reduce; seconds) into a cluster file "
        "(default cluster.toml) and plan with it",
    )
    pl.add_argument(
        "--search",
        action="store_true",
        help="also rank the layouts that fit (dp x tp x pp, zero stage, microbatches, schedule, recompute)",
    )
    pl.add_argument("--top", type=int, default=5, metavar="K", help="layouts --search shows (default 5)")
    pl.set_defaults(func=cmd_plan)

    i = sub.add_parser(
        "inspect",
        help="what a checkpoint holds (step, world size, strategy, tensors, bytes); "
        "verifies its checksums (exit 2 if one fails)",
    )
    i.add_argument(
        "checkpoint",
        help="a checkpoint directory (RUN_DIR/checkpoints/step-100), a final export "
        "(RUN_DIR/final), or a run directory: a line for each of its checkpoints",
    )
    i.add_argument("--tensors", action="store_true", help="also list every tensor with dtype, shape and bytes")
    i.set_defaults(func=cmd_inspect)
    rep = sub.add_parser("report", help="plots and a markdown summary of a run directory")
    rep.add_argument("run_dir", metavar="RUN_DIR")
    rep.add_argument("--out", default=None, help="where to write (default: RUN_DIR/report)")
    rep.set_defaults(func=cmd_report)
    from .data.prepare import add_data_parser

    add_data_parser(sub)

    from .jobs import add_job_parser

    add_job_parser(sub)
    if with_benchmarks:  # the benchmark modules import torch: only when they may be asked for
        from .bench import add_bench_parser

        add_bench_parser(sub)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(
        with_benchmarks=argv[:1] not in (["run"], ["plan"], ["inspect"], ["report"], ["job"], ["data"])
    ).parse_args(argv)
    if getattr(args, "nproc", 1) is not None and getattr(args, "nproc", 1) < 1:
        return _error("--nproc: must be >= 1", 2)
    if getattr(args, "nnodes", None) is not None and args.nnodes < 1:
        return _error("--nnodes: must be >= 1", 2)
    try:
        return args.func(args)
    except MissingExtra as exc:  # an optional package this command needs: how to install it
        return _error(str(exc), 2)


def console_main() -> None:
    """The `paratrain` command: main(), then out without the interpreter's teardown of torch
    (half a second), since all the command opened is closed and flushed by the time main returns."""
    keep_stdout_when_its_reader_leaves()  # `paratrain inspect ... | head`: no traceback, the real exit code
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    remove_multiprocessing_tempdir()
    os._exit(code or 0)


def remove_multiprocessing_tempdir() -> None:
    """Remove the folder multiprocessing made for this process (/tmp/pymp-*, where the worker
    server's socket lives): its exit handler, which would, does not run past os._exit."""
    import multiprocessing

    tempdir = multiprocessing.current_process()._config.get("tempdir")
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)


if __name__ == "__main__":
    console_main()
