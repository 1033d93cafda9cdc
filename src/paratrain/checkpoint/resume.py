"""Whether a checkpoint resumes under this run: the same checkpoint family of strategies and the
same optimizer."""

from __future__ import annotations

from collections.abc import Callable

from paratrain.checkpoint.format import CheckpointMismatch
from paratrain.checkpoint.reader import CheckpointReader


def check_resumable(
    reader: CheckpointReader, strategy: str, optimizer: str, key: str, checkpoint_family: Callable[[str], str | None]
) -> None:
    """A checkpoint resumes only under the strategy that wrote it (its files are that strategy's
    shards; the strategies of one checkpoint family take each other's) and with the same optimizer
    (its state is that optimizer's own: Adam's moments, SGD's momentum). CheckpointMismatch naming
    `key`, or train.optimizer, otherwise. `checkpoint_family(strategy)`: the registry's, which the
    caller passes (checkpoint/ sits below the strategies and names none)."""
    if checkpoint_family(reader.strategy) != checkpoint_family(strategy):
        raise CheckpointMismatch(
            key, f"checkpoint {reader.path} was written by strategy {reader.strategy!r}, this run uses {strategy!r}"
        )
    saved = reader.manifest.get("config", {}).get("train", {}).get("optimizer")
    if saved is not None and saved != optimizer:
        raise CheckpointMismatch(
            "train.optimizer",
            f"checkpoint {reader.path} holds the state of optimizer "
            f"{saved!r}, this run uses {optimizer!r}: resume with "
            f"train.optimizer = {saved!r}",
        )
