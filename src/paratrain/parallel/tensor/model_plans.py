"""Tensor-parallel plans as models carry them: wildcards over module names, and Hugging Face's own
plans (`config.base_model_tp_plan` under the base model's prefix, merged with the model class's
`_tp_plan` by transformers into `model._tp_plan`) read in paratrain's styles.

    "model.layers.*.self_attn.q_proj" = "colwise"      `*` stands for one part of a module name

transformers' styles (as `parallel.tp_plan` may name them too) and what paratrain runs for each:
    colwise, rowwise                       the same (parallel/tensor/layers.py); local_colwise and
                                           local_rowwise (older transformers' names) likewise: local
                                           or DTensor is transformers' own bookkeeping
    colwise_gather_output, colwise_rep     column-parallel, its output gathered whole (a head whose
                                           logits a model's own loss reads; Phi3's fused qkv_proj)
    rowwise_split_input, rowwise_rep       row-parallel on a whole input, each rank taking its slice
    embedding_rowwise                      vocabulary-parallel embedding
    embedding_colwise                      each rank a slice of every row, gathered whole
    replicate, replicated_with_grad_allreduce, local, local_params, sequence_parallel
                                           nothing to do: every tp rank holds the tensors whole and
                                           computes them and their gradients alike (paratrain's
                                           activations between tp blocks are whole on every rank, so
                                           a norm that transformers runs on a sequence shard runs
                                           on the whole sequence here, to the same values)
    packed_colwise, packed_rowwise          a fused [gate; up] split as gate and up each (on a Linear
                                           or an experts' parameter); colwise and rowwise on a
                                           parameter split its output or input dimension
    moe_tp_experts, all_reduce (gather),   communication around a module's own forward
    moe_identity_expert, mla_kv_a_proj     (parallel/tensor/experts.py)
Expert parallelism's styles (grouped_gemm, ep_*) spread the experts over ranks: parallel.ep's, they
exit 2 naming it."""

from __future__ import annotations

import re

from torch import nn

from paratrain.errors import ConfigError

KEY = "parallel.tp_plan"
HF_STYLES = {
    "colwise": "colwise",
    "local_colwise": "colwise",
    "rowwise": "rowwise",
    "local_rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather_output",
    "colwise_rep": "colwise_gather_output",
    "rowwise_split_input": "rowwise_split_input",
    "rowwise_rep": "rowwise_split_input",
    "embedding_rowwise": "vocab",
    "embedding_colwise": "embedding_colwise",
    "replicate": None,
    "replicated_with_grad_allreduce": None,
    "local": None,
    "local_params": None,
    "sequence_parallel": None,
    "packed_colwise": "packed_colwise",
    "packed_rowwise": "packed_rowwise",
    "moe_tp_experts": "moe_tp_experts",
    "all_reduce": "all_reduce",
    "gather": "all_reduce",  # older transformers' GatherParallel: the module's outputs summed
    "moe_identity_expert": "moe_identity_expert",
    "mla_kv_a_proj": "mla_kv_a_proj",
}
EP_STYLES = ("grouped_gemm", "ep_dispatch_experts", "ep_router", "ep_experts")


def expand(plan: dict, model: nn.Module, strict: bool) -> dict[str, str]:
    """`plan` with each wildcard name replaced by the module names it matches, in the model's
    order. `strict` (the user's plan): a name that matches no module exits 2; a model's own plan
    may name modules that this configuration lacks."""
    # modules, and parameters (an experts' stacked weights are planned as tensors)
    names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]
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
    return in_paratrain_styles(expand(own, model, strict=False), f"{type(model).__name__}'s own tensor-parallel plan")


def in_paratrain_styles(plan: dict[str, str], whose: str) -> dict[str, str]:
    """`plan` (module name -> transformers' or paratrain's style) in paratrain's styles, the
    replicated modules left out; a style paratrain does not run exits 2 naming it."""
    out = {}
    for name, style in plan.items():
        if style in EP_STYLES:
            raise ConfigError(
                KEY,
                f"{whose} splits {name!r} as {style!r}, expert parallelism (the experts spread over "
                f"ranks), which is parallel.ep's: tensor parallelism splits each expert (moe_tp_experts)",
            )
        if style not in HF_STYLES and style not in HF_STYLES.values():
            runs = ", ".join(HF_STYLES)
            fix = "" if whose == KEY else ": give parallel.tp_plan"
            raise ConfigError(
                KEY, f"{whose} splits {name!r} as {style!r}, which paratrain does not run (it runs {runs}){fix}"
            )
        mapped = HF_STYLES.get(style, style)
        if mapped is not None:
            out[name] = mapped
    return out


def check_heads(model: nn.Module, tp: int) -> None:
    """A transformers model's attention heads (query and key/value) split evenly over tp."""
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError("parallel.tp", f"tp {tp} does not divide the model's {attr} = {heads}")
