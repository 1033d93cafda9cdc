"""`paratrain bench plan-megatron`: the step-time model against Megatron-LM's published runs.

Table 1 of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC21, arXiv 2104.04473): GPT with V = 51,200 and s = 2,048 on DGX A100 nodes of 8, with
activation recomputation, mixed precision. Each row's layout (t, p, d = GPUs / (t p)) and global
batch is planned on an a100-80gb cluster, with the paper's kind of attention (scores materialized:
model.attention = "materialized"). Table 1 gives no microbatch size: one sequence a microbatch
under pp, all of a replica's sequences at once without (an assumption). Predicted TFLOP/s per GPU use
Megatron's own count, 96Bslh^2(1 + s/6h + V/16lh) / (step x GPUs), recompute included, as the
published ones do. Nothing runs: the figures are the model's arithmetic and hold on any machine.
"""

from __future__ import annotations

import time

from paratrain.bench.common import add_json_option
from paratrain.runtime.machine import emit_json

# params (B), heads, hidden, layers, t, p, GPUs, batch, published TFLOP/s per GPU
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQUENCE, VOCAB = 2048, 51200


def predict_row(row: tuple) -> dict:
    """One Table 1 row through `paratrain plan --cluster` (in-process)."""
    import torch

    from paratrain.cost.cluster import parse_cluster
    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.plan.planner import make_plan
    from paratrain.preflight import load

    params, heads, h, layers, t, p, gpus, batch, published = row
    d = gpus // (t * p)
    cfg = load(
        None,
        [
            f"model.n_layer={layers}",
            f"model.d_model={h}",
            f"model.n_head={heads}",
            f"model.block_size={SEQUENCE}",
            f"data.block_size={SEQUENCE}",
            f"model.vocab_size={VOCAB}",
            "model.attention='materialized'",
            f"data.max_chars={(batch + 1) * SEQUENCE * 12 // 10}",
            f"data.batch_size={batch}",
            "train.precision='bf16'",
            "train.recompute='full'",
            "parallel.strategy='hybrid'",
            f"parallel.tp={t}",
            f"parallel.pp={p}",
            "parallel.balance='params'",
            f"parallel.microbatches={batch // d if p > 1 else 1}",
        ],
    )
    cluster = parse_cluster({"nodes": gpus // 8, "devices_per_node": 8, "device": "a100-80gb"})
    start = time.perf_counter()
    with torch.device("meta"):
        model = build_model(cfg, build_dataset(cfg, "train"))
    plan = make_plan(cfg, model, 8, gpus // 8, "cuda", cluster)
    step = plan["predicted"]["step_s"]
    megatron_flops = 96 * batch * SEQUENCE * layers * h * h * (1 + SEQUENCE / (6 * h) + VOCAB / (16 * layers * h))
    predicted = megatron_flops / step / gpus / 1e12
    return {
        "params_B": params,
        "t": t,
        "p": p,
        "gpus": gpus,
        "batch": batch,
        "published_tflops": published,
        "predicted_tflops": predicted,
        "error": predicted / published - 1,
        "step_s": step,
        "breakdown": plan["step_breakdown"],
        "plan_s": time.perf_counter() - start,
    }


def run(args) -> int:
    rows = [predict_row(TABLE_1[i]) for i in args.rows]
    print(
        "| params (B) | t | p | GPUs | batch | published TFLOP/s | predicted TFLOP/s | error | step s | "
        "compute s | bubble s | tp comm s | p2p s | exposed dp s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b = r["breakdown"]
        print(
            f"| {r['params_B']} | {r['t']} | {r['p']} | {r['gpus']} | {r['batch']} | {r['published_tflops']} | "
            f"{r['predicted_tflops']:.1f} | {r['error']:+.1%} | {r['step_s']:.2f} | {b['compute_s']:.2f} | "
            f"{b['bubble_s']:.2f} | {b['tp_comm_s']:.2f} | {b['p2p_s']:.2f} | {b['exposed_dp_comm_s']:.2f} |",
            flush=True,
        )
    emit_json({"rows": rows}, args.json)
    return 0


def add_parser(which) -> None:
    p = which.add_parser("plan-megatron", help="the step-time model against Megatron-LM's Table 1 (SC21)")
    p.add_argument(
        "--rows",
        type=lambda s: [int(i) for i in s.split(",")],
        default=list(range(len(TABLE_1))),
        help="comma-separated row indices (0-9), default all",
    )
    add_json_option(p)
    p.set_defaults(func=run)
