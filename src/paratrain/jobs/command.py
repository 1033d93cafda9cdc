"""`paratrain job slurm|kubernetes|skypilot`: one self-contained job file for a cluster scheduler.

The config is checked as `paratrain run` checks it and embedded, resolved, in the file; the nodes then
need paratrain installed and nothing else copied. Each file starts one `paratrain run` per node with no
wiring of its own: `run` reads the node count, its rank and the rendezvous from the scheduler's
environment (paratrain.runtime.schedulers).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from paratrain.errors import ConfigError, say
from paratrain.jobs.job import Job, dns_label

SCHEDULERS = ("slurm", "kubernetes", "skypilot")
# What --submit hands the file to, per scheduler (the file's path is appended).
SUBMIT = {"slurm": ["sbatch"], "kubernetes": ["kubectl", "apply", "-f"], "skypilot": ["sky", "launch", "-y"]}


def add_job_parser(sub) -> None:
    j = sub.add_parser(
        "job",
        help="write a job file for a cluster scheduler (Slurm, Kubernetes, SkyPilot) "
        "with the config embedded; --submit hands it to the scheduler",
    )
    j.add_argument("scheduler", metavar="SCHEDULER", help="slurm | kubernetes | skypilot")
    j.add_argument("config", nargs="?", help="TOML config (default: the built-in default job)")
    j.add_argument("--nodes", type=int, required=True, help="how many nodes (hosts, pods)")
    j.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes per node (default: --gpus if given, else 2, as `run` on a CPU)",
    )
    j.add_argument(
        "--run-dir",
        default=None,
        help="on storage every node sees (default: runs/NAME, under the --volume mount on Kubernetes)",
    )
    j.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    j.add_argument("--max-restarts", type=int, default=0, help="passed to each node's `paratrain run`")
    j.add_argument("--image", default=None, help="container image with paratrain installed (required for kubernetes)")
    j.add_argument("--kind", default="trainjob", help="kubernetes: trainjob (Kubeflow Trainer v2) | pytorchjob")
    j.add_argument(
        "--volume",
        default=None,
        metavar="CLAIM",
        help="kubernetes: a PersistentVolumeClaim for the run directory, shared by the pods",
    )
    j.add_argument("--gpus", type=int, default=0, help="GPUs per node")
    j.add_argument("--cpus", type=int, default=None, help="CPUs per node")
    j.add_argument("--memory", default=None, help="memory per node, e.g. 32Gi")
    j.add_argument("--out", default=None, metavar="FILE", help="where to write (default: stdout)")
    j.add_argument("--submit", action="store_true", help="also submit: sbatch, kubectl apply -f, sky launch")
    j.set_defaults(func=cmd_job)


def check_options(args) -> None:
    """The job's own options, before the config is read. ConfigError naming the option."""
    if args.scheduler not in SCHEDULERS:
        raise ConfigError("SCHEDULER", f"unknown scheduler {args.scheduler!r}: one of {', '.join(SCHEDULERS)}")
    for option, value, minimum in (
        ("--nodes", args.nodes, 1),
        ("--nproc", args.nproc, 1),
        ("--max-restarts", args.max_restarts, 0),
        ("--gpus", args.gpus, 0),
        ("--cpus", args.cpus, 1),
    ):
        if value is not None and value < minimum:
            raise ConfigError(option, f"must be >= {minimum}, got {value}")
    if args.kind not in ("trainjob", "pytorchjob"):
        raise ConfigError("--kind", f"unknown kind {args.kind!r}: trainjob or pytorchjob")
    if args.scheduler == "kubernetes" and not args.image:
        raise ConfigError("--image", "required for kubernetes: a container image with paratrain installed")
    if args.submit:
        tool = SUBMIT[args.scheduler][0]
        if shutil.which(tool) is None:
            raise ConfigError(
                "--submit", f"{tool} is not installed here; write the file with --out and submit it where {tool} is"
            )
        if args.out is None:
            raise ConfigError("--submit", "needs --out FILE: the file to submit")


def make_job(args) -> Job:
    """Read and check the config as `run` would for this many nodes; ConfigError (exit 2) if invalid."""
    from paratrain import config as config_mod
    from paratrain.preflight import load_config, preflight

    cfg = load_config(args)
    nproc = args.nproc or args.gpus or 2
    # The device stays as the config says (`auto`): it is resolved on the nodes, not on this host.
    preflight(cfg, nproc * args.nodes)
    name = dns_label(cfg.name)
    mount = "/paratrain-runs" if args.scheduler == "kubernetes" and args.volume else None
    run_dir = args.run_dir or (f"{mount}/{name}" if mount else f"runs/{cfg.name}")
    return Job(
        name=name,
        config_toml=config_mod.to_toml(cfg),
        nodes=args.nodes,
        nproc=nproc,
        run_dir=run_dir,
        max_restarts=args.max_restarts,
        image=args.image,
        gpus=args.gpus,
        cpus=args.cpus,
        memory=args.memory,
        volume=args.volume,
        kind=args.kind,
    )


def render(scheduler: str, job: Job) -> str:
    from paratrain.jobs import kubernetes, skypilot, slurm

    return {"slurm": slurm.render, "kubernetes": kubernetes.render, "skypilot": skypilot.render}[scheduler](job)


def cmd_job(args) -> int:
    from paratrain.errors import report as _error

    try:
        check_options(args)
        text = render(args.scheduler, make_job(args))
    except ConfigError as exc:
        return _error(str(exc), 2)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    try:
        out.write_text(text)
    except OSError as exc:
        return _error(f"--out: cannot write {out}: {exc.strerror or exc}", 2)
    if args.scheduler == "slurm":
        out.chmod(0o755)
    say(f"job: {out}")
    if args.submit:
        return subprocess.run([*SUBMIT[args.scheduler], str(out)]).returncode
    return 0
