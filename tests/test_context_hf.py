"""parallel.cp for an unmodified Hugging Face Llama (`[model] factory = "hf"`): its attention routed
to the ring, its rotary positions the chunks' global ones, its own loss's label shift made over the
whole sequence; against one process training the same model on the same data."""

import pytest
import torch
from helpers import final_weights, max_rel_error, metrics, write_config
from test_hf_models import BERT, GPT2, LLAMA, QWEN2, built, job, next_token_loss, own_loss, train_alone
from torch.utils.data import default_collate
from user_models import token_blocks

from paratrain.cli import main

transformers = pytest.importorskip("transformers")


def val_loss(model, layout: str, loss_of) -> float:
    """The trained model's loss on the whole validation split, as one batch."""
    data = token_blocks("val", layout)
    model.eval()
    with torch.no_grad():
        return float(loss_of(model, default_collate([data[i] for i in range(len(data))])))


@pytest.mark.parametrize(
    "layout, loss, recompute",
    [
        ("pair", "cross_entropy", "none"),  # (ids, next ids): the targets cut with the ids
        ("labelled", "model", "none"),  # {"input_ids", "labels"}: the model shifts its labels and counts them
        ("labelled", "model", "full"),  # its layers rerun in backward: the ring's forward again
    ],
)
def test_llama_context_parallel_equals_single_process(tmp_path, gang, layout, loss, recompute):
    """cp 2 at world 2: 16 tokens in 4 chunks of 4, rank 0 holding the first and the last; grouped-
    query attention (4 query heads, 2 key/value heads), rotary positions, the model's own loss:
    final weights and validation loss equal one process's."""
    loss_of = next_token_loss if layout == "pair" else own_loss
    model = built(LLAMA)
    reference = train_alone(model, layout, loss_of)
    cfg = write_config(tmp_path / "c.toml", LLAMA)
    sets = ["parallel.cp=2", f"data.layout='{layout}'", f"train.loss='{loss}'", f"train.recompute='{recompute}'"]
    gang(2).train(cfg, tmp_path / "run", sets)
    assert max_rel_error(final_weights(tmp_path / "run"), reference) <= 1e-4
    expected = val_loss(model, layout, loss_of)
    assert abs(metrics(tmp_path / "run")[-1]["val_loss"] - expected) <= 1e-4 * expected


ATTENTION = {
    "GPT2": "'transformer.h.0.attn' (GPT2Attention)",
    "QWEN2": "'model.layers.0.self_attn' (Qwen2Attention)",
    "LLAMA": "'model.layers.0.self_attn' (LlamaAttention)",
}


@pytest.mark.parametrize("name", ["GPT2", "QWEN2"])
def test_other_decoder_families_under_context_parallel(tmp_path, gang, name):
    """GPT-2's learned absolute positions (wpe of position_ids) and Qwen2's biased q/k/v with
    rotary positions: cp 2 equals one process; the first step checked the ring in one attention
    against attention over the whole sequence (parallel.verify_plan)."""
    text = {"GPT2": GPT2, "QWEN2": QWEN2}[name]
    reference = train_alone(built(text), "pair", next_token_loss)
    cfg = write_config(tmp_path / "c.toml", text)
    out = gang(2).train(cfg, tmp_path / "run", ["parallel.cp=2"])
    assert out.count(f"parallel.cp's ring attention in {ATTENTION[name]}") == 1, out
    assert max_rel_error(final_weights(tmp_path / "run"), reference) <= 1e-4


# a family whose layers attend within a window of 4 tokens (use_sliding_window)
QWEN2_WINDOW = job(
    'config = { model_type = "qwen2", vocab_size = 64, hidden_size = 32, intermediate_size = 64, '
    "num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64, "
    "use_sliding_window = true, sliding_window = 4, max_window_layers = 0 }"
)
BERT_MLM = BERT.replace('task = "sequence-classification"', 'task = "masked-lm"')


@pytest.mark.parametrize(
    "text, why",
    [
        (LLAMA.replace('"causal-lm"', '"sequence-classification"'), "head is not per token"),  # one token pooled
        (QWEN2_WINDOW, "sliding_attention layers"),
        (BERT_MLM, "attention is not causal"),  # an encoder: every token attends to every other
    ],
)
def test_hf_models_cp_cannot_split_exit_2(tmp_path, capsys, text, why):
    cfg = write_config(tmp_path / "c.toml", text)
    args = ["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), "--set", "parallel.cp=2"]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "parallel.cp" in lines[0] and why in lines[0], lines


@pytest.mark.parametrize(
    "sets",
    [
        # cp 2 x dp 2 under zero3 (parameters gathered per layer, the hooks on the model still the
        # ring's) in 2 micro-batches a step (each counts its own tokens)
        ["parallel.strategy='zero3'", "train.grad_accum=2"],
        # cp 2 x tp 2: each tp rank's 2 query heads and 1 key/value head around its ring, its plan
        # verified with the ring in the attention
        ["parallel.strategy='tp'", "parallel.tp=2"],
    ],
    ids=["zero3-dp2", "tp2"],
)
def test_llama_context_parallel_at_world_4(tmp_path, gang, sets):
    """World 4, cp 2 with dp or tp, the model's own loss: equal to one process."""
    reference = train_alone(built(LLAMA), "labelled", own_loss)
    cfg = write_config(tmp_path / "c.toml", LLAMA)
    sets = [*sets, "parallel.cp=2", "data.layout='labelled'", "train.loss='model'"]
    gang(4).train(cfg, tmp_path / "run", sets, timeout=300)
    assert max_rel_error(final_weights(tmp_path / "run"), reference) <= 1e-4


PP = ["parallel.strategy='pp'", "parallel.pp=2", "parallel.balance='params'"]  # cp 2 x pp 2: 4 ranks


@pytest.mark.parametrize(
    "name, layout, loss",
    [
        # stage 0 the embedding and layer 0, stage 1 layer 1 and the head: each stage's rotary
        # positions the chunks' global ones, the targets cut with the ids
        ("LLAMA", "pair", "cross_entropy"),
        # the labels shifted over the whole sequence and counted before the cut, carried apart to
        # the last stage's loss_function
        ("LLAMA", "labelled", "model"),
        ("QWEN2", "pair", "cross_entropy"),  # another family: biased q/k/v
        ("GPT2", "pair", "cross_entropy"),  # the first stage's learned positions (wpe) the global ones
    ],
)
def test_hf_decoders_under_pipeline_and_context_parallel(tmp_path, gang, name, layout, loss):
    """cp 2 x pp 2 at world 4 (4 microbatches of 2 sequences): the stages' attention the ring of
    their cp group, checked on the first step against attention over the whole sequence
    (parallel.verify_plan, the stages' verdict agreed after the step); final weights and validation
    loss equal one process's."""
    text = {"LLAMA": LLAMA, "QWEN2": QWEN2, "GPT2": GPT2}[name]
    loss_of = next_token_loss if layout == "pair" else own_loss
    model = built(text)
    reference = train_alone(model, layout, loss_of)
    cfg = write_config(tmp_path / "c.toml", text)
    sets = [*PP, "parallel.cp=2", f"data.layout='{layout}'", f"train.loss='{loss}'"]
    out = gang(4).train(cfg, tmp_path / "run", sets, timeout=300)
    assert out.count(f"parallel.verify_plan: parallel.cp's ring attention in {ATTENTION[name]} equals") == 1, out
    assert max_rel_error(final_weights(tmp_path / "run"), reference) <= 1e-4
    expected = val_loss(model, layout, loss_of)
    assert abs(metrics(tmp_path / "run")[-1]["val_loss"] - expected) <= 1e-4 * expected
