"""paratrain's GPU path measured: the built-in GPT at GPT-2-small shape on one GPU, in one call.

    PYTHONPATH=src python3 benchmarks/gpu.py [--steps 10 --rounds 3 --batch 16 --json out.json]
                                             [--results benchmarks/results [--attach LOG]...]

GPT-2 small (12 layers, 12 heads, d_model 768, sequence 1024, vocabulary 50304, tied embeddings:
124M parameters) in bf16 autocast with torch.compile and fused attention (sdpa: flash attention on
an H100), AdamW, on random tokens (nothing is downloaded). Contenders, built from the same seed and
timed in alternating rounds of K steps, all at world 1 (a process group of one):
    paratrain run   the trainer's whole step (trainer.Trainer, dp, train.compile = true)
    dp, zero3       the strategies' train_step alone, compiled as train.compile compiles them
    plain           a nanoGPT-style loop: torch.compile(model), autocast, fused AdamW
    ddp             the plain loop's compiled model in torch's DistributedDataParallel
    fsdp2           torch's fully_shard on each block and the model (bf16 param_dtype and reduce_dtype,
                    as zero3's mixed precision), the same blocks compiled
Each row: median step time, tokens/s, MFU (model FLOPs utilisation: nanoGPT's 6N + 12 L H Q T
FLOPs per token against the GPU's dense bf16 peak; --peak-tflops for a GPU it does not know) and
tokens/s against the plain loop's. --results DIR writes DIR/gpu-DATE.md: the machine, the command,
the commit, the table, and each --attach file (make gpu-check's test and matrix logs). On a
machine without a GPU it prints one line and exits 0; --smoke runs the same flow with a tiny GPT
on the CPU (the script's own check, its figures meaningless).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

# dense bf16 tensor-core peaks, TFLOP/s (without sparsity)
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}
SHAPE = {"vocab_size": 50304, "n_layer": 12, "n_head": 12, "d_model": 768, "block_size": 1024, "tie_embeddings": True}
SMOKE_SHAPE = {"vocab_size": 128, "n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32}


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


def job(strategy: str, batch: int, total: int, log_every: int, device: str):
    from paratrain import config as config_mod

    return config_mod.from_dict(
        {
            "model": {"factory": "gpt", **SHAPE},
            "data": {
                "factory": "gpu:tokens",
                "batch_size": batch,
                "n_samples": batch * total,
                "block_size": SHAPE["block_size"],
                "vocab_size": SHAPE["vocab_size"],
            },
            "train": {
                "steps": total,
                "optimizer": "adamw",
                "lr": 6e-4,
                "precision": "bf16",
                "compile": True,
                "log_every": log_every,
                "device": device,
            },
            "parallel": {"strategy": strategy},
        }
    )


def torch_contenders(build, cfg, rt, batch) -> dict:
    """The PyTorch loops: plain, ddp, fsdp2 (`build()`: the GPT from the shared seed, on the CPU;
    `batch(name)`: that contender's next batch). Each a step function."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from paratrain.models.compiled import compile_blocks
    from paratrain.optim import build_optimizer, cross_entropy

    dev = rt.device

    def loop(name, model, params):
        opt = build_optimizer(list(params), cfg.train)

        def step():
            x, y = batch(name)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    plain = build().to(dev)
    ddp = build().to(dev)
    ddp_model = DistributedDataParallel(torch.compile(ddp), device_ids=[dev.index] if dev.type == "cuda" else None)
    fsdp = build().to(dev)
    mesh = init_device_mesh(dev.type, (1,))
    # bf16 parameters gathered and bf16 gradients reduced, float32 sharded parameters stepped: what
    # paratrain's zero3 does under train.precision = "bf16" (zero/engine.py)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in fsdp.blocks:  # a unit per block, as FSDP2's own recipe for transformers
        fully_shard(block, mesh=mesh, mp_policy=bf16)
    fully_shard(fsdp, mesh=mesh, mp_policy=bf16)
    compile_blocks(fsdp)  # the blocks train.compile compiles; FSDP2's hooks run around them
    return {
        "plain": loop("plain", torch.compile(plain), plain.parameters()),
        "ddp": loop("ddp", ddp_model, ddp.parameters()),
        "fsdp2": loop("fsdp2", fsdp, fsdp.parameters()),
    }


def measure(args, rt) -> tuple[dict, object]:
    """Every contender's step times (seconds), the trainer's rounds setting the pace; and the plain
    loop's model (for its FLOPs)."""
    import torch

    from paratrain.bench.tax import paced
    from paratrain.models.gpt import gpt
    from paratrain.optim import cross_entropy
    from paratrain.parallel.registry import build_for_training
    from paratrain.trainer import Trainer

    b, k, device = args.batch, args.steps, rt.device.type
    total = args.warmup + args.rounds * k
    data = tokens(n_samples=b * total, block_size=SHAPE["block_size"], vocab_size=SHAPE["vocab_size"])
    x_all, y_all = (t.to(rt.device) for t in data.tensors)
    steps_done: dict[str, int] = {}

    def build():
        torch.manual_seed(0)
        return gpt(**SHAPE)

    def batch(name):
        i = steps_done[name] % total
        steps_done[name] += 1
        return x_all[i * b : (i + 1) * b], y_all[i * b : (i + 1) * b]

    contenders = {}
    for name in ("dp", "zero3"):  # built and compiled as the trainer builds them
        strategy = build_for_training(build(), cross_entropy, job(name, b, total, k, device), rt)
        contenders[name] = lambda n=name, s=strategy: s.train_step(batch(n))
    contenders.update(torch_contenders(build, job("dp", b, total, k, device), rt, batch))
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
        trainer = paced(Trainer)(job("dp", b, total, k, device), run_dir, rt)
        trainer.pause_every, trainer.pause_from, trainer.pause = k, args.warmup, pause
        with open(os.devnull, "w") as sink:
            stdout, sys.stdout = sys.stdout, sink
            try:
                trainer.fit()
            finally:
                sys.stdout = stdout
    return times, build()


def rows_of(times: dict, per_token: float, peak: float | None, batch: int) -> list[dict]:
    rows = []
    for name, t in times.items():
        step_s = statistics.median(t)
        tok_s = batch * SHAPE["block_size"] / step_s
        rows.append(
            {
                "contender": name,
                "step_ms": step_s * 1e3,
                "tokens_per_s": tok_s,
                "mfu": tok_s * per_token / peak if peak else None,
            }
        )
    plain = next(r["tokens_per_s"] for r in rows if r["contender"] == "plain")
    for r in rows:
        r["vs_plain"] = r["tokens_per_s"] / plain
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| contender | step ms | tokens/s | MFU | tokens/s vs plain |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(
            f"| {r['contender']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {mfu} | {r['vs_plain']:.3f} |"
        )
    return lines


def write_results(directory: str, header: list[str], rows: list[dict], attach: list[str]) -> str:
    """DIR/gpu-DATE.md: how it was run, on what, the table, and the attached logs."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = _output(["git", "-C", root, "rev-parse", "--short", "HEAD"])
    dirty = _output(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"])
    command = " ".join(shlex.quote(a) for a in ["benchmarks/gpu.py", *sys.argv[1:]])
    today = datetime.date.today().isoformat()
    lines = [f"# GPU check and benchmark, {today}", "", f"Command: `{command}` (from `make gpu-check`)"]
    lines += [f"Commit: {commit or 'unknown'}{' (with uncommitted changes)' if dirty else ''}", ""]
    lines += [*header, "", *table(rows), ""]
    for path in attach:
        with open(path) as fh:
            lines += [f"## {os.path.basename(path)}", "", "```", fh.read().rstrip(), "```", ""]
    path, n = os.path.join(directory, f"gpu-{today}.md"), 2
    while os.path.exists(path):  # a second run that day keeps the first's record
        path, n = os.path.join(directory, f"gpu-{today}-{n}.md"), n + 1
    with open(path, "w") as fh:
        fh.write("\n".join(lines))
    return path


def _output(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--steps", type=int, default=10, help="steps per round per contender")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (the compile)")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--results", default=None, metavar="DIR", help="write DIR/gpu-DATE.md")
    p.add_argument("--attach", action="append", default=[], metavar="LOG", help="a log to add to the results file")
    p.add_argument("--smoke", action="store_true", help="a tiny GPT on the CPU: the script's own check, no figures")
    args = p.parse_args(argv)

    import torch

    if args.smoke:
        SHAPE.update(SMOKE_SHAPE)
    elif not torch.cuda.is_available():
        print("gpu benchmark: skipped, no CUDA GPU on this machine")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    from paratrain.bench.common import machine, machine_line
    from paratrain.runtime import process

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `gpu:tokens`, the trainer's data
    rt = process.init("cpu" if args.smoke else "cuda")
    times, model = measure(args, rt)
    m = machine()
    peak = peak_flops(m["gpu"] or "", args.peak_tflops)
    rows = rows_of(times, flops_per_token(model), peak, args.batch)
    cuda = rt.device.type == "cuda"
    peak_text = f"{peak / 1e12:g} TFLOP/s dense bf16" if peak else "unknown (--peak-tflops)"
    header = [
        machine_line(m),
        f"driver {_driver() if cuda else 'none'}, CUDA {torch.version.cuda}, peak {peak_text}",
        f"GPT ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M), seq {SHAPE['block_size']}, batch "
        f"{args.batch}, bf16 autocast, compiled, sdpa; median of {args.rounds} rounds of {args.steps} steps",
    ]
    print("\n".join([*header, *table(rows)]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": m, "batch": args.batch, "rows": rows}, fh, indent=1)
    if args.results:
        print(f"written: {write_results(args.results, header, rows, args.attach)}")
    process.shutdown()
    return 0


def _driver() -> str:
    return _output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) or "unknown"


if __name__ == "__main__":
    sys.exit(main())
