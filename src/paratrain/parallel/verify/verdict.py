"""`parallel.verify_plan`'s shared verdict: what every check of a sharded block against the same
block whole (tensor/verify.py for tp, context/verify.py for cp's ring, expert/verify.py for ep's
dispatch) measures, how far apart counts as the same, and how every rank agrees on one answer.

    error      the relative error of the sharded output against the whole block's (inf where the
               shapes differ)
    tolerance  by train.precision: float summation order alone (fp32), or bf16's rounding
    verdict    the first rank's failing line, on every rank (one all-gather of fixed-size rows):
               a ConfigError naming the plan's key (exit 2, one agreed line); on a pass, rank 0
               says which block was checked (one note a kind, once)
    first      FirstOfKind: which forward is the first training one of its module's kind, the one
               the cp and ep checks run on"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm import collectives
from paratrain.errors import ConfigError, note

# relative error of one block's output, sharded against whole: float summation order alone (fp32),
# or bf16's rounding of the partial sums
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}

LINE_BYTES = 2048  # room for the line (a block's plan entries), cut there at worst


def tolerance(precision: str) -> float:
    return TOLERANCE.get(precision, TOLERANCE["fp32"])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| in fp32; inf where the shapes differ (NaN stays NaN: a failure)."""
    if got.shape != want.shape:
        return math.inf
    a, b = got.detach().float(), want.detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def how_far(err: float) -> str:
    return "a different shape" if math.isinf(err) else f"relative error {err:.3g}"


def agreed_line(line: str, device: torch.device) -> str:
    """The first rank's non-empty `line`, on every rank (in one all-gather of fixed-size rows)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return line
    raw = line.encode()[:LINE_BYTES]
    row = torch.zeros(LINE_BYTES, dtype=torch.uint8, device=device)
    row[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    collectives.all_gather(rows, row, "verify-plan")
    found = [bytes(r.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for r in rows]
    return next((x for x in found if x), "")


class FirstOfKind:
    """The first training forward of each kind of `modules` (its class: the gpt's `Attention`, a
    transformers decoder's `LlamaAttention`, ...): what context/verify.py and expert/verify.py check,
    one module a kind, once."""

    def __init__(self, model: nn.Module, modules: list[nn.Module], precision: str):
        self.precision = precision
        self.names = {id(m): n for n, m in model.named_modules()}
        self.left = {type(m).__name__ for m in modules}  # the kinds not checked yet

    def done(self) -> bool:
        return not self.left

    def first(self, module: nn.Module) -> str | None:
        """`module`'s kind where this forward is the first training one of its kind (the kind then
        counted as checked), else None (evaluation is no training step)."""
        kind = type(module).__name__
        if kind not in self.left or not torch.is_grad_enabled():
            return None
        self.left.discard(kind)
        return kind

    def where(self, module: nn.Module, kind: str) -> str:
        """'<module name>' (<kind>), as a verdict's line names it."""
        return f"{self.names.get(id(module), kind)!r} ({kind})"


def verdict(key: str, err: float, limit: float, failed: str, passed: str, device: torch.device) -> None:
    """Collective over the world: ConfigError(`key`, the first failing rank's `failed` line) on
    every rank where any rank's `err` is above `limit`; else rank 0 notes `passed`."""
    line = agreed_line("" if err <= limit else failed, device)
    if line:
        raise ConfigError(key, line)
    if not dist.is_initialized() or dist.get_rank() == 0:
        note(f"parallel.verify_plan: {passed} ({how_far(err)}, tolerance {limit:g})")
