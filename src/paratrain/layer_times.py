"""Each layer's forward and backward time, measured on this machine: the compute of a plan on a
calibrated cpu cluster (`time_layers = true`, which `paratrain plan --calibrate` writes), as
Galvatron and vTrain profile layers instead of modelling them.

On a CPU a small model's layer costs more in eager dispatch (Python, the dispatcher, autograd's
bookkeeping: tens of microseconds an op) than in arithmetic, and the split between the two
changes with every op's shape, thread count and kernel; no FLOP count predicts it, a stopwatch
does. So each of the model's pipeline layers (the whole model where it has none) runs here for
real, on a microbatch of the plan's rows, at the thread count a worker of the planned run gets
(the launcher gives each of N processes cores // N threads): forward alone, and backward alone
from the gradient of its output, the loss in the last layer's. Medians of a few repeats, once
per (model, rows, threads) in a planning process; likewise the optimizer's step. How much N processes computing at once slow
each other (shared caches and memory bandwidth; more processes than cores take turns) is the
cluster's `cpu_contention`, which --calibrate measures. The model is timed only while it is cheap
to run here (MAX_FLOPS); a larger one is modelled instead.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch

from .cluster import median_seconds
from .config import Config

MAX_FLOPS = 5e9  # above this one microbatch's forward is not run here (a second or so at ~50 GFLOP/s)
REPEATS = 9


@dataclass(frozen=True)
class LayerTime:
    forward_s: float
    backward_s: float


_measured: dict[tuple, object] = {}
MAX_OPTIMIZED = 10**8  # parameters: above this the optimizer step is not run here


def layer_times(cfg: Config, rows: int, threads: int, forward_flops: int) -> list[LayerTime] | None:
    """Forward and backward seconds of each pipeline layer on `rows` samples at `threads` threads;
    None when the model is too large to run here (`forward_flops`: of its forward on `rows`)."""
    if forward_flops > MAX_FLOPS:
        return None
    key = (repr(cfg.model), repr(cfg.data), cfg.train.precision, rows, threads)
    if key not in _measured:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            _measured[key] = [LayerTime(*pair) for pair in _measure(cfg, rows)]
        finally:
            torch.set_num_threads(before)
    return _measured[key]


def optimizer_step_s(cfg: Config, threads: int) -> tuple[float, float] | None:
    """Seconds of an optimizer step (the run's own: optim.build_optimizer) over the model's
    parameters as the model holds them, and over one flat tensor of as many (as ZeRO shards them),
    at `threads` threads; None when the model is too large to step here."""
    from .data import build_dataset
    from .models import build_model
    from .optim import build_optimizer

    key = ("optimizer", repr(cfg.model), repr(cfg.data), repr(cfg.train), threads)
    if key not in _measured:
        with torch.device("meta"):
            count = sum(p.numel() for p in build_model(cfg, build_dataset(cfg, "train")).parameters())
        if count > MAX_OPTIMIZED:
            return None
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            params = list(build_model(cfg, build_dataset(cfg, "train")).parameters())
            flat = torch.nn.Parameter(torch.zeros(count))
            times = []
            for held in (params, [flat]):
                for p in held:
                    p.grad = torch.full_like(p, 1e-3)
                times.append(_median_s(build_optimizer(held, cfg.train).step))
            _measured[key] = tuple(times)
        finally:
            torch.set_num_threads(before)
    return _measured[key]


def _median_s(fn) -> float:
    return median_seconds(fn, REPEATS, warmups=2)


def _measure(cfg: Config, rows: int) -> list[list[float]]:
    """[forward_s, backward_s] of each pipeline layer."""
    from .data import build_dataset, load_batch
    from .models import build_model
    from .optim import build_loss
    from .parallel.pipeline_cut import pipeline_layers

    torch.manual_seed(cfg.train.seed)
    dataset = build_dataset(cfg, "train")
    model = build_model(cfg, dataset)
    layers = pipeline_layers(model) or [model]
    loss_fn = build_loss(cfg)
    x, y = load_batch(dataset, torch.arange(rows))
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if cfg.train.precision == "bf16" else contextlib.nullcontext()
    )
    inputs = [x]
    with torch.no_grad(), autocast:
        for layer in layers[:-1]:
            inputs.append(layer(inputs[-1]))
    out = []
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        given = inputs[i].detach().requires_grad_(inputs[i].is_floating_point())

        def forward(layer=layer, given=given, last=last):
            with autocast:
                result = layer(given)
                return loss_fn(result, y) if last else result

        def backward(forward=forward):
            result = forward()
            grad = None if result.dim() == 0 else torch.ones_like(result)
            start = time.perf_counter()
            result.backward(grad)
            return time.perf_counter() - start

        forward_s = _median_s(forward)
        backward(), backward()
        backward_s = statistics.median(backward() for _ in range(REPEATS))
        model.zero_grad(set_to_none=True)
        out.append([forward_s, backward_s])
    return out
