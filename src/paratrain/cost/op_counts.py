"""What each op of a forward costs, recorded as it runs (on fake tensors for the planner, on real
ones for `plan --calibrate`): FLOPs for the products torch's flop counter knows, else the bytes the
op writes."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count


def cpu_flash_attention_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    """The CPU's flash attention (what fake tensors run) as the flop counter counts CUDA's: the
    scores and their weighted sum in full, as a kernel that masks computes them."""
    return sdpa_flop_count(query.shape, key.shape, value.shape)


FLOPS = {**flop_registry, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash_attention_flops}


class OpRecorder(TorchDispatchMode):
    """Records, for every op run under it, (FLOPs, output bytes): FLOPs for the ops the flop
    counter knows (products), else 0 with the bytes the op writes (views write nothing)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counter = FLOPS.get(func._overloadpacket)
        if counter is not None:
            self.ops.append((counter(*args, **kwargs, out_val=out), 0))
        elif not func.is_view:
            written = sum(
                t.numel() * t.element_size()
                for t in torch.utils._pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor)
            )
            self.ops.append((0, written))
        return out
