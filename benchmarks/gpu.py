"""paratrain's GPU path measured: the built-in GPT at GPT-2-small shape on one GPU, in one call.

    PYTHONPATH=src python3 benchmarks/gpu.py [--steps 10 --rounds 3 --batch 16 --json out.json]

GPT-2 small (12 layers, 12 heads, d_model 768, sequence 1024, vocabulary 50304, tied embeddings:
124M parameters) in bf16 autocast with torch.compile and fused attention (sdpa: flash attention on
an H100), AdamW, on random tokens (nothing is downloaded). Contenders, built from the same seed and
timed in alternating rounds of K steps:
    paratrain run   the trainer's whole step (trainer.Trainer, dp at world 1, train.compile = true)
    dp, zero3       the strategies' train_step alone, at world 1, compiled block by block
    plain           a nanoGPT-style loop: torch.compile(model), autocast, fused AdamW
Each row: median step time, tokens/s and MFU (model FLOPs utilisation: nanoGPT's 6N + 12 L H Q T
FLOPs per token against the GPU's dense bf16 peak; --peak-tflops for a GPU it does not know). On
a machine without a GPU it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

# dense bf16 tensor-core peaks, TFLOP/s (without sparsity)
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}
SHAPE = {"vocab_size": 50304, "n_layer": 12, "n_head": 12, "d_model": 768, "block_size": 1024, "tie_embeddings": True}


def tokens(split: str = "train", n_samples: int = 256, block_size: int = 1024, vocab_size: int = 50304):
    """Random token blocks (inputs, next tokens): the data factory of the trainer's contender."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    rows = torch.randint(0, vocab_size, (n_samples if split == "train" else 0, block_size + 1), generator=g)
    return TensorDataset(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())


def peak_flops(name: str, given: float | None) -> float | None:
    if given:
        return given * 1e12
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if key in name:
            return PEAK_TFLOPS[key] * 1e12
    return None


def flops_per_token(model) -> float:
    """nanoGPT's estimate: 6 per parameter (less the position table) and the attention's 12 L H Q T."""
    n = sum(p.numel() for p in model.parameters()) - model.embed.pos.weight.numel()
    s = SHAPE
    return 6 * n + 12 * s["n_layer"] * s["n_head"] * (s["d_model"] // s["n_head"]) * s["block_size"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--steps", type=int, default=10, help="steps per round per contender")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (the compile)")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--smoke", action="store_true", help="a tiny GPT on the CPU: the script's own check, no figures")
    args = p.parse_args(argv)

    import torch

    if args.smoke:
        SHAPE.update(vocab_size=128, n_layer=2, n_head=2, d_model=32, block_size=32)
    elif not torch.cuda.is_available():
        print("gpu benchmark: skipped, no CUDA GPU on this machine")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    from paratrain import config as config_mod
    from paratrain.bench.common import machine, machine_line
    from paratrain.bench.tax import paced
    from paratrain.models.gpt import gpt
    from paratrain.optim import build_optimizer, cross_entropy
    from paratrain.parallel.registry import build_strategy
    from paratrain.runtime import process
    from paratrain.trainer import Trainer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `gpu:tokens`, the trainer's data
    device = "cpu" if args.smoke else "cuda"
    rt = process.init(device)
    dev, b, k = rt.device, args.batch, args.steps
    total = args.warmup + args.rounds * k

    def job(strategy: str):
        return config_mod.from_dict(
            {
                "model": {"factory": "gpt", **SHAPE},
                "data": {
                    "factory": "gpu:tokens",
                    "batch_size": b,
                    "n_samples": b * total,
                    "block_size": SHAPE["block_size"],
                    "vocab_size": SHAPE["vocab_size"],
                },
                "train": {
                    "steps": total,
                    "optimizer": "adamw",
                    "lr": 6e-4,
                    "precision": "bf16",
                    "compile": True,
                    "log_every": k,
                    "device": device,
                },
                "parallel": {"strategy": strategy},
            }
        )

    cfg = job("dp")
    data = tokens(n_samples=b * total, block_size=SHAPE["block_size"], vocab_size=SHAPE["vocab_size"])
    x_all, y_all = (t.to(dev) for t in data.tensors)

    def build():
        torch.manual_seed(0)
        return gpt(**SHAPE)

    contenders, steps_done = {}, {}

    def batch(name):
        i = steps_done[name] % total
        steps_done[name] += 1
        return x_all[i * b : (i + 1) * b], y_all[i * b : (i + 1) * b]

    for name in ("dp", "zero3"):
        strategy = build_strategy(build(), cross_entropy, job(name), rt)
        contenders[name] = lambda n=name, s=strategy: s.train_step(batch(n))
    plain = build().to(dev)
    compiled = torch.compile(plain)
    opt = build_optimizer(list(plain.parameters()), cfg.train)

    def plain_step():
        x, y = batch("plain")
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    contenders["plain"] = plain_step
    steps_done.update({name: 0 for name in contenders})
    times = {name: [] for name in ["paratrain run", *contenders]}

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn, n: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t0) / n

    def pause(step: int, since: float) -> None:
        """The trainer's rounds set the pace: after each, every other contender takes one."""
        if step > args.warmup:
            times["paratrain run"].append(since / k)
        for name, fn in contenders.items():
            if step == args.warmup:
                timed(fn, args.warmup)
            else:
                times[name].append(timed(fn, k))

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = paced(Trainer)(cfg, run_dir, rt)
        trainer.pause_every, trainer.pause_from, trainer.pause = k, args.warmup, pause
        with open(os.devnull, "w") as sink:
            stdout, sys.stdout = sys.stdout, sink
            try:
                trainer.fit()
            finally:
                sys.stdout = stdout

    m = machine()
    peak = peak_flops(m["gpu"] or "", args.peak_tflops)
    per_token = flops_per_token(plain)
    rows = []
    for name, t in times.items():
        step_s = statistics.median(t)
        tok_s = b * SHAPE["block_size"] / step_s
        rows.append(
            {
                "contender": name,
                "step_ms": step_s * 1e3,
                "tokens_per_s": tok_s,
                "mfu": tok_s * per_token / peak if peak else None,
            }
        )
    print(machine_line(m))
    peak_text = f"{peak / 1e12:g} TFLOP/s dense bf16" if peak else "unknown (--peak-tflops)"
    print(f"driver {_driver() if device == 'cuda' else 'none'}, CUDA {torch.version.cuda}, peak {peak_text}")
    print(
        f"GPT-2 small ({sum(p.numel() for p in plain.parameters()) / 1e6:.0f}M), seq {SHAPE['block_size']}, "
        f"batch {b}, bf16 autocast, compiled, sdpa; median of {args.rounds} rounds of {k} steps"
    )
    print(f"{'contender':<16}{'step ms':>10}{'tokens/s':>12}{'MFU':>8}")
    for r in rows:
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"{r['contender']:<16}{r['step_ms']:>10.1f}{r['tokens_per_s']:>12.0f}{mfu:>8}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": m, "batch": b, "rows": rows}, fh, indent=1)
    process.shutdown()
    return 0


def _driver() -> str:
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
