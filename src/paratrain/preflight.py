"""Everything `paratrain run`, `plan` and `job` check before a worker starts: the config, its
factories, sizes and combinations, on a model built on the meta device. ConfigError (exit 2)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sized
from pathlib import Path
from typing import cast

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
    registry.check_world(cfg, world)
    model, train_set = built_model_and_data(cfg)
    # the layout before the loss: a layout the model cannot take (cp on an encoder, pp's labels)
    # is the error to name, not the loss it would then compute wrongly
    check_layout_against(cfg, model, train_set)
    check_loss_and_samples(cfg, model, train_set)


def check_model_fits_this_machine(cfg: config_mod.Config, nproc: int, nnodes: int) -> None:
    """For `run` (`plan` may plan for other machines), before the model is built: a model whose
    fp32 weights alone, spread over every node, exceed this machine's memory exits 2 in one line
    with the figures. Building one of 10^8 experts, even on the meta device, takes minutes, and a
    worker would end in the allocator's traceback."""
    from paratrain.data import build_dataset
    from paratrain.models import parameters_at_least

    # the training set where the model takes sizes from it: the preflight builds it next, from the cache
    parts = parameters_at_least(cfg, lambda: build_dataset(cfg, "train"))
    need = sum(parts.values()) * 4 // nnodes
    have, kind = this_machine_memory(cfg.train.device, nproc)
    if parts and need > have:
        largest = max(parts, key=parts.__getitem__)
        over = f" over {nnodes} nodes" if nnodes > 1 else ""
        raise ConfigError(
            f"model.{largest}",
            f"{cfg.model.factory} would have at least {sum(parts.values()):.3g} parameters (most by this key), "
            f"{need / 2**30:,.1f} GiB of fp32 weights per node{over} before gradients and optimizer state; "
            f"this machine has {have / 2**30:,.1f} GiB of {kind}",
        )


def this_machine_memory(device: str, nproc: int) -> tuple[int, str]:
    """Bytes a node can hold a model in, at the most (host memory, or its cgroup's limit, plus the
    GPUs its processes take), and what they are."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError, ValueError):  # cgroup v2's "max" (no limit) is not a number
        host = min(host, int(Path("/sys/fs/cgroup/memory.max").read_text()))
    if device != "cuda":
        return host, "host memory"
    import torch

    gpus = sum(torch.cuda.get_device_properties(i).total_memory for i in range(nproc))
    return host + gpus, f"host and GPU memory ({nproc} GPUs)"


def checked_model_and_data(cfg: config_mod.Config) -> tuple:
    """The model and training set with the checks that no parallel layout changes done: `plan
    --search` builds them once per recompute mode and checks each layout on them."""
    model, train_set = built_model_and_data(cfg)
    check_loss_and_samples(cfg, model, train_set)
    return model, train_set


def built_model_and_data(cfg: config_mod.Config) -> tuple:
    """The model (on meta) and the training set as the workers build them (the data's size checked)."""
    import torch

    from paratrain.data import build_dataset
    from paratrain.models import build_model

    train_set = cast(Sized, build_dataset(cfg, "train"))  # "train" is always built: never None
    if len(train_set) < cfg.data.batch_size:
        raise ConfigError(
            "data.batch_size",
            f"{cfg.data.batch_size} is more than the {len(train_set)} training samples of {cfg.data.factory}",
        )
    build_dataset(cfg, "val")
    with torch.device("meta"):  # shapes only: no memory, no time
        model = build_model(cfg, train_set)
    return model, train_set


def check_loss_and_samples(cfg: config_mod.Config, model, train_set) -> None:
    """The loss, and a sample through the model (on meta) into it."""
    from paratrain.optim import build_loss

    build_loss(cfg)
    check_samples(cfg, train_set, model)
    check_vocabulary(cfg, model, train_set)


def check_vocabulary(cfg: config_mod.Config, model, train_set) -> None:
    """The data's token ids within the model's input embedding (a transformers model's, or any
    with `get_input_embeddings`): ids beyond it would fail in every worker with `IndexError: index
    out of range in self`. The data's vocabulary is its `vocab_size` (the tokenizer's: shards, the
    corpus), else the largest `input_ids` of sample 0 plus one."""
    import torch
    from torch import nn

    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embeddings, nn.Embedding) or len(train_set) == 0:
        return
    data_vocab, what = getattr(train_set, "vocab_size", None), "vocab_size"
    if not isinstance(data_vocab, int):
        sample = train_set[0]
        ids = sample.get("input_ids") if isinstance(sample, dict) else None
        if not (isinstance(ids, torch.Tensor) and ids.numel() and not ids.is_floating_point()):
            return
        data_vocab, what = int(ids.max()) + 1, "largest input_ids of sample 0, plus one"
    if data_vocab > embeddings.num_embeddings:
        raise ConfigError(
            "data.factory",
            f"{cfg.data.factory}'s token ids need a vocabulary of {data_vocab} (its {what}), but the model's "
            f"has {embeddings.num_embeddings}: tokenize the data with the model's own tokenizer",
        )


def check_layout_against(cfg: config_mod.Config, model, train_set) -> None:
    """The config's parallel layout against its model (on meta) and training set, whose own checks
    passed (checked_model_and_data)."""
    from paratrain.parallel.registry import strategy_class

    check_sequence_and_experts(cfg, model, train_set)
    strategy_class(cfg.parallel.strategy).check_model(cfg, model)
    if cfg.parallel.pp > 1 and cfg.train.loss == "model" and len(train_set):
        sample = train_set[0]
        if isinstance(sample, dict) and "labels" not in sample:
            # the last stage computes the model's own loss from the labels carried to it
            raise ConfigError(
                "data.factory",
                f'{cfg.data.factory}\'s dict samples carry no "labels" (keys {sorted(sample)}), which '
                f'train.loss = "model" under pp carries to the last stage',
            )


def check_sequence_and_experts(cfg: config_mod.Config, model, train_set) -> None:
    """parallel.cp and ep against the model (on meta) and the data; MoE layers where their experts
    and auxiliary losses are not yet split (tp, pp)."""
    from paratrain.models.moe import auxiliary_losses

    p = cfg.parallel
    if p.cp > 1 and len(train_set):
        from paratrain.parallel.context.attention import check_context

        check_context(cfg, model, train_set[0])
    if p.ep > 1:
        from paratrain.parallel.expert.experts import check_experts

        check_experts(cfg, model)
    moe = auxiliary_losses(model)
    if moe and (p.tp > 1 or p.pp > 1):
        raise ConfigError(
            "model.n_experts", "mixture-of-experts layers take dp and zero1-3 (with cp, ep), not tp or pp yet"
        )


def check_samples(cfg: config_mod.Config, train_set, model=None) -> None:
    """The first training sample, as the workers will see it: `(input, target)` with a tensor,
    tuple/list or dict input, or a dict alone (its own `labels`, with train.loss = "model"); for the
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
    if isinstance(sample, dict) and _all_tensors(sample):
        if cfg.train.loss in ("cross_entropy", "mse"):
            raise ConfigError(
                "train.loss",
                f"{cfg.data.factory}'s samples are dicts with no separate target (keys {sorted(sample)}): "
                f'{cfg.train.loss} needs one; train.loss = "model" takes the loss the model computes',
            )
        inputs, target = sample, None
    elif isinstance(sample, (tuple, list)) and len(sample) == 2 and _all_tensors(sample[0]):
        inputs, target = sample
    else:
        raise ConfigError(
            "data.factory",
            f"{cfg.data.factory}'s samples must be (input, target) pairs, whose input is a tensor, a tuple or "
            f"list of tensors or a dict of tensors, or dicts of tensors; got {_describe(sample)}",
        )
    if cfg.train.loss == "cross_entropy" and isinstance(target, torch.Tensor) and target.is_floating_point():
        raise ConfigError(
            "train.loss",
            f"cross_entropy takes class indices, but the targets of {cfg.data.factory} "
            f"are {str(target.dtype).removeprefix('torch.')} (a regression task: use "
            f"'mse'; soft labels: a module:function loss)",
        )
    if model is not None and (target is None or isinstance(target, torch.Tensor)):
        check_loss_shapes(cfg, model, inputs, target)


def _all_tensors(obj) -> bool:
    """A tensor, or a non-empty dict, tuple or list of tensors (nested)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return True
    values = list(obj.values()) if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else []
    return bool(values) and all(_all_tensors(v) for v in values)


def _describe(sample) -> str:
    if isinstance(sample, dict):
        return f"a dict with keys {sorted(map(str, sample))} not all tensors"
    if isinstance(sample, (tuple, list)):
        parts = ", ".join(type(v).__name__ for v in sample[:4])
        return f"a {type(sample).__name__} of {len(sample)} ({parts})"
    return f"a {type(sample).__name__}"


# Up to this many parameters, the shape check runs on the CPU, on zero weights and zero inputs
# (milliseconds); above it, on the meta device, whose kernels for a Linear are decompositions
# that import torch.compile's modules (about 2 s of CPU in a launcher that never compiles).
SHAPE_CHECK_ON_CPU_PARAMS = 2_000_000


def check_loss_shapes(cfg: config_mod.Config, model, inputs, target) -> None:
    """A batch of two samples through the model (built on meta) and a built-in loss, shapes only:
    `mse` on class indices, an output width that is not the targets', or an output with no logits
    (or no loss, for train.loss = "model") fails here instead of in every worker. A model that
    cannot run this way is left to the workers."""
    import copy

    import torch

    from paratrain.data.batch import feed, tree_map
    from paratrain.optim import BUILTIN_LOSSES

    loss = BUILTIN_LOSSES.get(cfg.train.loss)
    if loss is None:
        return
    device = "meta"
    if sum(p.numel() for p in model.parameters()) <= SHAPE_CHECK_ON_CPU_PARAMS:
        device = "cpu"
        # zeros, not to_empty: torch.empty_like of a meta tensor is one of those decompositions
        model = copy.deepcopy(model)._apply(lambda t: torch.zeros(t.shape, dtype=t.dtype))
    pair = tree_map(lambda t: torch.zeros((2, *t.shape), dtype=t.dtype, device=device), (inputs, target))
    try:
        with torch.no_grad():
            out = feed(model, pair[0])
    except Exception:
        return
    try:
        loss(out, pair[1])
    except Exception as exc:  # any failure here is the loss meeting this model's output
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        target_shape = "none" if pair[1] is None else tuple(pair[1].shape)
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            "train.loss",
            f"{cfg.train.loss} cannot compare the model's output {shape} with targets {target_shape} ({first})",
        ) from None
