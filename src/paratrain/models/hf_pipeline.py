"""Pipeline layers of a decoder-only transformers model, from its own `base_model_pp_plan`, or for a
family whose classes carry none (GPT-2 in transformers 5.24), from paratrain's table of its parts.

The plan names the base model's parts in order, whatever each family calls them: the token
embedding (the part that takes `input_ids`), parameter-free parts after it (a dropout), the
decoder layers (the one ModuleList), then the final norm (Llama, Qwen2, Mistral, Phi3:
`embed_tokens`, `layers`, `norm`; GPT-NeoX: `embed_in`, `emb_dropout`, `layers`,
`final_layer_norm`; Phi: `embed_tokens`, `embed_dropout`, `layers`, `final_layernorm`). GPT-2's are
`wte` and `wpe` (with `drop`), `h`, `ln_f`. The causal-LM class adds its head (the key of the
class's own `_pp_plan`, `lm_head`). Each layer here wraps the model's own modules (so parameter
names and the state dict stay the model's) and takes one tensor, as the pipeline sends:

    embedding     token ids -> hidden states (GPT-2: token plus position embedding), then the
                  parts after it (dropout)
    decoder layer hidden states -> hidden states; the position ids (0..T-1), the rotary embedding
                  (where the family has one) and the causal mask are rebuilt on each stage from the
                  hidden states' shape, as the base model builds them once for all its layers (no
                  padding mask: a pipeline sends one tensor)
    head          the final norm and lm_head: hidden states -> logits (a tensor, which the built-in
                  losses take); a head tied to the embedding is summed over its stages as any tie;
                  train.loss = "model": the model's own loss_function on them (own_loss), with the
                  labels a dict sample carries, taken out of it before the first stage (labels_apart)

Under parallel.cp a stage holds this rank's chunks of each sequence, not tokens 0..T-1: the
embedding and decoder layers take the chunks' global positions from parallel/context, which sets
their `paratrain_positions` as it sets the gpt's embedding's (the rotary embedding and learned
positions then see each token where it is in the sequence; the ring's causality needs no mask).

The rotary embedding is shared by every decoder layer and holds no parameters: it is kept out of
the layers' registered children, so a stage moved off a rank does not take it along."""

from __future__ import annotations

import torch
from torch import nn

# A family's parts, in order: (token embedding, position embedding or None, the parts after them),
# the decoder layers, the parts after those (the final norm). A family without a pp plan is found
# by its model_type.
UNPLANNED = {"gpt2": (("wte", "wpe", ("drop",)), "h", ("ln_f",))}


# a dict sample's keys that the model's own loss takes, not its first layer: the labels and, under
# parallel.cp, the labels shifted over the whole sequence and the count its mean divides by
# (parallel/context/hf.py)
LOSS_KEYS = ("labels", "shift_labels", "num_items_in_batch")


class _Positioned(nn.Module):
    # parallel.cp: the global positions of this rank's tokens (its chunks of the sequence), set by
    # parallel/context; None: the tokens are the whole sequence, positions 0..T-1
    paratrain_positions: torch.Tensor | None = None

    def positions(self, hidden: torch.Tensor) -> torch.Tensor:
        """The position ids of the tokens `hidden` holds, (1, tokens) as transformers' own default."""
        given = self.paratrain_positions
        return (torch.arange(hidden.shape[1], device=hidden.device) if given is None else given).unsqueeze(0)


class _Embedding(_Positioned):
    def __init__(self, embed: nn.Module, position: nn.Module | None, after: list[nn.Module]):
        super().__init__()
        self.embed, self.position, self.after = embed, position, nn.ModuleList(after)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # transformers' name: a dict sample's key
        hidden = self.embed(input_ids)
        if self.position is not None:
            hidden = hidden + self.position(self.positions(hidden))
        for part in self.after:
            hidden = part(hidden)
        return hidden


class _DecoderLayer(_Positioned):
    rotary: nn.Module | None  # in __dict__, not registered: declared for the type checker

    def __init__(self, layer: nn.Module, rotary: nn.Module | None, config):
        super().__init__()
        self.layer = layer
        self.__dict__["rotary"] = rotary  # shared, unregistered (see the module's docstring)
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = self.positions(hidden)
        # without position ids: 0..T-1 hold no packed sequences to look for, and under cp the ring's
        # implementation gets no mask (its causality is the chunks' global one)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None)
        rotary = {} if self.rotary is None else {"position_embeddings": self.rotary(hidden, position_ids=position_ids)}
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids, **rotary)
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    def __init__(self, before: list[nn.Module], lm_head: nn.Module):
        super().__init__()
        self.before, self.lm_head = nn.ModuleList(before), lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for part in self.before:
            hidden = part(hidden)
        return self.lm_head(hidden)


def _parts(config, base: nn.Module):
    """The base model's part names as UNPLANNED's, from its pp plan or the table; None for a model
    not cut here."""
    plan = getattr(config, "base_model_pp_plan", None) or {}
    if not plan:
        parts = UNPLANNED.get(getattr(config, "model_type", ""))
        names = [n for n in (*parts[0][:2], *parts[0][2], parts[1], *parts[2]) if n] if parts else []
        return parts if parts and all(hasattr(base, n) for n in names) else None
    names = list(plan)
    if not all(isinstance(getattr(base, n, None), nn.Module) for n in names):
        return None
    stacks = [n for n in names if isinstance(getattr(base, n), nn.ModuleList)]
    inputs = plan[names[0]][0] if isinstance(plan[names[0]], (tuple, list)) else None
    if len(stacks) != 1 or list(inputs or []) != ["input_ids"]:
        return None  # not a decoder stack fed by token ids: paratrain asks for pipeline_layers()
    at = names.index(stacks[0])
    if at == 0 or any(any(True for _ in getattr(base, n).parameters()) for n in names[1:at]):
        return None  # between the embedding and the layers only parameter-free parts (dropout)
    return (names[0], None, tuple(names[1:at])), stacks[0], tuple(names[at + 1 :])


def transformers_layers(model: nn.Module) -> list[nn.Module] | None:
    """The layers of a transformers causal LM cut as the module's docstring says (None for any
    other model: paratrain then asks for pipeline_layers() or an nn.Sequential)."""
    config = getattr(model, "config", None)
    base = getattr(model, "base_model", None)
    # the head: the class's own _pp_plan names it (the instance's merges the base model's in)
    head_plan = getattr(type(model), "_pp_plan", None) or {}
    head = getattr(model, next(iter(head_plan), "lm_head"), None) if len(head_plan) <= 1 else None
    if base is None or base is model or not isinstance(head, nn.Module):
        return None
    parts = _parts(config, base)
    if parts is None:
        return None
    assert config is not None  # parts come from it
    (embed, position, after), layers, before_head = parts
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None and position is None:
        return None  # positions from neither a rotary nor a learned embedding: a family not known here
    embedding = _Embedding(
        getattr(base, embed), getattr(base, position) if position else None, [getattr(base, n) for n in after]
    )
    decoders = [_DecoderLayer(layer, rotary, config) for layer in getattr(base, layers)[: config.num_hidden_layers]]
    return [embedding, *decoders, _Head([getattr(base, n) for n in before_head], head)]


def labels_apart(sample: dict) -> tuple[dict, dict]:
    """A dict sample as (what the first stage takes, what the last stage's own loss takes)."""
    return (
        {k: v for k, v in sample.items() if k not in LOSS_KEYS},
        {k: v for k, v in sample.items() if k in LOSS_KEYS},
    )


def own_loss(model: nn.Module):
    """The loss the whole model computes in its forward, on the last stage's logits and the labels
    carried to it (labels_apart's dict): a transformers model's `loss_function` (its shift of the
    labels included, unless `shift_labels` come shifted); None for a model without one."""
    fn = getattr(model, "loss_function", None)
    config = getattr(model, "config", None)
    if fn is None or config is None:
        return None
    vocab = config.get_text_config().vocab_size
    return lambda logits, labels: fn(logits=logits, vocab_size=vocab, **labels)
