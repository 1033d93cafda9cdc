"""The step time of context and expert parallelism (parallel.cp, parallel.ep), per microbatch.

The fake-tensor forward runs each sequence cut to this rank's T/C tokens (planned_batch.
context_chunks), which is right for every op but attention: ring attention computes the local
queries against the keys of the whole sequence, C times the local block's work (with load-balanced
chunks each rank does 1/C of the causal attention; the local block alone would be 1/C^2). So:

    attention   each fused attention's FLOPs x C (`ring_attention_ops`)
    ring        per attention and microbatch, the keys and values passed C - 1 times around the ring
                in forward, and in backward again, with their gradients passed C - 1 times besides:
                3 (C - 1) messages of the local keys' and values' bytes, each a send to the next
                rank while the previous one's arrives (parallel/context/ring.py)
    all-to-all  per MoE layer (the gpt's, a Hugging Face experts module) and microbatch, the tokens
                routed to experts (tokens x top_k rows of d_model) sent to the ranks that hold them
                and back, in forward and in backward: 4 all-to-alls over the E ranks of an ep group,
                (E - 1) / E of each leaving the rank (routing assumed in balance); under recompute
                the forward's 2 again

Both sit on the critical path: the ring's overlap with the attention's compute (a GPU's) is not
modelled, and the all-to-alls wait for the router's choice and the experts wait for them."""

from __future__ import annotations

from typing import Any

from torch import nn

from paratrain.cost.op_counts import Op

# `step` below: cost/step_time.py's Step (not imported: it imports this module)


def ring_attention_ops(ops: list[Op], cp: int) -> list[Op]:
    """The stage's ops as ring attention runs them over `cp` ranks: each fused attention's
    queries against the whole sequence's keys (C times the local block's FLOPs and key length)."""
    if cp == 1:
        return ops
    out = []
    for op in ops:
        if op.kind == "attention":
            seq_q, seq_k, *rest = op.shape
            op = op._replace(flops=op.flops * cp, shape=(seq_q, seq_k * cp, *rest))
        out.append(op)
    return out


def ring_bytes(ops: list[Op]) -> tuple[int, int]:
    """(bytes, attentions): what one pass around the ring carries for a stage, each attention's
    keys and values (a fused attention's second and third operands)."""
    attentions = [op for op in ops if op.kind == "attention" and len(op.inputs) >= 3]
    return sum(op.inputs[1][1] + op.inputs[2][1] for op in attentions), len(attentions)


def ring_s(step: Any, kv_bytes: int, attentions: int) -> float:
    """Seconds of a microbatch's ring exchanges through a stage of `attentions` attentions whose
    keys and values take `kv_bytes` together; full recompute passes them around once more."""
    cp = step.cfg.parallel.cp
    if cp == 1 or not attentions:
        return 0.0
    bw, lat = step.link(cp * step.cfg.parallel.tp)  # a ring's ranks are tp apart (comm/grid.py)
    passes = 4 if step.recompute == "full" else 3
    return passes * (cp - 1) * (kv_bytes / bw + attentions * lat)


def moe_layers(model: nn.Module) -> list[tuple[int, int]]:
    """(top_k, d_model) of each mixture-of-experts layer parallel.ep splits: the built-in gpt's
    (models/moe.py: its router's width) and transformers' experts modules (models/hf.py: their
    hidden size, top_k the model config's num_experts_per_tok)."""
    from paratrain.models.hf import hf_experts
    from paratrain.models.moe import expert_layers

    out = []
    for layer in expert_layers(model):
        router = getattr(layer, "router", None) or getattr(layer, "gate", None)
        width = getattr(router, "in_features", None)
        if width is not None:
            out.append((int(getattr(layer, "top_k", 1)), int(width)))
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", 1)
    for experts in hf_experts(model):
        hidden: Any = getattr(experts, "hidden_dim", None) or getattr(getattr(model, "config", None), "hidden_size", 0)
        out.append((int(top_k), int(hidden)))
    return out


def all_to_all_s(step: Any, tokens: int, element_bytes: int) -> float:
    """Seconds of a microbatch's all-to-alls (`tokens`: the microbatch's tokens on a rank)."""
    ep = step.cfg.parallel.ep
    if ep == 1:
        return 0.0
    bw, lat = step.link(ep)
    exchanges = 6 if step.recompute != "none" else 4  # recompute routes the tokens again
    seconds = 0.0
    for top_k, width in moe_layers(step.model):
        payload = tokens * top_k * width * element_bytes
        seconds += exchanges * (payload * (ep - 1) / ep / bw + (ep - 1) * lat)
    return seconds
