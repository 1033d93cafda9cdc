"""The `paratrain` command."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path

from paratrain import config as config_mod
from paratrain.errors import ConfigError, note, say, warn, write_failure
from paratrain.errors import report as _error
from paratrain.extras import MissingExtra
from paratrain.metrics import keep_stdout_when_its_reader_leaves
from paratrain.parallel import registry
from paratrain.preflight import check_model_fits_this_machine, load_config, preflight
from paratrain.run_dir import check_resume, lock_run_dir, newest_checkpoint_note, prepare_run_dir, release_locks


def place(cfg: config_mod.Config, args, on_this_machine: bool = False) -> tuple[int, str | None]:
    """Processes per node and the device (set in cfg, with a note when `auto` fell back to CPU),
    then every check that needs the world size (`on_this_machine`, for a run: the model's size
    against this machine's memory first). ConfigError if the run cannot start."""
    from paratrain.runtime.launch import default_nproc
    from paratrain.runtime.process import resolve_device

    nproc = args.nproc or default_nproc(cfg.train.device)
    cfg.train.device, device_note = resolve_device(cfg.train.device, nproc)  # the run dir's config names it
    if on_this_machine:
        check_model_fits_this_machine(cfg, nproc, args.nnodes)
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


def check_faults() -> bool:
    """PARATRAIN_FAULTS, which makes ranks fail on purpose (tests, benchmarks): malformed, it
    failed at the first collective in every worker; well-formed, it must never pass unnoticed.
    True when it is set: the workers then start with the faults installed (testing/faults.py)."""
    from paratrain.testing import faults

    text = os.environ.get(faults.ENV)
    if not text:
        return False
    try:
        unknown = sorted(set(faults.parse(text)) - set(faults.KNOWN))
    except ValueError as exc:
        raise ConfigError(faults.ENV, str(exc)) from None
    never = f"; {', '.join(unknown)} never fire{'s' * (len(unknown) == 1)} (known: {', '.join(faults.KNOWN)})"
    warn(f"{faults.ENV} is set ({text}): these ranks will fail on purpose{never if unknown else ''}")
    return True


def cmd_run(args) -> int:
    try:
        return run_job(args)
    finally:
        release_locks()


def run_job(args) -> int:
    from paratrain.jobs.preflight import check_nodes, node_facts
    from paratrain.models import worker_preload
    from paratrain.runtime.launch import call_preloaded, launch, start_worker_server
    from paratrain.runtime.schedulers import place_from_environment

    try:
        with_faults = check_faults()
        scheduler = place_from_environment(args, os.environ)
        check_launch(args)
        cfg = load_config(args)
        run_dir = Path(args.run_dir or Path("runs") / cfg.name)
        # its imports overlap the checks below: the trainer's, and a transformers model's. Forked
        # before the lock is taken: the server outlives this run, and a copy of the lock's file
        # descriptor in it held the folder against every later run of this process.
        start_worker_server(preload=("paratrain.trainer", *worker_preload(cfg)))
        if args.node_rank == 0:  # the other nodes of this run share the folder
            lock_run_dir(run_dir)
        nproc, device_note = place(cfg, args, on_this_machine=True)
        if scheduler is not None:
            note(f"{scheduler.describe(nproc)}")
        store = None  # under "continue", the nodes' supervisors go on meeting in it (fault/supervise.py)
        if args.nnodes > 1:  # every node the same software and config, before anyone waits on a collective
            note(f"node {args.node_rank} of {args.nnodes}: waiting for the others at {args.rdzv}")
            facts = node_facts(nproc, config_mod.to_toml(cfg))
            store = check_nodes(args.rdzv, args.nnodes, args.node_rank, facts, keep=cfg.fault.on_failure == "continue")
        resume_step = check_resume(args.resume, cfg, run_dir)
        prepare_run_dir(
            run_dir, cfg, args.resume, args.node_rank, resume_step if args.resume not in ("none", "auto") else None
        )
    except ConfigError as exc:
        return _error(str(exc), 2)
    if device_note:  # after the checks, so that a bad config still gets its one line
        note(f"{device_note}")
    worker_args = [
        *(["paratrain.testing.faults:injected_worker"] if with_faults else []),  # launch.call_preloaded's target
        "paratrain.trainer:forked_worker",  # ... or the target of the faults' worker
        str(run_dir / "config.toml"),
        "--run-dir",
        str(run_dir),
        "--resume",
        str(Path(args.resume).resolve()) if args.resume not in ("none", "auto") else args.resume,
    ]

    def start() -> None:
        if cfg.fault.on_failure == "continue":  # our own supervisor: the agent would restart everyone
            from paratrain.comm.grid import ReplicaLayout
            from paratrain.fault.supervise import supervise

            world = nproc * args.nnodes
            size = registry.spec(cfg.parallel.strategy).replica_size(cfg, world)
            layout = ReplicaLayout(world, size, stages=cfg.parallel.pp)
            where = {"node_rank": args.node_rank, "rdzv": args.rdzv, "store": store} if args.nnodes > 1 else {}
            supervise(
                call_preloaded,
                worker_args,
                layout=layout,
                nproc=nproc,
                max_restarts=args.max_restarts,
                timeout_s=cfg.parallel.timeout_s,
                **where,
            )
        else:
            launch(
                call_preloaded,
                worker_args,
                nproc=nproc,
                nnodes=args.nnodes,
                node_rank=args.node_rank,
                rdzv=args.rdzv,
                max_restarts=args.max_restarts,
                run_id=cfg.name,
                agent_log=run_dir / ("agent.log" if args.node_rank == 0 else f"agent-node{args.node_rank}.log"),
            )

    return outcome(
        start, lambda: newest_checkpoint_note(run_dir), lambda r: f" [rank {r} was a {registry.role_of(cfg, r)}]"
    )


def outcome(start, after_stop, role_of) -> int:
    """Run `start()` (a launch) and turn how its workers ended into the exit code and its line:
    0; 2 where the workers named bad input; 128 + the signal that stopped them (`after_stop()`
    says where to go on from); 1 for a failure, naming the rank (`role_of(rank)` adds its role)."""
    from paratrain.runtime.launch import Interrupted
    from paratrain.runtime.worker_failure import STOPPED_EXITS, WorkerFailure

    try:
        start()
    except ConfigError as exc:  # the rendezvous address cannot be used
        return _error(str(exc), 2)
    except Interrupted as exc:
        return _error(f"stopped by {exc}; the workers were stopped. {after_stop()}", 128 + exc.signum)
    except WorkerFailure as exc:
        if exc.own_exitcodes == {2}:
            return 2  # the worker printed which key was wrong
        if exc.own_exitcodes and exc.own_exitcodes <= STOPPED_EXITS:  # the workers were sent the signal
            signum = max(exc.own_exitcodes) - 128
            return _error(
                f"stopped by {signal.Signals(signum).name} (sent to the workers). {after_stop()}", 128 + signum
            )
        if exc.traceback:  # the worker's, once (the agent's copy went to its log)
            say(exc.traceback)
        log = f" (the agent's log: {exc.agent_log})" if exc.agent_log else ""
        return _error(f"training failed: {exc}{role_of(exc.rank)}{log}", 1)
    return 0


def cmd_launch(args) -> int:
    from paratrain.runtime.schedulers import place_from_environment

    try:
        scheduler = place_from_environment(args, os.environ)
        check_launch(args)
        if not Path(args.script).is_file():
            raise ConfigError("script", f"file not found: {args.script}")
    except ConfigError as exc:
        return _error(str(exc), 2)
    from paratrain.api.script import launch_script  # torch: after the checks, which need none
    from paratrain.runtime.launch import default_nproc

    args.nproc = args.nproc or default_nproc("auto")
    if scheduler is not None:
        note(f"{scheduler.describe(args.nproc)}")
    return outcome(lambda: launch_script(args), lambda: "", lambda r: "")


def played(make):
    """make() (the plan), where playing the model may fail in the model's own code (a custom
    module that fake tensors, the meta device or a real batch cannot run): one line naming the
    error and where it arose, exit 2, never a traceback (`paratrain run` need not play it so)."""
    import traceback

    try:
        return make()
    except (ConfigError, MissingExtra):
        raise
    except Exception as exc:  # noqa: BLE001 -- the model's own code may raise anything
        where = traceback.extract_tb(exc.__traceback__)[-1]
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(
            "model.factory",
            f"plan cannot play the model's forward ({type(exc).__name__}: {first[:200]} at "
            f"{where.filename}:{where.lineno}); the plan needs one, in fake tensors or on a real batch",
        ) from None


def cmd_plan(args) -> int:
    import torch

    from paratrain.cost.cluster import load_cluster, this_machines_cluster
    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.plan.planner import emit, make_plan

    # with the JSON on stdout, whatever else the plan prints on the way (a corpus prepared on
    # first use, a calibration's notes) goes to stderr: stdout is the JSON alone
    with contextlib.redirect_stdout(sys.stderr) if args.json == "-" else contextlib.nullcontext():
        try:
            cfg = load_config(args)
            check_output_folder("--json", args.json)
            if args.calibrate and args.cluster:
                raise ConfigError("--calibrate", "writes the cluster file it plans for: drop --cluster")
            cluster = load_cluster(args.cluster) if args.cluster else None
            if args.calibrate and torch.cuda.is_available():  # the GPU's kernels (plan/calibrate_gpu.py)
                from paratrain.plan.calibrate_gpu import calibrate_gpu

                cluster = calibrate_gpu(args.calibrate, args.nproc)
                note(
                    f"this machine's {cluster.device_name} GPU measured into {args.calibrate} (reuse it with --cluster)"
                )
            elif args.calibrate:
                from paratrain.plan.calibrate import calibrate
                from paratrain.trainer import train

                cluster = calibrate(args.calibrate, args.nproc or 2, train=train)
                note(f"this machine measured into {args.calibrate} (reuse it with --cluster)")
            if cluster is not None:  # the cluster's shape replaces --nproc / --nnodes
                args.nproc, args.nnodes = cluster.devices_per_node, cluster.nodes
            nproc, device_note = place(cfg, args)
            with torch.device("meta"):  # shapes only: no memory, no time
                model = build_model(cfg, build_dataset(cfg, "train"))
            device = "cuda" if cluster is not None and cluster.is_gpu else cfg.train.device
            if cluster is None and device == "cpu":  # this host's calibration where one was kept
                cluster, figures = this_machines_cluster(args.nnodes, nproc)
                note(figures)
            plan = played(lambda: make_plan(cfg, model, nproc, args.nnodes, device, cluster))
        except ConfigError as exc:
            return _error(str(exc), 2)
        if device_note and cluster is None:
            note(f"{device_note}")
        layouts = []
        if args.search:
            from paratrain.cost.cluster import this_machine
            from paratrain.plan.search import render_search, search

            plan["layouts"] = search(args.config, args.overrides, cluster or this_machine(args.nnodes, nproc), args.top)
            layouts = render_search(plan["layouts"])
    try:
        emit(plan, args.json, layouts)
    except OSError as exc:  # the folder checked before planning went away, or filled up
        return _error(f"--json: {write_failure(args.json, exc)}", 2)
    return 0


def check_output_folder(key: str, path: str | None) -> None:
    """A file a command will write (None or "-": stdout): checked before the work that fills it."""
    if path in (None, "-"):
        return
    if Path(path).is_dir():
        raise ConfigError(key, f"{path} is a directory: give a file name")
    if not Path(path).parent.is_dir():
        raise ConfigError(key, f"folder {Path(path).parent} does not exist")


def cmd_inspect(args) -> int:
    from paratrain.checkpoint.inspect import inspect

    return inspect(args.checkpoint, show_tensors=args.tensors)


def cmd_convert(args) -> int:
    from paratrain.checkpoint.convert import ConvertRefused, convert
    from paratrain.checkpoint.format import CheckpointWriteFailed

    try:
        dest = convert(Path(args.src), Path(args.dest), args.to)
    except ConvertRefused as exc:
        return _error(f"convert: {exc}", 2)
    except CheckpointWriteFailed as exc:
        return _error(f"convert: {exc}", 1)
    print(f"convert: {dest} ({args.to})")
    return 0


def cmd_report(args) -> int:
    from paratrain.report import NotARun, write_report

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
    # Unset, these three come from a cluster scheduler's environment (paratrain.runtime.schedulers), else 1, 0, none.
    r.set_defaults(nnodes=None)
    r.add_argument("--node-rank", type=int, default=None)
    r.add_argument("--rdzv", default=None, metavar="HOST:PORT", help="c10d rendezvous endpoint (multi-node)")
    r.add_argument("--max-restarts", type=int, default=0)
    r.add_argument("--run-dir", default=None, help="default: runs/NAME")
    r.add_argument("--resume", default="none", help="auto | none | PATH")
    r.set_defaults(func=cmd_run)

    la = sub.add_parser("launch", help="run your own training script (paratrain.init) on every process")
    la.add_argument("--nproc", type=int, default=None, help="processes per node (default: 2 on CPU, one per GPU)")
    la.add_argument("--nnodes", type=int, default=None)
    la.add_argument("--node-rank", type=int, default=None)
    la.add_argument("--rdzv", default=None, metavar="HOST:PORT", help="c10d rendezvous endpoint (multi-node)")
    la.add_argument("--max-restarts", type=int, default=0)
    la.add_argument("script", help="a Python script, run as `python script.py ARGS` on each process")
    la.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    la.set_defaults(func=cmd_launch)

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
        "(default cluster.toml) and plan with it; on a CUDA GPU its kernels (GEMMs, attention, copy, launch)",
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
    cv = sub.add_parser(
        "convert", help="a model's weights between a paratrain final/, a torch DCP directory and Hugging Face's"
    )
    cv.add_argument(
        "src", metavar="SRC", help="a final export (RUN_DIR/final), a checkpoint step-N, a DCP or an HF directory"
    )
    cv.add_argument("dest", metavar="DEST", help="the directory to write (absent or empty)")
    # a plain string, not choices: an unknown format is one line and exit 2 like every other bad input
    cv.add_argument("--to", required=True, metavar="dcp|safetensors|hf", help="the format DEST is written in")
    cv.set_defaults(func=cmd_convert)
    rep = sub.add_parser("report", help="plots and a markdown summary of a run directory")
    rep.add_argument("run_dir", metavar="RUN_DIR")
    rep.add_argument("--out", default=None, help="where to write (default: RUN_DIR/report)")
    rep.set_defaults(func=cmd_report)
    from paratrain.data.prepare import add_data_parser

    add_data_parser(sub)

    from paratrain.jobs.command import add_job_parser

    add_job_parser(sub)
    if with_benchmarks:  # the benchmark modules import torch: only when they may be asked for
        from paratrain.bench import add_bench_parser

        add_bench_parser(sub)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(
        with_benchmarks=argv[:1]
        not in (["run"], ["launch"], ["plan"], ["inspect"], ["convert"], ["report"], ["job"], ["data"])
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

    tempdir = getattr(multiprocessing.current_process(), "_config", {}).get("tempdir")  # private: not in typeshed
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)


if __name__ == "__main__":
    console_main()
