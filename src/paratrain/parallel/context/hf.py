"""parallel.cp for Hugging Face decoders (`[model] factory = "hf"`), unmodified, with no user code.

Which models. Decoders whose attention goes through transformers' attention interface (the class
flag `_supports_attention_backend`, configured "sdpa" or "eager") and whose positions come from
the `position_ids` of their forward: Llama, Qwen2/3, Mistral, Phi3, GPT-NeoX, GPT-2 and the other
families written on that pattern (rotary or learned absolute positions), with a causal-LM head or
none. Tested against one process: Llama (grouped-query attention), GPT-2, Qwen2. Refused before any worker
starts: encoders and encoder-decoders (their attention is not causal), heads that pool over the
sequence (a classifier reads one token that one rank holds), sliding-window layers (the ring
attends to every earlier token), attention dropout (the ring draws none).

Five things the gpt's own hooks do (models/gpt.py), done here from outside:

    attention  the config's attention implementation switched to "paratrain_ring", a function
               registered in transformers' AttentionInterface that gives the module's (q, k, v) to
               the ring. The mask transformers would build is skipped (an implementation it has no
               mask function for gets none): its causal mask would be the local tokens', while the
               ring's causality follows the chunks' global positions.
    positions  a forward pre-hook passes `position_ids`, the global positions of the local chunks,
               so rotary (or learned) position embeddings see each token where it is in the sequence;
               under pp, whose stages run the model's layers without its forward, the stages' layers
               take them as the gpt's embedding does (models/hf_pipeline.py).
    labels     transformers' causal-LM loss shifts `labels` inside the model (labels[..., 1:]), which
               after the cut would pair a chunk's last token with the next chunk's first of the
               same rank: the labels are shifted over the whole sequence before the cut and given as
               `shift_labels`, which its loss takes as they are (under pp carried to the last stage
               with the labels).
    the mean   the loss is a mean over the tokens that count (not -100), and the last token of each
               sequence never counts: the ranks of a ring hold unequal numbers of them, so a mean
               of the ranks' means would not be one process's. `num_items_in_batch` (the count over
               the whole sequences, divided by cp) makes each rank's loss its sum over that count,
               and the ranks' average the ring's one mean.
    balance    an MoE decoder's load-balancing loss (output_router_logits), a statistic of the rows
               a forward sees, taken over the ring's rows of the whole sequences (hf_balance.py).
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.parallel.context import hf_balance

RING = "paratrain_ring"  # the attention implementation's name in transformers' AttentionInterface
IGNORE = -100  # transformers' ignore_index: a label that no loss counts
EXACT = ("sdpa", "eager")  # implementations that compute exact attention, as the ring does


def is_hf(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.") and hasattr(model, "config")


def refusal(model: nn.Module) -> str | None:
    """Why the ring cannot take this transformers model's attention, or None where it can."""
    name, config = type(model).__name__, cast(Any, model.config)  # a transformers PretrainedConfig
    if not getattr(model, "_supports_attention_backend", False):
        return f"{name}'s attention does not go through transformers' attention interface"
    if config._attn_implementation not in EXACT:
        return f"{name} is configured for {config._attn_implementation!r} attention (the ring takes sdpa or eager)"
    if getattr(config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder (only decoders' causal attention is split by sequence)"
    attentions = attention_modules(model)
    if not attentions or not all(m.is_causal for m in attentions):
        return f"{name}'s attention is not causal"
    if not (_causal_lm(model) or model.base_model is model):
        return f"{name}'s head is not per token (a causal-LM head or none can be split by sequence)"
    windowed = [t for t in getattr(config, "layer_types", None) or () if t != "full_attention"]
    if windowed:
        return f"{name} has {windowed[0]} layers (the ring attends to every earlier token)"
    if getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_pdrop", 0.0):
        return f"{name} has attention dropout (set attention_dropout / attn_pdrop = 0)"
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return f"{name}'s forward takes no position_ids"
    return hf_balance.refusal(model)


def _causal_lm(model: nn.Module) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention layers: transformers' own interface reads `is_causal` from them (sdpa's)."""
    return [m for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)]


def ring_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """The attention interface's signature: (batch, heads, tokens, dim) in, (batch, tokens, heads,
    dim) out, and no attention weights. `attention_mask` is None (no mask function is registered
    for this implementation); the ring's causality is the chunks' global one."""
    if dropout or is_causal is False or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"parallel.cp: {type(module).__name__} asks for attention the ring does not compute")
    context = module.paratrain_context
    window = kwargs.get("sliding_window")
    if window is not None and window < query.shape[-2] * context.mesh.cp:
        raise ValueError(f"parallel.cp: {type(module).__name__} attends within a window of {window} tokens")
    # grouped-query attention (fewer key/value heads): the ring passes them as they are and each
    # block serves every query head of a group from its key/value head (attention.py)
    out = context.attention(query, key, value, scaling, module=module)
    return out.transpose(1, 2).contiguous(), None


def install(model: nn.Module, context) -> None:
    """Route the model's attention to `context` (a ContextParallel: its ring and positions) and give
    its forward the global positions of the local tokens as position_ids."""
    from transformers import AttentionInterface

    AttentionInterface.register(RING, ring_attention)
    for module in attention_modules(model):
        module.paratrain_context = context
    cast(Any, model).set_attn_implementation(RING)  # a transformers PreTrainedModel's
    params = list(inspect.signature(model.forward).parameters)
    place = params.index("position_ids")
    mask_place = params.index("attention_mask") if "attention_mask" in params else len(params)

    def with_positions(_module, args, kwargs):
        mask = kwargs.get("attention_mask", args[mask_place] if len(args) > mask_place else None)
        if isinstance(mask, torch.Tensor) and not bool(mask.all()):
            # the ring masks by position alone: padding would be attended to
            raise ValueError("parallel.cp: an attention_mask with padding is not split by sequence (pack or drop it)")
        if len(args) <= place and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = context.local_positions.unsqueeze(0)  # as transformers' own default: (1, tokens)
        return args, kwargs

    model.register_forward_pre_hook(with_positions, with_kwargs=True)
    hf_balance.install(model, context.mesh)


def shift_labels(inputs, seq_len: int, cp: int):
    """A dict batch's `labels` (the model shifts them) also given shifted over the whole sequence
    (`shift_labels`, cut with the rest), and the count the ranks' losses divide by (the module's
    docstring); any other batch as it is."""
    if not isinstance(inputs, dict) or "shift_labels" in inputs:
        return inputs
    labels = inputs.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.shape[1] != seq_len:
        return inputs
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    counted = inputs.get("num_items_in_batch", (shifted != IGNORE).sum())
    return {**inputs, "shift_labels": shifted, "num_items_in_batch": counted / cp}
