"""Before a multi-node run trains: every node reaches node 0 at the rendezvous endpoint and shows what it
runs (paratrain and torch versions, processes per node, the resolved config); node 0 compares them all
with its own. A node that differs is refused in seconds, by name, on every node, where it would
otherwise have joined and failed (or hung) somewhere in the first step.

The exchange uses a TCP store of its own on the rendezvous port, closed before the elastic agent of
node 0 binds that port for the rendezvous proper (the agents' clients retry until it listens), so a
job needs no second port.
"""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta

import tomllib

from paratrain.errors import ConfigError

PREFIX = "paratrain/preflight"
# How long node 0 waits for the others' acknowledgement of its verdict before closing the store.
ACK_TIMEOUT_S = 30


def node_facts(nproc: int, config_toml: str) -> dict:
    import torch

    from paratrain import __version__

    return {
        "host": socket.gethostname(),
        "paratrain": __version__,
        "torch": torch.__version__,
        "nproc": nproc,
        "config": config_toml,
    }


def check_nodes(rdzv: str, nnodes: int, node_rank: int, facts: dict, timeout_s: float = 300, keep: bool = False):
    """Meet the other nodes at `rdzv` (HOST:PORT, hosted by node 0) and compare `facts`. Returns when
    all agree; ConfigError (exit 2) naming the node and what differs, or the node that never came.
    `keep`: the store stays up and is returned (node 0: the server; the others: a client to it),
    for fault.on_failure = "continue", whose supervisors meet in it (fault/supervise.py)."""
    from torch.distributed import TCPStore

    from paratrain.runtime.process import listen_on, store_server

    host, _, port = rdzv.rpartition(":")
    try:
        socket.getaddrinfo(host, int(port))
    except socket.gaierror as exc:
        raise ConfigError(
            "--rdzv", f"node {node_rank} cannot resolve the rendezvous host {host!r}: {exc.strerror}"
        ) from None
    try:
        if node_rank == 0:  # on the rendezvous address alone, as the rendezvous store (docs/security.md)
            store = store_server(listen_on(host, int(port)), timedelta(seconds=timeout_s))
        else:
            store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        what = "cannot listen at" if node_rank == 0 else f"did not reach node 0 in {timeout_s:.0f} s at"
        raise ConfigError("--rdzv", f"node {node_rank} {what} {rdzv}: {str(exc).splitlines()[0]}") from None
    store.set(f"{PREFIX}/node-{node_rank}", json.dumps(facts))
    if node_rank == 0:
        verdict = _judge(store, nnodes, facts, timeout_s)
        store.set(f"{PREFIX}/verdict", verdict)
        _wait_for_acks(store, nnodes)
    else:
        verdict = store.get(f"{PREFIX}/verdict").decode()
        store.set(f"{PREFIX}/ack-{node_rank}", "1")
    if verdict:
        raise ConfigError("preflight", verdict)
    return store if keep else None  # dropped, node 0's frees the port for the rendezvous


def _judge(store, nnodes: int, own: dict, timeout_s: float) -> str:
    """'' when every node agrees with node 0, else one line naming the first node that differs."""
    keys = [f"{PREFIX}/node-{n}" for n in range(1, nnodes)]
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [n for n, key in enumerate(keys, 1) if not store.check([key])]
        if not missing:
            break
        if time.monotonic() > deadline:
            return (
                f"node{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not reach the "
                f"rendezvous in {timeout_s:.0f} s"
            )
        time.sleep(0.05)
    for n, key in enumerate(keys, 1):
        difference = describe_difference(own, json.loads(store.get(key)))
        if difference:
            return f"node {n} differs from node 0: {difference}"
    return ""


def describe_difference(ours: dict, theirs: dict) -> str:
    """What differs between node 0's facts and another node's, in words ('' when nothing does)."""
    where = f"(host {theirs.get('host', '?')})"
    for key in ("paratrain", "torch", "nproc"):
        if ours.get(key) != theirs.get(key):
            return f"{key} {theirs.get(key)} against {ours.get(key)} on node 0 {where}"
    if ours["config"] != theirs["config"]:
        a, b = _flatten(tomllib.loads(ours["config"])), _flatten(tomllib.loads(theirs["config"]))
        changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        shown = ", ".join(f"{k} = {b.get(k, '<unset>')!r} against {a.get(k, '<unset>')!r}" for k in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return f"config differs {where}: {shown}{more}"
    return ""


def _flatten(table: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _wait_for_acks(store, nnodes: int) -> None:
    """Hold the store open until every node has read the verdict (or ACK_TIMEOUT_S passed)."""
    deadline = time.monotonic() + ACK_TIMEOUT_S
    keys = [f"{PREFIX}/ack-{n}" for n in range(1, nnodes)]
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(0.02)
