"""Each layer's forward and backward time, measured on this machine: the compute of a plan on a
calibrated cpu cluster (`time_layers = true`, which `paratrain plan --calibrate` writes), as
Galvatron and vTrain profile layers instead of modelling them.

On a CPU a small model's layer costs more in eager dispatch (Python, the dispatcher, autograd's
bookkeeping: tens of microseconds an op) than in arithmetic, and the split between the two
changes with every op's shape, thread count and kernel; no FLOP count predicts it, a stopwatch
does. So each of the model's pipeline layers (the whole model where it has none) runs here for
real, on a microbatch of the plan's rows, at the thread count a worker of the planned run gets
(the launcher gives each of N processes cores // N threads): forward alone, and backward alone
from the gradient of its output, the loss in the last layer's; compiled block by block where the
config says train.compile = true (models/compiled.py). Medians of a few repeats, once
per (model, rows, threads); likewise the optimizer's step (from memory, not cache, as a run meets
it). They are kept in a small JSON file beside the cluster file (`cluster.toml` ->
`cluster.times.json`) that later plans on it reuse; --calibrate starts it afresh. How much N
processes computing at once slow each other (shared caches and memory bandwidth; more processes than cores take turns) is the
cluster's `cpu_contention`, which --calibrate measures. The model is timed only while it is cheap
to run here (MAX_FLOPS); a larger one is modelled instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.config import Config
from paratrain.errors import ConfigError

# above this one microbatch's forward is not run here: about half a second at one core's ~40 GFLOP/s
# (fp32, AVX2), some 20 s for the repeats of every layer. Below it the model's own layers are the
# stopwatch's, not the FLOP model's (peak from one 512^3 matmul, backward twice the forward): at
# the 5e9 this was, bench plan's gpt256 fell to the FLOP model in dp, zero3 and tp (6.8 GFLOP a
# 16-row forward) and was timed only in pp (3.4 GFLOP microbatches), one model, two time models.
MAX_FLOPS = 2e10
REPEATS = 9


@dataclass(frozen=True)
class LayerTime:
    forward_s: float
    backward_s: float


_measured: dict[str, list] = {}  # this process's timings, by key digest
MAX_OPTIMIZED = 10**8  # parameters: above this the optimizer step is not run here


def layer_times(
    cfg: Config, rows: int, threads: int, forward_flops: int, store: str | None = None
) -> list[LayerTime] | None:
    """Forward and backward seconds of each pipeline layer on `rows` samples at `threads` threads;
    None when the model is too large to run here (`forward_flops`: of its forward on `rows`).
    `store`: the JSON file of timings kept (read first, added to)."""
    if forward_flops > MAX_FLOPS:
        return None
    key: tuple = ("layers", repr(cfg.model), repr(cfg.data), cfg.train.precision, rows, threads)
    if cfg.train.compile:  # a compiled layer is another stopwatch reading (the key keeps eager's as it was)
        key += ("compiled",)
    what = f"{cfg.model.factory} layers, {rows} rows, {threads} threads"
    pairs = _remembered(store, key, what, threads, lambda: _measure(cfg, rows), pairs=True)
    return [LayerTime(*pair) for pair in pairs]


def optimizer_step_s(cfg: Config, threads: int, store: str | None = None) -> tuple[float, float] | None:
    """Seconds of an optimizer step (the run's own: optim.build_optimizer) over the model's
    parameters as the model holds them, and over one flat tensor of as many (as ZeRO shards them),
    at `threads` threads; None when the model is too large to step here. `store`: as layer_times'."""
    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.optim import build_optimizer

    with torch.device("meta"):
        count = sum(p.numel() for p in build_model(cfg, build_dataset(cfg, "train")).parameters())
    if count > MAX_OPTIMIZED:
        return None

    def measure() -> list[float]:
        params = list(build_model(cfg, build_dataset(cfg, "train")).parameters())
        flat = torch.nn.Parameter(torch.zeros(count))
        times = []
        for held in (params, [flat]):
            for p in held:
                p.grad = torch.full_like(p, 1e-3)
            times.append(_cold_median_s(build_optimizer(held, cfg.train).step))
        return times

    key = ("optimizer", repr(cfg.model), repr(cfg.data), repr(cfg.train), threads)
    what = f"{cfg.train.optimizer} step of {cfg.model.factory}, {threads} threads"
    model_s, flat_s = _remembered(store, key, what, threads, measure, pairs=False)
    return model_s, flat_s


STORE_FORMAT = "paratrain-times/1"


def _machine() -> str:
    """What the timings hold for: another torch, CPU or core count times again."""
    return f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores"


def _remembered(store: str | None, key: tuple, what: str, threads: int, measure, pairs: bool):
    """The timings under `key`: this process's, else the store's, else measured at `threads`
    threads now (and added to the store; a store that cannot be written is only not added to).
    `pairs`: [forward, backward] a layer; else two seconds (the optimizer's)."""
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    if digest in _measured:
        return _measured[digest]
    entries = _read_store(store)
    if digest in entries:
        seconds = entries[digest]["seconds"]
        if pairs != all(isinstance(s, list) for s in seconds) or (not pairs and len(seconds) != 2):
            raise ConfigError("--cluster", f"{store}: {what}: not the timings paratrain wrote; delete it to time again")
        _measured[digest] = seconds
        return _measured[digest]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _measured[digest] = measure()
    finally:
        torch.set_num_threads(before)
    if store is not None:
        entries[digest] = {"of": what, "seconds": _measured[digest]}
        doc = {"format": STORE_FORMAT, "machine": _machine(), "entries": entries}
        with contextlib.suppress(OSError):  # read-only: the next plan measures again
            partial = f"{store}.partial"
            Path(partial).write_text(json.dumps(doc, indent=1) + "\n")
            os.replace(partial, store)  # whole or not at all
    return _measured[digest]


def _read_store(store: str | None) -> dict:
    """The store's entries, none where it is absent or holds another machine's; a file that is not
    a store exits 2 (ConfigError) naming it."""
    if store is None or not os.path.exists(store):
        return {}
    try:
        doc = json.loads(Path(store).read_text())
        if doc.get("machine") != _machine():
            return {}
        entries = doc["entries"]
        ok = doc["format"] == STORE_FORMAT and all(_numbers(e["seconds"]) for e in entries.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ConfigError("--cluster", f"{store}: not a timings file paratrain wrote; delete it to time again")
    return entries


def _numbers(seconds) -> bool:
    """A list of seconds, or of [forward, backward] pairs."""
    flat = [t for s in seconds for t in (s if isinstance(s, list) else [s])]
    shaped = isinstance(seconds, list) and all(not isinstance(s, list) or len(s) == 2 for s in seconds)
    return (
        bool(flat) and shaped and all(isinstance(t, float | int) and not isinstance(t, bool) and t >= 0 for t in flat)
    )


def _median_s(fn) -> float:
    return median_seconds(fn, REPEATS, warmups=2)


def _median_of(timed) -> float:
    """The median of REPEATS calls of `timed`, which times what it does itself, after two untimed."""
    timed(), timed()
    return statistics.median(timed() for _ in range(REPEATS))


EVICT_BYTES = 64 * 2**20  # more than a CPU's last-level cache shared by a core (32 MiB here)


def _cold_median_s(fn) -> float:
    """The median of timed calls, each after writing EVICT_BYTES: from memory, not cache, as a run
    meets its optimizer step after a forward and backward (measured here: an mlp's AdamW step at
    0.5 ms called back to back, 0.8-1.0 ms after its forward and backward or after the write)."""
    evict = torch.empty(EVICT_BYTES // 4)

    def cold() -> float:
        evict.fill_(1.0)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return _median_of(cold)


def _measure(cfg: Config, rows: int) -> list[list[float]]:
    """[forward_s, backward_s] of each pipeline layer."""
    from paratrain.cost.planned_batch import cut_batch
    from paratrain.data import build_dataset, load_batch
    from paratrain.data.batch import feed, tree_map
    from paratrain.models import build_model
    from paratrain.models.compiled import compile_blocks
    from paratrain.models.layers import pipeline_layers

    torch.manual_seed(cfg.train.seed)
    dataset = build_dataset(cfg, "train")
    model = build_model(cfg, dataset)
    if cfg.train.compile:  # the layers as the run will run them; each timing's untimed first calls compile
        compile_blocks(model)
    cut = pipeline_layers(model)
    layers = cut or [model]
    x, y = load_batch(dataset, torch.arange(rows))
    x, y, loss_fn = cut_batch(cfg, model, x, y, cut=cut is not None)
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if cfg.train.precision == "bf16" else contextlib.nullcontext()
    )
    inputs = [x]
    with torch.no_grad(), autocast:
        for i, layer in enumerate(layers[:-1]):
            inputs.append(feed(layer, inputs[-1]) if i == 0 else layer(inputs[-1]))
    out = []
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        given = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), inputs[i])

        def forward(layer=layer, given=given, last=last, first=i == 0):
            with autocast:
                # the batch goes to the first layer as the model takes it (model(**x) for a dict)
                result = feed(layer, given) if first else layer(given)
                return loss_fn(result, y) if last else result

        def backward(forward=forward):
            result = forward()
            grad = None if result.dim() == 0 else torch.ones_like(result)
            start = time.perf_counter()
            result.backward(grad)
            return time.perf_counter() - start

        forward_s = _median_s(forward)
        backward_s = _median_of(backward)
        model.zero_grad(set_to_none=True)
        out.append([forward_s, backward_s])
    return out


def median_seconds(fn, repeats: int, warmups: int = 1) -> float:
    """The median of `repeats` timed calls after `warmups` untimed ones (the kernels' one-time
    set-up; a thread pool starts on the first call): the median, not the best, since on a shared
    machine a run sees the machine's typical share, not its best moment."""
    import statistics
    import time

    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
