"""Fault injection for tests and benchmarks: make one rank misbehave at one step, on purpose.

PARATRAIN_FAULTS holds `;`-separated faults, each `name@key=value,key=value`, e.g.
    skip_collective@rank=1,step=3,what=grad-bucket-0     rank 1 never issues that all-reduce
    exit_in_save@rank=0,step=8                           rank 0 dies mid-checkpoint
    ps_vanish@rank=3,step=10                             parameter-server rank 3 leaves (exit 0) at step 10
    ps_kill@rank=3,step=10                               parameter-server rank 3 SIGKILLs itself at step 10
A fault fires when every key it names matches; unset (the normal case) costs one environment lookup.
`paratrain` checks the value before any worker starts (exit 2 if malformed) and warns whenever it
is set: a run with faults set fails on purpose.
"""
from __future__ import annotations

import os


ENV = "PARATRAIN_FAULTS"
# Each fault and the keys it may name (the context its call site passes to active()).
KNOWN = {
    "skip_collective": {"rank", "step", "what"},
    "exit_in_save": {"rank", "step"},
    "ps_vanish": {"rank", "step"},
    "ps_kill": {"rank", "step"},
    # parameter_server.py: a worker between its push and its pull
    "ps_kill_before_pull": {"rank", "step"},
    "ps_stall_before_pull": {"rank", "step"},
    "ps_bad_header": {"rank", "step"},
}


def parse(text: str) -> dict[str, list[dict[str, str]]]:
    """{fault: [{key: value}, ...]} of a PARATRAIN_FAULTS value; ValueError saying what is wrong."""
    out: dict[str, list[dict[str, str]]] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, args = item.partition("@")
        if name not in KNOWN:
            raise ValueError(f"unknown fault {name!r} (known: {', '.join(KNOWN)})")
        spec = {}
        for pair in filter(None, args.split(",")):
            key, eq, value = pair.partition("=")
            if not eq or key not in KNOWN[name]:
                raise ValueError(f"{item!r}: expected {name}@KEY=VALUE,... with KEY one of "
                                 f"{', '.join(sorted(KNOWN[name]))}, got {pair!r}")
            spec[key] = value
        out.setdefault(name, []).append(spec)
    return out


def active(name: str, **context) -> bool:
    # Read at each call, not at import: a worker forked from the worker server imported this
    # module before its own environment was set.
    text = os.environ.get(ENV)
    if not text:
        return False
    for spec in parse(text).get(name, ()):
        if all(str(context.get(k)) == v for k, v in spec.items()):
            return True
    return False
