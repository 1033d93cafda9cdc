"""A strategy's checkpoint with what the loop around it adds (the step, the data position, every
RNG, a loop's own extras): written by `paratrain run`'s trainer and by the Python API's pt.save,
read back by both, so either resumes the other's format at any world size."""

from __future__ import annotations

from pathlib import Path

import torch

from paratrain.checkpoint.reader import CheckpointReader
from paratrain.checkpoint.resume import check_resumable
from paratrain.checkpoint.save import save
from paratrain.comm import collectives
from paratrain.runtime import process


class NonFiniteError(RuntimeError):
    """Non-finite values where there must be none (too many bad steps; a state about to be saved)."""


def save_train_state(
    strategy, rt: process.Runtime, run_dir: Path, loop: dict, *, strategy_name: str, config: dict, keep: int
):
    """Collective over the strategy's saving ranks: RUN_DIR/checkpoints/step-N (N = loop["step"]);
    `loop` (JSON) goes into every rank's metadata as "trainer". Returns the checkpoint's path (None
    on a rank that saves nothing)."""
    savers, group = strategy.checkpoint_ranks, strategy.checkpoint_group
    if rt.rank >= savers:
        return None
    tensors, meta = strategy.state_dict()
    # Skipped steps keep weights finite; this makes sure, agreed by all savers, before writing.
    finite = all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())
    flag = torch.tensor([0.0 if finite else 1.0], device=rt.device)
    if savers > 1:
        collectives.all_reduce(flag, "checkpoint-finite", group=group)
    if flag.item():
        raise NonFiniteError(f"not saving step {loop['step']}: the model or optimizer state holds non-finite values")
    rng = process.rng_state()
    return save(
        run_dir,
        loop["step"],
        {**tensors, **rng["tensors"]},
        {**meta, "rng": rng["json"], "trainer": loop},
        rank=rt.rank,
        world_size=savers,
        strategy=strategy_name,
        config=config,
        keep=keep,
        device=rt.device,
        group=group,
    )


def load_train_state(strategy, reader: CheckpointReader, rt: process.Runtime, *, resumes: tuple) -> dict:
    """The strategy's state and this rank's RNGs (a rank the saving world did not have keeps its
    own) from `reader`, once check_resumable(reader, *resumes) passes: `resumes` = (strategy name,
    optimizer, the flag or call a mismatch names, the registry's checkpoint_family). Returns what the loop saved ("trainer"):
    `paratrain run`'s resume and the Python API's pt.load both come through here."""
    check_resumable(reader, *resumes)
    strategy.load_state_dict(reader)
    _, meta0 = reader.load(rank=0)
    if rt.rank < reader.world_size:
        tensors, meta = reader.load(rank=rt.rank)
        process.set_rng_state(tensors, meta["rng"])
    return meta0["trainer"]
