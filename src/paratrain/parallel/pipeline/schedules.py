"""Pipeline schedules: for one pipeline rank, the ordered list of forward/backward actions.

An action is (kind, chunk, microbatch): kind "F" or "B", chunk the rank's local model chunk (always
0 unless interleaved). Rank r's chunk c is virtual stage c*p + r, so with v chunks per rank the
activations travel round the ranks v times. Schedules only order work; the engine
(pipeline.PipelineRunner) moves activations and gradients and waits only for what an action needs.

Diagrams: p = 4 ranks, m = 8 microbatches, digits are microbatches, F forward, B backward.

gpipe: all forwards, then all backwards (every microbatch's activations alive at the peak)
    rank 0  F0 F1 F2 F3 F4 F5 F6 F7 .. .. .. .. .. .. B0 B1 ...
    rank 3  .. .. .. F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 ...

1f1b: warm-up with p-r-1 forwards, then alternate one forward / one backward, then cool down;
at most p microbatches alive on rank 0, same bubble (p-1)/(m+p-1) as gpipe
    rank 0  F0 F1 F2 F3 .. .. .. B0 F4 .. B1 F5 .. B2 F6 .. B3 F7 .. B4 .. B5 .. B6 .. B7
    rank 3  .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7

interleaved (Megatron): v chunks per rank, microbatches in groups of p; the warm-up covers the
other chunks too, and the bubble shrinks to (p-1)/(v*m+p-1) of the step.
"""

from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F" or "B"
    chunk: int
    mb: int


def gpipe(p: int, rank: int, m: int, v: int = 1) -> list[Action]:
    forward = [Action("F", 0, i) for i in range(m)]
    backward = [Action("B", 0, i) for i in range(m)]
    return forward + backward


def one_f_one_b(p: int, rank: int, m: int, v: int = 1) -> list[Action]:
    warmup = min(p - rank - 1, m)
    actions = [Action("F", 0, i) for i in range(warmup)]  # warm-up
    for i in range(m - warmup):  # steady state
        actions += [Action("F", 0, warmup + i), Action("B", 0, i)]
    actions += [Action("B", 0, i) for i in range(m - warmup, m)]  # cool-down
    return actions


def interleaved(p: int, rank: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B; needs m divisible by p (microbatches go round in groups of p)."""
    if m % p:
        raise ValueError(f"interleaved needs microbatches ({m}) divisible by pipeline stages ({p})")
    total = m * v

    def forward(k: int) -> Action:  # the k-th forward of this rank
        return Action("F", (k % (p * v)) // p, (k // (p * v)) * p + k % p)

    def backward(k: int) -> Action:  # the k-th backward: chunks in reverse order
        return Action("B", v - 1 - (k % (p * v)) // p, (k // (p * v)) * p + k % p)

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    actions = [forward(k) for k in range(warmup)]  # warm-up
    for i in range(total - warmup):  # steady state
        actions += [forward(warmup + i), backward(i)]
    actions += [backward(k) for k in range(total - warmup, total)]  # cool-down
    return actions


def forward_only(p: int, rank: int, m: int, v: int = 1) -> list[Action]:
    """Evaluation: microbatch by microbatch, each through this rank's chunks in order."""
    return [Action("F", c, i) for i in range(m) for c in range(v)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}
