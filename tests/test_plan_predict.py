"""`train.recompute`, the cluster description and the step-time model of `paratrain plan`.

Recompute must train equal to no recompute (the equivalence promise) and keep only each block's
input for backward, as the plan counts it; memory is measured here as the resident memory a real
forward adds (glibc told to mmap every allocation over 64 KiB, so a freed tensor leaves RSS)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import CPU_ONLY, check_ok, final_weights, run_cli, write_config
from reference import train_reference
from test_model_parallel import GPT, rel_error  # GPT: a 2-block gpt, 20 SGD steps of 8 unshuffled samples

from paratrain.config import load
from paratrain.data import build_dataset, load_batch
from paratrain.models import build_model
from paratrain.optim import build_loss

DIGITS = """
[model]
factory = "{model}"
[data]
factory = "digits"
batch_size = 8
"""


@pytest.mark.parametrize(
    "text", [GPT, DIGITS.format(model="mlp"), DIGITS.format(model="cnn")], ids=["gpt", "mlp", "cnn"]
)
def test_recompute_gives_the_same_gradients(tmp_path, text):
    """Each built-in model: one forward and backward without recompute, with full and with
    selective recompute (products kept, the ops between them run again), equal gradients."""
    config = write_config(tmp_path / "job.toml", text)
    grads = []
    for mode in ("none", "full", "selective"):
        cfg = load(config, [f"train.recompute='{mode}'"])
        dataset = build_dataset(cfg, "train")
        torch.manual_seed(0)
        model = build_model(cfg, dataset)
        x, y = load_batch(dataset, torch.arange(8))
        build_loss(cfg)(model(x), y).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for recomputed in grads[1:]:
        assert recomputed.keys() == grads[0].keys()
        for name in grads[0]:
            torch.testing.assert_close(recomputed[name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_in_pipeline_stages_trains_equal(tmp_path, mode):
    """Interleaved pp 2 (four virtual stages, each chunk checkpointed by block) against plain
    single-process training of the same gpt without recompute."""
    from paratrain.data.datasets import corpus
    from paratrain.models.gpt import gpt

    train = corpus("train", block_size=16, max_chars=20000)
    x, y = load_batch(train, torch.arange(20 * 8) % len(train))
    torch.manual_seed(0)
    reference = train_reference(
        gpt(train.vocab_size, n_layer=2, n_head=4, d_model=32, block_size=16), x, y, steps=20, batch_size=8, lr=0.1
    )
    config = write_config(tmp_path / "gpt.toml", GPT)
    check_ok(
        run_cli(
            "run",
            str(config),
            "--nproc",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            f"train.recompute='{mode}'",
            "--set",
            "parallel.strategy='pp'",
            "--set",
            "parallel.pp=2",
            "--set",
            "parallel.schedule='interleaved'",
            "--set",
            "parallel.balance='params'",
        )
    )
    assert rel_error(final_weights(tmp_path / "run"), reference) <= 1e-4


MEASURE = """
import json, sys, torch
from paratrain.config import load
from paratrain.data import build_dataset, load_batch
from paratrain.models import build_model
from paratrain.optim import build_loss
from paratrain.cost.activations import saved_activation_bytes

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

seen = {}
for mode in ("none", "selective", "full"):
    cfg = load(None, sys.argv[1:] + [f"train.recompute='{mode}'"])
    dataset = build_dataset(cfg, "train")
    model, loss_fn = build_model(cfg, dataset), build_loss(cfg)
    x, y = load_batch(dataset, torch.arange(cfg.data.batch_size))
    with torch.no_grad():  # the kernels' one-time set-up, outside the measurement
        loss_fn(model(x), y)
    before = resident()
    loss = loss_fn(model(x), y)
    seen[mode] = {"measured": resident() - before, "planned": saved_activation_bytes(cfg, len(x))[0]}
    del loss
print(json.dumps(seen))
"""


def test_recompute_lowers_measured_activations_as_planned(tmp_path):
    """A 4-block gpt (d_model 256, 32 x 64 tokens): the memory a forward leaves for backward, with
    and without recompute, within 10 % of the plan's count; full recompute keeps under a tenth,
    selective between the two (the products' outputs)."""
    script = write_config(tmp_path / "measure.py", MEASURE)
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "model.d_model=256",
            "model.n_layer=4",
            "data.batch_size=32",
            "data.max_chars=100000",
            "data.tokenizer='chars'",  # a 96-character vocabulary: the blocks' activations dominate
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **CPU_ONLY, "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    for bytes_ in seen.values():
        assert abs(bytes_["measured"] - bytes_["planned"]) <= 0.1 * bytes_["planned"], seen
    assert seen["full"]["planned"] < seen["none"]["planned"] / 10
    assert seen["full"]["planned"] < seen["selective"]["planned"] < seen["none"]["planned"]


def write_cluster(tmp_path, body: str):
    return write_config(tmp_path / "cluster.toml", "[cluster]\n" + body)


A100_NODES = 'nodes = 4\ndevices_per_node = 8\ndevice = "a100-80gb"\n'


@pytest.mark.parametrize(
    "body, key",
    [
        ('nodes = 4\ndevices_per_node = 8\ndevice = "a100"\n', "cluster.device"),
        (A100_NODES + "peak_tflops = -1\n", "cluster.peak_tflops"),
        (A100_NODES + "nic_Gbps = 100\n", "cluster.nic_Gbps"),
        ('devices_per_node = 8\ndevice = "h200"\n', "cluster.nodes"),
        (A100_NODES + 'latency_us = "fast"\n', "cluster.latency_us"),
        (A100_NODES + "time_layers = true\n", "cluster.time_layers"),
        ('nodes = 1\ndevices_per_node = 2\ndevice = "cpu"\ntime_layers = 1\n', "cluster.time_layers"),
    ],
)
def test_a_bad_cluster_file_exits_2_naming_the_key(tmp_path, capsys, body, key):
    from paratrain.cli import main

    assert main(["plan", "--cluster", str(write_cluster(tmp_path, body))]) == 2
    err = capsys.readouterr().err
    assert f"paratrain: error: {key}:" in err and "Traceback" not in err


def predicted(tmp_path, cluster_body: str, sets: list[str]) -> dict:
    from paratrain.cli import main

    out = tmp_path / "plan.json"
    args = ["plan", "--cluster", str(write_cluster(tmp_path, cluster_body)), "--json", str(out)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return json.loads(out.read_text())


# a 39M-parameter gpt, 64 sequences of 512 tokens a step
GPT2 = [
    "model.n_layer=4",
    "model.d_model=512",
    "model.n_head=8",
    "model.block_size=512",
    "data.block_size=512",
    "model.vocab_size=50304",
    "data.batch_size=64",
    "train.precision='bf16'",
]
ONE_NODE = 'nodes = 1\ndevices_per_node = 8\ndevice = "a100-80gb"\n'


def test_prediction_on_a_gpu_cluster(tmp_path):
    """The figures the contract names, consistent with each other; the presets' peak and memory
    (and their overrides); compute-bound GEMMs put a large model near the efficiency ceiling."""
    plan = predicted(tmp_path, ONE_NODE, GPT2)
    p = plan["predicted"]
    assert set(p) == {"step_s", "samples_per_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_memory_gib"}
    assert p["samples_per_s"] == pytest.approx(64 / p["step_s"])
    assert p["tokens_per_s"] == pytest.approx(64 * 512 / p["step_s"])
    assert p["mfu"] == pytest.approx(p["tflops_per_device"] / 312)
    assert 0.2 < p["mfu"] < 0.85
    assert plan["capacity"]["bytes"] == 80 * 2**30 and plan["capacity"]["kind"] == "a100-80gb memory"
    faster = predicted(tmp_path, ONE_NODE + "peak_tflops = 624\nmemory_gib = 40\n", GPT2)
    assert faster["capacity"]["bytes"] == 40 * 2**30
    assert faster["predicted"]["step_s"] < p["step_s"]


def test_prediction_counts_recompute_bubble_and_dp_comm(tmp_path):
    """Recompute costs one more forward (3 -> 4 passes: at most a third more time); a pipeline
    idles (pp - 1) microbatches' work; dp over slow NICs exposes its all-reduce."""
    base = predicted(tmp_path, A100_NODES, GPT2)
    recompute = predicted(tmp_path, A100_NODES, [*GPT2, "train.recompute='full'"])
    ratio = recompute["step_breakdown"]["compute_s"] / base["step_breakdown"]["compute_s"]
    # a third more where the backward is twice the forward; fused attention's backward takes more
    # (2.5 times its forward's FLOPs: cost/kernels.py), so a little less than a third
    assert 4 / 3 - 0.03 < ratio <= 4 / 3 + 1e-9
    assert recompute["predicted"]["peak_memory_gib"] < base["predicted"]["peak_memory_gib"]
    pp = predicted(
        tmp_path,
        'nodes = 1\ndevices_per_node = 4\ndevice = "h100-sxm"\n',
        [*GPT2, "parallel.strategy='pp'", "parallel.pp=4", "parallel.microbatches=8", "parallel.balance='params'"],
    )
    # balanced by parameters the embedding's stage computes little: the warm-up and cool-down pass
    # it (and the other light stages) quickly, so the bubble is below 3 of 8 microbatches' pace
    parts = pp["step_breakdown"]
    assert 0 < parts["bubble_s"] < 3 / 8 * (parts["compute_s"] + parts["p2p_s"])
    slow = predicted(tmp_path, A100_NODES + "inter_node_Gbps = 10\n", GPT2)
    assert slow["step_breakdown"]["exposed_dp_comm_s"] > 10 * base["step_breakdown"]["exposed_dp_comm_s"]


def test_a_pipeline_takes_the_slowest_stages_pace_and_one_pass_of_the_others(tmp_path, monkeypatch):
    """1f1b: m microbatches at the slowest stage's pace, plus one microbatch's work on each other
    stage while the pipeline fills and drains (Narayanan et al.'s (pp - 1) microbatches when equal)."""
    from paratrain.cost import step_time

    work_ms = [1.0, 1.0, 1.0, 3.0]  # forward; backward twice it

    def stage_costs(cfg, rows, bounds, cluster, tp):
        return [step_time.StageCost(1, f * 1e-3, 2 * f * 1e-3, 0.0) for f in work_ms], 1

    monkeypatch.setattr(step_time, "stage_costs", stage_costs)
    sets = [*GPT2, "parallel.strategy='pp'", "parallel.pp=4", "parallel.microbatches=8", "parallel.balance='params'"]
    parts = predicted(tmp_path, 'nodes = 1\ndevices_per_node = 4\ndevice = "h100-sxm"\n', sets)["step_breakdown"]
    p2p = parts["p2p_s"] / 8
    assert parts["compute_s"] == pytest.approx(8 * 9e-3)
    assert parts["bubble_s"] == pytest.approx(3 * 3e-3, abs=4 * p2p + 1e-12)


def test_flops_are_megatrons_count():
    """The op trace's FLOPs of a gpt's forward + backward equal Megatron-LM's closed form
    72Bslh^2(1 + s/6h + V/12lh) (Narayanan et al., SC21, eq. 3 without recompute), exactly."""
    from paratrain.cost.cluster import PRESETS, Cluster
    from paratrain.cost.step_time import stage_costs

    L, h, heads, s, V, B = 2, 256, 4, 512, 5120, 4
    cfg = load(
        None,
        [
            f"model.n_layer={L}",
            f"model.d_model={h}",
            f"model.n_head={heads}",
            f"model.block_size={s}",
            f"data.block_size={s}",
            f"model.vocab_size={V}",
            f"data.batch_size={B}",
        ],
    )
    stages, tokens = stage_costs(cfg, B, None, Cluster(1, 1, "a100-80gb", PRESETS["a100-80gb"]), 1)
    assert tokens == s
    assert 3 * sum(stage.forward_flops for stage in stages) == 72 * B * s * L * h * h * (
        1 + s / (6 * h) + V / (12 * L * h)
    )


def test_materialized_attention_is_the_same_function():
    """gpt's model.attention = "materialized" (the scores as tensors, as Megatron-LM's 2021 runs
    computed them) gives sdpa's output."""
    from paratrain.models.gpt import gpt

    torch.manual_seed(0)
    fused = gpt(50, n_layer=1, d_model=32, block_size=16)
    torch.manual_seed(0)
    materialized = gpt(50, n_layer=1, d_model=32, block_size=16, attention="materialized")
    x = torch.randint(0, 50, (3, 16))
    torch.testing.assert_close(materialized(x), fused(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("row", [0, 4])
def test_megatron_table_1_within_10_percent(row):
    """Narayanan et al. (SC21) Table 1: 1.7B on 32 A100s (dp only) and 39.1B on 512 (t 8 x p 2 x d
    32): the predicted TFLOP/s per GPU, by Megatron's count, within 10 % of the published ones.
    `paratrain bench plan-megatron` runs every row (benchmarks/results/plan-megatron-*.md)."""
    from paratrain.bench.plan_megatron import TABLE_1, predict_row

    result = predict_row(TABLE_1[row])
    assert abs(result["error"]) <= 0.10, result


def test_search_ranks_the_layouts_that_fit(tmp_path, capsys):
    """Four A100s: the layouts come fastest first, each with the contract's keys, and the first
    one's predicted step is what `plan` predicts for that layout alone."""
    from paratrain.cli import main

    sets = ["data.batch_size=16", "data.max_chars=100000"]
    cluster = 'nodes = 1\ndevices_per_node = 4\ndevice = "a100-80gb"\n'
    out = tmp_path / "search.json"
    args = ["plan", "--cluster", str(write_cluster(tmp_path, cluster)), "--search", "--top", "50", "--json", str(out)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    layouts = json.loads(out.read_text())["layouts"]
    steps = [x["predicted"]["step_s"] for x in layouts]
    assert len(layouts) > 10 and steps == sorted(steps)
    assert {x["parallel"]["strategy"] for x in layouts} >= {"dp", "zero3", "hybrid"}
    assert all(set(x) >= {"parallel", "train", "predicted"} for x in layouts)
    assert "why:" in capsys.readouterr().out
    best = layouts[0]
    alone = predicted(
        tmp_path,
        cluster,
        [
            *sets,
            *(f"parallel.{k}={v!r}" for k, v in best["parallel"].items()),
            f"train.recompute='{best['train']['recompute']}'",
        ],
    )
    assert alone["predicted"]["step_s"] == pytest.approx(best["predicted"]["step_s"])


def full_plan_search(config, sets: list[str], cluster) -> list[tuple[float, dict]]:
    """The exhaustive slow path: every candidate planned in full, every rank, as `plan` plans it;
    of a layout, the recompute modes that fit are each slower than the one before (none, selective,
    full: each runs more), and the first of them is the layout's entry."""
    from paratrain.errors import ConfigError
    from paratrain.plan.planner import make_plan
    from paratrain.plan.search import candidates
    from paratrain.preflight import preflight

    fitting: dict[tuple, list] = {}  # layout -> its recompute modes that fit, in the candidates' order
    for layout in candidates(load(config, sets).data.batch_size, cluster.world, cluster.devices_per_node):
        try:
            cfg = load(config, [*sets, *layout])
            preflight(cfg, cluster.world)
        except ConfigError:
            continue
        with torch.device("meta"):
            model = build_model(cfg, build_dataset(cfg, "train"))
        plan = make_plan(cfg, model, cluster.devices_per_node, cluster.nodes, "cuda", cluster)
        if plan["capacity"]["fits"]:
            key = tuple(s for s in layout if not s.startswith("train.recompute="))
            fitting.setdefault(key, []).append((plan["predicted"]["step_s"], cfg))
    assert sum(len(modes) for modes in fitting.values()) > 10  # candidates enough to hold the search to
    for modes in fitting.values():
        steps = [step for step, _ in modes]
        assert steps == sorted(steps), [(cfg.train.recompute, step) for step, cfg in modes]
    return sorted((modes[0] for modes in fitting.values()), key=lambda x: x[0])


def test_search_on_replica_plans_equals_the_full_plans(tmp_path, monkeypatch):
    """Two A100s of 21 MiB (dp and some pipelines do not fit at their peak), an mlp: the search's replica plans
    with memoised traces give every fitting layout the step the full plan gives it, in the same order."""
    import functools

    from paratrain.cost.cluster import parse_cluster
    from paratrain.data import datasets
    from paratrain.plan.search import search

    # the slow path reads digits.csv.gz for every dataset it builds: once is enough here
    monkeypatch.setattr(datasets, "_digits_arrays", functools.cache(datasets._digits_arrays))

    config = write_config(tmp_path / "mlp.toml", DIGITS.format(model="mlp"))
    sets = ["model.hidden=1024", "data.batch_size=32"]
    cluster = parse_cluster({"nodes": 1, "devices_per_node": 2, "device": "a100-80gb", "memory_gib": 0.0205})
    slow = full_plan_search(config, sets, cluster)
    fast = search(config, sets, cluster, top=1000)
    assert 5 < len(fast) == len(slow) and "dp" not in {x["parallel"]["strategy"] for x in fast}
    for (step, _), layout in zip(slow, fast):
        assert layout["predicted"]["step_s"] == pytest.approx(step, rel=1e-12)
    best = slow[0][1].parallel
    assert (best.strategy, best.tp, best.pp) == tuple(fast[0]["parallel"][k] for k in ("strategy", "tp", "pp"))


def test_search_of_4096_devices_finishes():
    """512 nodes of 8 H100s, the default gpt, 4,096 sequences a step: hundreds of candidates, planned
    and timed well inside a minute (the figure on a quiet machine is in docs/planning.md)."""
    import time

    from paratrain.cost.cluster import parse_cluster
    from paratrain.plan.search import search

    cluster = parse_cluster({"nodes": 512, "devices_per_node": 8, "device": "h100-sxm"})
    start = time.perf_counter()
    sets = ["data.batch_size=4096", "data.max_chars=400000", "data.tokenizer='chars'"]  # 6,000 samples
    layouts = search(None, sets, cluster, top=3)
    assert time.perf_counter() - start < 120
    assert len(layouts) == 3 and layouts[0]["predicted"]["step_s"] <= layouts[-1]["predicted"]["step_s"]


def test_calibrate_writes_a_cluster_file_the_plan_reads_back(tmp_path, monkeypatch, capsys):
    """Two gloo processes measure this machine into a [cluster] file; the plan uses it at once and
    `--cluster` reads back the same device; with --cluster besides, exit 2. The calibration is kept
    for this host and its process count in the user's cache: a later plan without --cluster at that
    count uses it and says so, one at another count (or before) the cpu preset, saying that."""
    from dataclasses import asdict

    from paratrain.cli import main
    from paratrain.cost.cluster import calibration_file, load_cluster
    from paratrain.plan import calibrate

    # one launch: what is written and read back does not depend on how many medians are taken
    monkeypatch.setattr(calibrate, "CALIBRATION_ROUNDS", 1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "plan.json"
    assert main(["plan", "--nproc", "2", "--json", str(out)]) == 0
    assert "step times from the cpu preset" in capsys.readouterr().err
    path = tmp_path / "here.toml"
    threads = os.environ.get("OMP_NUM_THREADS")
    assert main(["plan", "--calibrate", str(path), "--json", str(tmp_path / "a.json")]) == 0
    assert os.environ.get("OMP_NUM_THREADS") == threads  # the workers' thread count is not left behind
    written = path.read_text()
    # each rank computes on its share of the cores, as a run's do (the forked workers set it)
    assert f"2 ranks at work ({max(1, (os.cpu_count() or 1) // 2)} compute thread(s) each)" in written, written
    keys = ("peak_tflops", "hbm_GBps", "op_overhead_us", "intra_node_GBps", "intra_latency_us", "p2p_latency_us")
    measured = ("stream_latency_us", "step_overhead_us", "cpu_contention", "sync_skew")
    for key in (*keys, *measured, "time_layers"):
        assert f"\n{key} = " in written
    assert (tmp_path / "here.times.json").exists()  # the layers it timed, for later plans
    used = json.loads((tmp_path / "a.json").read_text())["cluster"]
    again = load_cluster(str(path))
    assert used == {"nodes": 1, "devices_per_node": 2, "device": "cpu", **asdict(again.device)}
    kept = calibration_file(2)
    assert kept.parent == tmp_path / "cache" / "paratrain" / "calibration" and kept.read_text() == written
    capsys.readouterr()
    assert main(["plan", "--nproc", "2", "--json", str(out)]) == 0
    assert f"step times from this machine's calibration for 2 processes ({kept})" in capsys.readouterr().err
    assert json.loads(out.read_text())["cluster"] == used
    assert main(["plan", "--nproc", "1", "--json", str(out)]) == 0
    assert "step times from the cpu preset" in capsys.readouterr().err
    assert main(["plan", "--calibrate", str(path), "--cluster", str(path)]) == 2
    assert "paratrain: error: --calibrate:" in capsys.readouterr().err


def test_this_machines_compute_is_its_layers_timed_here(tmp_path, monkeypatch):
    """On a calibrated cpu cluster (time_layers) a stage's compute is the sum of its layers' forward
    and backward timed on this machine (layer_times: one entry per pipeline layer) at the thread
    count a worker gets, stretched by the measured cpu_contention; a model too large to run here
    is modelled."""
    from paratrain.cost import layer_times, step_time
    from paratrain.cost.cluster import parse_cluster

    cfg = load(str(write_config(tmp_path / "gpt.toml", GPT)), [])
    measured = layer_times.layer_times(cfg, 4, 1, forward_flops=0)
    layers = len(list(build_model(cfg, build_dataset(cfg, "train")).pipeline_layers()))
    assert len(measured) == layers and all(t.forward_s > 0 and t.backward_s > 0 for t in measured)
    assert layer_times.layer_times(cfg, 4, 1, forward_flops=int(layer_times.MAX_FLOPS) + 1) is None
    whole, flat = layer_times.optimizer_step_s(cfg, 1)
    assert whole > 0 and flat > 0

    fixed = [layer_times.LayerTime(0.001 * (i + 1), 0.002 * (i + 1)) for i in range(layers)]
    threads_given = []

    def timed(cfg, rows, threads, forward_flops, store=None):
        threads_given.append(threads)
        return fixed

    monkeypatch.setattr(layer_times, "layer_times", timed)
    monkeypatch.setattr(layer_times, "optimizer_step_s", lambda cfg, threads, store=None: (0.004, 0.001))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cpu = 'nodes = 1\ndevices_per_node = {}\ndevice = "cpu"\ntime_layers = true\n'
    one = predicted(tmp_path, cpu.format(1), ["data.batch_size=8"])["step_breakdown"]
    assert one["compute_s"] == pytest.approx(sum(t.forward_s + t.backward_s for t in fixed))
    assert threads_given == [2]  # one process on two cores: both as threads
    assert one["optimizer_s"] == pytest.approx(0.004)  # the whole model's step, timed
    zero1 = predicted(tmp_path, cpu.format(2), ["data.batch_size=8", "parallel.strategy='zero1'"])["step_breakdown"]
    assert zero1["optimizer_s"] == pytest.approx(0.001 / 2, rel=0.01)  # half of one flat tensor's
    sets = ["parallel.strategy='pp'", "parallel.pp=2", "parallel.microbatches=2", "data.batch_size=8"]
    four = {"nodes": 1, "devices_per_node": 4, "device": "cpu", "time_layers": True, "cpu_contention": 2.5}
    first, second = step_time.stage_costs(
        load(str(tmp_path / "gpt.toml"), sets), 4, [0, 2, layers], parse_cluster(four), 1
    )[0]
    assert threads_given[-1] == 1  # four processes on two cores: one thread each
    assert first.forward_s == pytest.approx(0.001 + 0.002)
    assert second.backward_s == pytest.approx(sum(t.backward_s for t in fixed[2:]))
    # slowed as measured where all four compute at once; a pipeline's light stage leaves its share
    body = cpu.format(4) + "cpu_contention = 2.5\n"
    dp4 = predicted(tmp_path, body, ["data.batch_size=8"])["step_breakdown"]
    assert dp4["compute_s"] == pytest.approx(2.5 * sum(t.forward_s + t.backward_s for t in fixed))
    pp4 = predicted(tmp_path, body, [*sets, "parallel.pp=4", "parallel.microbatches=4"])["step_breakdown"]
    work = [3 * w for w in (0.001, 0.002, 0.003, 0.004)]  # the four layers, one a stage
    assert pp4["compute_s"] == pytest.approx(4 * max(work) * 2.5 * sum(work) / (4 * max(work)))
    # warming up and cooling down half the stages work on average: at 2.5 x 0.625 / 2 < 1, unslowed
    assert pp4["bubble_s"] == pytest.approx(sum(work) - max(work), rel=0.05)
    # ranks that meet at collectives wait for the last (sync_skew); a pipeline's stages do not meet
    skewed = body + "sync_skew = 0.2\n"
    dp4 = predicted(tmp_path, skewed, ["data.batch_size=8"])["step_breakdown"]
    assert dp4["compute_s"] == pytest.approx(2.5 * 1.2 * sum(t.forward_s + t.backward_s for t in fixed))
    pp4 = predicted(tmp_path, skewed, [*sets, "parallel.pp=4", "parallel.microbatches=4"])["step_breakdown"]
    assert pp4["compute_s"] == pytest.approx(2.5 * sum(work))
    # the search's replica plans are timed alike
    from paratrain.plan.search import search

    layouts = search(str(tmp_path / "gpt.toml"), ["data.batch_size=8"], parse_cluster(four), top=3)
    assert len(layouts) == 3 and threads_given[-1] == 1
    threads_given.clear()
    # without time_layers (a cluster file written by hand, or no --cluster) nothing is timed
    predicted(tmp_path, cpu.format(2).replace("time_layers = true\n", ""), ["data.batch_size=8"])
    assert not threads_given


def test_layer_times_are_kept_for_later_plans(tmp_path, monkeypatch, capsys):
    """A plan on a calibrated cluster keeps what it timed in a JSON file beside the cluster file
    (cluster.times.json); a later plan reads it instead of timing again; another machine's file is
    timed afresh; a file that is not one exits 2 naming it."""
    from paratrain.cli import main
    from paratrain.cost import layer_times

    monkeypatch.setattr(layer_times, "_measured", {})
    body = 'nodes = 1\ndevices_per_node = 2\ndevice = "cpu"\ntime_layers = true\n'
    first = predicted(tmp_path, body, ["data.batch_size=8"])["predicted"]["step_s"]
    store = tmp_path / "cluster.times.json"
    kept = json.loads(store.read_text())
    assert sorted(e["of"].split()[0] for e in kept["entries"].values()) == [
        "adamw",
        "gpt",
    ]  # the default model: its layers, its optimizer

    def not_again(fn):
        raise AssertionError("timed again")

    monkeypatch.setattr(layer_times, "_measured", {})  # a new planning process
    monkeypatch.setattr(layer_times, "_median_s", not_again)
    assert predicted(tmp_path, body, ["data.batch_size=8"])["predicted"]["step_s"] == pytest.approx(first)

    kept["machine"] = "another machine"
    store.write_text(json.dumps(kept))
    monkeypatch.undo()
    monkeypatch.setattr(layer_times, "_measured", {})
    predicted(tmp_path, body, ["data.batch_size=8"])
    assert json.loads(store.read_text())["machine"] != "another machine"

    fresh = json.loads(store.read_text())  # this machine's, as the plan above wrote it again
    no_entries = {k: v for k, v in fresh.items() if k != "entries"}
    one_number = {**fresh, "entries": {k: {**e, "seconds": [1.0]} for k, e in fresh["entries"].items()}}
    for doc, said in ((no_entries, "not a timings file"), (one_number, "not the timings paratrain wrote")):
        monkeypatch.setattr(layer_times, "_measured", {})
        store.write_text(json.dumps(doc))
        capsys.readouterr()
        assert main(["plan", "--cluster", str(tmp_path / "cluster.toml"), "--set", "data.batch_size=8"]) == 2
        err = capsys.readouterr().err
        assert f"{store}: " in err and said in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_kendall_tau_of_the_bench():
    from paratrain.bench.plan import kendall_tau

    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)


def test_parameter_servers_are_predicted(tmp_path):
    """A sync ps step: compute, then every shard pushed and pulled through its server's link, then
    the servers' optimizer. Six A100s: one server carries the whole model to and from 5 workers, each
    of two servers half of it to and from 4: 2.5 times less on the slowest link."""
    ps = [*GPT2, "parallel.strategy='ps'", "data.batch_size=40"]
    six = 'nodes = 1\ndevices_per_node = 6\ndevice = "a100-80gb"\n'
    one = predicted(tmp_path, six, [*ps, "ps.servers=1"])
    two = predicted(tmp_path, six, [*ps, "ps.servers=2"])
    parts = one["step_breakdown"]
    assert one["predicted"]["step_s"] == pytest.approx(parts["compute_s"] + parts["push_pull_s"] + parts["optimizer_s"])
    assert parts["push_pull_s"] / two["step_breakdown"]["push_pull_s"] == pytest.approx(2.5, rel=0.05)
    assert 0 < one["predicted"]["mfu"]
