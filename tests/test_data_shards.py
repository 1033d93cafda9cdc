"""Data at scale: `paratrain data prepare`, shards streamed from S3 (moto's server) and HTTP, the
global order at any world size, exact resume from the data position every checkpoint records, and
fine-tuning data (chat, prompt-completion, packed, with a validation split) in the model's own tokenizer."""

from __future__ import annotations

import collections
import functools
import http.server
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import check_ok, final_weights, metrics, rel_error, run_cli, write_config

from paratrain.bench.data import local_s3_server
from paratrain.cli import main
from paratrain.data.stream import shards

BLOCK, BATCH, EPOCH_STEPS = 16, 16, 10
SAMPLES = BATCH * EPOCH_STEPS  # an epoch ends exactly at step 10


def corpus_text() -> str:
    """SAMPLES blocks of BLOCK bytes and one more byte (the last target), from the stdlib's source."""
    from paratrain.data.datasets import stdlib_text

    text = stdlib_text(40_000).encode("ascii", "replace").decode()
    return text[: SAMPLES * BLOCK + 1]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    src = root / "src"
    src.mkdir()
    text = corpus_text()
    (src / "a.txt").write_text(text[:1000])
    (src / "b.txt").write_text(text[1000:])
    assert (
        main(
            [
                "data",
                "prepare",
                str(src),
                str(root / "local"),
                "--block-size",
                str(BLOCK),
                "--shard-mb",
                str(40 * (BLOCK + 1) * 2 / 2**20),
                "--workers",
                "2",
            ]
        )
        == 0
    )
    return root


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on 127.0.0.1, and the fsspec storage options that reach it."""
    import s3fs

    with local_s3_server() as options:
        s3fs.S3FileSystem(**options).mkdir("paratrain-data")
        yield options


@pytest.fixture
def http_server(prepared):
    """A read-only HTTP server over the prepared folder whose first GET of each shard fails with
    503; it counts the shards it served."""
    failed, served = set(), collections.Counter()

    class Flaky(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            if self.path.endswith(".safetensors") and self.path not in failed:
                failed.add(self.path)
                self.send_error(503)
                return
            served[self.path] += 1
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Flaky, directory=str(prepared / "local"))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", failed, served
    server.shutdown()


def test_prepare_is_deterministic_and_bad_input_exits_2(tmp_path, capsys):
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n", "n": i}) for i in range(300)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines))
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        assert (
            main(
                [
                    "data",
                    "prepare",
                    str(tmp_path / "a.jsonl"),
                    str(out),
                    "--tokenizer",
                    "bpe:300",
                    "--block-size",
                    "8",
                    "--shard-mb",
                    "0.001",
                    "--workers",
                    str(workers),
                ]
            )
            == 0
        )
        outs.append({p.name: p.read_bytes() for p in out.iterdir()})
    assert outs[0] == outs[1]  # byte-identical, whatever the number of processes
    index = json.loads(outs[0]["index.json"])
    assert index["vocab_size"] == 300 and len(index["shards"]) > 1 and "tokenizer.json" in outs[0]
    import hashlib

    for shard in index["shards"]:
        data = outs[0][shard["name"]]
        assert len(data) == shard["bytes"] and hashlib.sha256(data).hexdigest() == shard["sha256"]

    np.save(tmp_path / "rows.npy", np.arange(90, dtype=np.int32).reshape(10, 9))
    (tmp_path / "t.csv").write_text("body,n\nhello world,1\n")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait")
    assert main(["data", "prepare", str(tmp_path / "rows.npy"), str(tmp_path / "npy"), "--block-size", "8"]) == 0
    assert json.loads((tmp_path / "npy" / "index.json").read_text())["samples"] == 10
    capsys.readouterr()
    for args, where in (
        (["missing.txt"], "SRC: missing.txt"),
        ([str(tmp_path / "a.jsonl"), "--field", "body"], "--field"),
        ([str(tmp_path / "t.csv"), "--field", "text"], "--field"),
        ([str(tmp_path / "bad.txt")], "not UTF-8"),
        ([str(tmp_path / "rows.npy"), "--block-size", "4"], "--block-size"),
    ):
        assert main(["data", "prepare", *args, str(tmp_path / "never")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("paratrain: error: ") and where in err, err


def test_the_corpus_as_bpe_tokens_is_prepared_once_into_shards_deterministically(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    from paratrain.config import ArgumentError
    from paratrain.data import datasets
    from paratrain.data import prepare as prepare_mod
    from paratrain.data.stream import ShardDataset

    spec = {"block_size": 16, "max_chars": 30_000, "tokenizer": "bpe:300"}
    train = datasets.corpus("train", cache_dir=str(tmp_path / "a"), **spec)
    val = datasets.corpus("val", cache_dir=str(tmp_path / "a"), **spec)
    assert isinstance(train, ShardDataset) and train.vocab_size == 300 and len(val) > 0
    (folder,) = [p for p in (tmp_path / "a").glob("text-*") if p.is_dir()]
    tokenizer = Tokenizer.from_file(str(folder / "train" / "tokenizer.json"))
    assert (folder / "val" / "tokenizer.json").read_bytes() == (folder / "train" / "tokenizer.json").read_bytes()
    x, y = train[0]
    assert torch.equal(x[1:], y[:-1]) and datasets.stdlib_text(30_000).startswith(tokenizer.decode(x.tolist()))

    def never(job):
        raise AssertionError(f"prepared again: {job}")

    monkeypatch.setattr(prepare_mod, "prepare", never)  # a later run (or another rank) finds it
    assert len(datasets.corpus("train", cache_dir=str(tmp_path / "a"), **spec)) == len(train)
    monkeypatch.undo()
    datasets.corpus("train", cache_dir=str(tmp_path / "b"), **spec)
    (again,) = [p for p in (tmp_path / "b").glob("text-*") if p.is_dir()]
    files = [p.relative_to(folder) for p in sorted(folder.rglob("*")) if p.is_file()]
    assert files == [p.relative_to(again) for p in sorted(again.rglob("*")) if p.is_file()]
    assert all((folder / f).read_bytes() == (again / f).read_bytes() for f in files)  # byte-identical
    assert len(datasets.corpus("val", cache_dir=str(tmp_path / "a"), **spec, val_fraction=0.0)) == 0
    with pytest.raises(ArgumentError, match="bpe:VOCAB"):
        datasets.corpus(tokenizer="bpe:many", cache_dir=str(tmp_path / "a"))


def test_order_is_global_seeded_and_resumes_at_the_recorded_position(prepared, tmp_path):
    ds = shards(str(prepared / "local"), cache_dir=str(tmp_path / "cache"), shuffle_window=64)
    assert len(ds) == SAMPLES and len(ds.index.shards) == 4
    sampler = ds.global_batch_sampler(BATCH, True, seed=3)
    steps = range(3 * EPOCH_STEPS)
    stream = torch.cat([sampler.global_indices(i) for i in steps])
    for world in (2, 4):  # step i's global batch is the ranks' slices, in rank order, at any world size
        again = ds.global_batch_sampler(BATCH, True, seed=3)
        assert torch.equal(stream, torch.cat([again.rank_indices(i, r, world) for i in steps for r in range(world)]))
    epochs = stream.view(3, SAMPLES)
    for e in range(3):  # every epoch is a permutation, none the same, each a window shuffle of shards
        assert torch.equal(epochs[e].sort().values, torch.arange(SAMPLES))
    assert not torch.equal(epochs[0], epochs[1])
    assert not torch.equal(
        stream, torch.cat([ds.global_batch_sampler(BATCH, True, 4).global_indices(i) for i in steps])
    )
    assert torch.equal(
        ds.global_batch_sampler(BATCH, False, 3).global_indices(12), torch.arange(12 * BATCH, 13 * BATCH) % SAMPLES
    )  # the contract's unshuffled order
    # A checkpoint at step 6 (mid-epoch) and 10 (an epoch's end) records (epoch, sample in epoch);
    # a sampler resumed there, even with another batch size, goes on with the exact next sample.
    assert sampler.position(6) == {"epoch": 0, "sample_in_epoch": 96}
    assert sampler.position(10) == {"epoch": 1, "sample_in_epoch": 0}
    assert len(json.dumps(sampler.position(10**9))) < 1024
    for step in (6, 10, 17):
        resumed = ds.global_batch_sampler(BATCH // 2, True, seed=3)
        resumed.resume_at(step, sampler.position(step))
        assert torch.equal(
            torch.cat([resumed.global_indices(step), resumed.global_indices(step + 1)]), sampler.global_indices(step)
        )


def test_http_streams_with_retries_and_a_bounded_cache_that_ranks_share(prepared, http_server, tmp_path):
    url, failed, served = http_server
    local = shards(str(prepared / "local"), cache_dir=str(tmp_path / "a"))
    shard_bytes = local.index.shards[0].bytes
    remote = shards(url, cache_dir=str(tmp_path / "b"), cache_limit_gb=2.5 * shard_bytes / 2**30)
    every = torch.arange(SAMPLES)
    assert all(torch.equal(a, b) for a, b in zip(remote.load_batch(every), local.load_batch(every)))
    assert len(failed) == 4  # each shard's first GET failed (503) and was retried
    cached = list(remote.cache.dir.iterdir())
    assert sum(p.stat().st_size for p in cached if p.suffix == ".safetensors") <= 2.5 * shard_bytes
    assert not [p for p in cached if p.name.endswith(".part")]

    # Two ranks of one node, one cache: each shard is downloaded once, the other rank waits for it.
    served.clear()
    ranks = [shards(url, cache_dir=str(tmp_path / "shared")) for _ in range(2)]
    threads = [threading.Thread(target=rank.load_batch, args=(every,)) for rank in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(n for path, n in served.items() if path.endswith(".safetensors")) == [1] * 4, served


def gpt_job(tmp_path: Path, path: str, options: dict | None, shuffle: bool = True, cache: str = "cache") -> Path:
    opts = "{" + ", ".join(f'{k} = "{v}"' for k, v in (options or {}).items()) + "}"
    return write_config(
        tmp_path / f"{cache}.toml",
        f"""
name = "shards"
[model]
factory = "gpt"
n_layer = 1
n_head = 2
d_model = 32
block_size = {BLOCK}
[data]
factory = "shards"
path = "{path}"
cache_dir = "{tmp_path / cache}"
storage_options = {opts}
shuffle_window = 64
batch_size = {BATCH}
shuffle = {str(shuffle).lower()}
[train]
steps = 24
optimizer = "sgd"
lr = 0.5
log_every = 2
eval_every = 0
[checkpoint]
every = 2
""",
    )


def test_s3_streamed_training_equals_local_and_one_process_and_resumes_exactly(prepared, s3, tmp_path, gang):
    env = {f"FSSPEC_S3_{k.upper()}": v for k, v in s3.items()}  # how `data prepare` reaches a custom endpoint
    check_ok(
        run_cli(
            "data",
            "prepare",
            str(prepared / "src"),
            "s3://paratrain-data/ds",
            "--block-size",
            str(BLOCK),
            "--shard-mb",
            str(40 * (BLOCK + 1) * 2 / 2**20),
            env=env,
        )
    )
    # Uninterrupted, streamed from S3 at world 2.
    streamed = tmp_path / "streamed"
    gang(2).train(gpt_job(tmp_path, "s3://paratrain-data/ds", s3, cache="s3cache"), streamed)
    assert sorted(p.name for p in (tmp_path / "s3cache").rglob("*.safetensors")) == [
        f"shard-0000{i}.safetensors" for i in range(4)
    ]

    # The same from local files, stopped mid-epoch (step 6, world 2), resumed to exactly an epoch's
    # end (step 10, world 1), resumed a second time to the end (world 2).
    from paratrain.checkpoint.reader import CheckpointReader

    local_job = gpt_job(tmp_path, str(prepared / "local"), None)
    chain = tmp_path / "chain"
    for steps, nproc, resume, position in (
        (6, 2, "none", (0, 96)),
        (EPOCH_STEPS, 1, "auto", (1, 0)),
        (24, 2, "auto", (2, 64)),
    ):
        out = gang(nproc).train(local_job, chain, [f"train.steps={steps}"], resume=resume)
        assert ("resumed from" in out) == (resume == "auto"), out
        _, meta = CheckpointReader(chain / "checkpoints" / f"step-{steps}").load(rank=0)
        assert meta["trainer"]["data"] == {"epoch": position[0], "sample_in_epoch": position[1]}
    assert rel_error(final_weights(chain), final_weights(streamed)) <= 1e-4

    # One plain process: the same model and seed, SGD over the same global batches.
    from reference import train_reference

    from paratrain import config as config_mod
    from paratrain.data import build_sampler
    from paratrain.models import build_model
    from paratrain.runtime.process import seed_everything

    cfg = config_mod.load(str(local_job), [])
    ds = shards(str(prepared / "local"), cache_dir=str(tmp_path / "ref"), shuffle_window=64)
    order = torch.cat([build_sampler(ds, cfg).global_indices(i) for i in range(24)])
    seed_everything(cfg.train.seed)
    model = build_model(cfg, ds)
    x, y = ds.load_batch(order)
    ref = train_reference(model, x, y, steps=24, batch_size=BATCH, lr=0.5)
    assert rel_error(final_weights(streamed), ref) <= 1e-4


def test_a_corrupt_shard_stops_the_run_naming_it_and_keeps_the_checkpoints(prepared, s3, tmp_path):
    import s3fs

    fs = s3fs.S3FileSystem(**s3)
    fs.put(str(prepared / "local") + "/", "paratrain-data/corrupt/", recursive=True)
    data = bytearray(fs.cat("paratrain-data/corrupt/shard-00002.safetensors"))
    data[-1] ^= 0xFF
    fs.pipe("paratrain-data/corrupt/shard-00002.safetensors", bytes(data))
    run_dir = tmp_path / "run"
    # Unshuffled, shard 2 (samples 80-119) is first read at step 5.
    proc = run_cli(
        "run",
        str(gpt_job(tmp_path, "s3://paratrain-data/corrupt", s3, shuffle=False)),
        "--nproc",
        "1",
        "--run-dir",
        str(run_dir),
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("paratrain: error: data.path: ") and "shard-00002.safetensors" in last and "sha256" in last
    ), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert main(["inspect", str(run_dir / "checkpoints" / "step-4")]) == 0  # saved before it, intact


def test_a_corrupt_shard_is_skipped_where_configured_the_next_shard_that_verifies_standing_in(
    prepared, tmp_path, monkeypatch, capsys
):
    import shutil

    from paratrain.data import shards as shards_mod
    from paratrain.errors import ConfigError

    monkeypatch.setattr(shards_mod.time, "sleep", lambda s: None)  # the retries of a corrupt download
    copy = tmp_path / "shards"
    shutil.copytree(prepared / "local", copy)
    data = bytearray((copy / "shard-00002.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (copy / "shard-00002.safetensors").write_bytes(bytes(data))
    every = torch.arange(SAMPLES)
    with pytest.raises(ConfigError, match="shard-00002.safetensors"):
        shards(str(copy), cache_dir=str(tmp_path / "strict")).load_batch(every)
    capsys.readouterr()
    x, y = shards(str(copy), cache_dir=str(tmp_path / "skip"), skip_corrupt=True).load_batch(every)
    clean_x, clean_y = shards(str(prepared / "local"), cache_dir=str(tmp_path / "clean")).load_batch(every)
    two, three = slice(80, 120), slice(120, 160)  # 40 samples a shard: shard 3 verifies and stands in
    assert torch.equal(x[two], clean_x[three]) and torch.equal(y[two], clean_y[three])
    assert torch.equal(x[:80], clean_x[:80]) and torch.equal(x[120:], clean_x[120:])
    # a rank whose slice holds only shard 2 picks the same stand-in
    other = shards(str(copy), cache_dir=str(tmp_path / "skip"), skip_corrupt=True)
    assert torch.equal(other.load_batch(every[two])[0], clean_x[three])
    err = capsys.readouterr().err
    assert err.count("shard-00002.safetensors") == 2 and err.count("skipped (data.skip_corrupt)") == 2, err


# -- fine-tuning data: the model's own tokenizer, chat and prompt-completion, packing, a val split --
WORDS = "red green blue cat dog bird runs jumps sleeps today now here".split()
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer learnt here on a few lines, with a chat template, as
    `save_pretrained` writes it (nothing downloaded). Every word with its leading space is one
    token, so replies of as many words have as many labels."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) + " " for i in range(len(WORDS))] * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    )
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    assert all(len(fast(" " + w, add_special_tokens=False)["input_ids"]) == 1 for w in WORDS)
    return out


def sentence(rng: np.random.Generator, n: int) -> str:
    return "".join(" " + WORDS[i] for i in rng.integers(0, len(WORDS), n))


def chat_lines(n: int, max_exchanges: int = 2) -> list[dict]:
    """Conversations of up to `max_exchanges` exchanges, prompts of any length, every reply three words."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        messages = [{"role": "system", "content": sentence(rng, 2)}] if i % 3 == 0 else []
        for _ in range(1 + i % max_exchanges if i % 4 else 1):
            messages += [
                {"role": "user", "content": sentence(rng, int(rng.integers(1, 6)))},
                {"role": "assistant", "content": sentence(rng, 3)},
            ]
        lines.append({"messages": messages})
    return lines


def prompt_completion_lines(n: int) -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"prompt": sentence(rng, int(rng.integers(1, 8))), "completion": sentence(rng, 2)} for _ in range(n)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_samples(dest: Path) -> dict[str, np.ndarray]:
    """Every shard of a folder `data prepare` wrote, its columns end to end."""
    from safetensors.numpy import load_file

    index = json.loads((dest / "index.json").read_text())
    shards = [load_file(dest / s["name"]) for s in index["shards"]]
    return {k: np.concatenate([s[k] for s in shards]).astype(np.int64) for k in shards[0]}


def test_chat_and_prompt_completion_data_label_only_replies_pack_whole_and_split(tokenizer_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    chats = chat_lines(24)
    src = {"chat": write_jsonl(tmp_path / "chat.jsonl", chats)}
    src["prompt-completion"] = write_jsonl(tmp_path / "pc.jsonl", prompt_completion_lines(12))
    prepared = {}
    for fmt, pack, workers in (
        ("chat", False, 1),
        ("chat", True, 1),
        ("chat", True, 2),
        ("prompt-completion", False, 1),
    ):
        dest = tmp_path / f"{fmt}-{pack}-{workers}"
        args = [str(src[fmt]), str(dest), "--format", fmt, "--tokenizer", str(tokenizer_dir), "--block-size", "48"]
        args += [
            *(["--pack"] if pack else []),
            "--val-fraction",
            "0.25",
            "--workers",
            str(workers),
            "--shard-mb",
            "0.004",
        ]
        assert main(["data", "prepare", *args]) == 0
        prepared.setdefault((fmt, pack), dest)

    def files(folder: Path) -> dict[str, bytes]:
        return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}

    by_one, by_two = files(prepared["chat", True]), files(tmp_path / "chat-True-2")
    assert by_one == by_two and len(by_one) > 6  # byte-identical, whatever the number of processes

    # The index records the tokenizer, and DEST holds its files: from_pretrained(DEST) is the same tokenizer.
    index = json.loads((prepared["chat", False] / "index.json").read_text())
    assert index["tokenizer"] == str(tokenizer_dir) and "tokenizer.json" in index["tokenizer_files"]
    again = AutoTokenizer.from_pretrained(prepared["chat", False])
    assert index["vocab_size"] == len(tok) == len(again) and again.chat_template == CHAT_TEMPLATE
    assert index["columns"] == ["attention_mask", "input_ids", "labels"] and index["cut_to_block_size"] == 0

    # The last quarter of the samples is the validation split, a shard folder of its own.
    assert index["splits"] == {"val": "val"} and (index["samples"], index["source_documents"]) == (18, 24)
    val = json.loads((prepared["chat", False] / "val" / "index.json").read_text())
    assert val["samples"] == 6 and "splits" not in val
    rows = {
        k: np.concatenate([read_samples(prepared["chat", False])[k], v])
        for k, v in read_samples(prepared["chat", False] / "val").items()
    }

    # Chat: learnt are exactly each assistant message's tokens and the end of its turn.
    for i, chat in enumerate(chats):
        ids, labels, mask = rows["input_ids"][i], rows["labels"][i], rows["attention_mask"][i].astype(bool)
        assert tok.decode(ids[mask]) == tok.apply_chat_template(chat["messages"], tokenize=False)
        learnt = labels != -100
        assert (labels[learnt] == ids[learnt]).all() and not (learnt & ~mask).any()
        replies = [m["content"] + "</s>" for m in chat["messages"] if m["role"] == "assistant"]
        assert tok.decode(labels[learnt]) == "".join(replies)
        assert learnt.sum() == 4 * len(replies)  # three words and the end of turn: nothing of the prompt

    # Prompt-completion: -100 on the prompt's tokens, the completion and its end learnt.
    pc = read_samples(prepared["prompt-completion", False])
    for ids, labels, record in zip(pc["input_ids"], pc["labels"], prompt_completion_lines(12)):
        prompt = tok(record["prompt"])["input_ids"]
        n_prompt = len(prompt)
        assert (
            ids[:n_prompt].tolist() == prompt
            and (labels[:n_prompt] == -100).all()
            and tok.decode(labels[n_prompt : n_prompt + 3]) == (record["completion"] + "</s>")
        )
        assert (labels[n_prompt + 3 :] == -100).all()

    # Packed: the same documents whole and in order, positions restarting at each, and no label
    # learnt from the document before.
    packed = read_samples(prepared["chat", True])
    assert set(packed) == {"input_ids", "labels", "position_ids"} and len(packed["input_ids"]) < 24
    documents = []
    for ids, labels, positions in zip(packed["input_ids"], packed["labels"], packed["position_ids"]):
        starts = np.flatnonzero(positions == 0).tolist() + [len(positions)]
        assert (labels[starts[:-1]] == -100).all()
        for a, b in zip(starts, starts[1:]):
            assert (positions[a:b] == np.arange(b - a)).all()
            if ids[a] != tok.pad_token_id:
                documents.append((ids[a:b].tolist(), labels[a:b].tolist()))
    unpacked = [
        (ids[m].tolist(), lab[m].tolist())
        for ids, lab, m in zip(rows["input_ids"], rows["labels"], rows["attention_mask"].astype(bool))
    ]
    n_documents = json.loads((prepared["chat", True] / "index.json").read_text())["source_documents"]
    assert n_documents == 24 and len(documents) > 12 and documents == unpacked[: len(documents)]

    # `[data] factory = "shards"` gives these rows as dict samples, the val split as its val.
    split_sets = {
        split: shards(str(prepared["chat", True]), cache_dir=str(tmp_path / "cache"), split=split)
        for split in ("train", "val")
    }
    for dataset, folder in zip(split_sets.values(), (prepared["chat", True], prepared["chat", True] / "val")):
        batch, target = dataset.load_batch(torch.arange(len(dataset)))
        assert target is None and {k: v.numpy().tolist() for k, v in batch.items()} == {
            k: v.tolist() for k, v in read_samples(folder).items()
        }
        assert set(dataset[0]) == {"input_ids", "labels", "position_ids"}
    kept = split_sets["train"].tokenizer_files()
    assert kept == {name: (prepared["chat", True] / name).read_bytes() for name in index["tokenizer_files"]}
    assert len(shards(str(prepared["prompt-completion", False]), cache_dir=str(tmp_path / "cache"))) == 9

    # Bad input exits 2 in one line naming it.
    write_jsonl(tmp_path / "bad.jsonl", [*chats[:2], {"messages": [{"role": "user", "content": "hi"}]}])
    capsys.readouterr()
    for args, where in (
        ([str(src["chat"]), "--format", "chat"], "--tokenizer DIR"),
        ([str(src["chat"]), "--format", "chat", "--tokenizer", str(tmp_path / "nowhere")], "--tokenizer"),
        ([str(tmp_path / "bad.jsonl"), "--format", "chat", "--tokenizer", str(tokenizer_dir)], "line 3 of"),
        ([str(src["prompt-completion"]), "--format", "chat", "--tokenizer", str(tokenizer_dir)], "`messages`"),
        ([str(src["chat"]), "--format", "prompt-completion", "--tokenizer", str(tokenizer_dir)], "`prompt`"),
        ([str(src["chat"]), "--format", "chat", "--tokenizer", str(tokenizer_dir), "--val-fraction", "1"], "[0, 1)"),
    ):
        assert main(["data", "prepare", *args, str(tmp_path / "never")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("paratrain: error: ") and where in err, err

    # A packed row as a Llama reads it: each document's logits as if it were alone. transformers
    # finds the documents from the positions only without a cache (use_cache = false in its config).
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    size = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), max_position_embeddings=48, use_cache=False, **size))
    row = {k: torch.from_numpy(packed[k][:1]) for k in ("input_ids", "position_ids")}
    logits = model(**row).logits[0]
    starts = torch.nonzero(row["position_ids"][0] == 0).flatten().tolist()
    assert len(starts) > 2  # documents and padding
    for a, b in zip(starts, starts[1:3]):
        assert torch.allclose(logits[a:b], model(row["input_ids"][:, a:b]).logits[0], atol=1e-5)


def train_at_world_1_and_2(
    gang, tmp_path: Path, tokenizer_dir: Path, fmt: str, records: list[dict], launch: bool = False
) -> dict[int, Path]:
    """`records` prepared as --format fmt with a validation split, and a tiny Llama sized by the
    tokenizer trained on them at world 1 and at world 2 (with `launch`, by `paratrain run` itself,
    the launcher's checks of the data included): the two run directories."""
    from transformers import AutoTokenizer

    data = tmp_path / fmt
    src = write_jsonl(tmp_path / f"{fmt}.jsonl", records)
    args = ["--format", fmt, "--tokenizer", str(tokenizer_dir), "--block-size", "32", "--val-fraction", "0.2"]
    assert main(["data", "prepare", str(src), str(data), *args]) == 0
    job = write_config(
        tmp_path / f"{fmt}.toml",
        f"""
name = "sft"
[model]
factory = "hf"
config = {{ model_type = "llama", vocab_size = {len(AutoTokenizer.from_pretrained(tokenizer_dir))}, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1, num_attention_heads = 2, num_key_value_heads = 2, max_position_embeddings = 32 }}
[data]
factory = "shards"
path = "{data}"
cache_dir = "{tmp_path / "cache"}"
batch_size = 8
[train]
steps = 6
optimizer = "sgd"
lr = 0.5
loss = "model"
log_every = 3
eval_every = 3
""",
    )
    runs = {world: tmp_path / f"{fmt}-world{world}" for world in (1, 2)}
    gang(1).train(job, runs[1])
    if launch:
        check_ok(run_cli("run", str(job), "--nproc", "2", "--run-dir", str(runs[2])))
    else:
        gang(2).train(job, runs[2])
    return runs


def test_chat_and_prompt_completion_data_train_at_world_2_as_at_world_1_with_val_loss(tokenizer_dir, tmp_path, gang):
    """Every sample has as many labels (one reply of three words and its end; a completion of two
    and its end), so each rank's mean over its label tokens is the global batch's mean over them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sources = {"chat": chat_lines(40, max_exchanges=1), "prompt-completion": prompt_completion_lines(40)}
    for fmt, records in sources.items():
        runs = train_at_world_1_and_2(gang, tmp_path, tokenizer_dir, fmt, records, launch=fmt == "chat")
        assert rel_error(final_weights(runs[1]), final_weights(runs[2])) <= 1e-4
        evaluated = [m for m in metrics(runs[2]) if "val_loss" in m]
        assert [m["step"] for m in evaluated] == [3, 6]
        assert all(m["val_perplexity"] == pytest.approx(np.exp(m["val_loss"])) for m in evaluated)
    # final/ is a Hugging Face directory with the data's tokenizer: both load from it.
    final = runs[2] / "final"
    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    assert len(AutoTokenizer.from_pretrained(final)) == vocab_size
    assert AutoModelForCausalLM.from_pretrained(final).config.vocab_size == vocab_size


def test_chat_data_with_uneven_labels_per_rank_trains_at_world_2_as_at_world_1(tokenizer_dir, tmp_path, gang):
    runs = train_at_world_1_and_2(gang, tmp_path, tokenizer_dir, "chat", chat_lines(40, max_exchanges=2))
    assert rel_error(final_weights(runs[1]), final_weights(runs[2])) <= 1e-4
