"""A Hugging Face MoE decoder under parallel.cp and parallel.ep together (`factory = "hf"`, no user
code): each sequence split over a ring, the experts over the same ranks, the routers' load-balancing
loss the whole sequences'; against one process training the same model on the same data."""

import pytest
from helpers import final_weights, max_rel_error, write_config
from test_hf_expert_parallel import MIXTRAL, QWEN2_MOE
from test_hf_models import built, next_token_loss, own_loss, train_alone

from paratrain.cli import main

pytest.importorskip("transformers")

# the model's own loss with its load-balancing loss (transformers' load_balancing_loss_func)
WITH_AUX = "num_experts_per_tok = 2, output_router_logits = true, router_aux_loss_coef = 0.1,"
CHECKED = (
    "parallel.cp's ring attention in 'model.layers.0.self_attn'",
    "parallel.ep's expert dispatch in 'model.layers.0.mlp.experts'",
)


def data_parallel_loss(model, batch):
    """The model's own loss as 2 data ranks take it: each on its contiguous half of the batch (the
    load-balancing loss is a statistic of the batch a data rank holds), their mean."""
    halves = [{k: v.chunk(2)[half] for k, v in batch.items()} for half in (0, 1)]
    return sum(own_loss(model, half) for half in halves) / 2


@pytest.mark.parametrize(
    "name, world, sets, loss",
    [
        # cp 2 x ep 2 at world 2: the ring's chunks routed to the ranks' 2 experts each and back
        ("MIXTRAL", 2, [], "cross_entropy"),
        # the load-balancing loss taken over the ring's rows of the whole sequences
        ("MIXTRAL", 2, [], "model"),
        ("QWEN2_MOE", 2, ["parallel.strategy='zero2'"], "model"),  # a shared expert, another router
        # cp 2 x dp 2, one expert a rank, ZeRO-3 sharding the dense parameters over all 4 ranks
        ("MIXTRAL", 4, ["parallel.strategy='zero3'", "parallel.ep=4"], "model"),
    ],
    ids=["mixtral-dp-ce", "mixtral-dp-own", "qwen2-moe-zero2-own", "mixtral-zero3-w4-ep4-own"],
)
def test_hf_moe_under_context_and_expert_parallel(tmp_path, gang, name, world, sets, loss):
    """Final weights equal one process's (at world 4, whose 2 data ranks each take their half's
    load-balancing loss, one process taking the halves' mean); the first step checked the ring in
    one attention and the dispatch of one experts module (parallel.verify_plan)."""
    text = {"MIXTRAL": MIXTRAL, "QWEN2_MOE": QWEN2_MOE}[name]
    if loss == "model":
        text = text.replace("num_experts_per_tok = 2,", WITH_AUX)
        loss_of = data_parallel_loss if world == 4 else own_loss
    else:
        loss_of = next_token_loss
    layout = "pair" if loss == "cross_entropy" else "labelled"
    reference = train_alone(built(text), layout, loss_of)
    cfg = write_config(tmp_path / "c.toml", text)
    sets = ["parallel.cp=2", "parallel.ep=2", *sets, f"data.layout='{layout}'", f"train.loss='{loss}'"]
    out = gang(world).train(cfg, tmp_path / "run", sets, timeout=300)
    for check in CHECKED:
        assert out.count(f"parallel.verify_plan: {check}") == 1, out
    assert max_rel_error(final_weights(tmp_path / "run"), reference) <= 1e-4


def test_a_load_balancing_loss_of_another_form_is_refused_under_cp(tmp_path, capsys, monkeypatch):
    """A family whose load_balancing_loss_func is not Mixtral's (Doge's takes num_keys too) has a
    statistic paratrain cannot take over the ring: cp with output_router_logits exits 2 before any
    worker starts, naming parallel.cp."""
    from transformers.models.mixtral import modeling_mixtral

    def another_form(gate_logits, num_experts, num_keys, top_k, attention_mask):
        raise AssertionError("never called: refused before any forward")

    monkeypatch.setattr(modeling_mixtral, "load_balancing_loss_func", another_form)
    cfg = write_config(tmp_path / "c.toml", MIXTRAL.replace("num_experts_per_tok = 2,", WITH_AUX))
    args = ["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), "--set", "parallel.cp=2"]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "parallel.cp" in lines[0] and "load-balancing loss" in lines[0], lines
