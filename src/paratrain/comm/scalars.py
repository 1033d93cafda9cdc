"""Small collectives on scalars and strings, shared by the trainer and the Python API: each a no-op
at world size 1, each named (collectives.py's log and hang reports say which one)."""

from __future__ import annotations

import torch

from paratrain.comm import collectives
from paratrain.runtime import process


def all_reduce_sum(t: torch.Tensor, rt: process.Runtime, what: str, group=None) -> torch.Tensor:
    if rt.world_size == 1:
        return t
    dev = t.to(rt.device)
    collectives.all_reduce(dev, what, group=group)
    return dev.cpu()


def reduce_loss_checking_sequences(loss_sum: torch.Tensor, rt: process.Runtime) -> tuple[float, float]:
    """Sum the logged loss over ranks, and in the same message compare every rank's collective
    fingerprint: ranks whose collectives drifted apart without a hang (same sizes, wrong order)
    are caught here instead of silently averaging the wrong gradients."""
    if rt.world_size == 1:
        return loss_sum[0].item(), loss_sum[1].item()
    fp = int(collectives.LOG.fingerprint, 16)
    mine = torch.cat([loss_sum, torch.tensor([fp >> 32, fp & 0xFFFFFFFF], dtype=torch.float64)]).to(rt.device)
    rows = [torch.empty_like(mine) for _ in range(rt.world_size)]
    collectives.all_gather(rows, mine, "log-loss")
    table = torch.stack(rows).cpu()
    prints = [tuple(r[2:].tolist()) for r in table]
    if len(set(prints)) > 1:
        majority = max(set(prints), key=prints.count)
        odd = [r for r, p in enumerate(prints) if p != majority]
        raise collectives.CollectiveFailure(
            f"rank {rt.rank}: collective sequences differ at step {collectives.LOG.step}: rank(s) "
            f"{', '.join(map(str, odd))} issued different collectives than their peers"
        )
    return table[:, 0].sum().item(), table[:, 1].sum().item()


def broadcast_str(text: str, rt: process.Runtime) -> str:
    if rt.world_size == 1:
        return text
    raw = text.encode()
    size = torch.tensor([len(raw)], dtype=torch.long, device=rt.device)
    collectives.broadcast(size, 0, "resume-path-size")
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=rt.device)
    if rt.is_main:
        buf.copy_(torch.tensor(list(raw), dtype=torch.uint8))
    collectives.broadcast(buf, 0, "resume-path")
    return bytes(buf.cpu().tolist()).decode()


def barrier(rt: process.Runtime, what: str, group=None) -> None:
    if rt.world_size > 1:
        collectives.barrier(what, group=group)
