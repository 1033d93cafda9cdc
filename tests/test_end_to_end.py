"""Whole runs through the CLI: the default job, accuracy on digits, the run directory contract."""

import json

from helpers import check_ok, final_weights, metrics, run_cli, write_config

from paratrain.models.gpt import gpt


def test_default_job_smoke(tmp_path):
    proc = check_ok(
        run_cli(
            "run",
            "--set",
            "train.steps=6",
            "--set",
            "train.log_every=2",
            "--set",
            "train.eval_every=0",
            "--set",
            "data.max_chars=200000",
            "--run-dir",
            str(tmp_path / "run"),
        )
    )
    assert "done: 6 steps" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all(" loss " in line and " lr " in line and " samples/s " in line for line in lines)
    run = tmp_path / "run"
    assert (run / "config.toml").is_file()
    entries = metrics(run)
    assert [e["step"] for e in entries] == [2, 4, 6]
    assert {"step", "loss", "lr", "samples_per_s", "time"} <= entries[0].keys()
    # final/model.safetensors is keyed exactly like the user's model.state_dict()
    weights = final_weights(run)
    manifest = json.loads((run / "final" / "manifest.json").read_text())
    model = gpt(vocab_size=weights["embed.tok.weight"].shape[0], n_layer=2, n_head=4, d_model=128, block_size=64)
    assert set(weights) == set(model.state_dict())
    assert manifest["step"] == 6 and "sha256" in manifest["files"]["model.safetensors"]


def test_default_job_on_bpe_tokens_prepared_once_into_shards(tmp_path):
    sets = ["train.steps=4", "train.log_every=2", "train.eval_every=4", "data.max_chars=100000"]
    sets += ["data.tokenizer=bpe:512", f"data.cache_dir={tmp_path / 'cache'}"]
    proc = check_ok(run_cli("run", *(a for s in sets for a in ("--set", s)), "--run-dir", str(tmp_path / "run")))
    # the launcher prepares the shards before the workers start; they stream what it wrote
    assert proc.stdout.count("data: prepared the corpus as bpe:512 tokens") == 1, proc.stdout
    assert final_weights(tmp_path / "run")["embed.tok.weight"].shape[0] == 512
    assert "val_loss" in metrics(tmp_path / "run")[-1]


def test_digits_reaches_90_percent(tmp_path, gang):
    cfg = write_config(
        tmp_path / "digits.toml",
        """
name = "digits-mlp"
[model]
factory = "mlp"
hidden = 128
[data]
factory = "digits"
batch_size = 64
[train]
steps = 150
optimizer = "adamw"
lr = 0.003
log_every = 50
eval_every = 75
""",
    )
    gang(2).train(cfg, tmp_path / "run")
    final = metrics(tmp_path / "run")[-1]
    assert final["step"] == 150 and final["val_acc"] >= 0.90, final


def test_corpus_from_an_fsspec_url(tmp_path):
    from paratrain.data.datasets import corpus

    (tmp_path / "t.txt").write_text("abcabcabd" * 100)
    ds = corpus(block_size=8, path=f"file://{tmp_path / 't.txt'}")
    assert ds.vocab_size == 4 and len(ds) == (900 * 9 // 10 - 1) // 8
    x, y = ds[0]
    assert x.shape == (8,) and (x[1:] == y[:-1]).all()


def test_val_fraction_zero_trains_on_every_sample_without_validation():
    from paratrain.data.datasets import corpus, digits

    assert len(digits("train", val_fraction=0.0)) == 1797 and len(digits("val", val_fraction=0.0)) == 0
    assert len(corpus("val", val_fraction=0.0)) == 0  # the trainer skips evaluating an empty split
