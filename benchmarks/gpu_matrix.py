"""Every ZeRO stage and dp at world 1 on the GPU, eager and compiled, through the trainer: a check
of `make gpu-check`, not a benchmark.

    PYTHONPATH=src python3 benchmarks/gpu_matrix.py [--steps 6] [--smoke]

Three models, random tokens (nothing is downloaded): the built-in GPT with 12 layers, the same GPT
with 4 layers of mixture-of-experts feed-forwards (8 experts, top 2), and a small
Hugging Face Llama built from a LlamaConfig at random init (transformers, the test extra; left out
with a line saying so where it is not installed). Each case is one Trainer on the process's NCCL
group of one, all in this process (as a benchmark holds them: several compiled models alive at
once), in fp32 at a learning rate that moves the loss; each must finish with finite losses, its
last within 2% of dp eager's on the same model (world 1: the same training up to summation order
and compiled kernels). One line per case; exit 1 if any failed. --smoke: tiny shapes on the CPU
(the script's own check). Without a GPU and without --smoke: one line, exit 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

STRATEGIES = ("dp", "zero1", "zero2", "zero3")
SEQ, SMOKE_SEQ = 256, 16
GPT = {"factory": "gpt", "vocab_size": 4096, "n_layer": 12, "n_head": 8, "d_model": 512, "block_size": SEQ}
SMOKE_GPT = {"factory": "gpt", "vocab_size": 128, "n_layer": 2, "n_head": 2, "d_model": 32, "block_size": SMOKE_SEQ}
# the GPT with mixture-of-experts feed-forwards (a token-choice router: data-dependent shapes under compile)
MOE = {"n_layer": 4, "n_experts": 8, "top_k": 2}
LLAMA_SHAPE = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": SEQ,
}
SMOKE_LLAMA_SHAPE = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": SMOKE_SEQ,
}
TOLERANCE = 0.02  # relative, on the last logged loss against dp eager's


def llama(shape: dict) -> dict:
    return {
        "factory": "hf",
        "task": "causal-lm",
        "config": {"model_type": "llama", "tie_word_embeddings": True, **shape},
    }


def job(model: dict, strategy: str, compiled: bool, steps: int, batch: int, device: str) -> dict:
    seq = model.get("block_size") or model["config"]["max_position_embeddings"]
    vocab = model.get("vocab_size") or model["config"]["vocab_size"]
    return {
        "model": model,
        "data": {"factory": "gpu:tokens", "batch_size": batch, "n_samples": batch * steps, "block_size": seq}
        | {"vocab_size": vocab, "shuffle": False},
        "train": {"steps": steps, "optimizer": "adamw", "lr": 1e-3, "log_every": 1, "compile": compiled}
        | {"device": device},
        "parallel": {"strategy": strategy},
    }


def run_case(cfg_dict: dict, rt) -> list[float]:
    """The case's logged losses (its stdout, the trainer's progress, kept out of the table)."""
    from paratrain import config as config_mod
    from paratrain.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir, open(os.devnull, "w") as sink:
        stdout, sys.stdout = sys.stdout, sink
        try:
            Trainer(config_mod.from_dict(cfg_dict), run_dir, rt).fit()
        finally:
            sys.stdout = stdout
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            return [json.loads(line)["loss"] for line in fh if '"loss"' in line]


def check(name: str, losses: list[float], reference: float | None) -> str | None:
    """Why the case failed, or None."""
    if not losses or not all(math.isfinite(x) for x in losses):
        return f"non-finite or no losses: {losses}"
    if reference is not None and abs(losses[-1] - reference) > TOLERANCE * abs(reference):
        return f"last loss {losses[-1]:.4f} vs dp eager's {reference:.4f} (more than {TOLERANCE:.0%} apart)"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the script's own check")
    args = p.parse_args(argv)

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu matrix: skipped, no CUDA GPU on this machine")
        return 0
    from paratrain.runtime import process

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `gpu:tokens`, the cases' data
    gpt = SMOKE_GPT if args.smoke else GPT
    models = {"gpt-12": gpt, "gpt-moe": gpt | MOE}
    try:
        import transformers  # noqa: F401  (the hf factory's)

        models["llama"] = llama(SMOKE_LLAMA_SHAPE if args.smoke else LLAMA_SHAPE)
    except ImportError:
        print("llama: left out, transformers is not installed (pip install -e '.[test]')")
    device = "cpu" if args.smoke else "cuda"
    rt = process.init(device)
    failed = 0
    for model_name, model in models.items():
        reference = None
        for compiled in (False, True):
            for strategy in STRATEGIES:
                name = f"{model_name} {strategy} {'compiled' if compiled else 'eager'}"
                t0 = time.perf_counter()
                try:
                    losses = run_case(job(model, strategy, compiled, args.steps, args.batch, device), rt)
                    why = check(name, losses, reference)
                except Exception as exc:  # one case's failure is its line; the others still run
                    losses, why = [], f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
                reference = reference if reference is not None or why else losses[-1]
                failed += why is not None
                loss = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no loss"
                print(
                    f"{name:<28}{'ok' if why is None else 'FAILED':<8}{loss}  {time.perf_counter() - t0:.1f}s",
                    flush=True,
                )
                if why:
                    print(f"    {why}", flush=True)
    process.shutdown()
    print(
        f"gpu matrix: {failed} of {len(models) * 2 * len(STRATEGIES)} case(s) failed"
        if failed
        else "gpu matrix: all ok"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
