"""parallel.ep on Hugging Face MoE models as users bring them (`factory = "hf"`, no user code):
paratrain finds their experts modules, routes each rank's tokens to the ranks computing their
experts and back, and the result equals single-process training of the same model."""

import pytest
from helpers import final_weights, max_rel_error, write_config
from test_hf_models import LLAMA, built, job, next_token_loss, own_loss, train_alone

pytest.importorskip("transformers")

# top-2 of 4 experts a layer, the chosen weights renormalized (Mixtral's router); its auxiliary
# loss off (output_router_logits's default): test_router_aux_loss_is_untouched_by_ep turns it on
MIXTRAL = job(
    'config = { model_type = "mixtral", vocab_size = 64, hidden_size = 16, intermediate_size = 32, '
    "num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, num_local_experts = 4, "
    "num_experts_per_tok = 2, max_position_embeddings = 64 }"
)
# another family of the same experts interface: a shared expert beside the routed ones, top-k
# weights not renormalized (norm_topk_prob's default); its experts run by transformers' eager
# loop (Mixtral's by the default, grouped_mm)
QWEN2_MOE = job(
    'config = { model_type = "qwen2_moe", vocab_size = 64, hidden_size = 16, intermediate_size = 32, '
    "moe_intermediate_size = 16, shared_expert_intermediate_size = 16, num_hidden_layers = 2, "
    "num_attention_heads = 4, num_key_value_heads = 2, num_experts = 4, num_experts_per_tok = 2, "
    "max_position_embeddings = 64, experts_implementation = 'eager' }"
)
EP2 = ["parallel.ep=2"]


@pytest.mark.parametrize(
    "name, world, sets",
    [
        ("MIXTRAL", 2, EP2),  # dp 2: each rank computes 2 of each layer's 4 experts
        ("QWEN2_MOE", 2, [*EP2, "parallel.strategy='zero2'"]),
        ("MIXTRAL", 2, [*EP2, "parallel.strategy='zero1'"]),
        ("MIXTRAL", 2, [*EP2, "parallel.strategy='zero3'"]),
        ("MIXTRAL", 4, [*EP2, "parallel.strategy='zero3'"]),  # each slice sharded over the 2 ranks keeping it
    ],
    ids=["mixtral-dp", "qwen2-moe-zero2", "mixtral-zero1", "mixtral-zero3", "mixtral-zero3-w4"],
)
def test_hf_moe_under_expert_parallel_equals_single_process(tmp_path, gang, name, world, sets):
    """ep 2; each rank keeps its slice of every experts stack (zero1-3: ZeRO-sharded over the ranks
    keeping the same slice); final/ holds the dense model's keys. The first step checked the
    dispatch of one experts module against its experts all run on one rank (parallel.verify_plan;
    the stacks' slices gathered for it)."""
    text = globals()[name]
    reference = train_alone(built(text), "pair", next_token_loss)
    cfg = write_config(tmp_path / "c.toml", text)
    out = gang(world).train(cfg, tmp_path / "run", sets)
    assert out.count("parallel.ep's expert dispatch in 'model.layers.0.mlp.experts'") == 1, out
    weights = final_weights(tmp_path / "run")
    assert weights.keys() == reference.keys()
    assert max_rel_error(weights, reference) <= 1e-4


def test_router_aux_loss_is_untouched_by_ep(tmp_path, gang):
    """Mixtral's own loss with its load-balancing loss (output_router_logits): a statistic of the
    batch each data rank holds, so data parallelism itself changes it; ep 2 keeps the router on the
    rank's own tokens, so it trains exactly as dp 2 does without ep."""
    text = MIXTRAL.replace("num_experts_per_tok = 2,", "num_experts_per_tok = 2, output_router_logits = true,")
    cfg = write_config(tmp_path / "c.toml", text)
    sets = ["data.layout='labelled'", "train.loss='model'", "model.config.router_aux_loss_coef=0.1"]
    gang(2).train(cfg, tmp_path / "ep2", [*sets, *EP2])
    gang(2).train(cfg, tmp_path / "dp2", sets)
    with_ep, without = final_weights(tmp_path / "ep2"), final_weights(tmp_path / "dp2")
    assert max_rel_error(with_ep, without) <= 1e-4
    # and the auxiliary loss did train the routers: one process without it differs
    plain = train_alone(built(MIXTRAL), "labelled", own_loss)
    assert max_rel_error(without, plain) > 1e-3


@pytest.mark.parametrize(
    "text, sets",
    [
        (MIXTRAL, ["parallel.ep=2", "model.config.num_local_experts=3"]),  # 3 experts over 2 ranks
        (LLAMA, ["parallel.ep=2"]),  # a dense model: no experts to split
    ],
)
def test_bad_hf_expert_layouts_exit_2_naming_parallel_ep(tmp_path, capsys, text, sets):
    from paratrain.cli import main

    cfg = write_config(tmp_path / "c.toml", text)
    args = [a for s in sets for a in ("--set", s)]
    code = main(["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "parallel.ep" in lines[0], lines


def test_mixtral_ranks_keep_their_expert_slices_and_resume_at_ep_1(tmp_path, gang):
    """ep 2 under dp: each rank keeps half of each experts stack (its weights and optimizer state
    half of ep 1's); a checkpoint written at ep 2 (the stacks whole on rank 0) resumes alone at
    ep 1, equal to the run that went on at ep 2."""
    cfg = write_config(tmp_path / "c.toml", MIXTRAL)
    adamw = ["train.optimizer='adamw'", "train.lr=0.003"]
    whole = gang(2).run("test_expert_weights:expert_bytes", config=str(cfg), overrides=adamw)
    split = gang(2).run("test_expert_weights:expert_bytes", config=str(cfg), overrides=[*adamw, *EP2])
    for one, half in zip(whole, split):
        assert half["experts"] * 2 == one["experts"] > 0 and half["dense"] == one["dense"]
        assert one["optimizer"] - half["optimizer"] == 2 * half["experts"]
    every = [*adamw, "checkpoint.every=4"]
    gang(2).train(cfg, tmp_path / "ep2", [*every, *EP2])
    gang(1).train(cfg, tmp_path / "ep1", every, resume=str(tmp_path / "ep2" / "checkpoints" / "step-4"))
    went_on, resumed = final_weights(tmp_path / "ep2"), final_weights(tmp_path / "ep1")
    assert went_on.keys() == resumed.keys() == built(MIXTRAL).state_dict().keys()
    assert max_rel_error(went_on, resumed) <= 1e-4


@pytest.mark.parametrize(
    "strategy, world, sets",
    [("zero1", 2, []), ("zero2", 2, []), ("zero3", 2, []), ("zero1", 4, ["parallel.replicas=2"])],
    ids=["zero1", "zero2", "zero3", "zero1-w4-replicas"],
)
def test_zero_holds_and_plans_a_rank_s_expert_slices(tmp_path, gang, strategy, world, sets):
    """ep 2 at world 2, and at world 4 in 2 replicas of 2 (adamw): each rank keeps half of each
    experts stack, alone in its replica; what it holds (parameters, gradients, optimizer state) is
    what `paratrain plan` says. Under zero1 and zero2, whose parameters are whole on every rank,
    half the stacks' bytes fewer than at ep 1 (optimizer state and zero3's parameters: half the
    stacks either way)."""
    from test_expert_weights import planned

    cfg = str(write_config(tmp_path / "c.toml", MIXTRAL))
    sets = [*sets, "train.optimizer='adamw'", f"parallel.strategy='{strategy}'"]
    held = gang(world).run("test_expert_weights:held_bytes", config=cfg, overrides=[*sets, *EP2])
    plan, whole = planned(cfg, world, [*sets, *EP2]), planned(cfg, world, sets)
    for rank in held:
        assert len(rank["experts"]) == 2 * 2  # each layer's two stacks, sliced
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert rank[key] == plan[key], (key, rank[key], plan[key])
    stacks = sum(p.numel() * 4 for n, p in built(MIXTRAL).named_parameters() if ".experts." in n)
    drop = {key: whole[key] - plan[key] for key in ("param_bytes", "optimizer_bytes")}
    assert drop["param_bytes"] == pytest.approx(0 if strategy == "zero3" else stacks / 2, abs=0.01 * stacks)
    assert drop["optimizer_bytes"] == pytest.approx(0, abs=0.01 * stacks)


@pytest.mark.parametrize(
    "strategy, world, sets", [("zero2", 2, []), ("zero3", 4, ["parallel.replicas=2"])], ids=["zero2", "zero3-hsdp"]
)
def test_zero_checkpoints_of_expert_slices_resume_across_ep(tmp_path, gang, strategy, world, sets):
    """A checkpoint written at ep 2 (each rank's pieces of its stacks' slices, at their places in the
    whole stacks; with replicas, by the first) resumes alone at ep 1, whose checkpoint resumes at
    ep 2: each equal to one process."""
    reference = train_alone(built(MIXTRAL), "pair", next_token_loss)
    cfg = write_config(tmp_path / "c.toml", MIXTRAL)
    every = ["checkpoint.every=4", f"parallel.strategy='{strategy}'"]
    split = [*every, *EP2, *sets]
    gang(world).train(cfg, tmp_path / "ep2", split)
    gang(1).train(cfg, tmp_path / "ep1", every, resume=str(tmp_path / "ep2" / "checkpoints" / "step-4"))
    gang(world).train(cfg, tmp_path / "back", split, resume=str(tmp_path / "ep1" / "checkpoints" / "step-8"))
    for name in ("ep2", "ep1", "back"):
        weights = final_weights(tmp_path / name)
        assert weights.keys() == reference.keys()
        assert max_rel_error(weights, reference) <= 1e-4, name
