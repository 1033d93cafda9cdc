"""`paratrain plan` for context and expert parallelism (cost/context_expert.py): the ring's and the
all-to-alls' time in the step, tokens counted whole under cp, and `--search` proposing cp and ep."""

import json

import pytest
from helpers import write_config
from test_context_expert import GPT

from paratrain.cli import main
from paratrain.cost.cluster import parse_cluster
from paratrain.plan.search import search

H100S = {"nodes": 1, "devices_per_node": 4, "device": "h100-sxm"}
LONG = 512  # tokens in a sequence


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan-cp-ep") / "gpt.toml"
    path.write_text(GPT.replace("block_size = 16", f"block_size = {LONG}"))
    return path


def plan_of(config, world: int, *sets: str) -> dict:
    import torch

    from paratrain.config import load
    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.plan.planner import make_plan

    cfg = load(str(config), ["model.d_model=64", *sets])
    with torch.device("meta"):
        model = build_model(cfg, build_dataset(cfg, "train"))
    return make_plan(cfg, model, world, 1, "cuda", parse_cluster({**H100S, "devices_per_node": world}))


def test_plan_times_the_ring_and_the_all_to_all(config):
    """cp 2: the ring's exchanges are in the step, and a sample counts all its tokens though a rank
    runs half of them; ep 2: the tokens' all-to-alls are; neither without its degree."""
    dense = plan_of(config, 2, "data.batch_size=2")
    ring = plan_of(config, 4, "data.batch_size=2", "parallel.cp=2")
    assert "cp_comm_s" not in dense["step_breakdown"] and ring["step_breakdown"]["cp_comm_s"] > 0
    for plan in (dense, ring):
        predicted = plan["predicted"]
        assert predicted["tokens_per_s"] == pytest.approx(predicted["samples_per_s"] * LONG)
    moe = ["data.batch_size=2", "model.n_experts=4"]
    local, split = plan_of(config, 2, *moe), plan_of(config, 2, *moe, "parallel.ep=2")
    assert "ep_comm_s" not in local["step_breakdown"] and split["step_breakdown"]["ep_comm_s"] > 0
    assert split["predicted"]["step_s"] > local["predicted"]["step_s"]


def test_plan_of_context_parallel_under_tensor_and_pipeline_parallelism(tmp_path, capsys):
    """`paratrain plan` of cp 2 x tp 2: the mesh line places cp in the global rank and each rank's
    ring position, and the step time has the ring's exchanges. At the same dp degree, cp 2 x pp 2
    holds half of each sequence's activations of pp 2 alone; tp's peak step memory over the model
    state halves likewise."""
    cfg = write_config(tmp_path / "gpt.toml", GPT)

    def plan(nproc: int, *sets: str) -> dict:
        out = tmp_path / f"plan-{len(list(tmp_path.iterdir()))}.json"
        args = ["plan", str(cfg), "--nproc", str(nproc), "--json", str(out)]
        assert main([*args, *(a for s in sets for a in ("--set", s))]) == 0
        return json.loads(out.read_text())

    tp = ["parallel.strategy='tp'", "parallel.tp=2"]
    assert main(["plan", str(cfg), "--nproc", "4", *(a for s in [*tp, "parallel.cp=2"] for a in ("--set", s))]) == 0
    text = capsys.readouterr().out
    assert "mesh: dp 1 x cp 2 x tp 2 x pp 1 (global rank = ((pp * 1 + dp) * 2 + cp) * 2 + tp)" in text, text
    split, whole = plan(4, *tp, "parallel.cp=2"), plan(2, *tp)
    assert split["mesh"]["cp"] == 2 and [r["cp"] for r in split["ranks"]] == [0, 0, 1, 1]
    assert split["step_breakdown"]["cp_comm_s"] > 0
    transient = [p["ranks"][0]["peak_bytes"] - p["ranks"][0]["model_state_bytes"] for p in (split, whole)]
    assert 0.4 < transient[0] / transient[1] < 0.6, transient
    pp = ["parallel.strategy='pp'", "parallel.pp=2"]
    split, whole = plan(4, *pp, "parallel.cp=2"), plan(2, *pp)
    activations = [p["ranks"][0]["activation_bytes"] for p in (split, whole)]
    assert 0.4 < activations[0] / activations[1] < 0.6, activations


def test_search_proposes_context_and_expert_parallelism(config):
    """One long sequence on 4 devices: data parallelism cannot split the batch, 2 heads do not split
    over tp 4 and one sample makes no microbatches for pp, so every layout that fits splits the
    sequence over the 4 devices: cp 4, or cp 2 under tp 2. With experts the search tries ep too,
    each rank of dp planned with 1/E of the experts."""
    cluster = parse_cluster(H100S)
    layouts = search(str(config), ["data.batch_size=1", "model.d_model=64", "model.n_layer=4"], cluster, 50)
    splits = {(x["parallel"]["cp"], x["parallel"]["tp"]) for x in layouts}
    assert splits == {(4, 1), (2, 2)}, [x["parallel"] for x in layouts]
    moe = ["data.batch_size=4", "model.d_model=64", "model.n_experts=4"]
    found = search(str(config), moe, cluster, 200)
    tried = {(x["parallel"]["cp"], x["parallel"]["ep"]) for x in found}
    assert {(1, 1), (1, 2), (1, 4), (2, 2), (4, 4)} <= tried, tried
    # the search's one-replica plans keep 1/E of the experts under dp, as the full plan does
    peak = {
        x["parallel"]["ep"]: x["predicted"]["peak_memory_gib"]
        for x in found
        if x["parallel"]["strategy"] == "dp" and x["parallel"]["cp"] == 1 and x["train"]["recompute"] == "none"
    }
    assert peak[4] < peak[2] < peak[1], peak


def test_search_proposes_context_parallelism_under_tensor_and_pipeline_parallelism(tmp_path):
    """Two sequences of 4,096 tokens on 8 H100s, 2 heads: tp is at most 2, dp at most 2, and pp
    needs 2 samples for its 2 microbatches, so no layout keeps a whole sequence on a device. The
    search places cp beside tp within the node (tp 2 x cp 2, tp 2 x cp 4) and under pp (pp 2 x cp 4,
    pp 2 x tp 2 x cp 2), one of them among the fastest three; each passes `run`'s checks and is
    predicted as `paratrain plan` predicts it alone."""
    import time

    import torch

    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.plan.planner import make_plan
    from paratrain.preflight import load, preflight

    path = tmp_path / "long.toml"
    path.write_text(GPT.replace("block_size = 16", "block_size = 4096"))
    sets = ["data.batch_size=2", "data.max_chars=40000", "model.d_model=2048", "model.n_layer=4"]
    cluster = parse_cluster({**H100S, "devices_per_node": 8})
    start = time.perf_counter()
    layouts = search(str(path), sets, cluster, 50)
    assert time.perf_counter() - start < 60
    grids = [(x["parallel"]["tp"], x["parallel"]["pp"], x["parallel"]["cp"]) for x in layouts]
    assert all(cp > 1 for _, _, cp in grids), grids
    assert {(2, 1, 2), (2, 1, 4), (1, 2, 4), (2, 2, 2)} <= set(grids), grids
    assert any(tp > 1 for tp, _, _ in grids[:3]), grids
    for x in layouts:
        p = x["parallel"]
        if p["tp"] == p["pp"] == 1:
            continue
        keys = ["strategy", "tp", "pp", "cp", *(["microbatches", "schedule"] if p["pp"] > 1 else [])]
        cfg = load(
            str(path),
            [*sets, *(f"parallel.{k}={p[k]!r}" for k in keys), f"train.recompute={x['train']['recompute']!r}"],
        )
        preflight(cfg, cluster.world)
        with torch.device("meta"):
            model = build_model(cfg, build_dataset(cfg, "train"))
        alone = make_plan(cfg, model, cluster.devices_per_node, cluster.nodes, "cuda", cluster)["predicted"]
        assert x["predicted"]["step_s"] == pytest.approx(alone["step_s"], rel=1e-9), p


def test_search_drops_context_parallelism_the_sequence_cannot_take(tmp_path):
    """Sequences of 24 tokens on 8 devices: 2 x cp 8 = 16 chunks do not divide them, so `run`
    refuses cp 8 and the search, checking each layout against the model and data it built once
    as `run` checks them, proposes cp 2 and 4 (and none) alone."""
    path = tmp_path / "short.toml"
    path.write_text(GPT.replace("block_size = 16", "block_size = 24"))
    cluster = parse_cluster({**H100S, "devices_per_node": 8})
    layouts = search(str(path), ["data.batch_size=8", "model.d_model=64"], cluster, 500)
    assert {x["parallel"]["cp"] for x in layouts} == {1, 2, 4}


def test_plan_divides_expert_weights_by_ep(config):
    """dp with ep 2 keeps half the experts on each rank: its parameter, gradient and (adamw)
    optimizer bytes lose half the experts' bytes; the experts average over no rank at world 2."""
    import torch

    from paratrain.models.gpt import gpt

    moe = ["data.batch_size=2", "model.n_experts=4", "train.optimizer='adamw'"]
    whole, split = plan_of(config, 2, *moe)["ranks"][0], plan_of(config, 2, *moe, "parallel.ep=2")["ranks"][0]
    with torch.device("meta"):
        model = gpt(96, n_layer=2, n_head=2, d_model=64, block_size=LONG, n_experts=4)
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    assert whole["param_bytes"] - split["param_bytes"] == experts // 2
    assert whole["grad_bytes"] - split["grad_bytes"] == experts // 2
    assert whole["optimizer_bytes"] - split["optimizer_bytes"] == experts  # two moments
    assert whole["comm"]["all_reduce"]["payload"] - split["comm"]["all_reduce"]["payload"] == experts


def test_plan_divides_a_mixtral_s_expert_stacks_by_ep(tmp_path):
    """A Hugging Face experts module's stacks: dp with ep 2 keeps half of each on a rank, and the
    step counts its tokens' all-to-alls."""
    pytest.importorskip("transformers")
    import torch
    from test_hf_expert_parallel import MIXTRAL
    from test_hf_models import built

    from paratrain.config import load
    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.plan.planner import make_plan

    path = tmp_path / "mixtral.toml"
    path.write_text(MIXTRAL)

    def plan_with(*sets: str) -> dict:
        cfg = load(str(path), list(sets))
        with torch.device("meta"):
            model = build_model(cfg, build_dataset(cfg, "train"))
        return make_plan(cfg, model, 2, 1, "cuda", parse_cluster({**H100S, "devices_per_node": 2}))

    dense, experts_split = plan_with(), plan_with("parallel.ep=2")
    whole, split = dense["ranks"][0], experts_split["ranks"][0]
    # its routed tokens' all-to-alls are timed too
    assert "ep_comm_s" not in dense["step_breakdown"] and experts_split["step_breakdown"]["ep_comm_s"] > 0
    model = built(MIXTRAL)
    stacks = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    assert stacks and whole["param_bytes"] - split["param_bytes"] == stacks // 2


def test_search_proposes_context_parallelism_for_a_hugging_face_decoder(tmp_path):
    """A transformers decoder takes the ring from outside (parallel/context/hf.py), with no hook of
    its own for the search to find: it is searched with cp as the gpt is, and a BERT (its attention
    not causal: cp refuses it) is not."""
    from test_hf_models import BERT, LLAMA

    cluster = parse_cluster({**H100S, "devices_per_node": 4})
    for text, cps in ((LLAMA, {1, 2, 4}), (BERT, {1})):
        path = tmp_path / "hf.toml"
        path.write_text(text)
        layouts = search(str(path), ["data.batch_size=4"], cluster, 500)
        assert {x["parallel"]["cp"] for x in layouts} == cps, text
