"""Pipeline layers of a decoder-only transformers model, from its own `base_model_pp_plan`.

The plan names the base model's parts in order (Llama, Qwen2, Mistral: `embed_tokens`, `layers`,
`norm`) and the causal-LM class adds `lm_head`. Each layer here wraps the model's own modules (so
parameter names and the state dict stay the model's) and takes one tensor, as the pipeline sends:

    embedding     token ids -> hidden states
    decoder layer hidden states -> hidden states; the position ids (0..T-1), the rotary embedding
                  and the causal mask are rebuilt on each stage from the hidden states' shape, as
                  the base model builds them once for all its layers (no padding mask: a pipeline
                  sends one tensor)
    head          the final norm and lm_head: hidden states -> logits (a tensor, which the built-in
                  losses take)

The rotary embedding is shared by every decoder layer and holds no parameters: it is kept out of
the layers' registered children, so a stage moved off a rank does not take it along."""

from __future__ import annotations

import torch
from torch import nn


class _Embedding(nn.Module):
    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class _DecoderLayer(nn.Module):
    def __init__(self, layer: nn.Module, rotary: nn.Module, config):
        super().__init__()
        self.layer = layer
        self.__dict__["rotary"] = rotary  # shared, unregistered (see the module's docstring)
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # without position ids: they start at 0 in every row, so no packed sequences to look for
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None)
        out = self.layer(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=self.rotary(hidden, position_ids=position_ids),
        )
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def transformers_layers(model: nn.Module) -> list[nn.Module] | None:
    """The layers of a transformers causal LM whose plan reads embed_tokens, layers, norm (None
    for any other model: paratrain then asks for pipeline_layers() or an nn.Sequential)."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    base = getattr(model, "base_model", None)
    head = getattr(model, "lm_head", None)
    if list(plan) != ["embed_tokens", "layers", "norm"] or base is None or base is model or head is None:
        return None
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        return None
    decoders = [_DecoderLayer(layer, rotary, config) for layer in base.layers[: config.num_hidden_layers]]
    return [_Embedding(base.embed_tokens), *decoders, _Head(base.norm, head)]
