"""The strategies paratrain knows, by name: the one list of them, and the questions about a config
that depend on its strategy. Torch-free (`paratrain --help` and the checks before any worker starts
read it); each spec names its engine, imported only when a run builds it.

config.py parses and checks each key on its own and imports no strategy; `check_config` here adds
what the strategy itself asks of the config (preflight.load_config runs both)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.errors import ConfigError, note
from paratrain.parallel.dp.spec import DataParallelSpec
from paratrain.parallel.federated.spec import FederatedSpec
from paratrain.parallel.hybrid.spec import ModelParallelSpec
from paratrain.parallel.ps.spec import ParameterServerSpec
from paratrain.parallel.spec import Spec
from paratrain.parallel.zero.spec import ZeroSpec

if TYPE_CHECKING:
    from paratrain.config import Config
    from paratrain.parallel.base import Strategy

SPECS: dict[str, Spec] = {
    spec.name: spec
    for spec in (
        DataParallelSpec(),
        *(ZeroSpec(stage) for stage in (1, 2, 3)),
        ModelParallelSpec("tp", ("tp", "cp")),
        ModelParallelSpec("pp", ("pp", "cp")),
        ModelParallelSpec("hybrid", ("tp", "pp", "cp")),
        ParameterServerSpec(),
        FederatedSpec(),
    )
}


def spec(name: str) -> Spec:
    """The spec of strategy `name` (check_config has checked it is one of SPECS)."""
    return SPECS[name]


def strategy_class(name: str) -> type[Strategy]:
    """The engine of strategy `name` (imports torch)."""
    return spec(name).engine()


def build_strategy(model, loss_fn, cfg: Config, rt, own_loop: bool = False) -> Strategy:
    """The config's strategy over `model` on this process group (`own_loop`: for the Python API's,
    where the user's model and optimizer keep every parameter: dp keeps every expert on every rank)."""
    cls = strategy_class(cfg.parallel.strategy)
    if own_loop and cls.splits_expert_weights:
        return cls(model, loss_fn, cfg, rt, own_loop=True)  # type: ignore[call-arg]  # dp's engine takes it
    return cls(model, loss_fn, cfg, rt)


def build_for_training(model, loss_fn, cfg: Config, rt, own_loop: bool = False) -> Strategy:
    """The strategy as `paratrain run` and the Python API train with it: built, its blocks compiled
    under train.compile (as the strategy placed, sharded and cut them: models/compiled.py), and a
    note where train.precision = bf16 runs on a CPU that emulates it."""
    if rt.device.type == "cpu":  # (a process that runs one job after another takes each one's policy)
        from paratrain.runtime import process

        policy = process.give_freed_memory_back if spec(cfg.parallel.strategy).gives_freed_memory_back else None
        (policy or process.keep_freed_memory)()
    strategy = build_strategy(model, loss_fn, cfg, rt, own_loop)
    if cfg.train.precision == "bf16" and rt.device.type == "cpu" and rt.is_main:
        from paratrain.runtime.machine import cpu_multiplies_bf16_natively

        if not cpu_multiplies_bf16_natively():
            note(
                "train.precision = bf16 on a CPU without native bf16 (no AMX or AVX512-BF16): its matmuls are emulated, slower than fp32"
            )
    if cfg.train.compile:
        from paratrain.models.compiled import compile_blocks

        compile_blocks(model, whole=strategy.compiles_whole)
    return strategy


def checkpoint_family(name: str) -> str | None:
    """The family of strategy `name`'s checkpoints; None for a name this version does not know."""
    return SPECS[name].checkpoint_family if name in SPECS else None


def check_config(cfg: Config) -> None:
    """What the config's strategy asks of it, with no world size and no dataset: ConfigError."""
    name = cfg.parallel.strategy
    if name not in SPECS:
        raise ConfigError("parallel.strategy", f"must be one of {' | '.join(SPECS)}, got {name!r}")
    if cfg.parallel.replicas > 1 and not SPECS[name].takes_replicas:
        takers = " | ".join(n for n, s in SPECS.items() if s.takes_replicas)
        raise ConfigError("parallel.replicas", f"must be 1 for strategy {name!r} (replica groups take {takers})")
    if cfg.fault.on_failure == "continue":
        if not SPECS[name].takes_replicas:
            takers = " | ".join(n for n, s in SPECS.items() if s.takes_replicas)
            raise ConfigError("fault.on_failure", f"'continue' takes strategies {takers}, not {name!r}")
        if cfg.parallel.compression in ("topk", "powersgd"):  # each rank's error feedback: not re-dealt
            raise ConfigError(
                "fault.on_failure", f"'continue' takes no parallel.compression {cfg.parallel.compression!r}"
            )
    check_sequence_and_experts(cfg)
    SPECS[name].check_config(cfg)


def check_sequence_and_experts(cfg: Config) -> None:
    """parallel.cp and parallel.ep: only strategies that declare them; cp without replica groups, ep
    without fault.on_failure = "continue" (zero1-3's replica groups take ep: zero/experts.py)."""
    p, spec_ = cfg.parallel, SPECS[cfg.parallel.strategy]
    for degree in ("cp", "ep"):
        if getattr(p, degree) == 1:
            continue
        if degree not in spec_.degrees:
            takers = " | ".join(n for n, s in SPECS.items() if degree in s.degrees)
            raise ConfigError(f"parallel.{degree}", f"must be 1 for strategy {spec_.name!r} ({degree} takes {takers})")
        if degree == "cp" and (p.replicas > 1 or cfg.fault.on_failure == "continue"):
            raise ConfigError(f"parallel.{degree}", "takes no replica groups (parallel.replicas, fault.on_failure)")
        if cfg.fault.on_failure == "continue":  # a lost replica's experts are not dealt again
            raise ConfigError(f"parallel.{degree}", "takes no fault.on_failure = 'continue'")


def data_parallel_degree(cfg: Config, world_size: int) -> int:
    """How many model replicas read different data: the divisor of the global batch."""
    return spec(cfg.parallel.strategy).data_parallel_degree(cfg, world_size)


def role_of(cfg: Config, rank: int) -> str:
    """What a rank does, for messages about it."""
    return spec(cfg.parallel.strategy).role_of(cfg, rank)


def check_world(cfg: Config, world_size: int) -> None:
    """Checks that depend on the number of processes."""
    strategy = spec(cfg.parallel.strategy)
    strategy.check_layout(cfg, world_size)
    if world_size % cfg.parallel.replicas:
        raise ConfigError("parallel.replicas", f"{cfg.parallel.replicas} does not divide the world size {world_size}")
    dp = strategy.data_parallel_degree(cfg, world_size)
    per_step = dp * cfg.train.grad_accum
    if cfg.data.batch_size % per_step:
        raise ConfigError(
            "data.batch_size",
            f"{cfg.data.batch_size} is not divisible by data-parallel degree {dp} "
            f"x train.grad_accum {cfg.train.grad_accum}",
        )
    strategy.check_batch(cfg, world_size)
