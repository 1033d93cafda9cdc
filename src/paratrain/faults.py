"""Fault injection for tests and benchmarks: make one rank misbehave at one step, on purpose.

PARATRAIN_FAULTS holds `;`-separated faults, each `name@key=value,key=value`, e.g.
    skip_collective@rank=1,step=3,what=grad-bucket-0     rank 1 never issues that all-reduce
    exit_in_save@rank=0,step=8                           rank 0 dies mid-checkpoint
    ps_vanish@rank=3,step=10                             parameter-server rank 3 leaves (exit 0) at step 10
    ps_kill@rank=3,step=10                               parameter-server rank 3 SIGKILLs itself at step 10
    fed_kill@rank=2,round=2                              federated worker rank 2 SIGKILLs itself mid-round
    fed_stall@rank=2,round=1                             federated worker rank 2 stalls 1.5 round_timeout_s
    fed_drop@client=4,round=0                            federated client 4 masks its update, then never sends it
A fault fires when every key it names matches; unset (the normal case) costs one environment lookup.
"""
from __future__ import annotations

import os


def _parse(text: str) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, args = item.partition("@")
        out.setdefault(name, []).append(dict(kv.split("=", 1) for kv in args.split(",") if kv))
    return out


def active(name: str, **context) -> bool:
    # Read at each call, not at import: a worker forked from the worker server imported this
    # module before its own environment was set.
    text = os.environ.get("PARATRAIN_FAULTS")
    if not text:
        return False
    for spec in _parse(text).get(name, ()):
        if all(str(context.get(k)) == v for k, v in spec.items()):
            return True
    return False
