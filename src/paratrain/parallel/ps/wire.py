"""The parameter servers' wire protocol: how a model is dealt to servers, how a shard travels as one
flat message, and what its header says.

Sharding: whole parameters are dealt to servers greedily by bytes (largest first, to the least
loaded server), so shards are balanced without splitting a tensor. On both sides a shard lives in
one flat buffer with a small header in front, parameters (or gradients) are views into it, and a
push or a pull is one point-to-point message per server (gloo, `isend`/`irecv`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from paratrain.config import PSConfig
    from paratrain.parallel.base import Strategy as _Base
else:
    _Base = object  # at run time a plain mixin

HEADER = 4  # float32 slots in front of every message (small integers are exact in float32)
PUSH_TAG, PULL_TAG, EXPORT_TAG = 11, 12, 13
# push header: [step the gradient is for, server version it was computed on, worker loss, 0]
# pull header: [server version, 1 if these are the final parameters,
#               1 if the gradient of the worker's last push was not finite and not applied, 0]


def assign_shards(sizes: list[int], servers: int) -> list[list[int]]:
    """Parameter indices per server: largest first, each to the server with the fewest bytes so far."""
    load, shards = [0] * servers, [list[int]() for _ in range(servers)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        s = min(range(servers), key=lambda s: load[s])
        shards[s].append(i)
        load[s] += sizes[i]
    return [sorted(shard) for shard in shards]


class FlatShard:
    """One server's parameters as a flat buffer [header | tensors]; `bind` makes tensors views of it."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.shapes = [p.shape for p in params]  # a server empties the parameters it does not hold
        self.numel = sum(p.numel() for p in params)
        self.nbytes = (HEADER + self.numel) * 4

    def new_buffer(self) -> torch.Tensor:
        return torch.zeros(HEADER + self.numel, dtype=torch.float32)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        out, offset = [], HEADER
        for shape in self.shapes:
            n = shape.numel()
            out.append(buf[offset : offset + n].view(shape))
            offset += n
        return out

    def bind_data(self, buf: torch.Tensor) -> None:
        for p, v in zip(self.params, self.views(buf)):
            v.copy_(p.detach())
            p.data = v

    def bind_grads(self, buf: torch.Tensor) -> None:
        for p, v in zip(self.params, self.views(buf)):
            p.grad = v


def first_line(exc: Exception) -> str:
    """The gist of a gloo error: its first sentence, without the source location in front."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])
    return text.split(". ")[0]


class EngineState(_Base):
    """What ParameterServer (ps/engine.py) sets up for the halves it mixes in (server.py,
    worker.py): declared for the type checker, which sees them as a Strategy (annotations only,
    nothing at run time)."""

    ps: PSConfig
    mode: str
    servers: list[int]
    workers: list[int]
    names: list[str]
    own_names: list[str]
    shard_index: list[list[int]]
    shards: list[FlatShard]
    step_index: int
    total_steps: int
    timeout: timedelta
    _p2p: Callable[..., Any]
    _wait: Callable[[Any, int], None]
    _set_live: Callable[[list[int]], None]
    _first_live_worker: Callable[[], int]
