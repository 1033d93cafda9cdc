"""One rank's plan (RankPlan): the bytes of model state it keeps, the activations it saves and the
messages it sends; and the byte counts every strategy's footprint shares."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import nn

from paratrain.config import Config

MIB = 2**20


@dataclass
class RankPlan:
    rank: int
    node: int
    local_rank: int
    role: str
    pp: int = 0
    dp: int = 0
    tp: int = 0
    cp: int = 0
    stages: list[int] = field(default_factory=list)  # virtual pipeline stages held
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    codec_bytes: int = 0  # what a top-k or PowerSGD codec keeps between steps
    activation_bytes: int | None = None  # peak saved for backward; None: not estimated (tp)
    # the most bytes allocated at once in a step: model state, the activations, what the step makes
    # and frees (activation gradients, logits, incoming gradients, communication buffers); None: not
    # estimated
    peak_bytes: int | None = None
    # per step, by collective: {"payload": bytes handed to it, "min_sent": bytes this rank must send},
    # as the profiler accounts them (ps: a sync step; async and ssp move as much per worker step);
    # None: not estimated (tp with a user loss on its sharded output)
    comm: dict[str, dict[str, float]] | None = None

    def add_comm(self, op: str, payload: int, group_size: int, times: int = 1) -> None:
        from paratrain.profile import min_bytes_sent

        if self.comm is None:
            self.comm = {}
        entry: dict[str, float] = self.comm.setdefault(op, {"payload": 0, "min_sent": 0.0})
        entry["payload"] += payload * times
        entry["min_sent"] += min_bytes_sent(op, payload, group_size) * times

    def as_dict(self) -> dict:
        """With the minimum bytes in whole bytes, as profile.jsonl has them."""
        out = asdict(self)
        if self.comm is not None:
            out["comm"] = {op: {"payload": e["payload"], "min_sent": int(e["min_sent"])} for op, e in self.comm.items()}
        out["model_state_bytes"] = self.model_state_bytes
        out["comm_min_bytes"] = None if self.comm is None else sum(e["min_sent"] for e in out["comm"].values())
        return out

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.codec_bytes


def optimizer_slots(cfg: Config) -> int:
    """Tensors of optimizer state per parameter: AdamW's two moments, SGD's momentum buffer."""
    if cfg.train.optimizer == "adamw":
        return 2
    return 1 if cfg.train.momentum > 0 else 0


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def padded_numel(params: list[nn.Parameter], world: int) -> int:
    """A flat unit's numbers, padded to a multiple of `world` as FlatUnit and Bucket pad them."""
    return -(-sum(p.numel() for p in params) // world) * world


def padded_bytes(groups: list[list[nn.Parameter]], world: int) -> tuple[int, int]:
    """(whole, per-rank shard) bytes of flat units padded to a multiple of `world`."""
    whole = sum(padded_numel(params, world) * params[0].element_size() for params in groups)
    return whole, whole // world


def peak_bytes(r: RankPlan) -> int:
    """A rank's predicted peak; where it is not estimated, its model state and activations."""
    return r.peak_bytes if r.peak_bytes is not None else r.model_state_bytes + (r.activation_bytes or 0)
