"""fault.on_failure = "continue", a worker's side: generations of members, a lost replica's way out
and a restarted one's way back in, while the others train on (docs/fault-tolerance.md).

Node 0's supervisor (supervise.py, leader.py) hosts the store and decides who trains:
generation g is the store's `gen-{g}`, the sorted original ranks of the live replicas, and
`latest` is the newest g.
Each generation gets a process group of its own on that store (its own key prefix), its members
renumbered in order: the ranks of a replica keep their places in comm/grid.py's ReplicaLayout and
mesh (a replica is one dp index; losing one renumbers the others as the smaller mesh numbers them),
and rank 0 is always the original rank 0, of replica 0 (which a run cannot lose: see
supervise.py), which logs.

    a peer dies      a collective of the step in flight fails on the survivors (gloo: at once,
                     "connection closed by peer"); each leaves its group and waits for the
                     supervisor's next generation (it saw the death as the process's exit)
    a replica joins  its restarted ranks wait in the store until the supervisor publishes a
                     generation with them; the others see it after their next step (rank 0 reads
                     `latest`; one all-reduce agrees on it, and on a SIGTERM any member got: the
                     trainer's stop agreement) and enter it as the step after begins
    either way       every member of the new generation builds the model and strategy again over
                     the new group (the same collectives in the same order on all of them), the
                     survivors confirm they stand at the same step, and replica 0's ranks send
                     their state (what a checkpoint holds: weights, optimizer, data position) to
                     everyone, in memory; then the step in flight (if any) is taken again by the
                     members with the whole global batch dealt over them: no step lost, none
                     logged twice, no checkpoint read.

What cannot go on (replica 0 lost, the survivors at different steps, a batch that does not divide
among them) ends the worker with FALLBACK_EXIT, and the supervisor restarts every worker from the
newest checkpoint, saying why.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from paratrain.comm import collectives
from paratrain.comm.grid import ReplicaLayout
from paratrain.errors import ConfigError, say
from paratrain.fault import stop
from paratrain.runtime import fault_points, process

INCARNATION = "PARATRAIN_INCARNATION"  # 0 at a worker's first start, n after its n-th restart
REPLICA_SIZE = "PARATRAIN_REPLICA_SIZE"  # ranks per replica (supervise.py)
REPLICA_STAGES = "PARATRAIN_REPLICA_STAGES"  # pipeline stages of a replica (parallel.pp)
PREFIX = "paratrain/continue/attempt-{attempt}/"  # the store's keys of one start of the whole run
FALLBACK_EXIT = 75  # a worker's exit code asking its supervisor to restart every worker


class CannotContinue(RuntimeError):
    """The run cannot go on without a restart; the message says why."""


def continuing() -> bool:
    return INCARNATION in os.environ


def keys(attempt: int) -> str:
    return PREFIX.format(attempt=attempt)


def train_through_failures(cfg, run_dir, resume: str, train_run, check_world) -> int:
    """A worker's run under fault.on_failure = "continue": `train_run` (trainer.train) in the
    newest generation that holds it; FALLBACK_EXIT, saying why, where the run cannot go on.
    `check_world(cfg, world)`: the registry's, whether the strategy fits the ranks left."""
    collectives.DIAGNOSE = False  # a lost peer never answers: regroup at once instead
    try:
        membership = Membership.start(cfg.train.device, cfg.parallel.timeout_s)
        membership.replicated = cfg.parallel.replicas > 1
        membership.grad_accum = cfg.train.grad_accum
        membership.check_world = check_world
        return train_run(membership.config(cfg), run_dir, membership.runtime(), resume, membership)
    except CannotContinue as exc:
        say(f"cannot continue: {exc}")
        return FALLBACK_EXIT


class Membership:
    """This worker's place in the generations of one start of the run."""

    replicated: bool  # parallel.replicas > 1; set by train_through_failures, as grad_accum is
    grad_accum: int
    joining: bool  # set by start: this incarnation joins a run under way

    def __init__(self, store, rank: int, layout: ReplicaLayout, device: torch.device, timeout_s: float):
        self.store, self.rank, self.layout = store, rank, layout
        self.device, self.backend = device, "nccl" if device.type == "cuda" else "gloo"
        self.timeout = timedelta(seconds=timeout_s)
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.prefix = keys(self.attempt)
        self.gen, self.members = -1, list[int]()
        self.saved: bytes | None = None  # this rank's state, kept until a regroup has passed it on
        self.check_world = lambda cfg, world: None  # the registry's, given by train_through_failures
        self.newest = -1  # the newest generation the members agreed on after a step

    @classmethod
    def start(cls, device_kind: str, timeout_s: float) -> Membership:
        """Into the newest generation that holds this rank (a restarted one waits to be let in)."""
        rank = int(os.environ["RANK"])
        device = process.pick_device(device_kind, int(os.environ.get("LOCAL_RANK", 0)), 1)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        world, size, stages = (int(os.environ[k]) for k in ("WORLD_SIZE", REPLICA_SIZE, REPLICA_STAGES))
        m = cls(store, rank, ReplicaLayout(world, size, stages), device, timeout_s)
        incarnation = int(os.environ[INCARNATION])
        m.joining = incarnation > 0  # into a run under way: Trainer.resume asks `settle` for the state
        if m.joining:
            store.set(f"{m.prefix}ready-{rank}-{incarnation}", "1")
        m.enter(m.wait_for_generation(after=-1, with_me=True))
        return m

    def runtime(self) -> process.Runtime:
        return process.Runtime(
            self.members.index(self.rank),
            len(self.members),
            int(os.environ.get("LOCAL_RANK", 0)),
            self.device,
            self.backend,
            self.attempt,
        )

    # -- generations ------------------------------------------------------------------------------
    def latest(self) -> int:
        key = f"{self.prefix}latest"
        try:
            return int(self.store.get(key)) if self.store.check([key]) else -1
        except dist.DistError as exc:  # node 0's supervisor, which hosts it, is gone
            raise CannotContinue(f"the supervisor's store no longer answers ({_first_line(exc)})") from None

    def wait_for_generation(self, after: int, with_me: bool = False) -> int:
        """The newest generation past `after` (and, `with_me`, one this rank belongs to)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while time.monotonic() < deadline:
            g = self.latest()
            if g > after and (not with_me or self.rank in self.members_of(g)):
                return g
            time.sleep(0.02)
        raise CannotContinue(f"rank {self.rank}: no new membership from the supervisor within {self.timeout}")

    def members_of(self, g: int) -> list[int]:
        return json.loads(self.store.get(f"{self.prefix}gen-{g}"))

    def enter(self, g: int) -> None:
        """Leave the current process group (if any) and form generation g's."""
        members = self.members_of(g)
        if self.rank not in members:  # its replica was taken out: its supervisor is about to stop it
            time.sleep(self.timeout.total_seconds())
            raise CannotContinue(f"rank {self.rank} is not in generation {g} ({members})")
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"{self.prefix}gen-{g}/", self.store),
            rank=members.index(self.rank),
            world_size=len(members),
            timeout=self.timeout,
            device_id=self.device if self.device.type == "cuda" else None,
        )
        self.gen, self.members = g, members

    def replicas(self, members: list[int]) -> list[int]:
        return sorted({self.layout.replica_of(r) for r in members})

    def config(self, cfg):
        """The run's config for this generation: parallel.replicas (if set) counts the live replicas,
        and train.grad_accum grows as the ranks shrink, where it divides, so that every micro-batch
        keeps its size and its place in the global batch: it draws the same dropout masks as in an
        uninterrupted run (process.SeededMicroBatches), and no survivor needs more memory."""
        micro_batches = self.grad_accum * self.layout.world
        if micro_batches % len(self.members) == 0:
            shared_out = dataclasses.replace(cfg.train, grad_accum=micro_batches // len(self.members))
            cfg = dataclasses.replace(cfg, train=shared_out)
        if not self.replicated:
            return cfg
        live = len(self.members) // self.layout.size
        return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, replicas=live))

    # -- the step ---------------------------------------------------------------------------------
    def step(self, trainer, run_step) -> torch.Tensor:
        """`run_step()` (the trainer's step, which counts trainer.step up) through any change of
        membership: a newer generation that the last step's agreement found (after_step) is entered
        first; where a peer is lost during the step, the new generation takes it again from its start."""
        while True:
            try:
                if self.newest > self.gen:
                    self.regroup(trainer, self.newest)
                return run_step()
            except collectives.CollectiveFailure as exc:  # (a local error, a bug or OOM, ends the worker)
                cause = _first_line(exc)
            # (out of the except block: the exception's frames no longer hold the broken group)
            self.lost_peer(trainer, cause)

    def lost_peer(self, trainer, cause: str) -> None:
        if self.rank == 0:
            print(f"step {trainer.step + 1}: a peer is lost ({cause}); waiting for the supervisor", flush=True)
        self.release(trainer)
        self.regroup(trainer, self.wait_for_generation(after=self.gen))

    # -- the trainer's stop agreement (stop.StopAgreement's part, which needs a group of its own) ------
    def stops(self, trainer) -> Membership:
        self.trainer = trainer
        stop.catch()
        return self

    def after_step(self, step: int) -> int:
        """After every step, on every member, one all-reduce (MAX) agrees on the newest generation
        (rank 0 reads it; the next step enters it) and on a stop signal that any member received
        (SIGTERM: stop.py): returns that signal, or 0. Where a peer is lost in it, the survivors
        regroup and the signal waits for the next step's agreement."""
        try:
            mine = [self.latest() if self.members.index(self.rank) == 0 else -1, stop.received()]
            shared = torch.tensor(mine)
            collectives.all_reduce(shared, "continue-agreement", op=dist.ReduceOp.MAX)
            self.newest = int(shared[0])
            return int(shared[1])
        except collectives.CollectiveFailure as exc:
            cause = _first_line(exc)
        self.lost_peer(self.trainer, cause)
        return 0

    def close(self) -> None:
        stop.release()

    def release(self, trainer) -> None:
        """Leave the current groups: replica 0's ranks pack their state first. A peer still blocked
        in a collective with us fails only once our connections close, and gloo closes them only
        when nothing holds the group any more: c10d's registry (the abort clears it), the works of
        the broken step (collectives.forget_works) and the strategy, which its own hooks on the
        parameters and the optimizer keep in reference cycles (collected here, not whenever the
        collector next runs: measured, 0.3-1.5 s later under dp; with zero2 in 3 replicas of 2, a
        peer blocked in the across-replica all-reduce waited for parallel.timeout_s)."""
        if trainer.strategy is not None:
            if self.saved is None and self.layout.replica_of(self.rank) == 0:
                self.saved = self.pack(trainer)
            self.profiler = trainer.strategy.profiler
            trainer.strategy = None
        if dist.is_initialized():
            dist.distributed_c10d._abort_process_group()
            collectives.forget_works()
            gc.collect()

    def regroup(self, trainer, g: int) -> None:
        """A survivor into generation g (with the other survivors and any joiners)."""
        before = self.replicas(self.members)
        rng = process.rng_state()
        done = trainer.step
        while True:
            self.release(trainer)
            failed = False
            try:
                self.enter(g)
                trainer.cfg, trainer.rt = self.config(trainer.cfg), self.runtime()
                trainer.build_model_and_strategy()
                trainer.strategy.profiler = self.profiler
                self.settle(trainer, done)
            except (RuntimeError, ConfigError) as exc:
                if isinstance(exc, CannotContinue):
                    raise
                failed = True  # a member was lost while we regrouped
            if not failed:
                break
            g = self.wait_for_generation(after=g)
        process.set_rng_state(rng["tensors"], rng["json"])
        self.saved = None
        self.record(trainer, before, self.replicas(self.members))

    def settle(self, trainer, done: int) -> None:
        """Every member of a new generation, its strategy built over the new group: the survivors
        confirm they stand at one step (a joiner, -1, has none), and everyone takes the state of
        replica 0's ranks."""
        if done < 0:  # a joiner lost on its way in
            fault_points.kill_if("kill_joining", rank=self.rank, incarnation=os.environ[INCARNATION])
        try:
            self.check_world(trainer.cfg, len(self.members))
        except ConfigError as exc:
            raise CannotContinue(f"{len(self.members)} ranks left: {exc}") from None
        steps = [torch.zeros(1, dtype=torch.long) for _ in self.members]
        collectives.all_gather(steps, torch.tensor([done]), "continue-steps")
        survivors = {int(s) for s in steps if int(s) >= 0}
        if len(survivors) != 1:
            raise CannotContinue(f"the surviving ranks stand at different steps ({sorted(survivors)})")
        # replica 0's ranks in order are the ranks of a checkpoint of one replica (a dp of 1)
        files = [self.broadcast_state(self.members.index(r)) for r in self.layout.ranks(0)]
        trainer.take_state(MemoryCheckpoint(files, trainer.cfg.to_dict()))
        collectives.LOG = collectives.CollectiveLog()  # a joiner has no history: the fingerprints start again
        collectives.LOG.step = trainer.step
        if done >= 0 and any(int(s) < 0 for s in steps):
            collectives.barrier("profiler start")  # the one a joiner's profiler starts with (profile.py)
        self.store.set(f"{self.prefix}ack-{self.gen}-{self.rank}", "1")

    # -- the state, in memory -----------------------------------------------------------------------
    def pack(self, trainer) -> bytes:
        from safetensors.torch import save

        tensors, meta = trainer.strategy.state_dict()
        step = trainer.step
        meta = {**meta, "trainer": {"step": step, "data": trainer.sampler.position(step)}}
        return save({k: v.detach().cpu().clone() for k, v in tensors.items()}, {"json": json.dumps(meta)})

    def broadcast_state(self, source: int) -> bytes:
        """Rank `source`'s packed state (replica 0's rank `source`), on every member."""
        mine = self.saved if self.members.index(self.rank) == source else b""
        assert mine is not None  # the source kept its state before the regroup
        size = torch.tensor([len(mine)], dtype=torch.long)
        collectives.broadcast(size, source, f"continue-state-{source}-size")
        buf = (
            torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else torch.empty(int(size), dtype=torch.uint8)
        )
        collectives.broadcast(buf, source, f"continue-state-{source}")
        return buf.numpy().tobytes()

    def record(self, trainer, before: list[int], after: list[int]) -> None:
        """replica_lost / replica_joined in metrics.jsonl and a line on the console (rank 0)."""
        if self.rank != 0:
            return
        with open(trainer.run_dir / "metrics.jsonl", "a") as log:
            for event, replicas in (
                ("replica_lost", set(before) - set(after)),
                ("replica_joined", set(after) - set(before)),
            ):
                for replica in sorted(replicas):
                    log.write(json.dumps({"event": event, "step": trainer.step, "replica": replica}) + "\n")
                    print(
                        f"step {trainer.step}: {event.replace('_', ' ')} {replica}: "
                        f"training on {len(self.members)} rank(s) of replicas {after}",
                        flush=True,
                    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__


class MemoryCheckpoint:
    """The packed states of replica 0's ranks, read like a checkpoint directory (strategy.load_state_dict)."""

    def __init__(self, files: list[bytes], config: dict):
        self.files, self.world_size = files, len(files)
        self.manifest = {"config": config}  # the layout it was saved in (ModelParallel reads tp and pp)
        self.path = "the state of a live replica"

    def load(self, rank: int) -> tuple[dict, dict]:
        from safetensors.torch import load

        data = self.files[rank]
        return load(data), json.loads(_metadata(data)["json"])


def _metadata(data: bytes) -> dict:
    """A safetensors blob's `__metadata__` (its header: 8 bytes of length, then JSON)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]).get("__metadata__", {})
