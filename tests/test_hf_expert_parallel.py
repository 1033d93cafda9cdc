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
    "name, sets",
    [
        ("MIXTRAL", EP2),  # dp 2: each rank computes 2 of each layer's 4 experts
        ("QWEN2_MOE", [*EP2, "parallel.strategy='zero2'"]),
    ],
)
def test_hf_moe_under_expert_parallel_equals_single_process(tmp_path, gang, name, sets):
    """ep 2 at world 2; final/ holds the dense model's keys (every rank keeps every expert). The
    first step checked the dispatch of one experts module against its experts all run on one rank
    (parallel.verify_plan; under dp the stacks' slices gathered for it)."""
    text = globals()[name]
    reference = train_alone(built(text), "pair", next_token_loss)
    cfg = write_config(tmp_path / "c.toml", text)
    out = gang(2).train(cfg, tmp_path / "run", sets)
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
