"""What each op of a forward costs, recorded as it runs (on fake tensors for the planner, on real
ones for `plan --calibrate`): FLOPs for the products torch's flop counter knows, else the bytes the
op writes; besides, what the GPU kernel model (kernels.py) needs: the bytes each op reads, a
product's GEMM shape, an attention's sequence and head sizes, and which tensors each op reads and
writes (a compiled model fuses chains of elementwise ops: what stays inside a chain is never
written to memory)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count
from torch.utils.weak import WeakIdKeyDictionary


def cpu_flash_attention_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    """The CPU's flash attention (what fake tensors run) as the flop counter counts CUDA's: the
    scores and their weighted sum in full, as a kernel that masks computes them."""
    return sdpa_flop_count(query.shape, key.shape, value.shape)


aten = torch.ops.aten
FLOPS = {**flop_registry, aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash_attention_flops}
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
}
# the products whose shapes are a GEMM's: (batch, m, n, k) from their operands
GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
# ops that read a few rows of their first input (a table), as many as they write
GATHERS = {aten.embedding, aten.index_select, aten.gather}
# ops that launch no kernel on a GPU: allocations, and a contiguous tensor's reshape
NO_KERNEL = {
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
    aten._unsafe_view,
    aten.detach,
    aten.alias,
    aten.lift_fresh,
}


class Op(NamedTuple):
    flops: int  # a product's (0 for everything else)
    written: int  # bytes of its outputs (0 for a product: the kernel model counts its operands)
    read: int = 0  # bytes of its tensor inputs (a product: its operands' and its output's)
    # "gemm", "attention", "product" (another flop-counted op), "memory" or "none" (no kernel on
    # a GPU: an allocation, a reshape, a query of metadata; the CPU's model counts its dispatch)
    kind: str = "memory"
    shape: tuple = ()  # gemm: (batch, m, n, k); attention: (query length, key length, head dim, causal, masked)
    inputs: tuple = ()  # (serial number, bytes) of each tensor read (a view: its base's number)
    outputs: tuple = ()  # of each tensor written
    name: str = ""  # the aten op's
    again: bool = False  # selective recompute runs it again in backward (models/recompute.py)


def tensor_bytes(t: torch.Tensor) -> int:
    """A tensor's bytes as a kernel reads them: its elements, or its storage where smaller (an
    expanded tensor reads its few elements once)."""
    size = t.numel() * t.element_size()
    try:
        return min(size, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return size


def gemm_shape(packet, args) -> tuple:
    """(batch, m, n, k) of a matrix product's operands."""
    if packet in (aten.addmm, aten.baddbmm):
        args = args[1:]
    a, b = args[0], args[1]
    batch = a.shape[0] if a.dim() == 3 else 1
    return (batch, a.shape[-2], b.shape[-1], a.shape[-1])


def attention_shape(packet, args, kwargs) -> tuple:
    """(query length, key length, head dim, causal, masked) of a fused attention: (batch, heads,
    seq, dim) operands; causal where the kernel masks by position itself, masked where a mask
    tensor is given."""
    query, key = args[0], args[1]
    if packet is aten._scaled_dot_product_efficient_attention:
        causal = bool(args[6] if len(args) > 6 else kwargs.get("is_causal", False))
    else:
        causal = bool(args[4] if len(args) > 4 else kwargs.get("is_causal", False))
    masked = kwargs.get("attn_mask") is not None or (
        packet is aten._scaled_dot_product_efficient_attention and len(args) > 3 and args[3] is not None
    )
    return (query.shape[-2], key.shape[-2], query.shape[-1], causal and not masked, masked)


class OpRecorder(TorchDispatchMode):
    """Records, for every op run under it, an Op: FLOPs for the ops the flop counter knows
    (products), else 0 with the bytes the op writes (views write nothing)."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self._serials = WeakIdKeyDictionary()  # by identity: a tensor's == compares elements
        self._next = 0

    def recomputed(self, func, keep: bool, output) -> None:
        """models/recompute.py's watcher: the op just recorded runs again in backward unless kept."""
        if not keep and self.ops and self.ops[-1].name == str(func._overloadpacket):
            self.ops[-1] = self.ops[-1]._replace(again=True)

    def _serial(self, t: torch.Tensor) -> int:
        number = self._serials.get(t)
        if number is None:
            number = self._serials[t] = self._next
            self._next += 1
        return number

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        leaves = torch.utils._pytree.tree_leaves
        ins = [t for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in leaves(out) if isinstance(t, torch.Tensor)]
        if func.is_view:  # the view is its base's bytes: a fused chain reading it reads the base
            if ins:
                for t in outs:
                    self._serials[t] = self._serial(ins[0])
            return out
        inputs = tuple((self._serial(t), tensor_bytes(t)) for t in ins)
        outputs = tuple((self._serial(t), t.numel() * t.element_size()) for t in outs)
        read = sum(size for _, size in inputs)
        if packet in GATHERS:  # the rows it picks, not the whole table
            read = sum(size for _, size in outputs) + sum(size for _, size in inputs[1:])
        counter = FLOPS.get(packet)
        if counter is not None:
            flops = counter(*args, **kwargs, out_val=out)
            if packet in GEMMS:
                kind, shape = "gemm", gemm_shape(packet, args)
            elif packet in ATTENTION:
                kind, shape = "attention", attention_shape(packet, args, kwargs)
            else:
                kind, shape = "product", ()
            written = sum(tensor_bytes(t) for t in outs)
            self.ops.append(Op(flops, 0, read + written, kind, shape, inputs, outputs, str(packet)))
        else:
            written = sum(size for _, size in outputs)
            kind = "none" if packet in NO_KERNEL or not outs else "memory"
            self.ops.append(Op(0, written, read, kind, (), inputs, outputs, str(packet)))
        return out
