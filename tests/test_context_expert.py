"""Long sequences and mixture-of-experts: parallel.cp (ring attention) and parallel.ep (experts
split over ranks) against single-process training of the same gpt on the same data.

World-4 runs are slow on 2 cores, so each composes what it can (cp with dp and zero at once)."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import final_weights, metrics, rel_error, write_config
from reference import train_reference

from paratrain import config as config_mod
from paratrain.checkpoint import latest_valid
from paratrain.cli import main
from paratrain.data import load_batch
from paratrain.data.datasets import corpus
from paratrain.models.gpt import gpt
from paratrain.models.moe import with_auxiliary_losses
from paratrain.run_dir import check_resume

STEPS, BATCH, BLOCK = 12, 8, 16
GPT = f"""
name = "long"
[model]
factory = "gpt"
n_layer = 2
n_head = 2
d_model = 16
block_size = {BLOCK}
[data]
factory = "corpus"
block_size = {BLOCK}
max_chars = 20000
batch_size = {BATCH}
shuffle = false
[train]
steps = {STEPS}
optimizer = "sgd"
lr = 0.1
log_every = {STEPS}
"""


@pytest.fixture(scope="module")
def dense_reference():
    train = corpus("train", block_size=BLOCK, max_chars=20000)
    x, y = load_batch(train, torch.arange(STEPS * BATCH) % len(train))
    torch.manual_seed(0)
    model = gpt(train.vocab_size, n_layer=2, n_head=2, d_model=16, block_size=BLOCK)
    weights = train_reference(model, x, y, steps=STEPS, batch_size=BATCH, lr=0.1)
    val = corpus("val", block_size=BLOCK, max_chars=20000)
    vx, vy = load_batch(val, torch.arange(len(val)))
    with torch.no_grad():
        logits = model(vx)
        val_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), vy.reshape(-1)).item()
    return weights, val_loss


def train(gang, tmp_path, name, world, *sets) -> str:
    """The run's rank 0 output."""
    cfg = write_config(tmp_path / "gpt.toml", GPT)
    return gang(world).train(cfg, tmp_path / name, sets)


# what parallel.verify_plan says on rank 0 once the first step checked one layer of each kind
RING_CHECKED = "parallel.verify_plan: parallel.cp's ring attention in 'blocks.0.attn' (Attention) equals"
DISPATCH_CHECKED = "parallel.verify_plan: parallel.ep's expert dispatch in 'blocks.0.mlp' (MixtureOfExperts) equals"


def check_equal(tmp_path, name, reference) -> None:
    weights, val_loss = reference
    assert rel_error(final_weights(tmp_path / name), weights) <= 1e-4, name
    assert abs(metrics(tmp_path / name)[-1]["val_loss"] - val_loss) <= 1e-4 * val_loss, name


def test_context_parallel_ring_of_two_equals_one_process(tmp_path, gang, dense_reference):
    """cp 2 at world 2: one sequence over both ranks (4 chunks, rank 0 holding the first and the
    last), the ring's keys and values exchanged forward and back; weights and validation loss
    equal one process's."""
    out = train(gang, tmp_path, "cp2", 2, "parallel.cp=2")
    check_equal(tmp_path, "cp2", dense_reference)
    assert out.count(RING_CHECKED) == 1, out  # one layer of the kind, once (parallel.verify_plan)


def test_context_parallel_with_data_parallel_and_zero(tmp_path, gang, dense_reference):
    """World 4: cp 2 x dp 2 under zero2 (gradients reduce-scattered over dp x cp), and cp 4 (a ring
    of four, 8 chunks of 2 tokens) under dp."""
    train(gang, tmp_path, "zero2-cp2", 4, "parallel.strategy='zero2'", "parallel.cp=2")
    check_equal(tmp_path, "zero2-cp2", dense_reference)
    train(gang, tmp_path, "cp4", 4, "parallel.cp=4")
    check_equal(tmp_path, "cp4", dense_reference)


@pytest.mark.parametrize(
    "name, sets, resumed_as",
    [
        # each tp rank's one head around its own ring of 2; the head's vocab-split loss per chunk;
        # its checkpoint (written by cp rank 0) resumed without cp, at world 2
        ("tp2-cp2", ["parallel.strategy='tp'", "parallel.tp=2"], 2),
        # 4 microbatches of each stage's chunks; stage 1 gets stage 0's chunks from its cp twin
        ("pp2-cp2", ["parallel.strategy='pp'", "parallel.pp=2"], None),
    ],
)
def test_context_parallel_under_tensor_and_pipeline_parallelism(
    tmp_path, gang, dense_reference, name, sets, resumed_as
):
    """World 4 on the (pp, dp, cp, tp) mesh: cp 2 x tp 2 and cp 2 x pp 2, the ring over the cp
    group composed with the hybrid engine's shards and stages; gradients averaged over the cp
    ranks, equal to one process (and so is the run resumed at another cp)."""
    out = train(gang, tmp_path, name, 4, *sets, "parallel.cp=2", "checkpoint.every=6")
    check_equal(tmp_path, name, dense_reference)
    # the ring checked on the first step: under tp where every rank runs the same blocks, under pp
    # agreed after the step (rank 0 names its stage's block)
    assert out.count(RING_CHECKED) == 1, out
    if resumed_as:
        cfg = tmp_path / "gpt.toml"
        step6 = str(tmp_path / name / "checkpoints" / "step-6")
        gang(resumed_as).train(cfg, tmp_path / "resumed", sets, resume=step6)
        check_equal(tmp_path, "resumed", dense_reference)


MOE = ["model.n_experts=4", "model.top_k=2", "model.moe_aux_loss=0.05"]


def train_moe_reference(aux: float, optimizer: str = "sgd", lr: float = 0.1, clip: float = 0.0):
    """The gpt with 4 experts a layer, top 2 per token, its load-balancing loss (weight `aux`) in
    the loss (`optimizer` at `lr`, gradients clipped to `clip`): final weights and validation loss."""
    train = corpus("train", block_size=BLOCK, max_chars=20000)
    x, y = load_batch(train, torch.arange(STEPS * BATCH) % len(train))
    torch.manual_seed(0)
    model = gpt(
        train.vocab_size, n_layer=2, n_head=2, d_model=16, block_size=BLOCK, n_experts=4, top_k=2, moe_aux_loss=aux
    )

    def cross_entropy(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    weights = train_reference(
        model,
        x,
        y,
        steps=STEPS,
        batch_size=BATCH,
        lr=lr,
        optimizer=optimizer,
        clip=clip,
        loss_fn=with_auxiliary_losses(cross_entropy, model),
    )
    val = corpus("val", block_size=BLOCK, max_chars=20000)
    vx, vy = load_batch(val, torch.arange(len(val)))
    model.eval()
    with torch.no_grad():
        val_loss = cross_entropy(model(vx), vy).item()
    return weights, val_loss


@pytest.fixture(scope="module")
def moe_reference():
    return train_moe_reference(0.05)


def test_expert_parallel_under_dp_and_zero2(tmp_path, gang, moe_reference):
    """ep 2 at world 2: each rank computes 2 of each layer's 4 experts, tokens sent to them and
    back by all-to-all; under dp and under zero2, equal to one process (router, experts and the
    load-balancing loss's gradient included)."""
    out = train(gang, tmp_path, "dp-ep2", 2, "parallel.ep=2", *MOE)
    check_equal(tmp_path, "dp-ep2", moe_reference)
    assert out.count(DISPATCH_CHECKED) == 1, out  # the dropped experts' weights gathered for it
    out = train(gang, tmp_path, "zero2-ep2", 2, "parallel.strategy='zero2'", "parallel.ep=2", *MOE)
    check_equal(tmp_path, "zero2-ep2", moe_reference)
    assert out.count(DISPATCH_CHECKED) == 1, out  # every expert's weights here


def test_resume_auto_skips_an_expert_parallel_checkpoint_missing_a_rank_file(tmp_path, gang):
    """Each ep rank's file holds its own experts: with one gone the newest checkpoint read as a model
    that does not match (exit 2), and --resume auto was stuck on it. It is skipped, naming why."""
    sets = ["parallel.ep=2", *MOE, "checkpoint.every=6"]
    train(gang, tmp_path, "ep-lost-file", 2, *sets)
    run_dir = tmp_path / "ep-lost-file"
    (run_dir / "checkpoints" / "step-12" / "rank-00001.safetensors").unlink()
    cfg = config_mod.load(tmp_path / "gpt.toml", sets)
    assert check_resume("auto", cfg, run_dir) == 6
    skipped = []
    assert latest_valid(run_dir, log=skipped.append).step == 6
    assert len(skipped) == 1 and "step 12" in skipped[0] and "rank-00001.safetensors: missing" in skipped[0]


def test_expert_parallel_under_bf16_autocast(tmp_path, gang, moe_reference):
    """Under train.precision = "bf16" the experts' outputs are bf16 and the residual stream is not
    (an index_add_ of the two crashed); ep 2 under dp trains as the fp32 reference does, up to
    bf16's rounding (which flips some top-2 choices, so weights are not compared), its dispatch
    verified at bf16's tolerance."""
    out = train(gang, tmp_path, "bf16-ep2", 2, "parallel.ep=2", "train.precision='bf16'", *MOE)
    assert out.count(DISPATCH_CHECKED) == 1, out
    logged = metrics(tmp_path / "bf16-ep2")
    # measured: 3.78558 against 3.78591 (1e-4 apart)
    assert abs(logged[-1]["val_loss"] - moe_reference[1]) <= 5e-3 * moe_reference[1], (logged[-1], moe_reference[1])


@pytest.mark.parametrize(
    "sets, nproc, key",
    [
        (["parallel.cp=3"], 3, "parallel.cp"),  # 6 chunks do not divide 16 tokens
        (["parallel.cp=2"], 3, "parallel.cp"),  # 2 does not divide the world of 3
        (["parallel.strategy='tp'", "parallel.tp=2", "parallel.cp=2"], 2, "parallel.cp"),  # cp x tp > world
        (["parallel.strategy='hybrid'", "parallel.tp=2", "parallel.cp=3"], 6, "parallel.cp"),  # 6 chunks, 16 tokens
        (["parallel.strategy='pp'", "parallel.pp=2", "parallel.cp=2", "parallel.replicas=2"], 8, "parallel.cp"),
        (["parallel.strategy='ps'", "parallel.cp=2"], 2, "parallel.cp"),
        (["parallel.cp=0"], 2, "parallel.cp"),
        (["parallel.ep=2", "model.n_experts=3"], 2, "parallel.ep"),  # 3 experts over 2 ranks
        (["parallel.ep=4", "model.n_experts=4"], 2, "parallel.ep"),  # 4 does not divide dp x cp = 2
        (["parallel.strategy='zero3'", "parallel.ep=2", "model.n_experts=3"], 2, "parallel.ep"),
        # 4 does not divide a replica's 2 ranks
        (["parallel.strategy='zero2'", "parallel.replicas=2", "parallel.ep=4", "model.n_experts=4"], 4, "parallel.ep"),
        (["parallel.ep=2"], 2, "parallel.ep"),  # a dense model: no experts to split
        (["parallel.strategy='tp'", "parallel.tp=2", "model.n_experts=2"], 2, "model.n_experts"),
        (["model.n_experts=2", "model.top_k=3"], 2, "model.top_k"),
    ],
)
def test_bad_context_and_expert_layouts_exit_2(tmp_path, capsys, sets, nproc, key):
    cfg = write_config(tmp_path / "c.toml", GPT)
    args = ["run", str(cfg), "--nproc", str(nproc), "--run-dir", str(tmp_path / "r")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], lines


def test_context_and_expert_parallel_together(tmp_path, gang, moe_reference):
    """World 4: cp 2 x dp 2 with ep 2 (each ep group a ring's two ranks, holding 2 experts each):
    the ring's chunks routed to their experts and back, each sequence's load-balancing loss summed
    over its ring; equal to one process."""
    train(gang, tmp_path, "cp2-ep2", 4, "parallel.cp=2", "parallel.ep=2", *MOE)
    check_equal(tmp_path, "cp2-ep2", moe_reference)


def test_plan_divides_activations_by_cp_and_plans_experts(tmp_path):
    """`paratrain plan`: at the same dp degree, cp 2 holds half of each sequence, so half the
    activations of cp 1; a model with experts is planned (its routing assumed in balance)."""
    cfg = write_config(tmp_path / "gpt.toml", GPT)
    activations = {}
    for cp in (1, 2):
        out = tmp_path / f"plan-{cp}.json"
        assert main(["plan", str(cfg), "--nproc", str(2 * cp), "--set", f"parallel.cp={cp}", "--json", str(out)]) == 0
        plan = json.loads(out.read_text())
        assert plan["mesh"]["dp"] == 2
        activations[cp] = plan["ranks"][0]["activation_bytes"]
    assert 0.4 < activations[2] / activations[1] < 0.6, activations
    moe = ["--set", "model.n_experts=4", "--set", "parallel.ep=2"]
    assert main(["plan", str(cfg), "--nproc", "2", *moe, "--json", str(tmp_path / "moe.json")]) == 0


def broken_job(rt, broken: str, **job) -> tuple[int, str]:
    """A gang member's run (gang.train_job) with the ring's chunk order or the dispatch broken on
    purpose: (2, the ConfigError's line) where the run stops as a launched worker exits 2, else (0, "")."""
    from paratrain.errors import ConfigError
    from paratrain.parallel.context import attention
    from paratrain.parallel.expert import experts
    from paratrain.testing.gang import train_job

    block, all_to_all = attention._block, experts.all_to_all
    if broken == "ring":  # each ring step computes the block of the other rank's chunks
        attention._block = lambda step, src, rank, half: block(step, rank, src, half)
    elif broken == "dispatch":  # every rank's rows come back in reverse: each row gets another row's expert output
        experts.all_to_all = lambda rows, send, receive, group: all_to_all(rows, send, receive, group).flip(0)
    try:
        train_job(rt, **job)
    except ConfigError as exc:
        return 2, str(exc)
    finally:
        attention._block, experts.all_to_all = block, all_to_all
    return 0, ""


RING_BROKEN = "parallel.cp: the ring does not compute 'blocks.0.attn' (Attention)"


@pytest.mark.parametrize(
    "broken, sets, named, world",
    [
        ("ring", ["parallel.cp=2"], RING_BROKEN, 2),
        # cp 2 x pp 2: each stage checks its own block, the world agreeing after the step
        ("ring", ["parallel.cp=2", "parallel.strategy='pp'", "parallel.pp=2"], RING_BROKEN, 4),
        ("dispatch", ["parallel.ep=2", *MOE], "parallel.ep: the expert dispatch does not compute 'blocks.0.mlp'", 2),
        ("ring", ["parallel.cp=2", "parallel.verify_plan=false"], None, 2),  # nothing checks: trains, wrong
    ],
)
def test_verify_plan_catches_a_broken_ring_or_dispatch(tmp_path, gang, broken, sets, named, world):
    """parallel.verify_plan: the first step runs one attention with the ring against attention
    over the whole sequence (the step's q, k, v gathered), one MoE layer's dispatch against its
    experts all run here; with the ring's chunks or the dispatch's rows out of place, every rank
    stops with the same line naming the module and the key (exit 2 from a launched worker)."""
    cfg = write_config(tmp_path / "gpt.toml", GPT)
    job = dict(config=str(cfg), run_dir=str(tmp_path / "r"), overrides=["train.steps=1", *sets], resume="none", env={})
    results = gang(world).run("test_context_expert:broken_job", broken=broken, **job)
    if named is None:
        assert results == [(0, "")] * 2 and "parallel.verify_plan:" not in gang(2).outputs[0], gang(2).outputs
        return
    assert len(set(results)) == 1 and results[0][0] == 2, results
    assert results[0][1].startswith(named) and "parallel.verify_plan = false skips" in results[0][1], results
