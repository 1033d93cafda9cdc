"""Everything `paratrain run`, `plan` and `job` check before a worker starts: the config, its
factories, sizes and combinations, on a model built on the meta device. ConfigError (exit 2)."""

from __future__ import annotations

import os
from pathlib import Path

from paratrain import config as config_mod
from paratrain.errors import ConfigError
from paratrain.parallel import registry


def load_config(args) -> config_mod.Config:
    """The config file (or the default job) with the --set overrides; ConfigError if invalid."""
    if args.config:
        os.environ["PARATRAIN_CONFIG_DIR"] = str(Path(args.config).resolve().parent)
    return load(args.config, args.overrides)


def load(path, overrides=()) -> config_mod.Config:
    """A config checked key by key (config.load) and by its strategy (registry.check_config)."""
    cfg = config_mod.load(path, overrides)
    registry.check_config(cfg)
    return cfg


def preflight(cfg: config_mod.Config, world: int) -> None:
    """Everything that can be checked before a worker starts: factories, sizes, combinations."""
    import torch

    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.optim import build_loss
    from paratrain.parallel.registry import strategy_class

    registry.check_world(cfg, world)
    train_set = build_dataset(cfg, "train")
    if len(train_set) < cfg.data.batch_size:
        raise ConfigError(
            "data.batch_size",
            f"{cfg.data.batch_size} is more than the {len(train_set)} training samples of {cfg.data.factory}",
        )
    build_dataset(cfg, "val")
    with torch.device("meta"):  # shapes only: no memory, no time
        model = build_model(cfg, train_set)
    strategy_class(cfg.parallel.strategy).check_model(cfg, model)
    build_loss(cfg)
    check_samples(cfg, train_set, model)


def check_samples(cfg: config_mod.Config, train_set, model=None) -> None:
    """The first training sample, as the workers will see it: an (input, target) pair, and for the
    built-in cross-entropy a class index, not a real-valued target (a regression task); for a
    built-in loss, the model's output (`model` on meta) must fit the targets. Each would otherwise
    fail in every worker at the first step."""
    import torch

    if len(train_set) == 0:
        return
    try:
        sample = train_set[0]
    except Exception as exc:  # the user's __getitem__
        raise ConfigError(
            "data.factory", f"{cfg.data.factory}: reading sample 0 failed: {type(exc).__name__}: {exc}"
        ) from None
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        what = (
            f"a dict with keys {sorted(sample)}"
            if isinstance(sample, dict)
            else f"a {type(sample).__name__}" + (f" of {len(sample)}" if isinstance(sample, (tuple, list)) else "")
        )
        raise ConfigError("data.factory", f"{cfg.data.factory}'s samples must be (input, target) pairs, got {what}")
    target = sample[1]
    if cfg.train.loss == "cross_entropy" and isinstance(target, torch.Tensor) and target.is_floating_point():
        raise ConfigError(
            "train.loss",
            f"cross_entropy takes class indices, but the targets of {cfg.data.factory} "
            f"are {str(target.dtype).removeprefix('torch.')} (a regression task: use "
            f"'mse'; soft labels: a module:function loss)",
        )
    if model is not None and isinstance(sample[0], torch.Tensor) and isinstance(target, torch.Tensor):
        check_loss_shapes(cfg, model, sample[0], target)


def check_loss_shapes(cfg: config_mod.Config, model, x, target) -> None:
    """A batch of two samples through the model and a built-in loss, all on the meta device
    (shapes only): `mse` on class indices, or an output width that is not the targets', fails
    here instead of in every worker. A model that cannot run on meta is left to the workers."""
    import torch

    from paratrain.optim import BUILTIN_LOSSES

    loss = BUILTIN_LOSSES.get(cfg.train.loss)
    if loss is None:
        return
    xs = torch.empty((2, *x.shape), dtype=x.dtype, device="meta")
    ys = torch.empty((2, *target.shape), dtype=target.dtype, device="meta")
    try:
        with torch.no_grad():
            out = model(xs)
    except Exception:
        return
    try:
        loss(out, ys)
    except (RuntimeError, ValueError) as exc:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            "train.loss",
            f"{cfg.train.loss} cannot compare the model's output {shape} with "
            f"targets {tuple(ys.shape)} ({str(exc).splitlines()[0]})",
        ) from None
