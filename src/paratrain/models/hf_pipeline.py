"""Pipeline layers of a decoder-only transformers model, from its own `base_model_pp_plan`, or for a
family whose classes carry none (GPT-2 in transformers 5.24), from paratrain's table of its parts.

The plan names the base model's parts in order (Llama, Qwen2, Mistral: `embed_tokens`, `layers`,
`norm`); GPT-2's are `wte` and `wpe` (with `drop`), `h`, `ln_f`. The causal-LM class adds
`lm_head`. Each layer here wraps the model's own modules (so parameter names and the state dict
stay the model's) and takes one tensor, as the pipeline sends:

    embedding     token ids -> hidden states (GPT-2: token plus position embedding, then dropout)
    decoder layer hidden states -> hidden states; the position ids (0..T-1), the rotary embedding
                  (where the family has one) and the causal mask are rebuilt on each stage from the
                  hidden states' shape, as the base model builds them once for all its layers (no
                  padding mask: a pipeline sends one tensor)
    head          the final norm and lm_head: hidden states -> logits (a tensor, which the built-in
                  losses take); a head tied to the embedding is summed over its stages as any tie

The rotary embedding is shared by every decoder layer and holds no parameters: it is kept out of
the layers' registered children, so a stage moved off a rank does not take it along."""

from __future__ import annotations

import torch
from torch import nn

# base_model_pp_plan's parts, in order: (token embedding, position embedding, dropout), the decoder
# layers, the final norm; a family without a plan is found by its model_type
PLANNED = (("embed_tokens", None, None), "layers", "norm")
UNPLANNED = {"gpt2": (("wte", "wpe", "drop"), "h", "ln_f")}


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class _Embedding(nn.Module):
    def __init__(self, embed: nn.Module, position: nn.Module | None, dropout: nn.Module | None):
        super().__init__()
        self.embed, self.position, self.dropout = embed, position, dropout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        if self.position is not None:
            hidden = hidden + self.position(_positions(hidden))
        return hidden if self.dropout is None else self.dropout(hidden)


class _DecoderLayer(nn.Module):
    def __init__(self, layer: nn.Module, rotary: nn.Module | None, config):
        super().__init__()
        self.layer = layer
        self.__dict__["rotary"] = rotary  # shared, unregistered (see the module's docstring)
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = _positions(hidden)
        # without position ids: they start at 0 in every row, so no packed sequences to look for
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None)
        rotary = {} if self.rotary is None else {"position_embeddings": self.rotary(hidden, position_ids=position_ids)}
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids, **rotary)
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def _parts(config, base: nn.Module):
    """The base model's part names (PLANNED or UNPLANNED's), or None for a model not cut here."""
    plan = getattr(config, "base_model_pp_plan", None) or {}
    if plan:
        return PLANNED if list(plan) == ["embed_tokens", "layers", "norm"] else None
    parts = UNPLANNED.get(getattr(config, "model_type", None))
    return parts if parts and all(hasattr(base, n) for n in (*parts[0], *parts[1:])) else None


def transformers_layers(model: nn.Module) -> list[nn.Module] | None:
    """The layers of a transformers causal LM cut as the module's docstring says (None for any
    other model: paratrain then asks for pipeline_layers() or an nn.Sequential)."""
    config = getattr(model, "config", None)
    base = getattr(model, "base_model", None)
    head = getattr(model, "lm_head", None)
    if base is None or base is model or head is None:
        return None
    parts = _parts(config, base)
    if parts is None:
        return None
    (embed, position, dropout), layers, norm = parts
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None and position is None:
        return None  # positions from neither a rotary nor a learned embedding: a family not known here
    embedding = _Embedding(*(getattr(base, n) if n else None for n in (embed, position, dropout)))
    decoders = [_DecoderLayer(layer, rotary, config) for layer in getattr(base, layers)[: config.num_hidden_layers]]
    return [embedding, *decoders, _Head(getattr(base, norm), head)]
