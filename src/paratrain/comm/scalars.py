"""Small collectives on scalars and strings, shared by the trainer and the Python API: each a no-op
at world size 1, each named (collectives.py's log and hang reports say which one)."""

from __future__ import annotations

import torch
import torch.distributed as dist

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
    return _broadcast_bytes(text.encode() if rt.is_main else b"", 0, rt.device, "resume-path").decode()


def _broadcast_bytes(raw: bytes, src: int, device: torch.device, what: str, group=None) -> bytes:
    """`raw` of rank `src` (global rank) on every rank of `group`: its length, then its bytes."""
    size = torch.tensor([len(raw)], dtype=torch.long, device=device)
    collectives.broadcast(size, src, f"{what}-size", group=group)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if raw:
        buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    collectives.broadcast(buf, src, what, group=group)
    return bytes(buf.cpu().tolist())


def broadcast_tree(tree, src: int, device: torch.device, what: str, group=None):
    """Rank `src`'s `tree` (tensors in any structure torch's pytree knows: tuples, dicts, a Hugging
    Face ModelOutput) on every rank of `group`, as tensors and JSON, never a pickle: the
    structure and each leaf's dtype and shape go first, then the tensors. A leaf that is neither a
    tensor nor a JSON value (a model's key-value cache object) arrives as None."""
    import json

    import torch.utils._pytree as pytree

    sending = dist.get_rank() == src
    header = b""
    if sending:
        leaves, spec = pytree.tree_flatten(tree)
        described = [
            {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
            if isinstance(v, torch.Tensor)
            else {"value": v if _is_json(v) else None}
            for v in leaves
        ]
        header = json.dumps({"spec": pytree.treespec_dumps(spec), "leaves": described}).encode()
    meta = json.loads(_broadcast_bytes(header, src, device, f"{what}-structure", group))
    out = []
    for i, leaf in enumerate(meta["leaves"]):
        if "value" in leaf:
            out.append(leaf["value"])
            continue
        t = (
            leaves[i].to(device)
            if sending
            else torch.empty(leaf["shape"], dtype=getattr(torch, leaf["dtype"]), device=device)
        )
        collectives.broadcast(t, src, what, group=group)
        out.append(t)
    return pytree.tree_unflatten(out, pytree.treespec_loads(meta["spec"]))


def _is_json(value) -> bool:
    import json

    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def barrier(rt: process.Runtime, what: str, group=None) -> None:
    if rt.world_size > 1:
        collectives.barrier(what, group=group)
