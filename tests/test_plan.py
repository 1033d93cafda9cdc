"""`paratrain plan` against what the strategies really hold.

The oracle (tests/fake_ranks.py) builds every rank's strategy, one rank at a time, on torch's fake
process group, counts the storage of its parameters, gradients and optimizer state, the peak of
activations saved for backward in one train_step, and what the next train_step hands the profiler
(payload and minimum bytes sent, by collective); the plan must give the same bytes, the same mesh
coordinates and the same pipeline stages, rank by rank."""

import json
import os
import subprocess
import sys

import pytest
from helpers import CPU_ONLY, ROOT

from paratrain.cli import main

# (world size, overrides of the default job: gpt with 2 blocks, 4 pipeline layers, AdamW)
CASES = {
    "dp": (2, []),
    "dp-bf16-wire": (2, ["parallel.compression='bf16'", "parallel.bucket_mb=0.3"]),
    "dp-topk": (2, ["parallel.compression='topk'", "parallel.bucket_mb=0.3", "parallel.topk_ratio=0.01"]),
    "dp-powersgd": (
        3,
        ["parallel.compression='powersgd'", "parallel.bucket_mb=0.3", "parallel.powersgd_rank=2", "data.batch_size=33"],
    ),
    "zero1": (4, ["parallel.strategy='zero1'", "parallel.bucket_mb=0.2", "train.grad_accum=2"]),
    "zero2": (
        4,
        ["parallel.strategy='zero2'", "parallel.bucket_mb=0.2", "train.optimizer='sgd'", "train.momentum=0.9"],
    ),
    "zero1-bf16": (4, ["parallel.strategy='zero1'", "parallel.bucket_mb=0.2", "train.precision='bf16'"]),
    "zero2-bf16": (
        4,
        ["parallel.strategy='zero2'", "parallel.bucket_mb=0.2", "train.precision='bf16'", "train.grad_accum=2"],
    ),
    "zero3": (
        4,
        ["parallel.strategy='zero3'", "parallel.bucket_mb=0.1", "train.grad_accum=2", "parallel.compression='fp16'"],
    ),
    "tp": (2, ["parallel.strategy='tp'", "parallel.tp=2"]),
    "tp-bf16": (2, ["parallel.strategy='tp'", "parallel.tp=2", "train.precision='bf16'"]),
    "dp2xtp2": (4, ["parallel.strategy='hybrid'", "parallel.tp=2", "parallel.bucket_mb=0.2"]),
    "interleaved": (
        2,
        ["parallel.strategy='pp'", "parallel.pp=2", "parallel.schedule='interleaved'", "parallel.balance='params'"],
    ),
    "gpipe": (
        2,
        [
            "parallel.strategy='pp'",
            "parallel.pp=2",
            "parallel.schedule='gpipe'",
            "parallel.microbatches=8",
            "parallel.balance='params'",
        ],
    ),
    "1f1b-accum": (
        2,
        [
            "parallel.strategy='pp'",
            "parallel.pp=2",
            "parallel.microbatches=4",
            "train.grad_accum=2",
            "parallel.balance='params'",
        ],
    ),
    "1f1b-bf16": (
        2,
        ["parallel.strategy='pp'", "parallel.pp=2", "parallel.balance='params'", "train.precision='bf16'"],
    ),
    "tp2xpp2": (4, ["parallel.strategy='hybrid'", "parallel.tp=2", "parallel.pp=2", "parallel.balance='params'"]),
    "tp2xpp2-tied": (
        4,
        [
            "parallel.strategy='hybrid'",
            "parallel.tp=2",
            "parallel.pp=2",
            "parallel.balance='params'",
            "model.tie_embeddings=true",
        ],
    ),
    "dp2xpp2": (
        4,
        ["parallel.strategy='hybrid'", "parallel.pp=2", "parallel.balance='params'", "train.optimizer='sgd'"],
    ),
    "ps": (4, ["parallel.strategy='ps'", "ps.servers=2"]),
}
# a quarter of the default batch: every case still splits it as before (microbatches, accumulation,
# replicas), some into microbatches of one row (whose inputs and targets autograd saves as views of
# one token row: the plan once counted that row as an activation), and the oracle's real forward
# and backward take less CPU (20 s at half the batch, 33 s at the whole)
CASES = {case: (world, ["data.batch_size=8", *sets]) for case, (world, sets) in CASES.items()}


@pytest.fixture(scope="module")
def held():
    """What each rank holds, for every case, from one oracle process."""
    cases = json.dumps(list(CASES.values()))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fake_ranks.py"), cases],
        capture_output=True,
        text=True,
        timeout=900,  # 20 s on a quiet 2-core machine; several minutes under heavy load
        env={**os.environ, **CPU_ONLY},
    )
    assert proc.returncode == 0, proc.stderr
    return dict(zip(CASES, json.loads(proc.stdout.splitlines()[-1])))


def plan(tmp_path, world: int, sets: list[str], nnodes: int = 1) -> dict:
    out = tmp_path / "plan.json"
    args = ["plan", "--nproc", str(world // nnodes), "--nnodes", str(nnodes), "--json", str(out)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_plan_is_what_every_rank_holds(tmp_path, monkeypatch, held, case):
    world, sets = CASES[case]
    # the fake backend takes ZeRO's native collectives (NCCL's path); so must the plan
    monkeypatch.setenv("PARATRAIN_NATIVE_COLLECTIVES", "1")
    ranks = plan(tmp_path, world, sets)["ranks"]
    assert len(ranks) == world
    for predicted, real in zip(ranks, held[case]):
        for key, value in real.items():
            if key == "activation_bytes" and predicted[key] is None:
                assert "parallel.tp=2" in sets, "activations go unestimated under tp only"
                continue
            assert predicted[key] == value, f"{case} rank {real['rank']}: {key} planned {predicted[key]}, held {value}"
    if case.startswith("zero"):  # sharded optimizer state: 1/world of dp's, up to the padding
        dp = plan(tmp_path, world, [s for s in sets if not s.startswith("parallel.strategy")])["ranks"][0]
        assert dp["optimizer_bytes"] <= ranks[0]["optimizer_bytes"] * world < 1.01 * dp["optimizer_bytes"]


def test_plan_grid_cut_and_batch(tmp_path, capsys):
    """Two nodes of two: ranks 2, 3 on node 1; tp innermost; the cut by parameters, each stage
    on its pp rank; 32 samples = dp 1 replica of 4 microbatches of 8; time balance noted."""
    p = plan(tmp_path, 4, ["parallel.strategy='hybrid'", "parallel.tp=2", "parallel.pp=2"], nnodes=2)
    assert [(r["node"], r["local_rank"], r["pp"], r["tp"]) for r in p["ranks"]] == [
        (0, 0, 0, 0),
        (0, 1, 0, 1),
        (1, 0, 1, 0),
        (1, 1, 1, 1),
    ]
    assert [(s["stage"], s["pp_rank"], s["layers"]) for s in p["stages"]] == [(0, 0, [0, 1]), (1, 1, [2, 3])]
    assert sum(s["parameters"] for s in p["stages"]) == p["model"]["parameters"]
    assert p["batch"] == {"global": 32, "per_replica": 32, "microbatches": 4, "rows_per_microbatch": 8}
    assert any("balance = 'time'" in n for n in p["notes"])
    text = capsys.readouterr().out
    assert "mesh: dp 1 x tp 2 x pp 2" in text and "stage 1 on pp rank 1: layers 2-3" in text


@pytest.mark.parametrize(
    "sets, key",
    [
        (["parallel.strategy='hybrid'", "parallel.tp=3"], "parallel.tp"),
        (["train.lrr=1"], "train.lrr"),
        (["parallel.strategy='pp'", "parallel.pp=2", "parallel.microbatches=5"], "parallel.microbatches"),
    ],
)
def test_plan_rejects_what_run_rejects(capsys, sets, key):
    args = ["plan", "--nproc", "4"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


def test_plan_says_whether_it_fits_this_machine(tmp_path, capsys):
    """On CPU the busiest node's ranks share host memory: the default job fits, a 39B-parameter gpt
    in dp over 4 ranks a node (2.5 TB a node) does not."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    small = plan(tmp_path, 2, [])
    need = sum(r["peak_bytes"] for r in small["ranks"])
    assert small["capacity"] == {
        "kind": "host memory",
        "bytes": host,
        "where": "node 0",
        "needed": need,
        "fits": True,
        "activations_counted": True,
    }
    huge = plan(tmp_path, 8, ["model.n_layer=48", "model.d_model=8192", "model.n_head=64"], nnodes=2)
    assert huge["model"]["parameters"] > 38e9 and not huge["capacity"]["fits"]
    assert huge["capacity"]["needed"] == sum(r["peak_bytes"] for r in huge["ranks"] if r["node"] == 0)
    assert "DOES NOT FIT: node 0 needs" in capsys.readouterr().out


# Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC20),
# Figure 1: model states per device of a 7.5B-parameter model on 64 devices with mixed-precision
# Adam (2 + 2 + 12 bytes a parameter), in GB
ZERO_PAPER_GB = {"dp": 120, "zero1": 31.4, "zero2": 16.6, "zero3": 1.88}
GPT_7_5B = [  # Megatron-LM's 7.5B GPT (Narayanan et al., Table 1), its embeddings tied
    "model.n_layer=36",
    "model.d_model=4096",
    "model.n_head=32",
    "model.block_size=2048",
    "model.vocab_size=51200",
    "model.tie_embeddings=true",
    "data.block_size=2048",
    "data.tokenizer='chars'",
    "data.max_chars=400000",
    "data.batch_size=64",
    "train.precision='bf16'",
]


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero_stages_plan_the_zero_papers_model_states(tmp_path, strategy):
    """Under bf16, ZeRO stages 1 and 2 keep bf16 working parameters and gradients and the fp32
    master copy only in each rank's optimizer shard, as the paper's do: the plan's model states per
    rank within 10 % of the paper's. (dp and zero3, whose 16 and 16 / N bytes a parameter bf16 does
    not change, plan 119.5 and 1.87 GB: benchmarks/results/memory-2026-11-26.md; a plan of this
    model takes half a minute, so they are left out here.)"""
    (rank,) = plan(tmp_path, 64, [*GPT_7_5B, f"parallel.strategy='{strategy}'"], nnodes=8)["ranks"][:1]
    states = rank["param_bytes"] + rank["grad_bytes"] + rank["optimizer_bytes"]
    assert abs(states / 1e9 / ZERO_PAPER_GB[strategy] - 1) <= 0.10, states / 1e9


@pytest.mark.parametrize(
    "sets",
    [
        ["train.recompute='full'", "train.precision='bf16'", "parallel.tp=2", "parallel.pp=2"],  # Megatron's
        ["parallel.pp=2"],
    ],
    ids=["recompute-bf16-tp2xpp2", "pp2"],
)
def test_a_deep_stage_is_extrapolated_exactly(monkeypatch, sets):
    """A stage of many identical blocks is played with two and three of them and extrapolated
    (activations.extrapolated): the same bytes as played whole, layer by layer."""
    import torch

    from paratrain.cost import activations
    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.models.layers import pipeline_layers
    from paratrain.parallel.pipeline.cut import allowed_cuts, parameter_costs, partition
    from paratrain.parallel.tensor.layers import plan_for, planned_sharding
    from paratrain.preflight import load

    small = ["model.n_layer=12", "model.d_model=32", "model.n_head=4", "parallel.strategy='hybrid'"]
    cfg = load(None, [*small, *sets])
    with torch.device("meta"):
        model = build_model(cfg, build_dataset(cfg, "train"))
    tp_plan = plan_for(model, None) if cfg.parallel.tp > 1 else {}
    layers = pipeline_layers(model)
    bounds = partition(parameter_costs(layers), 2, allowed_cuts(model, layers, tp_plan))
    used = []
    extrapolated = activations.extrapolated
    monkeypatch.setattr(activations, "extrapolated", lambda *a: used.append(extrapolated(*a)) or used[-1])
    sharding = planned_sharding(tp_plan, cfg.parallel.tp)
    fast = activations.step_memory(cfg, 4, bounds, tp_plan, cfg.parallel.tp, sharding=sharding)
    assert len(used) == 2 and None not in used  # both stages: 7 and 6 blocks in a row
    monkeypatch.setattr(activations, "MIN_REPEATS", 10**9)
    assert activations.step_memory(cfg, 4, bounds, tp_plan, cfg.parallel.tp, sharding=sharding) == fast


def test_plan_json_on_stdout_is_the_json_alone_on_a_cold_cache(tmp_path, capsys):
    """`plan --json`'s stdout is the JSON alone, also where the plan prepares the default job's
    corpus first (a fresh machine's cache: the first GPU run met it) and its note is printed on the
    way; the note goes to stderr."""
    sets = ["data.max_chars=20000", "data.tokenizer=bpe:300", f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(["plan", "--nproc", "2", "--json", *(a for s in sets for a in ("--set", s))]) == 0
    said = capsys.readouterr()
    assert json.loads(said.out)["world_size"] == 2
    assert "data: prepared the corpus as bpe:300 tokens" in said.err
