"""The tensor x pipeline (x data) parallel grid's cost model for `paratrain plan`: which stages and
which tp shard of each parameter every rank holds, the activations and step peak each rank's
schedule plays out, the pipeline's messages and receive buffers, and the grid's dp gradient
averaging (dp/footprint.py), with the functions the engines themselves run (the pipeline cut, the
schedules, the tp plan's shard ranges)."""

from __future__ import annotations

from paratrain.cost.activations import StageMemory
from paratrain.cost.ranks import RankPlan


def peak_in_schedule(actions, stage_of_chunk: list[int], stage_bytes: list[int]) -> int:
    """The most activation bytes alive at once while a rank plays its actions: a forward adds its
    stage's, the backward of the same (chunk, microbatch) drops them."""
    alive = peak = 0
    for a in actions:
        alive += stage_bytes[stage_of_chunk[a.chunk]] * (1 if a.kind == "F" else -1)
        peak = max(peak, alive)
    return peak


def step_peak(actions, stage_of_chunk: list[int], memories: list[StageMemory]) -> int:
    """The most bytes alive at once, over the model state, while a rank plays its actions (one
    microbatch's forward, backward, forward, ... without pp): a forward peaks at what is alive
    plus its stage's forward peak and leaves its kept bytes; its backward peaks at what the other
    microbatches keep plus its own backward peak, and frees its kept bytes."""
    alive = peak = 0
    for a in actions:
        m = memories[stage_of_chunk[a.chunk]]
        if a.kind == "F":
            peak = max(peak, alive + m.forward_peak)
            alive += m.kept
        else:
            alive -= m.kept
            peak = max(peak, alive + m.backward_peak)
    return peak


def receive_buffers(actions, stages: list[int], boundary: list[int]) -> int:
    """Bytes of the pipeline engine's receive buffers on a rank playing `actions` (`stages`: the
    virtual stage of each chunk): each action's receive (a later stage's input for a forward, an
    earlier stage's output gradient for a backward) is posted LOOKAHEAD actions ahead and its
    buffer taken back after the microbatch's backward; buffers taken back serve later receives of
    the same size and are kept between steps, so the pool is the most of each size in use at once."""
    from paratrain.parallel.pipeline.runner import LOOKAHEAD

    last = len(boundary) - 1  # boundary[s]: what enters stage s
    in_use: dict[int, int] = {}
    most: dict[int, int] = {}
    held: dict[tuple[int, int], list[int]] = {}  # (chunk, microbatch) -> sizes of its buffers

    def post(a) -> None:
        s = stages[a.chunk]
        size = boundary[s] if a.kind == "F" and s > 0 else boundary[s + 1] if a.kind == "B" and s < last else 0
        if size:
            in_use[size] = in_use.get(size, 0) + 1
            most[size] = max(most.get(size, 0), in_use[size])
            held.setdefault((a.chunk, a.mb), []).append(size)

    posted = 0
    for i in range(-1, len(actions)):
        for a in actions[posted : i + 1 + LOOKAHEAD]:
            post(a)
        posted = max(posted, min(i + 1 + LOOKAHEAD, len(actions)))
        if i >= 0 and actions[i].kind == "B":
            for size in held.pop((actions[i].chunk, actions[i].mb), []):
                in_use[size] -= 1
    return sum(size * n for size, n in most.items())


def pipeline_comm(r: RankPlan, actions, boundary: list[int], n_stages: int, world: int) -> None:
    """Each forward sends its output to the next stage and each backward its input's gradient to
    the previous one (receives mirror them); the profiler counts them on the world group."""
    for a in actions:
        s = r.stages[a.chunk]
        if a.kind == "F":
            if s > 0:
                r.add_comm("recv", boundary[s], world)
            if s < n_stages - 1:
                r.add_comm("send", boundary[s + 1], world)
        else:
            if s < n_stages - 1:
                r.add_comm("recv", boundary[s + 1], world)
            if s > 0:
                r.add_comm("send", boundary[s], world)
