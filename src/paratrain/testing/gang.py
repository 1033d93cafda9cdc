"""A gang: N worker processes that meet in one gloo process group once and then run job after job
in it, the fast test tier's machinery.

A `paratrain run` costs about 3 s before its first step on 2 cores (the command's own start, the
worker server's imports, the elastic agent, the rendezvous), more than most equivalence runs take
to train. A test that checks what a strategy computes, not how a run is launched, hands its job to a
gang instead: each member calls `paratrain.trainer.train` (what a launched worker calls between
process.init and shutdown) or a function of the test's own, on the same process group as the last
job, and the test reads the run directory as it would after `paratrain run`. The launch itself is
tested end to end by the integration tier.

    with Gang(2) as gang:
        gang.train(config_path, tmp_path / "run", overrides=["train.steps=4"])

A job that fails on any member (an exception, or a member outliving `timeout`) kills the gang,
whose process group may be half way through a collective, and raises JobFailed with every member's
output; the next job starts a fresh gang (`gangs`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import multiprocessing
import os
import resource
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import cast

PRELOAD = ["paratrain.runtime.worker_server"]  # as a launch's worker server: torch and the trainer, once


class JobFailed(AssertionError):
    """A job failed on some member; the message holds each member's output and traceback."""


def _member(rank: int, world: int, port: int, conn, sys_path: list[str]) -> None:
    """One member's life: meet, then run jobs until the pipe closes or brings None."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CUDA_VISIBLE_DEVICES="",
    )
    sys.path[:0] = [p for p in sys_path if p not in sys.path]  # the test modules' own jobs
    # Each run's shared-memory channels stay open until the member leaves (a launched worker leaves
    # after one run; its process groups go after each job): room for a gang's lifetime (Gangs.JOBS).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))
    import torch
    from torch.distributed import distributed_c10d as c10d

    from paratrain.runtime import process

    # as a launch sets OMP_NUM_THREADS: the caller's own where it set one, else a share of the cores
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(
        int(threads) if threads.isdigit() and int(threads) > 0 else max(1, (os.cpu_count() or 1) // world)
    )
    rt = process.init("cpu", timeout_s=120)
    gc.freeze()  # what the member holds for its life, left out of every collection (_destroy_groups_but)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            job = None
        if job is None:
            process.leave()
        target, kwargs = job
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            groups = set(c10d._world.pg_map)  # the member's own (the world's) and none of the job's yet
            try:
                module, _, name = target.partition(":")
                result = getattr(importlib.import_module(module), name)(rt, **kwargs)
                status = "ok"
            except BaseException:  # noqa: BLE001  every failure goes back to the test
                result, status = traceback.format_exc(), "error"
        if status == "ok":  # a failed job's gang is closed, its groups with it
            _destroy_groups_but(groups)
        conn.send((status, result, out.getvalue()))


def _destroy_groups_but(kept: set) -> None:
    """The process groups a job made, destroyed once it is done, as a launched worker's go when it
    leaves. A gloo group keeps three threads whose loop wakes while idle: 100 idle groups took 14 %
    of a core, and a member that kept every job's groups ran hundreds of them, its gang idle or not
    (the suite's cores went to them as it went on)."""
    from torch.distributed import distributed_c10d as c10d

    for group in [g for g in c10d._world.pg_map if g not in kept]:
        c10d.destroy_process_group(group)
    # The job's objects that still hold a group (in reference cycles) let go of it. Only what the
    # jobs made since the last freeze is collected: a collection of everything a member holds
    # (torch, transformers, the compiled graphs) took 0.3 s a job in each member, a quarter of the
    # CPU of a gang-tier module's run (py-spy over tests/test_zero.py).
    gc.collect()
    gc.freeze()  # what outlives a job (imports, caches) is the member's


class Gang:
    def __init__(self, world: int, preload: tuple[str, ...] = ()):
        """`preload`: more modules for the process's fork server to import before it forks a member
        (it starts with the first gang: the first gang's list is the one that counts)."""
        from paratrain.runtime.process import free_port

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([*PRELOAD, *preload])
        self.world = world
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_member,
                args=(rank, world, port, child, list(sys.path)),
                daemon=True,
                name=f"gang{world}-r{rank}",
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.alive = True
        self.jobs = 0

    def run(self, target: str, timeout: float = 120, **kwargs) -> list:
        """`target(rt, **kwargs)` ("module:function") on every member; their results by rank, and
        each member's output in `self.outputs`. Raises JobFailed."""
        self.jobs += 1
        for conn in self.conns:
            conn.send((target, kwargs))
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self.conns))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0 or any(status == "error" for status, _, _ in replies.values()):
                # a member failed or hangs: give its peers a moment to fail too (their tracebacks
                # name the collective they were in), then stop them all
                for rank, conn in list(pending.items()):
                    if conn.poll(min(2.0, max(left, 0))):
                        replies[rank] = self._receive(conn)
                        pending.pop(rank)
                break
            for ready in wait(list(pending.values()), timeout=left):
                rank = self.conns.index(cast(Connection, ready))  # wait() returns what it was given
                replies[rank] = self._receive(ready)
                pending.pop(rank)
        self.outputs = [replies.get(rank, ("", "", ""))[2] for rank in range(self.world)]
        if pending or any(status != "ok" for status, _, _ in replies.values()):
            self.close()
            raise JobFailed(f"{target} on a gang of {self.world}:\n" + self._describe(replies, pending, timeout))
        return [replies[rank][1] for rank in range(self.world)]

    @staticmethod
    def _receive(conn) -> tuple:
        try:
            return conn.recv()
        except EOFError:
            return ("error", "the member died", "")

    def _describe(self, replies: dict, pending: dict, timeout: float) -> str:
        parts = []
        for rank in range(self.world):
            if rank in pending:
                parts.append(f"--- rank {rank}: no answer within {timeout:.0f} s")
            else:
                status, result, output = replies[rank]
                parts.append(f"--- rank {rank}: {status}\n{output}" + (result if status != "ok" else ""))
        return "\n".join(parts)

    def train(
        self, config, run_dir, overrides=(), resume: str = "none", env: dict | None = None, timeout: float = 120
    ) -> str:
        """`paratrain run CONFIG --run-dir RUN_DIR --set ... --resume ...` on this gang, less the
        launch, with `env` set for the run's length: rank 0's output, as the command would print it."""
        self.run(
            "paratrain.testing.gang:train_job",
            timeout=timeout,
            config=str(config) if config else None,
            run_dir=str(run_dir),
            overrides=list(overrides),
            resume=resume,
            env=dict(env or {}),
        )
        return self.outputs[0]

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
            conn.close()
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def __enter__(self) -> Gang:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def train_job(rt, config: str | None, run_dir: str, overrides: list[str], resume: str, env: dict) -> int:
    """A member's part of Gang.train: the worker's own path from its config to the end of the run."""
    from pathlib import Path

    from paratrain import preflight, trainer

    # Relative paths and `module:function` names in the config are the config's folder's, as under
    # `paratrain run`; the modules found there are forgotten after the run, so that the next job's
    # module of the same name (another test's tmp_path/model.py) is its own.
    config_dir = str(Path(config).resolve().parent) if config else None
    env = {**env, "PARATRAIN_CONFIG_DIR": config_dir}
    env_before = {key: os.environ.get(key) for key in env}
    path_before = list(sys.path)
    _set_env(env)
    try:
        cfg = preflight.load(config, overrides)
        code = trainer.train(cfg, Path(run_dir), rt, resume)
    finally:
        _set_env(env_before)
        sys.path[:] = path_before
        if config_dir:
            for name, module in list(sys.modules.items()):
                if (getattr(module, "__file__", None) or "").startswith(config_dir + os.sep):
                    del sys.modules[name]
    if code:
        raise RuntimeError(f"the run ended with exit code {code}")
    return code


def _set_env(values: dict) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class Gangs:
    """One live gang per world size, started when first asked for and reused after (the pytest
    fixture `gang` of tests/conftest.py holds one of these per test process)."""

    JOBS = 40  # then a fresh gang: what runs leave open (process groups, channels) stays bounded

    def __init__(self, preload: tuple[str, ...] = ()):
        """`preload`: what the members' jobs import beyond the trainer (Gang's)."""
        self.live: dict[int, Gang] = {}
        self.preload = preload

    def __call__(self, world: int) -> Gang:
        gang = self.live.get(world)
        if gang is not None and gang.jobs >= self.JOBS:
            gang.close()
        if gang is None or not gang.alive:
            gang = self.live[world] = Gang(world, self.preload)
        return gang

    def close(self) -> None:
        for gang in self.live.values():
            gang.close()
        self.live.clear()
