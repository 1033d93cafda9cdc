"""TOML -> validated, typed config.

Every key of the user contract lives here with its type, default and `doc=` string;
docs/gen_config_ref.py turns them into the configuration reference (docs/configuration.md), so a
key documented here is documented there. Errors are `ConfigError`s that name the dotted key, so the
CLI can print one line and exit 2 before any worker starts.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import tomllib

from paratrain.errors import ConfigError
from paratrain.extras import EXTRAS, hint
from paratrain.lora_keys import LORA_STRATEGIES, check_lora
from paratrain.overrides import apply_overrides, control_characters


class ArgumentError(ValueError):
    """A built-in factory's argument out of range: `arg` is its name, which the caller puts under
    the config section it came from (model.n_head, data.block_size)."""

    def __init__(self, arg: str, why: str):
        super().__init__(why)
        self.arg = arg


def require(ok: bool, arg: str, why: str) -> None:
    if not ok:
        raise ArgumentError(arg, why)


def require_at_least(low: int, **values: int) -> None:
    """Each named argument is >= `low`; the first that is not is named."""
    for arg, value in values.items():
        require(value >= low, arg, f"must be >= {low}, got {value}")


def opt(default, choices: tuple | None = None, check=None, doc: str = ""):
    """A config field with allowed `choices` or a `check(value) -> error or None`."""
    if isinstance(default, (dict, list)):
        return field(
            default_factory=lambda: type(default)(default), metadata={"choices": choices, "check": check, "doc": doc}
        )
    return field(default=default, metadata={"choices": choices, "check": check, "doc": doc})


def _positive(v):
    """Must be > 0."""
    return None if v > 0 else "must be > 0"


def _non_negative(v):
    """Must be >= 0."""
    return None if v >= 0 else "must be >= 0"


def _ratio(v):
    """Must be in (0, 1]."""
    return None if 0 < v <= 1 else "must be in (0, 1]"


def _at_least_one(v):
    """Must be >= 1."""
    return None if v >= 1 else "must be >= 1"


def _factory_name(v):
    """Must not be empty."""
    return None if v else "must not be empty"


def _installed(module: str):
    """A check that the optional package `module` is installed where the option is on."""

    def check(v):
        return hint(module) if v else None

    check.__doc__ = f"Needs `pip install 'paratrain[{EXTRAS[module][1]}]'`."
    return check


def _seed(v):
    # torch takes seeds below 2**64, and the workers add their rank and the epoch to it
    return None if 0 <= v < 2**63 else "must be in [0, 2**63)"


MAX_TIMEOUT_S = 7 * 24 * 3600


def _timeout(v):
    # a week: longer is no timeout at all, and overflows the C timeouts of torch, gloo and select()
    return None if 0 < v <= MAX_TIMEOUT_S else f"must be in (0, {MAX_TIMEOUT_S}] seconds (a week)"


@dataclass
class ModelConfig:
    """The model: a built-in factory or your own `module:function` returning an `nn.Module`."""

    factory: str = opt("gpt", check=_factory_name, doc="mlp | cnn | gpt | hf (transformers) | module:function")
    lora: dict = opt(
        {},
        check=check_lora,
        doc="{ r = 8, alpha = 16, dropout = 0.0, target_modules = [...] }: LoRA adapters through peft (only they "
        "train; final/ holds them in PEFT's format and final/merged/ the merged model); dp and zero1-3",
    )
    kwargs: dict = opt({}, doc="every other key of [model], passed to the factory")


@dataclass
class DataConfig:
    """The dataset: a built-in factory or your own `module:function` returning a map-style Dataset
    whose items are (input, target)."""

    factory: str = opt("corpus", check=_factory_name, doc="digits | corpus | synthetic | module:function")
    batch_size: int = opt(64, check=_positive, doc="global samples per optimizer step")
    shuffle: bool = opt(
        True,
        doc="a seeded permutation per epoch (seed and epoch only, never the world "
        "size); false: step i reads samples (i*B + j) mod len(dataset)",
    )
    kwargs: dict = opt({}, doc="every other key of [data], passed to the factory")


@dataclass
class TrainConfig:
    """The training loop: steps, optimizer, schedule, precision, device, logging."""

    steps: int = opt(200, check=_non_negative, doc="optimizer steps of the whole run")
    optimizer: str = opt("adamw", choices=("sgd", "adamw"), doc="torch's fused implementation where it applies")
    lr: float = opt(1e-3, check=_non_negative, doc="peak learning rate")
    lr_schedule: str = opt(
        "constant", choices=("constant", "cosine"), doc="cosine: from lr down to 0 at the last step, after the warm-up"
    )
    warmup_steps: int = opt(0, check=_non_negative, doc="steps of linear learning-rate warm-up, under either schedule")
    momentum: float = opt(0.0, check=_non_negative, doc="sgd only")
    weight_decay: float = opt(0.0, check=_non_negative, doc="sgd and adamw")
    loss: str = opt(
        "cross_entropy",
        check=_factory_name,
        doc="cross_entropy | mse | model (the output's own `loss`) | module:function",
    )
    grad_accum: int = opt(
        1, check=_positive, doc="micro-batches per optimizer step; the global batch stays data.batch_size"
    )
    clip_grad_norm: float = opt(0.0, check=_non_negative, doc="clip the global gradient norm to this; 0 = off")
    precision: str = opt("fp32", choices=("fp32", "bf16"), doc="bf16: autocast of forward and loss")
    compile: bool = opt(
        False,
        doc="torch.compile the model block by block (pipeline_layers, an nn.Sequential's children, "
        "ModuleList elements) under every strategy; the first step compiles",
    )
    recompute: str = opt(
        "none",
        choices=("none", "full", "selective"),
        doc="full: keep only each block's input and run its forward again in backward; selective: "
        "torchtitan's op policy: keep its input, its attention's output and every other matrix product's, "
        "run the rest again (the ops between the products and the other half of the matmuls)",
    )
    seed: int = opt(0, check=_seed)
    log_every: int = opt(10, check=_positive, doc="steps between metrics lines (and the profiler's gather)")
    eval_every: int = opt(0, check=_non_negative, doc="0 = only after the last step")
    device: str = opt(
        "auto",
        choices=("auto", "cpu", "cuda"),
        doc="auto: CUDA with NCCL when every process of the node has a GPU, else CPU with gloo",
    )
    torch_profiler: bool = opt(False, doc="also record torch.profiler traces of a few steps")
    track_memory: bool = opt(
        False,
        doc="each step's peak of tensor bytes allocated, per rank in profile.jsonl and as peak_memory_mib "
        "(the largest rank's) in metrics.jsonl; on the CPU it runs torch's profiler throughout",
    )
    max_bad_steps: int = opt(5, check=_non_negative, doc="consecutive non-finite steps skipped before the run stops")


@dataclass
class ParallelConfig:
    """How the work is split over the processes: the strategy, its degrees and its communication."""

    strategy: str = opt("dp", doc="how the work is split over the processes")
    tp: int = opt(1, check=_positive, doc="tensor-parallel degree (tp, hybrid)")
    pp: int = opt(1, check=_positive, doc="pipeline stages (pp, hybrid)")
    cp: int = opt(
        1,
        check=_positive,
        doc="context-parallel degree (dp, zero1-3, tp, pp, hybrid): each sequence split over cp ranks, attention as a ring",
    )
    ep: int = opt(
        1,
        check=_positive,
        doc="expert-parallel degree (dp, zero1-3): each mixture-of-experts layer's experts split over ep "
        "of the data-parallel x cp ranks, tokens sent to them by all-to-all",
    )
    microbatches: int = opt(4, check=_positive, doc="pipeline microbatches per replica batch")
    schedule: str = opt("1f1b", choices=("gpipe", "1f1b", "interleaved"), doc="pipeline schedule")
    virtual_stages: int = opt(2, check=_positive, doc="model chunks per pipeline rank (interleaved only)")
    balance: str = opt("time", choices=("time", "params"), doc="pipeline cut: measured layer time or parameters")
    tp_plan: dict = opt(
        {}, doc="module name -> colwise | rowwise | ... in transformers' style names (tensor parallelism)"
    )
    verify_plan: bool = opt(
        True,
        doc="tp: the first step runs each distinct sharded block once against the same block whole (its "
        "weights gathered) on the step's own input; a mismatch, or a sharded forward that fails where the whole "
        "block runs, exits 2 naming the module and the plan entry; "
        "pp: before training, the model's `pipeline_layers()` chained against its own forward on the first "
        "microbatch, at each cut and the end; a mismatch exits 2 naming the cut; cp (under pp in each stage) and ep "
        "(dp, zero1-3): the first step runs one attention with the ring and one MoE layer's dispatch per kind "
        "against the same layer whole (the step's q, k, v or expert weights gathered); a mismatch exits 2 naming "
        "the module and parallel.cp or parallel.ep (docs/models.md, docs/long-sequences-and-moe.md: what each costs)",
    )
    bucket_mb: float = opt(25.0, check=_positive, doc="gradient bucket size (dp, zero1/2 buckets, zero3 units)")
    compression: str = opt(
        "none",
        choices=("none", "bf16", "fp16", "topk", "powersgd"),
        doc="gradient averaging: dp takes all, zero1-3 none, bf16 or fp16, the rest none",
    )
    topk_ratio: float = opt(0.01, check=_ratio, doc="topk: share of each bucket's entries sent")
    powersgd_rank: int = opt(4, check=_at_least_one, doc="powersgd: rank of the low-rank factors")
    powersgd_warm_start: bool = opt(True, doc="powersgd: start each step from the last step's Q")
    timeout_s: float = opt(300.0, check=_timeout, doc="collective timeout")
    sync_batchnorm: bool = opt(
        True,
        doc="batch-norm layers normalise over the global batch (dp, zero1-3, sync ps, hybrid); "
        "false: each rank over its own samples, rank 0's statistics broadcast before every step and "
        "validation as DDP does",
    )
    replicas: int = opt(
        1,
        check=_positive,
        doc="model replicas: each is sharded (zero1-3; zero3 with replicas is HSDP) or split (tp, pp, hybrid: "
        "1 or world / (tp x pp)) over world/replicas ranks; what fault.on_failure = continue loses and restarts",
    )


@dataclass
class CheckpointConfig:
    """Resumable checkpoints in RUN_DIR/checkpoints/step-N; the final export is always written."""

    every: int = opt(0, check=_non_negative, doc="steps between checkpoints; 0 = final export only")
    keep: int = opt(3, check=_positive, doc="newest checkpoints kept; older ones are deleted")


@dataclass
class FaultConfig:
    """What a run does when a worker dies (docs/fault-tolerance.md)."""

    on_failure: str = opt(
        "restart",
        choices=("restart", "continue"),
        doc="restart: every worker from the newest checkpoint; continue: the surviving replicas go on",
    )


@dataclass
class PSConfig:
    """Parameter servers (strategy = "ps")."""

    servers: int = opt(1, check=_positive, doc="the first `servers` ranks serve parameters, the rest are workers")
    mode: str = opt(
        "sync",
        choices=("sync", "async", "ssp"),
        doc="sync: one averaged step per global batch; async: every push applied at once; "
        "ssp: async within ps.staleness steps",
    )
    staleness: int = opt(4, check=_non_negative, doc="ssp: how many steps a worker may run ahead of the slowest")
    straggler_rank: int = opt(
        -1,
        check=lambda v: None if v >= -1 else "must be a worker rank or -1 (none)",
        doc="experiments: the worker rank slowed down by straggler_factor; -1 = none",
    )
    straggler_factor: float = opt(
        1.0,
        check=lambda v: None if v >= 1 else "must be >= 1",
        doc="that worker's step takes this many times its compute time",
    )
    drop_after_s: float = opt(
        30.0, check=_positive, doc="async | ssp: a worker silent this long is dropped; servers always wait"
    )


@dataclass
class FederatedConfig:
    clients: int = opt(100, check=_positive, doc="simulated clients, spread over the worker ranks")
    clients_per_round: int = opt(10, check=_positive, doc="clients sampled (seeded) for each round")
    local_steps: int = opt(10, check=_positive, doc="client optimizer steps per round, each of data.batch_size samples")
    algorithm: str = opt("fedavg", choices=("fedavg", "fedprox", "fedadam"))
    mu: float = opt(0.0, check=_non_negative, doc="fedprox: weight of the proximal term mu/2 |w - w_global|^2")
    server_lr: float = opt(
        1.0, check=_positive, doc="fedadam's step size; fedavg and fedprox scale the mean update by it"
    )
    partition: str = opt("dirichlet", choices=("iid", "dirichlet"), doc="how the training set is dealt to clients")
    alpha: float = opt(0.5, check=_positive, doc="dirichlet: concentration (smaller = more skewed labels)")
    min_samples: int = opt(10, check=_positive, doc="fewest samples a client may hold; a draw below it exits 2")
    secure_aggregation: bool = opt(False, doc="pairwise-masked updates: the server only sees their sum")
    round_timeout_s: float = opt(300.0, check=_positive, doc="a worker not answering within this is dropped")


@dataclass
class LogConfig:
    """Extra outputs of a run besides metrics.jsonl, profile.jsonl and trace.json. MLflow and wandb
    get rank 0's config as params, the metrics.jsonl values of every logged step, and final/."""

    tensorboard: bool = opt(
        False, check=_installed("tensorboard"), doc="also write TensorBoard event files to RUN_DIR/tensorboard"
    )
    mlflow: bool = opt(False, check=_installed("mlflow"), doc="to MLFLOW_TRACKING_URI, else RUN_DIR/mlruns")
    wandb: bool = opt(False, check=_installed("wandb"), doc="to wandb, offline unless WANDB_MODE says otherwise")


@dataclass
class Config:
    name: str = "paratrain"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        """The TOML-shaped dict (factory kwargs flattened back into their sections)."""
        out: dict[str, Any] = {"name": self.name}
        for f in dataclasses.fields(self):
            if f.name == "name":
                continue
            section = dataclasses.asdict(getattr(self, f.name))
            section.update(section.pop("kwargs", {}))
            out[f.name] = section
        return out


# Sections whose unknown keys are factory keyword arguments rather than errors.
_OPEN_SECTIONS = {"model", "data"}

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a table"}


def _check_value(key: str, f: dataclasses.Field, value: Any) -> Any:
    type_name = cast(str, f.type)  # a name, not a type: this module has future annotations
    want = {"int": int, "float": float, "str": str, "bool": bool, "dict": dict}[type_name]
    ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError(key, f"expected {_TYPE_NAMES[want]}, got {value!r} ({type(value).__name__})")
    if want is float and not math.isfinite(value):
        raise ConfigError(key, f"must be finite, got {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(key, f"must be one of {' | '.join(choices)}, got {value!r}")
    check = f.metadata.get("check")
    if check and (why := check(value)):
        raise ConfigError(key, f"{why}, got {value!r}")
    return value


def _build_section(name: str, cls, raw: Any):
    if not isinstance(raw, dict):
        raise ConfigError(name, f"expected a table, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "kwargs"}
    values, extra = {}, {}
    for key, value in raw.items():
        if key in fields:
            values[key] = _check_value(f"{name}.{key}", fields[key], value)
        elif name in _OPEN_SECTIONS:
            extra[key] = value
        else:
            raise ConfigError(f"{name}.{key}", f"unknown key (known: {', '.join(fields)})")
    if name in _OPEN_SECTIONS:
        values["kwargs"] = extra
    return cls(**values)


def from_dict(raw: dict) -> Config:
    sections = {f.name: f for f in dataclasses.fields(Config) if f.name != "name"}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "name":
            if not isinstance(value, str) or not value:
                raise ConfigError("name", f"expected a non-empty string, got {value!r}")
            if value in (".", "..") or any(c in value for c in "/\\") or control_characters(value):
                # runs/NAME is the run directory: a path there could reach any folder
                raise ConfigError(
                    "name", f"{value!r} must be a plain name, without '/', '\\', '..' or control characters"
                )
            kwargs["name"] = value
        elif key in sections:
            kwargs[key] = _build_section(key, sections[key].default_factory, value)
        else:
            raise ConfigError(key, f"unknown key (known: name, {', '.join(sections)})")
    cfg = Config(**kwargs)
    _check_combinations(cfg)
    return cfg


def _check_combinations(cfg: Config) -> None:
    """Checks that need no world size and no dataset."""
    if cfg.model.lora and cfg.parallel.strategy not in LORA_STRATEGIES:
        raise ConfigError(
            "model.lora", f"trains under {' | '.join(LORA_STRATEGIES)}, not {cfg.parallel.strategy} (yet)"
        )
    if cfg.train.track_memory and cfg.train.torch_profiler:
        raise ConfigError("train.track_memory", "counts allocations with torch's profiler: drop train.torch_profiler")


def default_config_path() -> Path:
    return Path(str(importlib.resources.files("paratrain") / "configs" / "default.toml"))


def read_toml(path: str | Path, key: str = "config") -> dict:
    """The TOML file every command reads (a config, a cluster file): a missing, unreadable, binary
    or directory path is a ConfigError naming `key`, never a traceback."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(key, f"file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(key, f"{path} is a directory, not a TOML file") from None
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(key, f"{path} is not a text file (not UTF-8): not a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(key, f"{path} is not valid TOML: {exc}") from None


def load(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    raw = read_toml(path if path is not None else default_config_path())
    return from_dict(apply_overrides(raw, list(overrides)))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):  # json's escapes are TOML's too; json leaves DEL bare, which TOML does not take
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else _toml_value(key)


def to_toml(cfg: Config) -> str:
    data = cfg.to_dict()
    lines = [f"name = {_toml_value(data.pop('name'))}"]
    for section, table in data.items():
        lines += ["", f"[{section}]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


# -- what the [parallel] keys imply ------------------------------------------------------------
def virtual_stages(cfg: Config) -> int:
    p = cfg.parallel
    return p.virtual_stages if p.schedule == "interleaved" and p.pp > 1 else 1


def microbatch_count(cfg: Config) -> int:
    return cfg.train.grad_accum * (cfg.parallel.microbatches if cfg.parallel.pp > 1 else 1)
