"""Checkpoints and run files from untrusted or damaged places: crafted manifests and shards, torn
metrics lines, pruning next to corrupt checkpoints, leftovers of crashed saves.

Every refusal here is exit 2 (or, under --resume auto, a skipped checkpoint) with one line, never a
traceback. Everything runs in this process: the real trainer writes a real checkpoint once, as a
lone rank, and resumes from damaged copies of it.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import metrics, write_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import DIGITS_MLP
from safetensors.torch import save as st_save

import paratrain.data
from paratrain import checkpoint as ckpt
from paratrain import config as config_mod
from paratrain.checkpoint import format as checkpoint_format
from paratrain.checkpoint.inspect import inspect
from paratrain.cli import main
from paratrain.errors import ConfigError
from paratrain.metrics import keep_steps_up_to, read_jsonl
from paratrain.run_dir import check_resume, prepare_run_dir

CONFIG = (
    DIGITS_MLP.replace("steps = 20", "steps = 8").replace("log_every = 10", "log_every = 4")
    + """
[checkpoint]
every = 4
keep = 4
"""
)


def train_in_process(*argv: str) -> int:
    """A one-rank run of the real trainer in this process: no interpreter to start, no rendezvous."""
    from paratrain.trainer import main as worker_main

    saved = {k: os.environ.pop(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k in os.environ}
    try:
        return worker_main(list(argv))
    finally:
        for k in ("MASTER_ADDR", "MASTER_PORT"):  # the lone process picked a port: the next picks its own
            os.environ.pop(k, None)
        os.environ.update(saved)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A run directory with checkpoints step-4 and step-8 and a final export."""
    root = tmp_path_factory.mktemp("pristine")
    cfg = write_config(root / "c.toml", CONFIG)
    assert train_in_process(str(cfg), "--run-dir", str(root / "run")) == 0
    return root


def fresh_copy(pristine: Path, dest: Path) -> Path:
    shutil.copytree(pristine / "run", dest)
    return dest


def rewrite_manifest(ckpt_dir: Path, edit) -> None:
    path = ckpt_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps(edit(manifest)))


def reseal(ckpt_dir: Path) -> None:
    """Make the manifest's sizes and checksums those of the files as they are now (what an
    attacker crafting a checkpoint does)."""

    def edit(m):
        for name in m["files"]:
            data = (ckpt_dir / name).read_bytes()
            m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        return m

    rewrite_manifest(ckpt_dir, edit)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paratrain: error: "), err[-2000:]
    return lines[0]


def refuse_resume(pristine: Path, ckpt_dir: Path, capsys, *extra: str) -> str:
    assert (
        main(
            [
                "run",
                str(pristine / "c.toml"),
                "--resume",
                str(ckpt_dir),
                "--run-dir",
                str(ckpt_dir.parents[2] / "elsewhere"),
                *extra,
            ]
        )
        == 2
    )
    return one_error_line(capsys.readouterr().err)


# -- point 3: the names paratrain writes, no symlinks, a world size that matches the files ---------
@pytest.mark.parametrize(
    "name",
    ["../rank-00000.safetensors", "ABSOLUTE", "sub/rank-00000.safetensors", "rank-0.safetensors", "model.safetensors"],
)
def test_a_manifest_names_only_files_paratrain_writes(pristine, tmp_path, capsys, name):
    """Each name is there with the shard's bytes, and the manifest holds their checksum: only the
    name can refuse it."""
    run = fresh_copy(pristine, tmp_path / "run")
    step = run / "checkpoints" / "step-8"
    if name == "ABSOLUTE":
        name = str(tmp_path / "outside.safetensors")
    outside = step / name  # an absolute name replaces the directory
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(step / "rank-00000.safetensors", outside)
    entry = {"sha256": checkpoint_format.sha256_file(outside), "bytes": outside.stat().st_size}
    rewrite_manifest(step, lambda m: {**m, "files": {name: entry}})
    with pytest.raises(ckpt.CheckpointError, match="not a file name paratrain writes"):
        ckpt.CheckpointReader(step).verify()
    assert inspect(step, out=io.StringIO()) == 2
    one_error_line(capsys.readouterr().err)
    assert "--resume" in refuse_resume(pristine, step, capsys)


def test_a_symlinked_shard_is_refused_not_followed(pristine, tmp_path, capsys):
    run = fresh_copy(pristine, tmp_path / "run")
    step = run / "checkpoints" / "step-8"
    target = tmp_path / "elsewhere.safetensors"
    (step / "rank-00000.safetensors").rename(target)
    (step / "rank-00000.safetensors").symlink_to(target)  # the same bytes: the checksum holds
    with pytest.raises(ckpt.CheckpointError, match="symlink"):
        ckpt.CheckpointReader(step).verify()
    listing = io.StringIO()
    assert inspect(step, out=listing) == 2
    assert "SYMLINK (not followed)" in listing.getvalue()
    one_error_line(capsys.readouterr().err)
    assert "symlink" in refuse_resume(pristine, step, capsys)
    assert ckpt.latest_valid(run, log=lambda m: None).step == 4


@pytest.mark.parametrize("world_size", [10**12, 1e12, 2, 0, True])
def test_world_size_must_match_the_files(pristine, tmp_path, capsys, world_size):
    """1e12 drove a loop over ranks that never ended."""
    run = fresh_copy(pristine, tmp_path / "run")
    step = run / "checkpoints" / "step-8"
    rewrite_manifest(step, lambda m: {**m, "world_size": world_size})
    with pytest.raises(ckpt.CheckpointError, match="world_size"):
        ckpt.CheckpointReader(step)
    assert "world_size" in refuse_resume(pristine, step, capsys)


@pytest.mark.parametrize("parallel", [{"tp": 3}, {"pp": 0}, {"tp": "2"}])
def test_a_layout_that_does_not_divide_the_world_size_is_refused(pristine, tmp_path, parallel):
    """hybrid's resume takes its shards' layout (tp, pp) from the manifest's config."""
    run = fresh_copy(pristine, tmp_path / "run")
    step = run / "checkpoints" / "step-8"

    def edit(m):
        m["config"]["parallel"].update(parallel)
        return m

    rewrite_manifest(step, edit)
    with pytest.raises(ckpt.CheckpointError, match="do not divide world_size"):
        ckpt.CheckpointReader(step)


# -- point 7: each reproduced crash, and the fuzz -------------------------------------------------
def header_length_2_60(step: Path) -> None:
    shard = step / "rank-00000.safetensors"
    shard.write_bytes(struct.pack("<Q", 2**60) + shard.read_bytes()[8:])
    reseal(step)


def shard_dims_out_of_range(step: Path) -> None:
    """A second shard of the same tensors, claiming they are split along dimension 7."""
    tensors, meta = ckpt.CheckpointReader(step).load(0)
    meta["shard_dims"] = {"0.weight": 7}
    (step / "rank-00001.safetensors").write_bytes(st_save(tensors, metadata={"json": json.dumps(meta)}))

    def edit(m):
        m["files"]["rank-00001.safetensors"] = m["files"]["rank-00000.safetensors"]
        return {**m, "world_size": 2}

    rewrite_manifest(step, edit)
    reseal(step)


def zero_without_metadata(step: Path) -> None:
    tensors, _ = ckpt.CheckpointReader(step).load(0)
    (step / "rank-00000.safetensors").write_bytes(st_save(tensors))
    rewrite_manifest(step, lambda m: {**m, "strategy": "zero2"})
    reseal(step)


@pytest.mark.parametrize(
    "command,damage,extra",
    [
        ("inspect", lambda s: (s / "manifest.json").write_text("[]"), ()),
        ("inspect", lambda s: (s / "manifest.json").write_text("[" * 100_000 + "]" * 100_000), ()),
        ("inspect", lambda s: (s / "manifest.json").write_text(json.dumps({"format": ckpt.FORMAT})), ()),
        ("resume", header_length_2_60, ()),
        ("resume", shard_dims_out_of_range, ()),
        ("resume", zero_without_metadata, ("--set", "parallel.strategy='zero2'")),
    ],
    ids=[
        "inspect-list",
        "inspect-deep-json",
        "inspect-missing-keys",
        "resume-header-2^60",
        "resume-shard-dims",
        "resume-zero-no-metadata",
    ],
)
def test_crafted_checkpoints_exit_2_with_one_line(pristine, tmp_path, capsys, command, damage, extra):
    run = fresh_copy(pristine, tmp_path / "run")
    step = run / "checkpoints" / "step-8"
    damage(step)
    if command == "inspect":
        assert main(["inspect", str(step)]) == 2
        one_error_line(capsys.readouterr().err)
    else:
        refuse_resume(pristine, step, capsys, *extra)


def test_resume_auto_skips_a_manifest_that_is_a_list_for_the_older_checkpoint(pristine, tmp_path, capsys):
    run = fresh_copy(pristine, tmp_path / "run")
    (run / "checkpoints" / "step-8" / "manifest.json").write_text("[]")
    cfg = config_mod.load(str(pristine / "c.toml"), [])
    assert check_resume("auto", cfg, run) == 4
    warnings = []
    assert ckpt.latest_valid(run, log=warnings.append).step == 4
    assert "skipping checkpoint step 8" in warnings[0] and (run / "checkpoints.invalid" / "step-8").is_dir()


def test_resume_auto_skips_a_checkpoint_with_a_shard_missing(pristine, tmp_path):
    """A lost shard is the checkpoint's loss, not a model that does not match: auto falls back
    (it exited 2 "does not match the model" under the strategies whose shapes come from every shard)."""
    run = fresh_copy(pristine, tmp_path / "run")
    (run / "checkpoints" / "step-8" / "rank-00000.safetensors").unlink()
    cfg = config_mod.load(str(pristine / "c.toml"), [])
    assert check_resume("auto", cfg, run) == 4
    warnings = []
    assert ckpt.latest_valid(run, log=warnings.append).step == 4
    assert len(warnings) == 1 and "skipping checkpoint step 8" in warnings[0] and "missing" in warnings[0]


def test_a_read_only_checkpoints_folder_exits_2_before_a_resume_starts(pristine, tmp_path, capsys):
    """Its first save failed in every worker with a traceback; a read-only bind mount stands for
    it, where this process may mount one (root: permissions alone do not stop root)."""
    run = fresh_copy(pristine, tmp_path / "run")
    checkpoints = run / "checkpoints"
    if subprocess.run(["mount", "--bind", str(checkpoints), str(checkpoints)], capture_output=True).returncode:
        pytest.skip("no bind mount here")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(checkpoints)], check=True)
        code = main(["run", str(pristine / "c.toml"), "--resume", "auto", "--run-dir", str(run)])
    finally:
        subprocess.run(["umount", str(checkpoints)], check=True)
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and f"--run-dir: {checkpoints} is not writable: Read-only file system" in line, line


# Mutations of a real checkpoint: its manifest's JSON structure, the bytes of a shard's header or
# body (sealed again into the manifest, as a crafted checkpoint would be, or not), its file names.
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
MANIFEST_KEYS = ["format", "step", "world_size", "strategy", "time", "config", "files"]
NAMES = st.sampled_from(
    [
        "../rank-00000.safetensors",
        "/dev/zero",
        "rank-00001.safetensors",
        "rank-1.safetensors",
        "manifest.json",
        ".",
        "",
        "rank-00000.safetensors/..",
        "step-4/rank-00000.safetensors",
    ]
)


def mutate_manifest(m: dict, data) -> dict:
    how = data.draw(st.sampled_from(["drop", "replace", "file-entry", "whole"]))
    if how == "whole":
        return data.draw(JSON_VALUES)
    m = copy.deepcopy(m)
    if how == "file-entry":
        entry = m["files"]["rank-00000.safetensors"]
        entry[data.draw(st.sampled_from(["sha256", "bytes", "other"]))] = data.draw(JSON_VALUES)
        return m
    key = data.draw(st.sampled_from(MANIFEST_KEYS))
    if how == "drop":
        m.pop(key)
    else:
        m[key] = data.draw(JSON_VALUES)
    return m


def mutate_shard(step: Path, data) -> None:
    shard = step / "rank-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    where = data.draw(st.sampled_from(["length", "header", "body", "truncate", "append"]))
    if where == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif where == "append":
        raw += data.draw(st.binary(min_size=1, max_size=16))
    else:
        lo, hi = {"length": (0, 7), "header": (8, header_end - 1), "body": (header_end, len(raw) - 1)}[where]
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(lo, hi))] = data.draw(st.integers(0, 255))
    shard.write_bytes(bytes(raw))
    if data.draw(st.booleans()):
        reseal(step)


def rename_shard(step: Path, data) -> None:
    name = data.draw(NAMES)
    if data.draw(st.booleans()):  # the file moves with the manifest's name for it
        target = step / name
        if name and not target.exists() and target.parent.is_dir():
            (step / "rank-00000.safetensors").rename(target)
    rewrite_manifest(step, lambda m: {**m, "files": {name: m["files"]["rank-00000.safetensors"]}})


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_checkpoints_load_or_are_refused_in_one_line(pristine, capsys, data):
    """Every mutation either loads, or is refused in one line by `inspect` and `--resume PATH`,
    and skipped by `--resume auto` for the older valid checkpoint; no traceback anywhere."""
    cfg = config_mod.load(str(pristine / "c.toml"), [])
    original = json.loads((pristine / "run" / "checkpoints" / "step-8" / "manifest.json").read_text())
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        # the up-front check builds the model from the dataset each time: the same dataset here
        built = functools.cache(functools.partial(paratrain.data.build_dataset, cfg))
        patch.setattr(paratrain.data, "build_dataset", lambda _cfg, split="train": built(split))
        run = fresh_copy(pristine, Path(tmp) / "run")
        step = run / "checkpoints" / "step-8"
        kind = data.draw(st.sampled_from(["manifest", "shard", "name"]))
        if kind == "manifest":
            (step / "manifest.json").write_text(json.dumps(mutate_manifest(original, data)))
        elif kind == "shard":
            mutate_shard(step, data)
        else:
            rename_shard(step, data)
        capsys.readouterr()

        with open(os.devnull, "w") as devnull:
            code = inspect(step, out=devnull)
        assert code in (0, 2)
        err = capsys.readouterr().err
        if code:
            one_error_line(err)
        try:
            resumable = check_resume(str(step), cfg, run) == 8
        except ConfigError as exc:
            resumable = False
            assert "\n" not in str(exc)
        try:
            assert check_resume("auto", cfg, run) in (4, 8)
        except ConfigError as exc:  # e.g. a manifest that names another optimizer: exit 2
            assert "\n" not in str(exc)
        found = ckpt.latest_valid(run, log=lambda m: None)
        assert found.step == 8 if resumable else found.step in (4, 8)
        for rank in range(found.world_size):  # what the workers then read: every shard
            assert found.load(rank)[1]["trainer"]["step"] == found.step


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


# -- point 5: pruning and --resume auto next to a corrupt newer checkpoint -------------------------
def save_step(run: Path, step: int, keep: int) -> Path:
    tensors = {"model.w": torch.full((4,), float(step))}
    return ckpt.save(
        run,
        step,
        tensors,
        {"trainer": {"step": step}},
        rank=0,
        world_size=1,
        strategy="dp",
        config={},
        keep=keep,
        device=torch.device("cpu"),
    )


def test_pruning_keeps_the_checkpoint_just_written_and_counts_only_valid_ones(tmp_path):
    """The issue's scenario: a valid step-10, a corrupt step-30, then step-20 saved with keep = 1."""
    save_step(tmp_path, 10, keep=3)
    corrupt = save_step(tmp_path, 30, keep=3) / "rank-00000.safetensors"
    corrupt.write_bytes(flip_last_byte(corrupt.read_bytes()))
    checkpoint_format.VERIFIED.clear()  # another process's checkpoints, as after a restart
    save_step(tmp_path, 20, keep=1)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-20", "step-30"], names  # step-10 pruned; the corrupt one neither counts nor goes
    assert ckpt.latest_valid(tmp_path, log=lambda m: None).step == 20


def test_resume_auto_moves_a_corrupt_newer_checkpoint_aside_and_survives_a_torn_metrics_line(
    pristine, tmp_path, capsys
):
    """The issue's scenario through the trainer: resume from step-4 past a corrupt step-30 with
    keep = 1, with a metrics.jsonl whose last line a crash tore in half."""
    run = fresh_copy(pristine, tmp_path / "run")
    checkpoints = run / "checkpoints"
    shutil.copytree(checkpoints / "step-8", checkpoints / "step-30")
    shutil.rmtree(checkpoints / "step-8")
    shard = checkpoints / "step-30" / "rank-00000.safetensors"
    shard.write_bytes(flip_last_byte(shard.read_bytes()))
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 9, "loss": 2.3')
    checkpoint_format.VERIFIED.clear()
    assert (
        train_in_process(
            str(pristine / "c.toml"), "--resume", "auto", "--run-dir", str(run), "--set", "checkpoint.keep=1"
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "skipping checkpoint step 30" in err and "checkpoints.invalid" in err, err
    assert "not a log entry" in err, err
    assert "at step 4" in out, out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-8"]
    assert (run / "checkpoints.invalid" / "step-30").is_dir()
    assert [m["step"] for m in metrics(run)] == [4, 8]


# -- point 6: torn lines in the logs ---------------------------------------------------------------
def test_a_log_that_is_not_one_is_summed_up_not_listed_line_by_line(tmp_path, capsys):
    log = tmp_path / "metrics.jsonl"
    log.write_bytes(b"\xff\xfe not json\n" * 1000)
    assert read_jsonl(log) == []
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and "997 more lines" in lines[-1], lines


def test_torn_log_lines_are_skipped_and_rewrites_replace_the_file_whole(tmp_path, capsys, monkeypatch):
    from paratrain.profile import _open_profile
    from paratrain.report import load_run

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n[1, 2]\n{"step": 3, "loss": 0.5}\n{"step": 4')
    assert [e["step"] for e in read_jsonl(log)] == [1, 3]
    assert capsys.readouterr().err.count("not a log entry") == 3
    (tmp_path / "config.toml").write_text("")
    assert [e["step"] for e in load_run(tmp_path)["metrics"]] == [1, 3]
    shutil.copy(log, tmp_path / "profile.jsonl")
    _open_profile(tmp_path / "profile.jsonl", 2).close()
    assert [e["step"] for e in read_jsonl(tmp_path / "profile.jsonl")] == [1]

    before = log.read_text()

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        keep_steps_up_to(log, 1)
    assert log.read_text() == before, "a rewrite cut short must leave the old file whole"
    monkeypatch.undo()
    assert [e["step"] for e in keep_steps_up_to(log, 1)] == [1]
    assert [e["step"] for e in read_jsonl(log)] == [1]


# -- point 10: the final export and leftovers -------------------------------------------------------
def test_a_fresh_run_moves_the_earlier_final_export_aside(pristine, tmp_path):
    run = fresh_copy(pristine, tmp_path / "run")
    cfg = config_mod.load(str(pristine / "c.toml"), [])
    prepare_run_dir(run, cfg, "none", 0)
    assert not (run / "final").exists()
    assert [p.name.split("-")[0] for p in run.glob("final.prev-*")] == ["final.prev"]


def test_leftovers_of_crashed_saves_and_exports_are_removed(tmp_path):
    (tmp_path / "checkpoints" / ".tmp-step-3").mkdir(parents=True)
    (tmp_path / ".tmp-final").mkdir()
    cfg = config_mod.load(None, [])
    prepare_run_dir(tmp_path, cfg, "auto", 0)
    assert not list(tmp_path.glob(".tmp-*")) and not list((tmp_path / "checkpoints").glob(".tmp-*"))
    (tmp_path / "checkpoints" / ".tmp-step-5").mkdir()
    save_step(tmp_path, 6, keep=3)  # a run resumed past a crash mid-save
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-6"]


def test_export_final_syncs_its_directory_before_the_rename(tmp_path, monkeypatch):
    events = []
    from paratrain.checkpoint import export

    sync = export.fsync_dir
    monkeypatch.setattr(export, "fsync_dir", lambda path: (events.append(("fsync", Path(path).name)), sync(path)))
    rename = os.rename
    monkeypatch.setattr(export.os, "rename", lambda a, b: (events.append(("rename", Path(a).name)), rename(a, b)))
    ckpt.export_final(tmp_path, {"w": (torch.float32, (2,))}, [{"w": torch.ones(2)}], step=1, config={}, extra={})
    assert events.index(("fsync", ".tmp-final")) < events.index(("rename", ".tmp-final")), events
