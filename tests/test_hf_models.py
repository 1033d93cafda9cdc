"""Hugging Face transformers models as users bring them (`[model] factory = "hf"`, random init from
a config, or a local save_pretrained directory): each strategy equals single-process PyTorch
written here, and final/ loads back with from_pretrained."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import final_weights, max_rel_error, run_cli, write_config
from torch.utils.data import default_collate
from user_models import tiny_images, token_blocks

TESTS = Path(__file__).parent  # the data factories' module (user_models.py) resolves from here

transformers = pytest.importorskip("transformers")

LLAMA = """
name = "llama"
[model]
factory = "hf"
task = "causal-lm"
config = { model_type = "llama", vocab_size = 64, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64, tie_word_embeddings = true }
[data]
factory = "user_models:token_blocks"
batch_size = 8
shuffle = false
[train]
steps = 10
optimizer = "sgd"
lr = 0.5
log_every = 5
"""

BERT = """
name = "bert"
[model]
factory = "hf"
task = "sequence-classification"
config = { model_type = "bert", vocab_size = 64, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 2, max_position_embeddings = 32, num_labels = 3, hidden_dropout_prob = 0.0, attention_probs_dropout_prob = 0.0 }
[data]
factory = "user_models:token_blocks"
layout = "classify"
batch_size = 8
shuffle = false
[train]
steps = 10
optimizer = "sgd"
lr = 0.5
log_every = 5
"""


def job(config: str) -> str:
    """LLAMA's job with another [model] config (a decoder of another family)."""
    start = LLAMA.index("config = {")
    return LLAMA[:start] + config + LLAMA[LLAMA.index("\n", start) :]


# no base_model_pp_plan in transformers 5.24: cut by paratrain's table of its parts; wte tied to lm_head
GPT2 = job(
    'config = { model_type = "gpt2", vocab_size = 64, n_embd = 32, n_layer = 2, n_head = 4, n_positions = 64, '
    "resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0, bos_token_id = 0, eos_token_id = 0 }"
)
# a second family with its own plans; q/k/v with biases, lm_head untied
QWEN2 = job(
    'config = { model_type = "qwen2", vocab_size = 64, hidden_size = 32, intermediate_size = 64, '
    "num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64 }"
)
# its pp plan names its parts otherwise (embed_in, emb_dropout, layers, final_layer_norm)
GPT_NEOX = job(
    'config = { model_type = "gpt_neox", vocab_size = 64, hidden_size = 32, intermediate_size = 64, '
    "num_hidden_layers = 2, num_attention_heads = 4, max_position_embeddings = 64 }"
)
# its own tp plan gathers the fused qkv_proj and gate_up_proj whole (colwise_gather_output) and
# splits o_proj and down_proj on their whole inputs (rowwise_split_input)
PHI3 = job(
    'config = { model_type = "phi3", vocab_size = 64, hidden_size = 32, intermediate_size = 64, '
    "num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64, "
    "pad_token_id = 0, bos_token_id = 0, eos_token_id = 0 }"
)
# multi-head latent attention and mixture of experts, with its own plan: mla_kv_a_proj, experts'
# stacks split packed_colwise (a fused gate and up) and rowwise, moe_tp_experts, shared experts
DEEPSEEK_V2 = job(
    'config = { model_type = "deepseek_v2", vocab_size = 64, hidden_size = 32, intermediate_size = 64, '
    "moe_intermediate_size = 16, num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 4, "
    "n_shared_experts = 1, n_routed_experts = 4, num_experts_per_tok = 2, first_k_dense_replace = 1, "
    "kv_lora_rank = 16, q_lora_rank = 16, qk_rope_head_dim = 8, v_head_dim = 8, qk_nope_head_dim = 8, "
    "n_group = 1, topk_group = 1, max_position_embeddings = 64 }"
)
# transposed experts: gate_up_proj split packed_rowwise, down_proj colwise, under moe_tp_experts
LLAMA4 = job(
    'config = { model_type = "llama4_text", vocab_size = 64, hidden_size = 32, intermediate_size = 32, '
    "intermediate_size_mlp = 64, num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, "
    "head_dim = 8, num_local_experts = 4, num_experts_per_tok = 1, max_position_embeddings = 64, "
    "interleave_moe_layer_step = 1, attention_chunk_size = 64 }"
)
# experts' and shared experts' stacks split as tensors, the shared experts' partial sums all_reduce'd.
# Its own plan (transformers 5.24) splits the experts' fused gate_up_proj "colwise", which
# parallel.verify_plan catches (each rank would get gate rows only or up rows only): a user plan
# splits it packed_colwise instead, the rest as its own plan does
INKLING = job(
    'config = { model_type = "inkling_text", vocab_size = 64, hidden_size = 32, num_hidden_layers = 2, '
    "num_attention_heads = 4, num_key_value_heads = 2, head_dim = 8, swa_num_attention_heads = 4, "
    "swa_num_key_value_heads = 2, swa_head_dim = 8, sliding_window_size = 8, max_position_embeddings = 64, "
    "intermediate_size = 64, moe_intermediate_size = 16, n_routed_experts = 4, num_experts_per_tok = 2, "
    "n_shared_experts = 1, d_rel = 4, rel_extent = 16 }"
)
# zero experts: moe_identity_expert divides their input by tp, which moe_tp_experts sums back
LONGCAT = job(
    'config = { model_type = "longcat_flash", vocab_size = 64, hidden_size = 32, num_layers = 1, head_dim = 8, '
    "num_attention_heads = 4, kv_lora_rank = 16, q_lora_rank = 16, qk_rope_head_dim = 8, qk_nope_head_dim = 8, "
    "v_head_dim = 8, ffn_hidden_size = 64, expert_ffn_hidden_size = 16, n_routed_experts = 4, "
    "zero_expert_num = 2, moe_topk = 2, max_position_embeddings = 64 }"
)
# attention sinks, a bare parameter per head, split colwise with the heads (local_params on its owner)
GRANITE_SWA = job(
    'config = { model_type = "granite_swa", vocab_size = 64, hidden_size = 32, intermediate_size = 64, '
    "num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64, "
    "bos_token_id = 0, eos_token_id = 0, pad_token_id = 0 }"
)
TP2 = ["parallel.strategy='tp'", "parallel.tp=2"]
INKLING_PLAN = ", ".join(
    f"'model.layers.*.mlp.{name}'='{style}'"
    for name, style in [
        ("experts.gate_up_proj", "packed_colwise"),
        ("experts.down_proj", "rowwise"),
        ("experts", "moe_tp_experts"),
        ("shared_experts.gate_proj", "colwise"),
        ("shared_experts.up_proj", "colwise"),
        ("shared_experts.down_proj", "rowwise"),
        ("shared_experts", "all_reduce"),
    ]
)
PACKED_MLP = "'model.layers.*.mlp.gate_up_proj'='packed_colwise', 'model.layers.*.mlp.down_proj'='rowwise'"
PP2 = ["parallel.strategy='pp'", "parallel.pp=2", "parallel.balance='params'"]


def next_token_loss(model, batch):
    ids, targets = batch
    logits = model(ids).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def own_loss(model, batch):
    return model(**batch).loss


def classify_loss(model, batch):
    inputs, labels = batch
    return F.cross_entropy(model(**inputs).logits, labels)


def image_loss(model, batch):
    pixels, labels = batch
    return F.cross_entropy(model(pixels).logits, labels)


def train_alone(model, layout: str, loss_of, steps: int = 10, batch: int = 8, lr: float = 0.5, data=None) -> dict:
    """Plain single-process training on the contract's unshuffled batches (of token_blocks in
    `layout`, or of `data`)."""
    data = token_blocks("train", layout) if data is None else data
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        idx = torch.arange(step * batch, (step + 1) * batch) % len(data)
        opt.zero_grad()
        loss_of(model, default_collate([data[i] for i in idx.tolist()])).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def built(text: str):
    """The model the config's [model] section builds, from the seed every run starts with."""
    import tomllib

    from paratrain.models.hf import hf

    section = tomllib.loads(text)["model"]
    torch.manual_seed(0)
    return hf(config=section["config"], task=section["task"])


@pytest.mark.parametrize(
    "strategy, layout, loss, recompute",
    [
        ("dp", "pair", "cross_entropy", "none"),
        ("zero3", "labelled", "model", "none"),
        ("dp", "labelled", "model", "full"),  # through the model's activation_checkpointing_enable()
        ("tp", "pair", "cross_entropy", "none"),  # the model's own base_model_tp_plan
        ("tp", "labelled", "model", "none"),  # its loss on logits gathered by colwise_gather_output
        ("pp", "pair", "cross_entropy", "none"),  # cut by its base_model_pp_plan, ties summed
        ("pp", "labelled", "model", "none"),  # its loss_function on the last stage, the labels carried there
    ],
)
def test_llama_equals_single_process(tmp_path, gang, strategy, layout, loss, recompute):
    reference = train_alone(built(LLAMA), layout, next_token_loss if layout == "pair" else own_loss)
    cfg = write_config(tmp_path / "c.toml", LLAMA)
    sets = [f"parallel.strategy='{strategy}'", f"data.layout='{layout}'", f"train.loss='{loss}'"]
    sets += [f"train.recompute='{recompute}'", f"parallel.tp={2 if strategy == 'tp' else 1}"]
    sets += [f"parallel.pp={2 if strategy == 'pp' else 1}"]
    gang(2).train(cfg, tmp_path / "run", sets, timeout=300)  # pp times its layers first: slow on 2 shared cores
    assert max_rel_error(final_weights(tmp_path / "run"), reference) <= 1e-4


@pytest.mark.parametrize(
    "name, sets, world",
    [
        ("GPT2", PP2, 2),
        ("GPT2", ["parallel.strategy='zero3'"], 2),
        ("QWEN2", ["parallel.strategy='tp'", "parallel.tp=2"], 2),  # its own base_model_tp_plan
        ("QWEN2", PP2, 2),  # its own base_model_pp_plan
        ("GPT_NEOX", PP2, 2),  # its own base_model_pp_plan, under other names
        ("PHI3", ["parallel.strategy='tp'", "parallel.tp=2"], 2),  # its own plan's every style
        ("DEEPSEEK_V2", TP2, 2),  # mla_kv_a_proj, packed_colwise and rowwise experts, moe_tp_experts
        ("LLAMA4", TP2, 2),  # packed_rowwise and colwise experts
        ("INKLING", [*TP2, f"parallel.tp_plan={{{INKLING_PLAN}}}"], 2),  # all_reduce around the shared experts
        ("LONGCAT", TP2, 2),  # moe_identity_expert
        ("GRANITE_SWA", TP2, 2),  # a parameter split with its heads
        # the fused gate_up_proj Linear split as gate and up each: the fix for the plan caught below
        ("PHI3", [*TP2, f"parallel.tp_plan={{{PACKED_MLP}}}"], 2),
        ("LLAMA", [*PP2[1:], "parallel.strategy='hybrid'"], 4),  # dp 2 x pp 2
    ],
)
def test_decoder_families_equal_single_process(tmp_path, gang, name, sets, world):
    """Plain factories of unmodified decoders of three families, each strategy equal to one process."""
    text = globals()[name]
    reference = train_alone(built(text), "pair", next_token_loss)
    cfg = write_config(tmp_path / "c.toml", text)
    gang(world).train(cfg, tmp_path / "run", sets, timeout=300)
    assert max_rel_error(final_weights(tmp_path / "run"), reference) <= 1e-4


# an encoder-decoder: the model shifts its labels into the decoder's input and computes its loss
T5 = job(
    'config = { model_type = "t5", vocab_size = 64, d_model = 32, d_kv = 8, d_ff = 64, num_layers = 2, '
    "num_heads = 4, dropout_rate = 0.0, decoder_start_token_id = 0, pad_token_id = 0 }"
).replace('task = "causal-lm"', 'task = "seq2seq-lm"')
# pixel values in, a class of 3 out: (pixels, label) samples, the built-in loss on the output's logits
VIT = (
    job(
        'config = { model_type = "vit", image_size = 8, patch_size = 4, num_channels = 3, hidden_size = 32, '
        "num_hidden_layers = 2, num_attention_heads = 4, intermediate_size = 64, num_labels = 3, "
        "hidden_dropout_prob = 0.0, attention_probs_dropout_prob = 0.0 }"
    )
    .replace('task = "causal-lm"', 'task = "image-classification"')
    .replace("token_blocks", "tiny_images")
)


@pytest.mark.parametrize(
    "name, auto, sets",
    [
        ("T5", "AutoModelForSeq2SeqLM", ["data.layout='labelled'", "train.loss='model'"]),
        ("VIT", "AutoModelForImageClassification", ["parallel.strategy='zero3'"]),
    ],
)
def test_other_heads_equal_single_process_and_load_back(tmp_path, gang, name, auto, sets):
    """task names the head as transformers' Auto classes do; final/ loads with the matching one."""
    text = globals()[name]
    if name == "T5":
        reference = train_alone(built(text), "labelled", own_loss)
    else:
        reference = train_alone(built(text), "", image_loss, data=tiny_images("train"))
    cfg = write_config(tmp_path / "c.toml", text)
    gang(2).train(cfg, tmp_path / "run", sets, timeout=300)
    weights = final_weights(tmp_path / "run")
    # key biases hold rounding noise alone (as BERT's below): compared absolutely, below 1e-3
    assert max_rel_error(weights, reference, floor=1e-3) <= 1e-4
    loaded = getattr(transformers, auto).from_pretrained(tmp_path / "run" / "final")
    assert type(loaded) is type(built(text))
    state = loaded.state_dict()
    assert all(torch.equal(state[k], weights[k]) for k in weights)


def test_llama_hybrid_with_its_own_loss_equals_single_process(tmp_path, gang):
    """dp 2 x pp 2: each replica's last stage runs the model's loss_function on its labels."""
    reference = train_alone(built(LLAMA), "labelled", own_loss)
    cfg = write_config(tmp_path / "c.toml", LLAMA)
    sets = [*PP2[1:], "parallel.strategy='hybrid'", "data.layout='labelled'", "train.loss='model'"]
    gang(4).train(cfg, tmp_path / "run", sets, timeout=300)
    assert max_rel_error(final_weights(tmp_path / "run"), reference) <= 1e-4


def test_bert_classifier_with_dict_inputs_equals_single_process(tmp_path, gang):
    reference = train_alone(built(BERT), "classify", classify_loss)
    cfg = write_config(tmp_path / "c.toml", BERT)
    gang(2).train(cfg, tmp_path / "run")
    # Attention's key biases get a gradient that is zero but for rounding (softmax ignores a shift
    # common to every key), so they hold rounding noise alone: compared absolutely, below 1e-3.
    assert max_rel_error(final_weights(tmp_path / "run"), reference, floor=1e-3) <= 1e-4


def test_pretrained_directory_in_and_final_loads_with_from_pretrained(tmp_path, gang):
    """pretrained = DIR (save_pretrained's) trains like the model loaded from it; final/ is a
    Hugging Face model directory holding the trained weights, tied ones included."""
    built(LLAMA).save_pretrained(tmp_path / "start")
    start = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "start")
    reference = train_alone(start, "pair", next_token_loss)
    text = LLAMA.replace(LLAMA[LLAMA.index("config = {") : LLAMA.index("[data]")], 'pretrained = "start"\n')
    cfg = write_config(tmp_path / "c.toml", text)
    gang(2).train(cfg, tmp_path / "run")
    weights = final_weights(tmp_path / "run")
    assert max_rel_error(weights, reference) <= 1e-4
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    state = loaded.state_dict()
    assert state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in weights)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied


def test_lora_under_zero3_equals_single_process_peft_and_final_loads_with_peft(tmp_path, gang):
    """[model] lora: only the adapters train, as plain peft in one process trains them; final/ holds
    the adapter in PEFT's format (PeftModel.from_pretrained) and final/merged/ the merged model,
    a transformers directory giving the trained model's logits."""
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trained = get_peft_model(built(LLAMA), lora)
    frozen = {k: v.clone() for k, v in trained.state_dict().items() if "lora_" not in k}
    reference = train_alone(trained, "pair", next_token_loss)
    sets = ["parallel.strategy='zero3'", "model.lora={r=4, alpha=8, target_modules=['q_proj', 'v_proj']}"]
    gang(2).train(write_config(tmp_path / "c.toml", LLAMA), tmp_path / "run", sets)
    weights = final_weights(tmp_path / "run")
    assert max_rel_error(weights, reference) <= 1e-4
    assert all(torch.equal(weights[k], v) for k, v in frozen.items())
    final = tmp_path / "run" / "final"
    ids = token_blocks("train", "pair")[0][0][None]
    want = trained.eval()(ids).logits
    loaded = PeftModel.from_pretrained(built(LLAMA), final).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    for model in (loaded, merged):
        assert (model(ids).logits - want).abs().max().item() <= 1e-5
    # paratrain inspect checks every file final/ lists: the adapter's and merged/'s beside the model
    from paratrain.cli import main

    assert main(["inspect", str(final)]) == 0
    manifest = json.loads((final / "manifest.json").read_text())
    assert {"adapter_config.json", "merged/model.safetensors"} <= manifest["files"].keys()
    manifest["files"]["../model.safetensors"] = manifest["files"]["model.safetensors"]  # a name outside final/
    (final / "manifest.json").write_text(json.dumps(manifest))
    assert main(["inspect", str(final)]) == 2


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.task='translation'", "model.task"),
        ("model.config={hidden_size=32}", "model.config"),  # no model_type
        ("model.config={model_type='nosuchmodel'}", "model.config"),
        # the worker server's preload reads [model] before the preflight checks it (worker_preload)
        ("model.config='llama'", "model.config"),
        ("model.task=['causal-lm']", "model.task"),
        ("model.pretrained='missing'", "model.config"),  # both config and pretrained
        (
            "parallel.strategy='tp' --set parallel.tp=2 --set parallel.tp_plan={'model.layers.*.mlp.fc'='colwise'}",
            "parallel.tp_plan",
        ),
        (
            "parallel.strategy='tp' --set parallel.tp=2 --set parallel.tp_plan={'model.*.mlp.up_proj'='packed_colwise'}",
            "parallel.tp_plan",
        ),
        # expert parallelism's style: parallel.ep's, named
        (
            "parallel.strategy='tp' --set parallel.tp=2 --set parallel.tp_plan={'model.layers.*.mlp.up_proj'='grouped_gemm'}",
            "parallel.tp_plan",
        ),
        ("parallel.strategy='tp' --set parallel.tp=2 --set model.config.num_key_value_heads=1", "parallel.tp"),
        # the model's own loss would read one rank's slice of lm_head's logits
        (
            "parallel.strategy='tp' --set parallel.tp=2 --set model.config.tie_word_embeddings=false "
            "--set data.layout='labelled' --set train.loss='model' --set parallel.tp_plan={'lm_head'='colwise'}",
            "parallel.tp_plan",
        ),
        # the model's own loss takes dict samples with labels, under pp as under any strategy
        ("parallel.strategy='pp' --set parallel.pp=2 --set train.loss='model'", "train.loss"),
        # ... whose labels the last stage takes: a dict sample without them exits 2 up front
        (
            "parallel.strategy='pp' --set parallel.pp=2 --set train.loss='model' --set data.layout='ids'",
            "data.factory",
        ),
        ("model.lora={rank=4}", "model.lora.rank"),
        ("model.lora={r=0}", "model.lora.r"),
        ("model.lora={target_modules='q_proj'}", "model.lora.target_modules"),
        ("model.lora={target_modules=['no_such_proj']}", "model.lora.target_modules"),
        ("model.lora={target_modules=['embed_tokens']}", "model.lora.target_modules"),  # merged Linear only
        ("parallel.strategy='tp' --set parallel.tp=2 --set model.lora={r=4}", "model.lora"),
    ],
)
def test_bad_hf_model_exits_2_naming_the_key(tmp_path, capsys, override, key):
    from paratrain.cli import main

    cfg = write_config(tmp_path / "c.toml", LLAMA)
    sets = [a for part in override.split(" --set ") for a in ("--set", part)]
    code = main(["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), *sets])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and key in lines[0], lines


def test_the_worker_server_imports_the_models_transformers_modules():
    """`paratrain run` has the worker server import the model's transformers modules once, before
    it forks the workers (each imported them itself: about 8 s of CPU a worker on the 2-core EPYC,
    a 2-step Llama run 15.7 s -> 12.0 s); the names are modules that import."""
    import importlib

    from paratrain import config as config_mod
    from paratrain.models import worker_preload

    llama = config_mod.from_dict({"model": {"factory": "hf", "config": {"model_type": "llama"}}})
    modules = worker_preload(llama)
    assert "transformers.models.llama.modeling_llama" in modules
    assert all(importlib.import_module(m) for m in modules)
    assert worker_preload(config_mod.from_dict({})) == ()  # the built-in gpt: the trainer's imports


def test_a_broken_torchvision_is_named_as_the_cause(tmp_path):
    """A torchvision that does not match torch breaks every transformers model (transformers
    imports it for its image utilities): the one line says so, not "Could not import module"."""
    broken = tmp_path / "site" / "torchvision"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    info = tmp_path / "site" / "torchvision-0.99.0.dist-info"  # installed, for transformers' check
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.99.0\n")
    cfg = write_config(tmp_path / "c.toml", LLAMA)
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    proc = run_cli(
        "run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), cwd=TESTS, env={"PYTHONPATH": path}
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "model.factory" in lines[0] and "torchvision::nms" in lines[0] and "matching torchvision" in lines[0]


def test_a_fused_projection_split_colwise_exits_2_naming_it(tmp_path):
    """Phi3's fused gate_up_proj split colwise gives each rank half of the gate rows and half of the
    up rows, which the model chunks into the wrong gate and up: shapes fit, values do not. The
    first step checks each kind of block whole (parallel.verify_plan) and exits 2 naming it."""
    plan = '"model.layers.*.mlp.gate_up_proj" = "colwise", "model.layers.*.mlp.down_proj" = "rowwise"'
    cfg = write_config(tmp_path / "c.toml", PHI3 + f"[parallel]\nstrategy = 'tp'\ntp = 2\ntp_plan = {{ {plan} }}\n")
    proc = run_cli("run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), cwd=TESTS)
    lines = sorted(set(proc.stderr.strip().splitlines()))  # each rank says the one agreed line
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "'model.layers.0.mlp'" in lines[0] and '"model.layers.0.mlp.gate_up_proj" = "colwise"' in lines[0]


def test_llama_with_a_wildcard_tp_plan_equals_single_process(tmp_path, gang):
    """A user plan that leaves lm_head whole: the model's own loss reads whole logits."""
    reference = train_alone(built(LLAMA), "labelled", own_loss)
    cfg = write_config(tmp_path / "c.toml", LLAMA + TP_MLP_ONLY)
    gang(2).train(cfg, tmp_path / "run", ["data.layout='labelled'", "train.loss='model'"])
    assert max_rel_error(final_weights(tmp_path / "run"), reference) <= 1e-4


TP_MLP_ONLY = """
[parallel]
strategy = "tp"
tp = 2
tp_plan = { "model.layers.*.mlp.gate_proj" = "colwise", "model.layers.*.mlp.up_proj" = "colwise", "model.layers.*.mlp.down_proj" = "rowwise" }
"""


@pytest.mark.parametrize(
    "job, sets, world",
    [
        ("LLAMA", [], 2),
        ("LLAMA", ["parallel.strategy='zero3'", "data.layout='labelled'", "train.loss='model'"], 2),
        ("LLAMA", ["train.recompute='full'"], 2),
        ("LLAMA", ["parallel.strategy='tp'", "parallel.tp=2"], 2),
        ("LLAMA", PP2, 2),
        ("LLAMA", [*PP2[1:], "parallel.strategy='hybrid'"], 4),  # dp 2 x pp 2
        ("GPT2", PP2, 2),
        ("GPT2", ["parallel.strategy='zero3'"], 2),
        ("BERT", [], 2),
        ("VIT", [], 2),  # its trunc_normal_ init reads values: built on meta, its tensors made fake
        ("LLAMA", ["parallel.strategy='zero3'", "model.lora={r=4}"], 2),  # peft swaps tensors: the same
        ("DEEPSEEK_V2", TP2, 2),  # experts' stacks planned as tensors, communication around modules
        ("LLAMA", ["parallel.strategy='tp'", "parallel.tp=2", "data.layout='labelled'", "train.loss='model'"], 2),
        ("LLAMA", [*PP2, "data.layout='labelled'", "train.loss='model'"], 2),  # labels to the last stage
    ],
)
def test_plan_takes_model_outputs_and_dict_batches(tmp_path, capsys, job, sets, world):
    """`paratrain plan`'s fake-tensor run accepts ModelOutput outputs and dict batches."""
    from paratrain.cli import main

    cfg = write_config(tmp_path / "c.toml", globals()[job])
    code = main(["plan", str(cfg), "--nproc", str(world), *[a for s in sets for a in ("--set", s)]])
    out = capsys.readouterr()
    assert code == 0 and "predicted" in out.out, out.err


@pytest.mark.parametrize("world", [1, 2, 3])
def test_packed_shards_join_back_in_their_own_layout(world):
    """A fused [gate; up] split as gate and up each (packed_*): the shards a checkpoint saves join
    back to the whole tensor at any other tp (hybrid/state.py's resharding), and cut again alike."""
    from paratrain.parallel.tensor.experts import join_shards, shard_slice

    whole = torch.arange(4 * 12 * 5, dtype=torch.float32).reshape(4, 12, 5)  # an experts' (E, 2I, H)
    parts = [shard_slice(whole, 1, world, r, 2) for r in range(world)]
    gate, up = whole.chunk(2, 1)
    assert torch.equal(parts[0], torch.cat([gate[:, : 6 // world], up[:, : 6 // world]], 1))
    assert torch.equal(join_shards(parts, 1, 2), whole)
