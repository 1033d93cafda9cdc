"""The framework's tax: `paratrain run --nproc 1` against the plain PyTorch loop it replaces.

One worker holds both: the real trainer (trainer.Trainer's fit, with its sampler, profiler,
metrics, stop agreement and logging, the path `paratrain run` takes) and a plain loop (fetch the
batch, forward, loss, zero_grad, backward, optimizer step) over the same model, data, optimizer and
batch. The trainer hands the machine to the plain loop every K steps, so the two alternate in
rounds and see the same machine noise; each side's step time is the median over rounds of a
round's time over K. Both read the same batches in the same order from the same initial weights,
so their final weights must agree: the table says by how much.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

from paratrain.bench.common import add_json_option, add_round_options, one_or_more_of, relaunch
from paratrain.runtime.machine import emit_json

MODELS = ("mlp", "gpt")


def add_parser(which) -> None:
    p = which.add_parser("tax", help="paratrain run --nproc 1 vs a plain PyTorch loop (step time, ratio)")
    add_options(p)
    p.set_defaults(func=run)


def add_options(p) -> None:
    add_round_options(p, steps=5, rounds=10, warmup=3, steps_help="steps per round per side (train.log_every = this)")
    p.add_argument("--models", type=one_or_more_of(MODELS), default="mlp,gpt", help="mlp (a user factory), gpt")
    p.add_argument(
        "--compile",
        action="store_true",
        help="train.compile = true for paratrain, the plain loop eager: what compiling gains, tax included",
    )
    add_json_option(p)


def run(args) -> int:
    return relaunch("paratrain.bench.tax", args, add_options, nproc=1, run_id="bench-tax")


def user_mlp(in_features: int, hidden: int = 1536, n_layers: int = 4, out_features: int = 10):
    """The user's model: a factory paratrain knows nothing about."""
    from torch import nn

    layers, width = [], in_features
    for _ in range(n_layers):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, out_features))


def job(model: str, steps: int, compiled: bool = False) -> dict:
    """The config of each contender: a user MLP on synthetic data, or the built-in GPT (4 layers,
    d_model 256, sequence 128) on the character corpus; AdamW at a constant rate, no clipping."""
    train = {"steps": steps, "optimizer": "adamw", "lr": 1e-3, "log_every": steps, "compile": compiled}
    if model == "mlp":
        return {
            "model": {"factory": "paratrain.bench.tax:user_mlp", "in_features": 1024},
            "data": {"factory": "synthetic", "batch_size": 64, "in_features": 1024, "n_samples": 8192},
            "train": train,
        }
    return {
        "model": {"factory": "gpt", "n_layer": 4, "n_head": 4, "d_model": 256, "block_size": 128},
        "data": {"factory": "corpus", "tokenizer": "chars", "block_size": 128, "batch_size": 4, "max_chars": 400_000},
        "train": train,
    }


def measure(model: str, args, rt) -> dict:

    from paratrain import config as config_mod
    from paratrain.data import load_batch
    from paratrain.models import build_model
    from paratrain.optim import build_loss, build_optimizer
    from paratrain.runtime import process
    from paratrain.trainer import Trainer

    k, total = args.steps, args.warmup + args.rounds * args.steps
    cfg = config_mod.from_dict(job(model, k, args.compile))
    cfg.train.steps, cfg.train.device = total, "cpu"
    times: dict[str, list[float]] = {"paratrain": [], "plain": []}

    process.seed_everything(cfg.train.seed)  # the trainer's initial weights
    with tempfile.TemporaryDirectory() as run_dir:
        trainer_cls = paced(Trainer)
        trainer = trainer_cls(cfg, run_dir, rt)
        plain_set = trainer.train_set
        process.seed_everything(cfg.train.seed)
        net = build_model(cfg, plain_set)
        opt, loss_fn = build_optimizer(list(net.parameters()), cfg.train), build_loss(cfg)
        sampler = trainer.sampler
        plain_step = [0]

        def plain_steps(n: int) -> float:
            batches = [sampler.global_indices(plain_step[0] + i) for i in range(n)]  # the DataLoader's sampler
            t0 = time.perf_counter()
            for idx in batches:
                x, y = load_batch(plain_set, idx)
                loss = loss_fn(net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            plain_step[0] += n
            return time.perf_counter() - t0

        def pause(step: int, since: float) -> None:
            if step == args.warmup:
                plain_steps(args.warmup)
            elif step > args.warmup:
                times["paratrain"].append(since / k)
                times["plain"].append(plain_steps(k) / k)

        trainer.pause_every, trainer.pause_from, trainer.pause = k, args.warmup, pause
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # the progress lines
            trainer.fit()
        ours = trainer.strategy.model
        drift = max(
            ((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-12)).item()
            for a, b in zip(ours.parameters(), net.parameters())
        )
    med = {side: statistics.median(t) for side, t in times.items()}
    return {
        "model": model,
        "parameters": sum(p.numel() for p in net.parameters()),
        "batch": cfg.data.batch_size,
        "paratrain_compiled": args.compile,
        "timed_steps": len(times["plain"]) * k,
        "paratrain_step_ms": med["paratrain"] * 1e3,
        "plain_step_ms": med["plain"] * 1e3,
        # each round's ratio against the plain round right after it (the same machine load), the median
        "ratio": statistics.median(a / b for a, b in zip(times["paratrain"], times["plain"])),
        "max_rel_weight_diff": drift,
    }


def paced(trainer_cls):
    """The trainer, which after every `pause_every`-th step from `pause_from` on calls
    pause(step, seconds since the last pause ended) and leaves its time out of its own."""

    class Paced(trainer_cls):  # type: ignore[misc, valid-type]  # mypy takes no base class given at run time
        def _account(self, *args) -> None:
            super()._account(*args)
            if self.step >= self.pause_from and (self.step - self.pause_from) % self.pause_every == 0:
                now = time.perf_counter()
                self.pause(self.step, now - getattr(self, "resumed", now))
                self.resumed = time.perf_counter()

    return Paced


def worker(argv=None) -> None:
    from paratrain.runtime import process

    p = argparse.ArgumentParser()
    add_options(p)
    args = p.parse_args(argv)
    rt = process.init("cpu")
    rows = [measure(model, args, rt) for model in args.models.split(",")]
    print(
        f"tax benchmark: paratrain run --nproc 1 (the trainer's whole step"
        f"{', compiled' if args.compile else ''}) vs a plain PyTorch loop (eager), median of {args.rounds} interleaved rounds of {args.steps} steps"
    )
    print(f"{'model':<6}{'params':>9}{'batch':>7}{'paratrain ms':>14}{'plain ms':>10}{'ratio':>8}{'weights agree':>15}")
    for r in rows:
        print(
            f"{r['model']:<6}{r['parameters'] / 1e6:>8.1f}M{r['batch']:>7}{r['paratrain_step_ms']:>14.1f}"
            f"{r['plain_step_ms']:>10.1f}{r['ratio']:>8.3f}{r['max_rel_weight_diff']:>15.1e}"
        )
    print("ratio = median over rounds of paratrain / plain step time, each round against the next (<= 1.00: no tax)")
    emit_json(rows, args.json)
    process.shutdown()


if __name__ == "__main__":
    from paratrain.runtime import process

    worker()
    process.leave()
