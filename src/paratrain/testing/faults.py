"""Fault injection for tests and benchmarks: make one rank misbehave at one step, on purpose.

`paratrain run` installs these faults at the training code's fault points (runtime/fault_points.py)
in each worker when PARATRAIN_FAULTS is set.

PARATRAIN_FAULTS holds `;`-separated faults, each `name@key=value,key=value`, e.g.
    skip_collective@rank=1,step=3,what=grad-bucket-0     rank 1 never issues that all-reduce
    exit_in_save@rank=0,step=8                           rank 0 dies mid-checkpoint
    disk_full_in_save@step=10                            every rank's shard of step 10 meets a full disk (ENOSPC)
    ps_vanish@rank=3,step=10                             parameter-server rank 3 leaves (exit 0) at step 10
    ps_kill@rank=3,step=10                               parameter-server rank 3 SIGKILLs itself at step 10
    fed_kill@rank=2,round=2                              federated worker rank 2 SIGKILLs itself mid-round
    fed_stall@rank=2,round=1                             federated worker rank 2 stalls 1.5 round_timeout_s
    fed_drop@client=4,round=0                            federated client 4 masks its update, then never sends it
    kill@rank=2,step=30,attempt=0                        rank 2 SIGKILLs itself as step 31 begins (first start only)
    kill_joining@rank=2,incarnation=1                    rank 2, started again once (continue), dies rejoining
    term@rank=1,step=5                                   rank 1 gets SIGTERM as step 6 begins (preempted alone)
A fault fires when every key it names matches; unset (the normal case) costs one environment lookup.
`paratrain` checks the value before any worker starts (exit 2 if malformed) and warns whenever it
is set: a run with faults set fails on purpose.
"""

from __future__ import annotations

import os

ENV = "PARATRAIN_FAULTS"
# The faults that call sites ask for (active(NAME, ...)): a name not here is named in the CLI's
# warning, as it would never fire.
KNOWN = (
    "skip_collective",
    "exit_in_save",
    "disk_full_in_save",  # where no small filesystem can be mounted to fill
    "ps_vanish",
    "ps_kill",
    "ps_kill_before_pull",
    "ps_stall_before_pull",
    "ps_bad_header",  # a ps worker between push and pull
    "fed_drop",
    "fed_stall",
    "fed_kill",
    "kill",  # any rank, at the start of a step (the trainer)
    "term",  # the same, SIGTERM
    "kill_joining",  # a rank rejoining under fault.on_failure = "continue", before it takes the state
)  # federated clients and client ranks


def parse(text: str) -> dict[str, list[dict[str, str]]]:
    """{fault: [{key: value}, ...]} of a PARATRAIN_FAULTS value; ValueError saying what is malformed."""
    out: dict[str, list[dict[str, str]]] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, args = item.partition("@")
        if not name.isidentifier():
            raise ValueError(f"{item!r}: expected NAME@KEY=VALUE,..., got the name {name!r}")
        spec = {}
        for pair in filter(None, args.split(",")):
            key, eq, value = pair.partition("=")
            if not eq or not key.isidentifier():
                raise ValueError(f"{item!r}: expected {name}@KEY=VALUE,..., got {pair!r}")
            spec[key] = value
        out.setdefault(name, []).append(spec)
    return out


def active(name: str, context: dict) -> bool:
    """Whether fault `name` fires for `context` (runtime/fault_points.py's injector). The variable is
    read at each call, not at import: a worker forked from the worker server imported this module
    before its own environment was set."""
    text = os.environ.get(ENV)
    if not text:
        return False
    for spec in parse(text).get(name, ()):
        if all(str(context.get(k)) == v for k, v in spec.items()):
            return True
    return False


def injected_worker(target: str, *args: str) -> None:
    """A worker of `paratrain run` with PARATRAIN_FAULTS set: the faults installed at the training
    code's fault points, then the worker itself (`target`, as launch.call_preloaded takes it)."""
    from paratrain.runtime import fault_points
    from paratrain.runtime.launch import call_preloaded

    fault_points.install(active)
    call_preloaded(target, *args)
