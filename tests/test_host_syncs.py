"""Between logged steps the trainer's step makes no host sync and no collective that a plain loop
does not make (the contract's "Compilation": on a GPU the host must run ahead of the device).

Counted in each gang member, per step, under a TorchDispatchMode: host syncs (`.item()`, `bool(t)`,
`float(t)`: aten._local_scalar_dense; and `Tensor.tolist`) and collectives (every c10d op: the
strategy's, the trainer's, the stop agreement's on its own gloo group). Inside a step (data and
train_step) and outside it (the trainer's accounting, stop agreement, logging) separately. The
plain loop: torch DDP over the same model on the same group, counted the same way.
"""

from __future__ import annotations

import collections
from unittest import mock

import pytest
import torch
from helpers import write_config
from reference import DIGITS_MLP
from torch.utils._python_dispatch import TorchDispatchMode

STEPS, LOG_EVERY = 10, 4


class Counts(TorchDispatchMode):
    """Host syncs and collectives since the mode was entered (`snapshot()`)."""

    def __init__(self):
        super().__init__()
        self.syncs, self.collectives = 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("aten._local_scalar_dense"):
            self.syncs += 1
        elif name.startswith("c10d."):
            self.collectives[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        tolist = torch.Tensor.tolist

        def counted_tolist(t, *args, **kwargs):
            self.syncs += 1
            return tolist(t, *args, **kwargs)

        self._patch = mock.patch.object(torch.Tensor, "tolist", counted_tolist)
        self._patch.start()
        return super().__enter__()

    def __exit__(self, *exc):
        self._patch.stop()
        return super().__exit__(*exc)

    def snapshot(self) -> tuple[int, int]:
        return self.syncs, sum(self.collectives.values())


def counted_run(rt, config: str, run_dir: str, overrides: list[str]) -> list[dict]:
    """A gang job: the run, each step's counts {step, in_syncs, in_colls, out_syncs, out_colls}
    ("in": the step's data and train_step; "out": the rest, up to the next step's start)."""
    from paratrain import trainer
    from paratrain.testing.gang import train_job

    marks: list[tuple] = []  # (step about to run, at its start, at its end)
    counts = Counts()
    step, fit = trainer.Trainer._train_step, trainer.Trainer.fit

    def marked_step(self, lr, prof):
        begin = counts.snapshot()
        loss = step(self, lr, prof)
        marks.append((self.step, begin, counts.snapshot()))
        return loss

    def counted_fit(self):
        with counts:
            return fit(self)

    with (
        mock.patch.object(trainer.Trainer, "_train_step", marked_step),
        mock.patch.object(trainer.Trainer, "fit", counted_fit),
    ):
        train_job(rt, config, run_dir, overrides, "none", {})
    rows = []
    for (n, begin, end), (_, following, _) in zip(marks, marks[1:]):
        rows.append(
            dict(
                step=n,
                in_syncs=end[0] - begin[0],
                in_colls=end[1] - begin[1],
                out_syncs=following[0] - end[0],
                out_colls=following[1] - end[1],
            )
        )
    return rows


def plain_ddp_loop(rt, steps: int) -> list[tuple[int, int]]:
    """A gang job: torch DDP on the digits MLP, the loss read at no step; (syncs, collectives) per step."""
    from torch.nn.parallel import DistributedDataParallel

    from paratrain.data.datasets import digits
    from paratrain.models.mlp import mlp

    x, y = digits("train").tensors
    torch.manual_seed(0)
    model = DistributedDataParallel(mlp(64, hidden=32, n_layers=2, out_features=10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    out = []
    for i in range(steps):
        begin = slice(12 * (2 * i + rt.rank), 12 * (2 * i + rt.rank + 1))
        with Counts() as counts:
            loss = torch.nn.functional.cross_entropy(model(x[begin]), y[begin])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        out.append(counts.snapshot())
    return out


@pytest.fixture(scope="module")
def ddp_per_step(gang):
    """The plain loop's (syncs, collectives) in a step past DDP's first two (which set up its buckets)."""
    counts = gang(2).run("test_host_syncs:plain_ddp_loop", steps=5)[0][2:]
    assert len(set(counts)) == 1, counts
    return counts[0]


@pytest.mark.parametrize("strategy", ["dp", "zero2", "zero3"])
def test_steps_between_logged_ones_make_no_host_sync_and_only_the_strategys_collectives(
    tmp_path, gang, ddp_per_step, strategy
):
    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP)
    overrides = [f"parallel.strategy='{strategy}'", f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}"]
    rows = gang(2).run(
        "test_host_syncs:counted_run", config=str(cfg), run_dir=str(tmp_path / "run"), overrides=overrides
    )
    for rank, steps in enumerate(rows):
        assert [r["step"] for r in steps] == list(range(1, STEPS)), steps
        # step 1 calibrates the stop agreement (the first check, before any step's time is known)
        quiet = [r for r in steps if r["step"] % LOG_EVERY and r["step"] > 1]
        logged = [r for r in steps if r["step"] % LOG_EVERY == 0]
        assert quiet and logged
        for r in quiet:
            assert r["in_syncs"] == 0 and r["out_syncs"] == 0, (rank, r)
            assert r["out_colls"] == 0, (rank, r)  # the trainer adds none: no loss, stop or metric collective
        in_step = {r["in_colls"] for r in quiet}
        assert len(in_step) == 1, (rank, quiet)  # the strategy's own communication, the same every step
        if strategy == "dp":  # a bucket's all-reduce, as DDP's plain loop
            assert (0, in_step.pop()) == ddp_per_step, (rank, quiet, ddp_per_step)
        # a logged step reads the loss (the counting sees it) and meets the other ranks
        assert all(r["out_syncs"] > 0 and r["out_colls"] > 0 for r in logged), (rank, logged)
