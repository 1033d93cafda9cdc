"""The fast tier's engine (paratrain/testing/gang.py): a job that fails on one member fails the test
at once with that member's traceback, not after the process group's timeout, and the next job gets a
fresh gang."""

import time

import pytest
import torch.distributed as dist

from paratrain.testing.gang import JobFailed


def rank_sum(rt):
    import torch

    t = torch.tensor([rt.rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def rank_1_fails(rt):
    if rt.rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # rank 0 waits here for a peer that never comes


def test_a_failed_member_fails_the_job_at_once_and_the_next_job_gets_a_fresh_gang(gang):
    assert gang(2).run("test_gang:rank_sum") == [3.0, 3.0]
    start = time.monotonic()
    with pytest.raises(JobFailed, match="ValueError: rank 1 gives up"):
        gang(2).run("test_gang:rank_1_fails")
    assert time.monotonic() - start < 15  # not the process group's timeout (120 s)
    assert gang(2).run("test_gang:rank_sum") == [3.0, 3.0]
