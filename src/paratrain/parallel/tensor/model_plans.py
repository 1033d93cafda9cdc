"""Tensor-parallel plans as models carry them: wildcards over module names, and Hugging Face's own
plans (`config.base_model_tp_plan` under the base model's prefix, merged with the model class's
`_tp_plan` by transformers into `model._tp_plan`) read in paratrain's styles.

    "model.layers.*.self_attn.q_proj" = "colwise"      `*` stands for one part of a module name

transformers' styles and what paratrain runs for each:
    colwise, rowwise                       the same (parallel/tensor/layers.py)
    colwise_gather_output, colwise_rep     column-parallel, its output gathered whole (a head whose
                                           logits a model's own loss reads)
    embedding_rowwise                      vocabulary-parallel embedding
    replicate, replicated_with_grad_allreduce
                                           nothing to do: every tp rank holds the tensor whole and
                                           computes its gradient alike
Any other style exits 2 naming it."""

from __future__ import annotations

import re

from torch import nn

from paratrain.errors import ConfigError

KEY = "parallel.tp_plan"
HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather_output",
    "colwise_rep": "colwise_gather_output",
    "embedding_rowwise": "vocab",
    "replicate": None,
    "replicated_with_grad_allreduce": None,
}


def expand(plan: dict, model: nn.Module, strict: bool) -> dict[str, str]:
    """`plan` with each wildcard name replaced by the module names it matches, in the model's
    order. `strict` (the user's plan): a name that matches no module exits 2; a model's own plan
    may name modules that this configuration lacks."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        if "*" not in pattern:
            if pattern in names or strict:
                out[pattern] = style  # check_plan names one that is not a module
            continue
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        matched = [n for n in names if regex.match(n)]
        if strict and not matched:
            raise ConfigError(KEY, f"{pattern!r} matches no module of the model")
        out.update(dict.fromkeys(matched, style))
    return out


def transformers_plan(model: nn.Module) -> dict[str, str]:
    """A transformers model's own plan (`_tp_plan`, full module names) in paratrain's styles; {} for
    other models. A style paratrain does not run exits 2 naming it."""
    own = getattr(model, "_tp_plan", None)
    if not isinstance(own, dict) or not hasattr(getattr(model, "config", None), "base_model_tp_plan"):
        return {}
    out = {}
    for name, style in expand(own, model, strict=False).items():
        if style not in HF_STYLES:
            raise ConfigError(
                KEY,
                f"{type(model).__name__}'s own tensor-parallel plan splits {name!r} as {style!r}, which "
                f"paratrain does not run (it runs {', '.join(HF_STYLES)}): give parallel.tp_plan",
            )
        if HF_STYLES[style] is not None:
            out[name] = HF_STYLES[style]
    return out


def check_heads(model: nn.Module, tp: int) -> None:
    """A transformers model's attention heads (query and key/value) split evenly over tp."""
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError("parallel.tp", f"tp {tp} does not divide the model's {attr} = {heads}")
