"""Decoder-only character transformer (GPT).

Written to be split: `pipeline_layers()` lists the modules that run one after another
(embedding, each block, head), `paratrain_tp_plan()` how tensor parallelism splits them, and
attention takes its number of heads from the width of its projections, so a tensor-parallel plan
that narrows q/k/v to a slice of the heads needs no other change. Separate q, k and v projections (not one fused qkv) make that column split a plain slice.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config import require, require_at_least
from paratrain.models.moe import MixtureOfExperts
from paratrain.models.recompute import run_layers


class Embedding(nn.Module):
    # parallel.cp: the global positions of this rank's tokens (its chunks of the sequence), set by
    # parallel/context; None: the tokens are the whole sequence, positions 0..T-1
    paratrain_positions: torch.Tensor | None = None

    def __init__(self, vocab_size: int, d_model: int, block_size: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = self.paratrain_positions
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


ATTENTION = ("sdpa", "materialized")


def materialized_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention with the scores stored, masked and softmaxed as tensors (GPT-2's and
    Megatron-LM's 2021 implementation): the same function as the fused kernel, more memory traffic."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v


class Attention(nn.Module):
    # parallel.cp: causal attention of this rank's chunks against the whole sequence, (q, k, v) ->
    # y, set by parallel/context (ring attention); None: attention over the local tokens alone
    paratrain_attention = None

    def __init__(self, d_model: int, n_head: int, attention: str = "sdpa"):
        super().__init__()
        self.head_dim = d_model // n_head
        self.materialized = attention == "materialized"
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        heads = self.q.out_features // self.head_dim  # local heads: fewer under tensor parallelism

        def split(t):
            return t.view(B, T, heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        if self.paratrain_attention is not None:
            y = self.paratrain_attention(q, k, v)
        elif self.materialized:
            y = materialized_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, attention: str = "sdpa", moe: dict | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head, attention)
        self.ln2 = nn.LayerNorm(d_model)
        # n_experts > 0: the feed-forward is a mixture of experts, each one FeedForward
        self.mlp = (
            MixtureOfExperts(d_model, **moe, expert=lambda: FeedForward(d_model)) if moe else FeedForward(d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 128,
        block_size: int = 64,
        tie_embeddings: bool = False,
        attention: str = "sdpa",
        n_experts: int = 0,
        top_k: int = 2,
        moe_aux_loss: float = 0.01,
    ):
        super().__init__()
        require_at_least(1, vocab_size=vocab_size, n_head=n_head, d_model=d_model, block_size=block_size)
        require_at_least(0, n_layer=n_layer)
        require(d_model % n_head == 0, "n_head", f"d_model {d_model} is not divisible by n_head {n_head}")
        require(attention in ATTENTION, "attention", f"{attention!r} is not one of {', '.join(ATTENTION)}")
        require_at_least(0, n_experts=n_experts)
        require(
            not n_experts or 1 <= top_k <= n_experts, "top_k", f"{top_k} is not between 1 and n_experts {n_experts}"
        )
        # nan compares false to everything: "not >= 0" alone would call it negative
        require(
            math.isfinite(moe_aux_loss) and moe_aux_loss >= 0,
            "moe_aux_loss",
            f"must be finite and >= 0, got {moe_aux_loss}",
        )
        moe = dict(n_experts=n_experts, top_k=top_k, aux_weight=moe_aux_loss) if n_experts else None
        self.block_size = block_size
        self.recompute = "none"  # train.recompute: "full" or "selective" checkpoints each pipeline layer
        self.embed = Embedding(vocab_size, d_model, block_size)
        self.blocks = nn.ModuleList(Block(d_model, n_head, attention, moe) for _ in range(n_layer))
        self.head = Head(d_model, vocab_size)
        if tie_embeddings:  # GPT-2's weight tying: the output projection is the token embedding
            # Tied before the init pass, which then writes it twice (the head last), as a sharded
            # strategy's replay of that pass on the meta device does (models/materialize.py).
            self.head.lm_head.weight = self.embed.tok.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if (bias := getattr(module, "bias", None)) is not None:
                nn.init.zeros_(bias)

    def pipeline_layers(self) -> list[nn.Module]:
        """The modules that run one after another; a pipeline cuts between them."""
        return [self.embed, *self.blocks, self.head]

    def paratrain_tp_plan(self) -> dict[str, str]:
        """Tensor parallelism: heads split across ranks (q/k/v by column, proj by row), the MLP
        likewise, the vocabulary split in the embedding and the head."""
        plan = {"embed.tok": "vocab", "head.lm_head": "colwise"}
        for i in range(len(self.blocks)):
            plan.update(
                {
                    f"blocks.{i}.attn.q": "colwise",
                    f"blocks.{i}.attn.k": "colwise",
                    f"blocks.{i}.attn.v": "colwise",
                    f"blocks.{i}.attn.proj": "rowwise",
                    f"blocks.{i}.mlp.fc": "colwise",
                    f"blocks.{i}.mlp.proj": "rowwise",
                }
            )
        return plan

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return run_layers(self.pipeline_layers(), idx, self.recompute)


def parameters_at_least(arguments: dict) -> dict[str, int]:
    """The parameters of gpt(**arguments), by the argument that multiplies them, from the
    arguments alone (biases, norms, positions and routers left out: a lower bound): the size of a
    model too large to build, which building even on the meta device would take minutes to show."""
    d, layers, experts = arguments["d_model"], arguments["n_layer"], arguments["n_experts"]
    attention, feed_forward = 4 * d * d, 8 * d * d
    embeddings = {"vocab_size": arguments["vocab_size"] * d * (1 if arguments["tie_embeddings"] else 2)}
    if experts:
        return {**embeddings, "n_layer": layers * attention, "n_experts": layers * experts * feed_forward}
    return {**embeddings, "n_layer": layers * (attention + feed_forward)}


def gpt(
    vocab_size: int,
    n_layer: int = 4,
    n_head: int = 4,
    d_model: int = 128,
    block_size: int = 64,
    tie_embeddings: bool = False,
    attention: str = "sdpa",
    n_experts: int = 0,
    top_k: int = 2,
    moe_aux_loss: float = 0.01,
) -> GPT:
    """attention: "sdpa" (torch's fused kernel) or "materialized" (scores as tensors); n_experts > 0:
    each block's feed-forward a mixture of that many experts, top_k per token (models/moe.py), with
    the load-balancing loss weighted by moe_aux_loss."""
    return GPT(
        vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        d_model=d_model,
        block_size=block_size,
        tie_embeddings=tie_embeddings,
        attention=attention,
        n_experts=n_experts,
        top_k=top_k,
        moe_aux_loss=moe_aux_loss,
    )
