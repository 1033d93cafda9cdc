"""Context parallelism: the sequence split over the C ranks of a cp group, attention as a ring.

The chunks. Causal attention makes a token's work grow with its position, so C contiguous slices
would leave the last rank with most of it. The sequence is cut into 2C chunks and rank r holds
chunks r and 2C-1-r (one early, one late): every rank does the same work.

    C = 2, T tokens:   | chunk 0 | chunk 1 | chunk 2 | chunk 3 |
                         rank 0    rank 1    rank 1    rank 0

Every other layer (embeddings with the chunks' own global positions, layer norms, MLPs, the head,
the loss against the targets cut the same way) is per token and runs on the local chunks alone.

The ring. Attention needs every earlier token's keys and values. Each rank's (k, v) travel around
the ring: at step s rank r holds those of rank src = r - s (mod C), computes its queries against
them while the next step's arrive, and merges the block's result into its running output by
log-sum-exp (the rows' softmax denominators), as flash attention merges key blocks. Which block a
step computes follows from the chunk layout (r's chunks: r < 2C-1-r; src's: src < 2C-1-src):

    s = 0     (own k, v)  all local queries, causal over the local 2 chunks
    src < r              all local queries against src's first chunk only, no mask
    src > r              r's second chunk against both of src's chunks, no mask

Backward walks the ring again: (k, v) travel as in forward, each with the gradient accumulators
of the rank that owns them (dk, dv), which after C steps are back home, complete. A block's
probabilities are recomputed from the saved log-sum-exp (no C x C blocks kept): memory for
attention is the local chunks' own. On the CPU each block is torch's fused flash kernel (no score
matrix, even transiently); elsewhere the same block in plain tensor ops.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.grid import DataMesh, Mesh
from paratrain.data.batch import tree_map
from paratrain.errors import ConfigError
from paratrain.parallel.context import hf
from paratrain.parallel.context.ring import Ring
from paratrain.parallel.context.verify import RingVerifier


def chunk_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The global positions of rank `cp_rank`'s tokens: chunk r then chunk 2C-1-r."""
    c = seq_len // (2 * cp)
    first, second = cp_rank * c, (2 * cp - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def _block(step: int, src: int, rank: int, half: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of the block at ring step `step` (the layout above)."""
    if step == 0:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) * scale
    if causal:
        above = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def _fused(q: torch.Tensor) -> bool:
    """Whether torch's fused CPU attention kernel takes the block: it returns the log-sum-exp the
    ring merges by and never makes the block's score matrix (the math below does, transiently)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16)


def _block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and its rows' log-sum-exp."""
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale
        )
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return (scores - lse.unsqueeze(-1)).exp() @ v, lse


def _block_backward(dout, q, k, v, out, lse, delta, causal: bool, scale: float):
    """One block's (dq, dk, dv), its probabilities recomputed from the rows' final log-sum-exp
    (`out`, `lse` and `delta` = rowsum(dout * out) are the whole ring's, not the block's)."""
    if _fused(q):
        parts = (dout, q, k, v, out, lse)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.contiguous() for t in parts), 0.0, causal, scale=scale
        )
    probs = (_scores(q, k, causal, scale) - lse.unsqueeze(-1)).exp()
    dscores = probs * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return dscores @ k * scale, dscores.transpose(-2, -1) @ q * scale, probs.transpose(-2, -1) @ dout


def _merge(out, lse, rows: slice, block_out, block_lse) -> None:
    """Fold a block's (output, log-sum-exp) into the running ones of its query rows."""
    old = lse[..., rows]
    new = torch.logaddexp(old, block_lse)
    out[..., rows, :] = out[..., rows, :] * (old - new).exp().unsqueeze(-1) + block_out * (
        block_lse - new
    ).exp().unsqueeze(-1)
    lse[..., rows] = new


def _serving(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head repeated for the `groups` query heads it
    serves (heads are dimension 1), for the block alone: the ring passes the heads as they are."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _served(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of a repeated key/value head: the sum over the query heads it served."""
    if groups == 1:
        return grad
    b, h, length, d = grad.shape
    return grad.reshape(b, h // groups, groups, length, d).sum(2)


class RingAttention(torch.autograd.Function):
    """Causal attention of the local chunks' queries against every rank's keys and values (as many
    heads as the queries, or fewer: grouped-query attention, each key/value head serving an equal
    group of query heads)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float):
        half, groups = q.shape[-2] // 2, q.shape[1] // k.shape[1]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])
        for step in range(ring.size):
            arriving = ring.shift(kv) if step < ring.size - 1 else None  # overlaps the block below
            rows, keys, causal = _block(step, (ring.rank - step) % ring.size, ring.rank, half)
            block_out, block_lse = _block_forward(
                q[..., rows, :],
                _serving(kv[0][..., keys, :], groups),
                _serving(kv[1][..., keys, :], groups),
                causal,
                scale,
            )
            _merge(out, lse, rows, block_out, block_lse.to(lse.dtype))
            if arriving is not None:
                kv = arriving.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, half, groups = ctx.ring, ctx.scale, q.shape[-2] // 2, q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)  # each row's sum of dP * P: the softmax's backward
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # the gradient of the (k, v) this rank holds at this step
        for step in range(ring.size):
            arriving = ring.shift(kv) if step < ring.size - 1 else None
            rows, keys, causal = _block(step, (ring.rank - step) % ring.size, ring.rank, half)
            dqb, dkb, dvb = _block_backward(
                dout[..., rows, :],
                q[..., rows, :],
                _serving(kv[0][..., keys, :], groups),
                _serving(kv[1][..., keys, :], groups),
                out[..., rows, :],
                lse[..., rows],
                delta[..., rows],
                causal,
                scale,
            )
            dq[..., rows, :] += dqb
            dkv[0][..., keys, :] += _served(dkb, groups)
            dkv[1][..., keys, :] += _served(dvb, groups)
            dkv = ring.shift(dkv).wait()  # with its (k, v): after C shifts, home
            if arriving is not None:
                kv = arriving.wait()
        return dq, dkv[0], dkv[1], None, None


class ContextParallel:
    """A model's attention and positions under parallel.cp, and each batch cut to this rank's
    chunks. The model opts in through two hooks (models/gpt.py has them): modules with a
    `paratrain_attention` attribute take (q, k, v) -> y, modules with `paratrain_positions` the
    global positions of the local tokens. A Hugging Face decoder is hooked from outside (hf.py).
    `verify`: train.precision where parallel.verify_plan checks the ring on the first step
    (verify.py), None where it does not; `verdict_after_step`: the world agrees on the checks when
    the engine calls verdict_after_step, not inside the attention (pipeline stages)."""

    def __init__(
        self, model: nn.Module, mesh: DataMesh | Mesh, verify: str | None = None, verdict_after_step: bool = False
    ):
        self.mesh = mesh
        self.ring = Ring(mesh)
        self.local_positions = torch.arange(0)  # the current batch's, set by local_batch
        self.attentions = hooked(model, "paratrain_attention")
        self.hf = not self.attentions and hf.is_hf(model)
        if not self.attentions:
            why = hf.refusal(model) if self.hf else f"{type(model).__name__} has no attention to split"
            if why:
                raise ConfigError("parallel.cp", f"{why}: paratrain cannot split its sequences")
            hf.install(model, self)
        for module in self.attentions:  # each its own: the check names the module it runs in
            module.paratrain_attention = functools.partial(self.attention, module=module)  # type: ignore[assignment]  # torch types a module's attribute as a tensor or module
        attentions = self.attentions or hf.attention_modules(model)
        self.verifier = (
            RingVerifier(model, attentions, mesh, verify, chunk_positions, verdict_after_step) if verify else None
        )
        self.embeddings = hooked(model, "paratrain_positions")
        for module in hooked(model, "paratrain_sequence_split"):  # per-sequence sums (an MoE's balance)
            module.paratrain_sequence_split = (mesh.cp, self.ring_sum)  # type: ignore[assignment]  # torch types a module's attribute as a tensor or module
        self.positions: dict[tuple[int, torch.device], torch.Tensor] = {}  # by sequence length

    def position_stages(self, stages: list[nn.Module]) -> None:
        """Tell the pipeline stages' layers the local tokens' global positions too: a transformers
        decoder's layers wrap its modules outside the model (models/hf_pipeline.py)."""
        self.embeddings += [
            m for stage in stages for m in hooked(stage, "paratrain_positions") if m not in self.embeddings
        ]

    def verdict_after_step(self, device: torch.device) -> None:
        """Collective over the world, after every training step: on the first, the verdict on the
        ring's checks the stages made in it (verify.py), where it waits until after the step."""
        if self.verifier is not None and self.verifier.after_step:
            self.verifier.verdict(device)
            self.verifier = None

    def ring_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the cp group of a tensor that needs no gradient."""
        t = t.detach().clone()
        dist.all_reduce(t, group=self.mesh.cp_group)
        return t

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *, module: nn.Module
    ) -> torch.Tensor:
        """Causal attention over the ring; `scale` multiplies the scores (1/sqrt(head dim) if None).
        `module`: the attention module it runs in (what parallel.verify_plan's check names)."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        out = RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), self.ring, scale)
        if self.verifier is not None:
            self.verifier.check(module, q, k, v, scale, out)
            if self.verifier.done() and not self.verifier.after_step:  # nothing more runs, compiled or not
                self.verifier = None
        return out

    def local_batch(self, batch):
        """(inputs, targets) with every tensor whose dimension 1 is the inputs' sequence cut to this
        rank's chunks (inputs and targets alike, so the loss pairs each local token with its own
        target); the embeddings told the chunks' global positions."""
        first = next(iter(_tensors(batch[0])), None)
        if first is None or first.dim() < 2:
            return batch
        seq_len, device = first.shape[1], first.device
        key = (seq_len, device)
        if key not in self.positions:
            self.positions[key] = chunk_positions(seq_len, self.mesh.cp, self.mesh.cp_rank).to(device)
        positions = self.local_positions = self.positions[key]
        for module in self.embeddings:
            module.paratrain_positions = positions
        if self.hf:  # its loss shifts labels: shifted over the whole sequence first (hf.py)
            batch = (hf.shift_labels(batch[0], seq_len, self.mesh.cp), batch[1])

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(1, positions) if t.dim() >= 2 and t.shape[1] == seq_len else t

        return tree_map(cut, batch)


def _tensors(obj) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(found.append, obj)
    return found


def hooked(model: nn.Module, hook: str) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(type(m), hook)]


def check_context(cfg, model: nn.Module, sample) -> None:
    """Before any worker starts (`model` on meta, `sample` the first training item): the model has
    attention paratrain can split, and 2 x cp divides its sequences (ConfigError naming parallel.cp)."""
    cp = cfg.parallel.cp
    if hf.is_hf(model) and (why := hf.refusal(model)):
        raise ConfigError("parallel.cp", f"{why}: paratrain cannot split its sequences")
    if not hooked(model, "paratrain_attention") and not hf.is_hf(model):
        raise ConfigError(
            "parallel.cp",
            f"{type(model).__name__} has no attention paratrain can split by sequence (gpt and "
            "Hugging Face decoders have)",
        )
    inputs = sample[0] if isinstance(sample, (tuple, list)) else sample
    first = next(iter(_tensors(inputs)), None)
    if first is None or first.dim() < 1:
        raise ConfigError("parallel.cp", f"{cfg.data.factory}'s samples have no sequence to split")
    if first.shape[0] % (2 * cp):
        raise ConfigError(
            "parallel.cp",
            f"2 x cp = {2 * cp} chunks do not divide the sequence of {first.shape[0]} tokens (data.block_size)",
        )


def context_parallel(
    model: nn.Module, mesh: DataMesh | Mesh, verify: str | None = None, verdict_after_step: bool = False
) -> ContextParallel | None:
    """The model's attention made a ring over the mesh's cp group (None when cp is 1); `verify` and
    `verdict_after_step`: ContextParallel's."""
    return ContextParallel(model, mesh, verify, verdict_after_step) if mesh.cp > 1 else None
