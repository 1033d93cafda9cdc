"""Where `paratrain run` is in a cluster job: the node count, this node's rank and the rendezvous,
read from the environment each scheduler gives its tasks, so a job file needs no wiring of its own.

Why each scheduler is read the way it is:
* Kubeflow Trainer (v2) hands every node torchrun's own options as PET_* variables.
* A Kubeflow PyTorchJob (v1) sets WORLD_SIZE and RANK counting pods, master included; its PET_NNODES
  has counted the master wrongly in some operator versions, so it is not read.
* Slurm gives the node list in its compressed form (`node[01-04,7]`), which is expanded here: `scontrol`
  is often missing inside a job's container, and a node that cannot expand the list rendezvoused with
  itself and hung.
* SkyPilot lists every node's address, the head first.
Under plain torchrun (TORCHELASTIC_RUN_ID, LOCAL_RANK set) the variables describe a worker, not a node:
nothing is read. Flags given to `paratrain run` win over all of it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from paratrain.errors import ConfigError

# Slurm gives no port: one is derived from the job id, so that two jobs sharing a node do not meet
# at each other's rendezvous. MASTER_PORT, if the job sets it, wins.
SLURM_PORT_BASE = 29500
SLURM_PORT_SPAN = 1000


@dataclass
class Placement:
    scheduler: str  # "Kubeflow Trainer", "PyTorchJob", "Slurm", "SkyPilot"
    nnodes: int
    node_rank: int
    rdzv: str  # HOST:PORT of node 0
    nproc: int | None  # processes per node, when the scheduler says
    job: str = ""  # the scheduler's name for the job, for the first log line

    def describe(self, nproc: int) -> str:
        job = f" job {self.job}" if self.job else ""
        return (
            f"{self.scheduler}{job}: node {self.node_rank} of {self.nnodes}, {nproc} process"
            f"{'es' if nproc != 1 else ''} each (world {self.nnodes * nproc}), rendezvous at {self.rdzv}"
        )


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list, in order: `gpu[01-03,7],login` -> gpu01 gpu02 gpu03 gpu07 login.
    Several bracket groups in one name multiply (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2); zero padding
    follows the range's first bound, as Slurm writes it."""
    names = []
    for item in _split_top_level(nodelist):
        parts = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
        choices = [[parts[i]] if i % 2 == 0 else _expand_ranges(parts[i], nodelist) for i in range(len(parts))]
        names += ["".join(combo) for combo in itertools.product(*choices)]
    return names


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ConfigError("SLURM_JOB_NODELIST", f"unbalanced brackets in {nodelist!r}")
        if char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ConfigError("SLURM_JOB_NODELIST", f"unbalanced brackets in {nodelist!r}")
    items.append(nodelist[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ConfigError("SLURM_JOB_NODELIST", f"cannot read the range [{ranges}] in {nodelist!r}")
        width = len(low)
        out += [str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]
    return out


def _int(env: Mapping[str, str], key: str, minimum: int = 0) -> int:
    value = env[key].strip()
    if not value.isdigit() or int(value) < minimum:
        raise ConfigError(key, f"expected an integer >= {minimum}, got {env[key]!r}")
    return int(value)


def _nproc(env: Mapping[str, str]) -> int | None:
    """PET_NPROC_PER_NODE as a count; None for torchrun's words (auto, gpu, cpu): `run`'s own default."""
    value = env.get("PET_NPROC_PER_NODE", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _torchrun_style(name: str, nodes: str, rank: str, addr: str, port: str):
    """A reader of a scheduler that hands each node torchrun's own figures under its own names."""

    def read(env: Mapping[str, str]) -> Placement:
        return Placement(name, _int(env, nodes, 1), _int(env, rank), f"{env[addr]}:{_int(env, port, 1)}", _nproc(env))

    return read


_kubeflow_trainer = _torchrun_style(
    "Kubeflow Trainer", "PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"
)
_pytorchjob = _torchrun_style("PyTorchJob", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


def _slurm(env: Mapping[str, str]) -> Placement:
    nodes = expand_nodelist(env["SLURM_JOB_NODELIST"])
    nnodes = _int(env, "SLURM_NNODES", 1) if "SLURM_NNODES" in env else len(nodes)
    if len(nodes) != nnodes:
        raise ConfigError("SLURM_JOB_NODELIST", f"names {len(nodes)} nodes, SLURM_NNODES says {nnodes}")
    job_id = _int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
    return Placement(
        "Slurm", nnodes, _int(env, "SLURM_NODEID"), f"{nodes[0]}:{_slurm_port(env)}", None, str(job_id or "")
    )


def _slurm_port(env: Mapping[str, str]) -> int:
    job_id = _int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
    return _int(env, "MASTER_PORT", 1) if "MASTER_PORT" in env else SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def slurm_task(env: Mapping[str, str]) -> dict[str, str] | None:
    """The torchrun environment of a process that srun started itself (`srun python script.py`: a
    task per process, no launcher between), for paratrain.init; None elsewhere. srun marks its
    tasks with SLURM_STEP_ID: an sbatch script's own shell has SLURM_PROCID = 0 and the job's
    SLURM_NTASKS too, and must not wait for peers. A launcher's worker (RANK set) is left alone.
    The store is on task 0's node, the step's first, at the port `paratrain run` would take;
    MASTER_ADDR and MASTER_PORT win."""
    if "RANK" in env or not env.get("SLURM_STEP_ID", "").strip() or "SLURM_PROCID" not in env:
        return None
    world = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    nodes = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    task = {
        "RANK": str(_int(env, "SLURM_PROCID")),
        "WORLD_SIZE": str(_int(env, world, 1)),
        "LOCAL_RANK": str(_int(env, "SLURM_LOCALID")),
        "MASTER_ADDR": env.get("MASTER_ADDR") or expand_nodelist(env[nodes])[0],
        "MASTER_PORT": str(_slurm_port(env)),
    }
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node and "SLURM_NODEID" in env:  # `2(x3),1`: two tasks on each of three nodes, then one
        counts = [int(n) for part in per_node.split(",") for n in _repeat(part, per_node)]
        task["LOCAL_WORLD_SIZE"] = str(counts[min(_int(env, "SLURM_NODEID"), len(counts) - 1)])
    return task


def _repeat(part: str, whole: str) -> list[str]:
    match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
    if not match:
        raise ConfigError("SLURM_STEP_TASKS_PER_NODE", f"cannot read {whole!r}")
    return [match[1]] * int(match[2] or 1)


# SkyPilot's own port convention for multi-node tasks, also what its examples pass to torchrun.
SKYPILOT_PORT = 8008


def _skypilot(env: Mapping[str, str]) -> Placement:
    ips = env["SKYPILOT_NODE_IPS"].split()
    nnodes = _int(env, "SKYPILOT_NUM_NODES", 1) if "SKYPILOT_NUM_NODES" in env else len(ips)
    if len(ips) != nnodes:
        raise ConfigError("SKYPILOT_NODE_IPS", f"lists {len(ips)} nodes, SKYPILOT_NUM_NODES says {nnodes}")
    gpus = env.get("SKYPILOT_NUM_GPUS_PER_NODE", "0").strip()
    port = _int(env, "MASTER_PORT", 1) if "MASTER_PORT" in env else SKYPILOT_PORT
    return Placement(
        "SkyPilot",
        nnodes,
        _int(env, "SKYPILOT_NODE_RANK"),
        f"{ips[0]}:{port}",
        int(gpus) if gpus.isdigit() and int(gpus) > 0 else None,
        env.get("SKYPILOT_TASK_ID", ""),
    )


# (scheduler reader, the variables that must all be set for it), most specific first: a PyTorchJob may
# also set PET_* variables, and a Slurm allocation may run a SkyPilot task.
SCHEDULERS = (
    (_pytorchjob, ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")),
    (_kubeflow_trainer, ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")),
    (_skypilot, ("SKYPILOT_NODE_IPS", "SKYPILOT_NODE_RANK")),
    (_slurm, ("SLURM_JOB_NODELIST", "SLURM_NODEID")),
)

# Set by torchrun for each worker it starts: then RANK/WORLD_SIZE count workers, not nodes.
TORCHRUN_WORKER = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")


def detect(env: Mapping[str, str]) -> Placement | None:
    """The scheduler whose variables `env` holds, or None (a plain run, or a worker under torchrun).
    ConfigError naming the variable when one cannot be read."""
    if any(key in env for key in TORCHRUN_WORKER):
        return None
    for read, keys in SCHEDULERS:
        if all(env.get(key, "").strip() for key in keys):
            placement = read(env)
            if not 0 <= placement.node_rank < placement.nnodes:
                raise ConfigError(
                    placement.scheduler, f"node rank {placement.node_rank} is not in [0, {placement.nnodes})"
                )
            return placement
    return None


def place_from_environment(args, env: Mapping[str, str]) -> Placement | None:
    """Fill `paratrain run`'s --nnodes/--node-rank/--rdzv (and --nproc) from the scheduler, unless a flag
    was given; the flags left unset get their plain defaults. Returns the scheduler, or None."""
    flags = (args.nnodes, args.node_rank, args.rdzv)
    placement = detect(env) if all(flag is None for flag in flags) else None
    if placement is None:
        args.nnodes = 1 if args.nnodes is None else args.nnodes
        args.node_rank = 0 if args.node_rank is None else args.node_rank
        return None
    # One node needs no rendezvous across hosts: it keeps the local one, on loopback.
    args.nnodes, args.node_rank = placement.nnodes, placement.node_rank
    args.rdzv = placement.rdzv if placement.nnodes > 1 else None
    if args.nproc is None and placement.nproc is not None:
        args.nproc = placement.nproc
    return placement
