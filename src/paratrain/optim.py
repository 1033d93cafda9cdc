"""Optimizer, learning-rate schedule and loss, built from the [train] section."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config import Config, TrainConfig
from paratrain.resolve import resolve_callable


def build_optimizer(params: Iterable[nn.Parameter] | list[dict], cfg: TrainConfig) -> torch.optim.Optimizer:
    """torch's SGD or AdamW, in its fused form (one pass over each tensor) where it has one.

    The default (foreach) form makes a pass per arithmetic op: on CPU, measured on 9.4M fp32
    parameters, an SGD-with-momentum step takes 9.3 ms against 4.9 fused, an AdamW step 37.7 ms
    against 5.8. The update is the same formula (equal up to rounding), and so is the state."""
    param_list: list[Any] = list(params)
    kind, kwargs = (
        (torch.optim.SGD, dict[str, Any](lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay))
        if cfg.optimizer == "sgd"
        else (torch.optim.AdamW, dict[str, Any](lr=cfg.lr, weight_decay=cfg.weight_decay))
    )
    if _fusable(param_list):
        try:
            return kind(param_list, fused=True, **kwargs)
        except (RuntimeError, ValueError):  # a build of torch without this fused kernel
            pass
    return kind(param_list, **kwargs)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` can skip a step on a flag that stays on the device: torch's fused SGD,
    Adam and AdamW take one (`found_inf`, as GradScaler hands them), so the decision to skip a
    non-finite step needs no host sync in the step."""
    return type(optimizer) in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW) and all(
        g.get("fused") and not g.get("dampening") for g in optimizer.param_groups
    )


def step_unless(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """optimizer.step(), a no-op on the device where `nonfinite` (a float32 scalar) is 1: the
    parameters and the state (AdamW's step count too) are left as they were (skips_on_device).
    SGD's momentum buffers start at zero here: torch's fused SGD makes a missing one with
    empty_like and fills it only in a step that is not skipped, while from zero the first step
    computes what it does without one (buf = 0 * momentum + g = g, dampening 0)."""
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            if group["momentum"]:
                for p in group["params"]:
                    if p.grad is not None and optimizer.state[p].get("momentum_buffer") is None:
                        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    optimizer.found_inf = nonfinite  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, name_of: dict[int, str], new: Mapping[str, torch.Tensor]
) -> torch.optim.Optimizer:
    """The user's optimizer class and hyper-parameters over the tensors a strategy trains in place
    of the model's parameters (`new`: by the name of the parameter each stands for; `name_of`: the
    name of each parameter the user's optimizer holds, by id). Each keeps the param group of its
    parameter; a parameter with no tensor in `new` (held by another rank) is left out, so a group
    may be empty on some rank."""
    groups = []
    for g in optimizer.param_groups:
        names = [name_of.get(id(p)) for p in g["params"]]
        if None in names:
            raise ValueError("pt.setup: the optimizer holds a tensor that is no trainable parameter of the model")
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": [new[n] for n in names if n is not None and n in new]})
    # each group carries every hyper-parameter; the constructor takes the defaults it names
    # (AdamW's defaults also hold keys its constructor does not take)
    accepted = inspect.signature(type(optimizer)).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


def _fusable(params: list) -> bool:
    """torch fuses its optimizers for floating-point tensors on CPU and CUDA only."""
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return bool(tensors) and all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors)


def lr_factor(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of train.lr at a step: constant, or linear warm-up then cosine decay to zero."""
    if cfg.lr_schedule == "constant":
        return lambda step: 1.0 if step >= cfg.warmup_steps else (step + 1) / cfg.warmup_steps

    def cosine(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(cfg.steps - cfg.warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - cfg.warmup_steps, span) / span))

    return cosine


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def output_field(output, name: str):
    """`output.name` or `output[name]` (a ModelOutput is both, a dict only the second), or None."""
    value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
    return value if isinstance(value, torch.Tensor) else None


def output_logits(output):
    """The logits inside whatever the model returned: a tensor, a tuple, or `logits` (attribute or
    key) of anything else."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output_field(output, "logits")
    if logits is not None:
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the built-in losses need a tensor output or one with `logits`, got {type(output).__name__}")


IGNORE_INDEX = -100  # torch's and transformers' ignore_index: a target that no loss counts

# While a training step (or a validation chunk) runs on token targets: the label tokens per sample
# of the global batch (token_mean.py), so that cross_entropy divides its sum of token losses by
# that times its rows and the strategies' mean of the calls is the global batch's token mean;
# unset, the call's own mean.
LABEL_TOKENS_PER_SAMPLE: ContextVar[torch.Tensor | None] = ContextVar("label_tokens_per_sample", default=None)


def cross_entropy(output, target: torch.Tensor) -> torch.Tensor:
    logits = output_logits(output)
    flat = logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1)
    per_sample = LABEL_TOKENS_PER_SAMPLE.get()
    if per_sample is None:
        return F.cross_entropy(*flat)
    return F.cross_entropy(*flat, reduction="sum") / (per_sample * target.shape[0])


def mse(output, target: torch.Tensor) -> torch.Tensor:
    out = output_logits(output)
    return F.mse_loss(out.float(), target.reshape(out.shape).to(torch.float32))


def model_loss(output, target=None) -> torch.Tensor:
    """train.loss = "model": the loss the model computed itself (Hugging Face style, `labels` in
    the inputs): the output's `loss` (attribute or key), or the output when it is a scalar."""
    loss = output if isinstance(output, torch.Tensor) else output_field(output, "loss")
    if loss is None or loss.dim() != 0:
        what = (
            f"a tensor of shape {tuple(loss.shape)}"
            if loss is not None
            else f"a {type(output).__name__} without `loss`"
        )
        raise TypeError(f'train.loss = "model" needs a scalar output or one with `loss`, got {what}')
    return loss


BUILTIN_LOSSES = {"cross_entropy": cross_entropy, "mse": mse, "model": model_loss}


def build_loss(cfg: Config) -> Callable:
    return BUILTIN_LOSSES.get(cfg.train.loss) or resolve_callable(cfg.train.loss, "train.loss")


@torch.no_grad()
def accuracy_counts(output, target) -> tuple[int, int] | None:
    """(correct, total) for classification-shaped outputs and class targets, else None (a model's
    own loss's labels: None, or a dict of them under pp, models/hf_pipeline.labels_apart)."""
    try:
        logits = output_logits(output)
    except TypeError:
        return None
    if not isinstance(target, torch.Tensor) or not (
        target.dtype in (torch.long, torch.int) and logits.dim() == target.dim() + 1
    ):
        return None
    pred = logits.argmax(dim=-1)
    return int((pred == target).sum()), target.numel()
