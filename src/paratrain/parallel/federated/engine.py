"""strategy = "federated": one trainer step is one round.

Ranks: rank 0 is the server (samples the round's clients, aggregates, evaluates, checkpoints,
exports); ranks 1..W-1 are workers, each simulating the clients dealt to it (client c lives on
worker 1 + c mod (W-1)) one after another in one model. With one process, rank 0 does both.

A round, as point-to-point messages (gloo isend/irecv) between the server and each worker that
holds sampled clients (every rank derives the sample from (seed, round), so none is announced):

    server                                   worker w (clients C_w of the round)
      global weights             ->            each c in C_w: local training, delta_c
      [secure aggregation:
      keys: advertised pk table  <-> pk_c       share keys: encrypted Shamir shares, routed]
      sum over reports           <-            per client: [present, loss, update]
      [dropped clients           <-> their key shares from the survivors]
      w <- server optimizer(weighted mean delta)

An update is (n_c / N) delta_c with N the round's sampled samples; masked under secure
aggregation (secagg.py). A worker that does not answer within federated.round_timeout_s of the
round's start, or whose connection breaks (its process died), is dropped: its clients leave this
round and every later one, and the round completes with the others. Worker ranks run under a
guard (fault/guard.py), so one dying does not end the job.

The trainer's own collectives (evaluation, export) run on each rank's one-rank group: workers
never wait on each other, and a dead worker cannot block them. Rank 0 evaluates the global model.

Code: this module holds the round's frame (sampling, aggregation, state); rounds.py its messages.
"""

from __future__ import annotations

import time

import torch
from torch.nn.utils import parameters_to_vector

from paratrain import checkpoint as ckpt
from paratrain.comm import grid
from paratrain.data import build_dataset
from paratrain.errors import say
from paratrain.optim import set_lr
from paratrain.parallel.base import Strategy, unique_parameters, whole_model_chunks
from paratrain.parallel.federated import secagg
from paratrain.parallel.federated.client import LocalTrainer, copy_into
from paratrain.parallel.federated.partition import deal_clients, describe, local_batches, write_report
from paratrain.parallel.federated.rounds import ServerRound, WorkerRound
from paratrain.parallel.federated.server import ServerOptimizer, sample_clients
from paratrain.runtime import fault_points


def check_model(cfg, model) -> None:
    """Before any worker starts: the partition can be drawn (alpha against min_samples)."""
    deal_clients(cfg, build_dataset(cfg, "train"))


class Federated(ServerRound, WorkerRound, Strategy):
    name = "federated"
    check_model = staticmethod(check_model)

    def __init__(self, model, loss_fn, cfg, rt):
        super().__init__(model.to(rt.device), loss_fn, cfg, rt)
        self.fed = fed = cfg.federated
        cfg.train.log_every = 1  # a round is the unit of the run: one metrics line each
        self.is_server = rt.rank == 0
        self.workers = list(range(1, rt.world_size)) or [0]
        self.reads_data = False  # clients read their own partitions
        self.dp_rank, self.dp_size = 0, 1
        self.reports_loss = False  # the server hears the clients' losses: reduce_loss
        self.lockstep = False
        self.checkpoint_ranks = 1  # the server holds the whole state
        if rt.world_size > 1:
            self.trainer_group = grid.live_group([rt.rank])
        self.params = [p for _, p in unique_parameters(self.model)]
        if any(p.dtype != torch.float32 for p in self.params):
            raise NotImplementedError("strategy 'federated' needs float32 parameters")
        self.global_flat = parameters_to_vector(self.params).detach().cpu().clone()
        self.train_set = build_dataset(cfg, "train")
        self.parts, self.summary = deal_clients(cfg, self.train_set)
        simulates = not self.is_server or rt.world_size == 1
        self.local = LocalTrainer(self.model, loss_fn, cfg, rt.device) if simulates else None
        self.optimizer = self.local.optimizer if self.local else None
        self.server_opt = (
            ServerOptimizer(fed.algorithm, fed.server_lr, self.global_flat.numel()) if self.is_server else None
        )
        self.round = 0
        self.live = set(self.workers)
        self.loss_sums = torch.zeros(2, dtype=torch.float64)
        self.stats: dict = {}
        self.reported = False
        self.cut_off = False  # a worker that lost the server (it dropped us, or it is gone)
        self.dismissed: set[int] = set()  # server: workers dropped for silence, maybe still alive

    @property
    def evaluates(self) -> bool:
        return self.is_server

    def set_lr(self, lr: float) -> None:
        if self.optimizer is not None:
            set_lr(self.optimizer, lr)

    # -- the round --------------------------------------------------------------------------------
    def train_step(self, batch) -> torch.Tensor:
        sampled = sample_clients(self.cfg.train.seed, self.round, self.fed.clients, self.fed.clients_per_round)
        if self.is_server:
            self._report_partition()
            loss = self._serve(sampled)
        else:
            loss = self._work(sampled)
        self.round += 1
        return loss

    def _report_partition(self) -> None:
        if not self.reported:
            self.reported = True
            print(describe(self.summary), flush=True)
            if self.run_dir is not None:
                write_report(self.run_dir, self.summary)

    def _batches(self, client: int):
        return local_batches(
            self.parts[client], self.fed.local_steps, self.cfg.data.batch_size, self.cfg.train.seed, self.round, client
        )

    def _train_client(self, client: int, total_samples: int) -> tuple[torch.Tensor, float]:
        """A client's weighted update (n_c / N) delta_c and its mean local loss."""
        assert self.local is not None  # a rank that simulates clients
        delta, loss = self.local.train(self.global_flat, self.train_set, self._batches(client), self.profiler)
        return delta.mul_(len(self.parts[client]) / total_samples), loss

    def _dropped_by_fault(self, client: int) -> bool:
        return fault_points.fires("fed_drop", client=client, round=self.round)

    def _serve(self, sampled: list[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        self.stats = {"bytes_up": 0, "bytes_down": 0}
        total = sum(len(self.parts[c]) for c in sampled)
        if self.rt.world_size == 1:
            present, losses, update = self._round_in_process(sampled, total)
        else:
            present, losses, update = self._round_over_workers(sampled, total)
        self.skipped_step = False
        dropped = [c for c in sampled if c not in present]
        if update is None:
            say(
                f"federated: round {self.round + 1}: no update ({len(present)} of {len(sampled)} clients "
                f"reported{'; too few key shares to unmask' if present else ''})"
            )
        elif not torch.isfinite(update).all():
            self.skipped_step = True
        else:
            weight = sum(len(self.parts[c]) for c in present) / total
            assert self.server_opt is not None  # rank 0, the server
            self.server_opt.step(self.global_flat, update.float() / weight)
        copy_into(self.params, self.global_flat.to(self.rt.device))  # the model rank 0 evaluates
        if losses:
            self.loss_sums += torch.tensor([sum(losses), len(losses)], dtype=torch.float64)
        self.stats.update(clients=len(present), dropped_clients=dropped, round_s=time.perf_counter() - t0)
        return torch.tensor(sum(losses) / len(losses) if losses else float("nan"))

    def _round_in_process(self, sampled, total):
        updates, losses = {}, {}
        for pos, c in enumerate(sampled):
            updates[pos], losses[c] = self._train_client(c, total)
        gone = {pos for pos, c in enumerate(sampled) if self._dropped_by_fault(c)}
        present = [c for pos, c in enumerate(sampled) if pos not in gone]
        if not self.fed.secure_aggregation:
            if not present:
                return [], [], None
            return present, [losses[c] for c in present], sum(updates[sampled.index(c)].double() for c in present)
        masked_sum, _ = secagg.run_in_process({p: secagg.quantise(u) for p, u in updates.items()}, gone)
        return present, [losses[c] for c in present], None if masked_sum is None else secagg.dequantise(masked_sum)

    # -- metrics, loss ----------------------------------------------------------------------------
    def step_metrics(self) -> dict:
        return dict(self.stats) if self.is_server else {}

    def reduce_loss(self, sums: torch.Tensor) -> torch.Tensor:
        out, self.loss_sums = self.loss_sums, torch.zeros_like(self.loss_sums)
        return out

    # -- state ----------------------------------------------------------------------------------
    def _named_global(self) -> dict[str, torch.Tensor]:
        names = [n for n, _ in unique_parameters(self.model)]
        out, offset = {}, 0
        for name, p in zip(names, self.params):
            out[name] = self.global_flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        return out

    def state_dict(self):
        tensors = {f"model.{k}": v for k, v in self._named_global().items()}
        assert self.server_opt is not None  # checkpoint_ranks = 1: the server saves
        tensors.update(self.server_opt.state())
        return tensors, {"federated": {"round": self.round, "algorithm": self.fed.algorithm}}

    def load_state_dict(self, reader) -> None:
        tensors, meta = reader.load(rank=0)
        missing = [k for k in self._named_global() if f"model.{k}" not in tensors]
        if missing:
            raise ckpt.CheckpointMismatch(
                "resume", "checkpoint does not match the model: missing " + ", ".join(missing)
            )
        with torch.no_grad():
            for k, v in self._named_global().items():
                v.copy_(tensors[f"model.{k}"])
        if self.server_opt is not None:
            self.server_opt.load(tensors)
        self.round = int(meta["federated"]["round"])
        copy_into(self.params, self.global_flat.to(self.rt.device))

    def model_chunks(self):
        if not self.is_server:
            return iter(())
        copy_into(self.params, self.global_flat.to(self.rt.device))
        return whole_model_chunks(self.model)
