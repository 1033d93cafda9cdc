"""Fine-tuning what users already have (docs/fine-tuning.md), through `paratrain run`: a Hugging
Face directory written by save_pretrained as `pretrained`, completion-only labels (prompts masked
with -100) and the model's own loss, equal to one process computing that loss over the global
batch; data whose token ids exceed the model's vocabulary exit 2 before any worker starts."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import check_ok, final_weights, max_rel_error, metrics, run_cli, write_config
from test_model_parallel import GPT
from torch.utils.data import default_collate
from user_models import prompt_completions

TESTS = Path(__file__).parent  # the data factory's module (user_models.py) resolves from here

transformers = pytest.importorskip("transformers")

SFT = """
name = "sft"
[model]
factory = "hf"
pretrained = "start"
[data]
factory = "user_models:prompt_completions"
batch_size = 8
shuffle = false
[train]
steps = 4
optimizer = "sgd"
lr = 0.5
loss = "model"
grad_accum = 2
log_every = 2
"""

FAMILIES = {
    "llama": dict(model_type="llama", tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),  # q/k/v biases, lm_head apart
}


def save_pretrained(family: str, path: Path) -> None:
    """A tiny decoder at random init, saved as a user's fine-tuning starts from (nothing downloaded)."""
    settings = dict(FAMILIES[family])
    config = transformers.AutoConfig.for_model(
        settings.pop("model_type"),
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **settings,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def global_token_mean(model, batch: dict) -> torch.Tensor:
    """The loss of one process over the global batch: the sum of the next-token losses over the
    label tokens (not -100), divided by their number."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    summed = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    return summed / (labels != -100).sum()


def train_alone(path: Path, steps: int = 4, batch: int = 8, lr: float = 0.5) -> tuple[dict, list[float]]:
    """The weights after plain single-process SGD on the unshuffled global batches, and each step's loss."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    data, losses = prompt_completions(), []
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        loss = global_token_mean(model, default_collate([data[i] for i in range(step * batch, (step + 1) * batch)]))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


@pytest.mark.parametrize(
    "family, sets",
    [
        ("llama", ["parallel.strategy='dp'"]),
        ("qwen2", ["parallel.strategy='zero3'"]),
        # the built-in cross_entropy on the same tokens (the targets shifted in the data), each
        # pipeline stage a rank, 2 pipeline microbatches of each accumulation micro-batch
        (
            "llama",
            ["parallel.strategy='pp'", "parallel.pp=2", "parallel.microbatches=2"]
            + ["data.layout='pair'", "train.loss='cross_entropy'"],
        ),
    ],
)
def test_pretrained_with_masked_prompts_equals_one_process(tmp_path, family, sets):
    """`run` from a save_pretrained directory, two ranks, two accumulation micro-batches each,
    prompts of every length masked: a loss that is a mean over label tokens is normalised by the
    global batch's, so the trained weights and the logged losses (validation included) are one
    process's; final/ loads back with from_pretrained."""
    save_pretrained(family, tmp_path / "start")
    reference, losses = train_alone(tmp_path / "start")
    cfg = write_config(tmp_path / "c.toml", SFT)
    overrides = [a for s in sets for a in ("--set", s)]
    check_ok(run_cli("run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "run"), *overrides, cwd=TESTS))
    weights = final_weights(tmp_path / "run")
    assert max_rel_error(weights, reference, floor=1e-3) <= 1e-4
    logged = [m["loss"] for m in metrics(tmp_path / "run") if "loss" in m]
    assert logged == pytest.approx([sum(losses[:2]) / 2, sum(losses[2:]) / 2], rel=1e-5)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert all(torch.equal(v, weights[k]) for k, v in loaded.state_dict().items())
    # the validation loss too: the token mean over the whole validation set (the same samples)
    with torch.no_grad():
        val_loss = global_token_mean(loaded, default_collate(list(prompt_completions("val"))))
    assert metrics(tmp_path / "run")[-1]["val_loss"] == pytest.approx(val_loss.item(), rel=1e-5)


@pytest.mark.parametrize(
    "sets, need",
    [
        (["data.vocab=80"], "80 (its vocab_size)"),
        # no vocab_size declared: sample 0's largest id, here 79 or below (random ids under 80)
        (["data.vocab=80", "data.declared=false"], "largest input_ids"),
    ],
)
def test_token_ids_beyond_the_vocabulary_exit_2_naming_both_sizes(tmp_path, capsys, sets, need):
    from paratrain.cli import main

    save_pretrained("llama", tmp_path / "start")
    capsys.readouterr()  # transformers' progress bar of the save
    cfg = write_config(tmp_path / "c.toml", SFT)
    overrides = [a for s in sets for a in ("--set", s)]
    code = main(["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), *overrides])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "data.factory" in lines[0] and need in lines[0] and "model's has 64" in lines[0], lines


def test_pretrained_on_meta_reads_from_pretrained_values_a_tensor_at_a_time(tmp_path):
    """Under a sharding strategy each pretrained tensor reaches the strategy alone, its value
    from_pretrained's, buffers the files lack (rotary frequencies) included; files naming tensors
    the model has not are left to the factory's whole load."""
    from safetensors.torch import load_file, save_file

    from paratrain.models.hf import hf
    from paratrain.models.materialize import materialize, tensor_names
    from paratrain.models.pretrained import pretrained_on_meta

    save_pretrained("qwen2", tmp_path / "start")
    model = pretrained_on_meta(lambda: hf(pretrained=str(tmp_path / "start")), str(tmp_path / "start"))
    assert model is not None and all(p.is_meta for p in model.parameters())
    kept: dict[int, torch.Tensor] = {}
    materialize(model, 0, lambda meta, value: kept.__setitem__(id(meta), value))
    names = tensor_names(model)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "start")
    expected = {**dict(loaded.named_parameters()), **dict(loaded.named_buffers())}
    assert all(torch.equal(kept[id(names[k])], v) for k, v in expected.items())

    renamed = {f"old.{k}": v for k, v in load_file(tmp_path / "start" / "model.safetensors").items()}
    save_file(renamed, tmp_path / "start" / "model.safetensors")
    assert pretrained_on_meta(lambda: hf(pretrained=str(tmp_path / "start")), str(tmp_path / "start")) is None


def test_a_paratrain_final_as_pretrained_for_a_built_in_model(tmp_path, gang, capsys):
    """`pretrained` for a built-in factory: a run's final/ (its safetensors keyed like the model's
    state_dict) is where the next run starts, under zero3 its tensors read one at a time (lr 0
    keeps them as they are), and it trains on as one process does; weights that do not fit the
    model exit 2 before any worker starts, naming the tensor."""
    from paratrain.cli import main

    cfg = write_config(tmp_path / "c.toml", GPT.replace("steps = 20", "steps = 4"))
    gang(2).train(cfg, tmp_path / "first")
    start = final_weights(tmp_path / "first")
    pretrained = f"model.pretrained='{tmp_path / 'first' / 'final'}'"
    gang(2).train(cfg, tmp_path / "kept", [pretrained, "parallel.strategy='zero3'", "train.lr=0.0"])
    kept = final_weights(tmp_path / "kept")
    assert all(torch.equal(kept[k], start[k]) for k in start)
    gang(2).train(cfg, tmp_path / "zero3", [pretrained, "parallel.strategy='zero3'"])
    gang(1).train(cfg, tmp_path / "alone", [pretrained])
    trained, alone = final_weights(tmp_path / "zero3"), final_weights(tmp_path / "alone")
    # (attention key biases get no gradient: rounding noise alone, compared absolutely below 1e-3)
    assert max_rel_error(trained, alone, floor=1e-3) <= 1e-4 and max_rel_error(trained, start) > 1e-3

    capsys.readouterr()
    code = main(["run", str(cfg), "--nproc", "2", "--set", pretrained, "--set", "model.n_layer=3"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "model.pretrained" in lines[0] and "blocks.2" in lines[0], lines


def test_masked_token_targets_under_vocabulary_parallel_cross_entropy(tmp_path, gang):
    """The built-in cross_entropy on masked token targets under tp, whose gpt head is split over
    the vocabulary (the loss from its slices): -100 counts for nothing and the sum is divided by
    the global batch's label tokens, as one process computes it."""
    corpus = 'factory = "corpus"\nblock_size = 16\nmax_chars = 20000\n'
    masked = GPT.replace(corpus, 'factory = "user_models:prompt_completions"\nlayout = "pair"\n')
    masked = masked.replace("steps = 20", "steps = 4").replace("d_model = 32\n", "d_model = 32\nblock_size = 16\n")
    cfg = write_config(tmp_path / "c.toml", masked)
    gang(2).train(cfg, tmp_path / "tp", ["parallel.strategy='tp'", "parallel.tp=2", "train.grad_accum=2"])
    gang(1).train(cfg, tmp_path / "alone")
    assert max_rel_error(final_weights(tmp_path / "tp"), final_weights(tmp_path / "alone"), floor=1e-3) <= 1e-4


def test_the_worker_server_imports_a_pretrained_models_family(tmp_path):
    """The worker server imports the family's transformers modules once for the workers (about
    8 s of CPU each), named by a pretrained directory's config.json as by a config's model_type."""
    from paratrain import config as config_mod
    from paratrain.models import worker_preload

    save_pretrained("qwen2", tmp_path / "start")
    cfg = config_mod.from_dict({"model": {"factory": "hf", "pretrained": str(tmp_path / "start")}})
    assert "transformers.models.qwen2.modeling_qwen2" in worker_preload(cfg)
