"""Where fake tensors cannot play a model: one rank's tp collectives without peers, and a forward
that reads its tensors' values (`.item()`, numpy) played on real tensors instead (activations.FakeRun)."""

from __future__ import annotations

import contextlib

import torch

from paratrain.config import Config
from paratrain.data.batch import tensors_in
from paratrain.errors import note


@contextlib.contextmanager
def without_peers():
    """tp's layers all-reduce (and a gathered head all-gathers) through paratrain.comm.collectives;
    one rank played alone in fake tensors has no group to reduce with, and a collective leaves its
    tensors' shapes as they are: each does nothing meanwhile."""
    from paratrain.comm import collectives

    all_reduce, all_gather = collectives.all_reduce, collectives.all_gather
    collectives.all_reduce = lambda tensor, what, group=None, async_op=False, op=None: None
    collectives.all_gather = lambda outputs, tensor, what, group=None: None
    try:
        yield
    finally:
        collectives.all_reduce, collectives.all_gather = all_reduce, all_gather


class RealTensors(contextlib.nullcontext):
    """FakeTensorMode's place where the model's forward cannot run in fake tensors: real tensors
    as they are."""

    @staticmethod
    def from_tensor(t: torch.Tensor) -> torch.Tensor:
        return t


# the verdict (the first fake run's) by the model and data sections: a search's candidates, which
# differ in [parallel] and train.recompute alone, share it
_VERDICTS: dict[str, bool] = {}


def plays_in_fake_tensors(cfg: Config, run) -> bool:
    """Whether the model's forward runs in fake tensors, tried once per model and data on `run` (a forward
    that reads values, `.item()` or numpy, cannot: the planner then measures on a real batch and
    says so)."""
    key = repr((cfg.model, cfg.data))
    if key not in _VERDICTS:
        try:
            with without_peers(), torch.no_grad():
                run.forward()
            fits = True
        except Exception as exc:  # noqa: BLE001 -- whatever the model's own code raises on fake tensors
            fits = False
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
            rows = len(tensors_in(run.x)[0])
            note(
                f"plan: the model's forward cannot run in fake tensors ({why}); its memory and ops are "
                f"measured on a real microbatch of {rows} samples on this CPU instead"
            )
        _VERDICTS[key] = fits
    return _VERDICTS[key]
