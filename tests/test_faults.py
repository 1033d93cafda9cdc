"""Fault tolerance: killed workers, hung collectives, non-finite steps, corrupt and half-written checkpoints."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import CPU_ONLY, check_ok, final_weights, max_rel_error, metrics, run_cli, write_config
from reference import DIGITS_MLP, digits_mlp_reference

from paratrain.bench.recovery import SLOW_MODEL, config_text, run_and_kill, worker_pids
from paratrain.cli import main

BASE = (
    DIGITS_MLP.replace("steps = 20", "steps = 16").replace("log_every = 10", "log_every = 4")
    + """
[checkpoint]
every = 4
keep = 4
"""
)


@pytest.mark.parametrize("strategy", ["dp", "zero2"])
def test_killed_worker_is_restarted_and_resumes_exactly(tmp_path, gang, strategy):
    choose = ("--set", f"parallel.strategy='{strategy}'")
    killed = run_and_kill(tmp_path / "killed", steps=30, every=5, pause=0.03, kill_after_step=12, extra_args=choose)
    assert killed["returncode"] == 0, killed["output"]
    assert killed["resumed_from"] is not None and killed["steps_recomputed"] <= 5
    # The survivor must not linger when the agent stops it for the restart: it did for 10 s,
    # diagnosing its failed all-reduce, while it took SIGTERM for a request to save. A restart does
    # what the run's start did but the command's imports, so it takes about as long (~2 s each on a
    # quiet machine; both stretch alike on a loaded one, where a fixed 8 s bound once failed at 8.6).
    assert killed["recovery_s"] < killed["start_s"] + 5, (
        f"recovery {killed['recovery_s']:.1f} s, start {killed['start_s']:.1f} s"
    )
    # the same run, never interrupted (its checkpoints are where a restart would resume from)
    straight = config_text(30, 5, 0.0)
    cfg = write_config(tmp_path / "killed" / "straight.toml", straight)
    gang(2).train(cfg, tmp_path / "straight", [choose[1]])
    a, b = final_weights(killed["run_dir"]), final_weights(tmp_path / "straight")
    assert all(torch.equal(a[k], b[k]) for k in a), "the restarted run differs from the uninterrupted one"
    logged = [m["step"] for m in metrics(killed["run_dir"])]
    assert logged == list(range(1, 31)), "every step is logged exactly once"


def test_restart_of_a_run_resumed_from_a_path_goes_on_from_its_own_newest_checkpoint(tmp_path, gang):
    """--resume PATH with --max-restarts: a restart went back to PATH, redoing every step since; and
    the checkpoints past PATH already in the run directory (the future of the run resumed from)
    would be taken for this run's own. They are moved aside; the restart resumes from this run's."""
    (tmp_path / "slowmodel.py").write_text(SLOW_MODEL)
    cfg = write_config(tmp_path / "earlier.toml", config_text(steps=20, every=5, pause=0.0))
    gang(2).train(cfg, tmp_path / "run")  # keeps steps 15, 20
    start = tmp_path / "run" / "checkpoints" / "step-15"
    killed = run_and_kill(
        tmp_path, steps=30, every=5, pause=0.03, kill_after_step=27, extra_args=("--resume", str(start))
    )
    assert killed["returncode"] == 0, killed["output"]
    assert "the checkpoints past it here (step 20) moved to" in killed["output"], killed["output"]
    resumed = [line for line in killed["output"].splitlines() if line.startswith("resumed from")]
    assert len(resumed) == 2 and "at step 15 " in resumed[0], resumed
    restart_step = int(resumed[1].split("at step ")[1].split()[0])
    assert restart_step >= 25 and str(start) not in resumed[1], resumed
    # steps 1-15 are the earlier run's, the rest this run's: each logged once
    assert [m["step"] for m in metrics(killed["run_dir"])] == list(range(1, 31))


def test_skipped_collective_is_reported_with_rank_operation_and_step(tmp_path):
    cfg = write_config(tmp_path / "c.toml", BASE)
    t0 = time.monotonic()
    proc = run_cli(
        "run",
        str(cfg),
        "--set",
        "parallel.timeout_s=5",
        "--run-dir",
        str(tmp_path / "run"),
        env={"PARATRAIN_FAULTS": "skip_collective@rank=1,step=2,what=grad-bucket-0"},
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "training failed" in last and "rank 1 issued a different collective" in last, last
    assert "grad-bucket-0" in last and "all_reduce" in last, last
    assert "step 2" in last or "step 3" in last, last
    assert elapsed < 60, f"the hang took {elapsed:.0f}s to be reported"
    # the elastic agent's own report (E1127 12:00:00.000 PID .../api.py:836] ...) in the run's log alone
    assert last.endswith(f"(the agent's log: {tmp_path / 'run' / 'agent.log'})"), last
    assert "Root Cause" not in proc.stderr and not re.search(r"^[EWIF]\d{4} ", proc.stderr, re.M), proc.stderr


def nan_factory(tmp_path, bad):
    (tmp_path / "nandigits.py").write_text(
        "from paratrain.data.datasets import digits\n"
        "def nan_digits(split='train', bad=()):\n"
        "    ds = digits(split)\n"
        "    if split == 'train':\n"
        "        x = ds.tensors[0].clone()\n"
        "        x[list(bad)] = float('nan')\n"
        "        ds.tensors = (x, ds.tensors[1])\n"
        "    return ds\n"
    )
    return BASE.replace('factory = "digits"', f'factory = "nandigits:nan_digits"\nbad = {bad}')


def test_non_finite_step_is_skipped_on_every_rank(tmp_path, gang):
    # sample 90 is in rank 1's half of step 3 (samples 72..95): only rank 1 sees the NaN
    cfg = write_config(tmp_path / "c.toml", nan_factory(tmp_path, [90]))
    out = gang(2).train(cfg, tmp_path / "run")
    assert "step 4: non-finite loss or gradient, update skipped" in out
    expected = digits_mlp_reference(steps=16, skip_steps={3})
    weights = final_weights(tmp_path / "run")
    assert max_rel_error(weights, expected) <= 1e-4
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert metrics(tmp_path / "run")[0]["skipped_steps"] == 1


@pytest.mark.parametrize("servers, workers", [(1, 2), (2, 1)])
def test_sync_parameter_server_skips_a_non_finite_step(tmp_path, gang, servers, workers):
    """As dp does: the servers drop the step's update together and tell every worker (the NaN
    update turned the whole model to NaN and the run still ended with exit 0)."""
    cfg = write_config(tmp_path / "c.toml", nan_factory(tmp_path, [90]))
    out = gang(servers + workers).train(cfg, tmp_path / "run", ["parallel.strategy='ps'", f"ps.servers={servers}"])
    assert "step 4: non-finite loss or gradient, update skipped" in out, out
    weights = final_weights(tmp_path / "run")
    assert max_rel_error(weights, digits_mlp_reference(steps=16, skip_steps={3})) <= 1e-4


def test_async_parameter_server_refuses_a_non_finite_push(tmp_path):
    cfg = write_config(tmp_path / "c.toml", nan_factory(tmp_path, [90]))
    proc = check_ok(
        run_cli(
            "run",
            str(cfg),
            "--nproc",
            "3",
            "--set",
            "parallel.strategy='ps'",
            "--set",
            "ps.mode='async'",
            "--run-dir",
            str(tmp_path / "run"),
        )
    )
    assert "refuses worker rank 2's push for step 4: non-finite" in proc.stderr, proc.stderr
    assert all(torch.isfinite(w).all() for w in final_weights(tmp_path / "run").values())


@pytest.mark.parametrize("codec", ["powersgd", "topk"])
def test_a_skipped_step_does_not_poison_error_feedback(tmp_path, gang, codec):
    """Error feedback would carry the NaN of step 4 into every later step; the skip drops it."""
    cfg = write_config(tmp_path / "c.toml", nan_factory(tmp_path, [90]))
    out = gang(2).train(cfg, tmp_path / "run", [f"parallel.compression='{codec}'"])
    assert "step 4: non-finite" in out and "step 5: non-finite" not in out, out
    assert sum(m.get("skipped_steps", 0) for m in metrics(tmp_path / "run")) == 1
    assert all(torch.isfinite(w).all() for w in final_weights(tmp_path / "run").values())


def test_too_many_non_finite_steps_stop_the_run(tmp_path):
    cfg = write_config(tmp_path / "c.toml", nan_factory(tmp_path, [90, 114, 138]))  # steps 4, 5, 6
    proc = run_cli("run", str(cfg), "--set", "train.max_bad_steps=2", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "non-finite" in last and "train.max_bad_steps" in last, last
    # the checkpoint at step 4 was written after a skipped step: finite, and nothing later exists
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-4"]


def test_crash_during_save_and_corrupt_checkpoints_fall_back(tmp_path, capsys, gang):
    """The refusals (exit 2, before any worker starts) run in this process: no interpreter to start."""
    cfg = write_config(tmp_path / "c.toml", BASE)
    gang(2).train(cfg, tmp_path / "straight")
    expected = final_weights(tmp_path / "straight")

    # 1. rank 0 dies after writing its shard of step 8, before the manifest: no half checkpoint
    proc = run_cli(
        "run", str(cfg), "--run-dir", str(tmp_path / "crash"), env={"PARATRAIN_FAULTS": "exit_in_save@rank=0,step=8"}
    )
    assert proc.returncode == 1
    ckpts = tmp_path / "crash" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-")) == ["step-4"]
    proc = check_ok(run_cli("run", str(cfg), "--resume", "auto", "--run-dir", str(tmp_path / "crash")))
    assert "at step 4" in proc.stdout
    assert all(torch.equal(expected[k], final_weights(tmp_path / "crash")[k]) for k in expected)

    # 2. corrupt the two newest checkpoints of the straight run: one altered, one truncated
    ckpts = tmp_path / "straight" / "checkpoints"
    altered = ckpts / "step-16" / "rank-00000.safetensors"
    data = bytearray(altered.read_bytes())
    data[-1] ^= 0xFF
    altered.write_bytes(bytes(data))
    truncated = ckpts / "step-12" / "rank-00001.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:10])
    assert main(["run", str(cfg), "--resume", str(ckpts / "step-16"), "--run-dir", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "sha256" in err and "--resume" in err, err
    proc = check_ok(run_cli("run", str(cfg), "--resume", "auto", "--run-dir", str(tmp_path / "straight")))
    assert "skipping checkpoint step 16" in proc.stderr and "skipping checkpoint step 12" in proc.stderr
    assert "at step 8" in proc.stdout
    assert all(torch.equal(expected[k], final_weights(tmp_path / "straight")[k]) for k in expected)
    # 3. --resume auto onto a checkpoint of another strategy: exit 2, not a failed run
    assert (
        main(
            [
                "run",
                str(cfg),
                "--resume",
                "auto",
                "--set",
                "parallel.strategy='zero2'",
                "--run-dir",
                str(tmp_path / "straight"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "strategy 'dp'" in err, err[-500:]
    # 4. ... or of another optimizer (its state is SGD's, not Adam's): exit 2 naming train.optimizer,
    # up front for a named checkpoint
    for resume in ("auto", str(ckpts / "step-8")):
        assert (
            main(
                [
                    "run",
                    str(cfg),
                    "--resume",
                    resume,
                    "--set",
                    "train.optimizer='adamw'",
                    "--run-dir",
                    str(tmp_path / "straight"),
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert "train.optimizer" in err and "'sgd'" in err, err[-500:]
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "how", [[], ["--nproc", "3", "--set", "parallel.strategy='ps'", "--set", "ps.mode='async'"]], ids=["dp", "async-ps"]
)
def test_ctrl_c_stops_every_process_at_once(tmp_path, how):
    """Ctrl-C reaches the terminal's whole process group: the launcher says what happened (exit 130,
    one line, the checkpoint to go on from) and the workers stop with it, not when the elastic
    agent gives up on them 30 s later (they ignored SIGINT, inherited from the fork server; an
    async worker's guard deadlocked in its signal handler)."""
    cfg = write_config(tmp_path / "c.toml", BASE.replace("steps = 16", "steps = 1000000"))
    argv = [sys.executable, "-m", "paratrain.cli", "run", str(cfg), "--run-dir", str(tmp_path / "run"), *how]
    proc = subprocess.Popen(
        argv,
        env={**os.environ, **CPU_ONLY},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        # Any checkpoint: a fast run writes and prunes them (keep = 4) quicker than this looks.
        while not any((tmp_path / "run" / "checkpoints").glob("step-*/manifest.json")):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint after 120 s"
            time.sleep(0.05)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGINT, err
        assert time.monotonic() - t0 < 15, "the workers outlived Ctrl-C"
        last = err.strip().splitlines()[-1]
        assert "stopped by SIGINT" in last and "--resume auto" in last and "Traceback" not in err, err
        for _ in range(100):  # the fork server leaves once the launcher is gone
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("processes of the run outlived it")
    finally:  # whatever failed above, leave nothing running
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()


def test_the_worker_blamed_is_the_one_whose_error_is_its_own(tmp_path):
    """Ranks whose peer died fail too, in the same second: the one to name is the rank whose error
    is not a lost connection, whatever its rank number; a rank the agent stopped is never named."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from paratrain.runtime.worker_failure import blame

    def failed(rank, exitcode, message, timestamp=100):
        path = tmp_path / f"error-{rank}.json"
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": str(timestamp)}}}))
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))

    gone = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242"
    own = "RuntimeError: stack expects a non-empty TensorList"
    failures = {
        0: failed(0, 1, gone),
        1: failed(1, 1, gone),
        3: failed(3, 1, own),
        2: failed(2, -15, ""),
        4: failed(4, 128 + signal.SIGTERM, ""),
    }  # 4 stopped on the SIGTERM the agent sent it
    culprit = blame(failures)
    assert (culprit.rank, culprit.cause) == (3, own)
    assert culprit.own_exitcodes == {1, 128 + signal.SIGTERM}
    del failures[4]
    failures[3] = failed(3, 1, own, timestamp=101)
    assert blame(failures).rank == 3  # a lost connection is a consequence, even when reported first
    del failures[3]
    assert blame(failures).rank == 0  # only consequences: the earliest, then the lowest rank


def test_a_failed_workers_traceback_starts_at_its_own_code_and_names_the_users_frame(tmp_path, monkeypatch):
    """From a worker's error report: its traceback without the frames that started it (torch's
    process wrappers, paratrain's entry point), each traceback of a chain trimmed; the innermost
    frame of the user's own code (not Python's, an installed package's or paratrain's)."""
    from pathlib import Path

    import paratrain
    from paratrain.runtime.worker_failure import _users_frame, _without_startup_frames

    monkeypatch.chdir(tmp_path)
    torch_dir, ours = Path(torch.__file__).parent, Path(paratrain.__file__).parent

    def frame(file, line, code):
        return f'  File "{file}", line {line}, in f\n    {code}\n'

    start = frame(torch_dir / "multiprocessing/spawn.py", 87, "fn(i, *args)") + frame(
        ours / "runtime/launch.py", 70, "getattr(module, name)(*args)"
    )
    user = frame(tmp_path / "model.py", 9, "return self.l(x) + oops") + frame(
        torch_dir / "nn/functional.py", 1, "raise ValueError('x')"
    )
    stack = (
        f"Traceback (most recent call last):\n{frame(tmp_path / 'model.py', 3, 'int(x)')}ValueError: x\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        f"Traceback (most recent call last):\n{start}{frame(ours / 'trainer.py', 1, 'fit()')}{user}KeyError: 'y'\n"
    )
    trimmed = _without_startup_frames(stack)
    assert "spawn.py" not in trimmed and "launch.py" not in trimmed, trimmed
    assert trimmed.count("Traceback (most recent call last):") == 2 and "trainer.py" in trimmed, trimmed
    assert trimmed.endswith("KeyError: 'y'") and "During handling" in trimmed, trimmed
    assert _users_frame(stack) == "model.py:9"  # the raised exception's, not the first one's line 3
    assert _users_frame(f"Traceback (most recent call last):\n{start}KeyError: 'y'\n") == ""
    assert _without_startup_frames(f"Traceback (most recent call last):\n{start}E\n").count("File") == 2  # all kept


SIGTERM_STEPS = 100  # the signal comes after step 10: ample time left to stop before the end, under load too


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory, gang):
    """The final weights of the SIGTERM test's run, trained without a stop."""
    workdir = tmp_path_factory.mktemp("never-stopped")
    (workdir / "slowmodel.py").write_text(SLOW_MODEL)
    cfg = write_config(workdir / "c.toml", config_text(steps=SIGTERM_STEPS, every=0, pause=0.0))
    gang(2).train(cfg, workdir / "run")
    return final_weights(workdir / "run")


@pytest.mark.parametrize("who", ["process-group", "rank-1"])
def test_sigterm_saves_a_checkpoint_and_the_run_resumes_exactly(tmp_path, who, never_stopped):
    """Preemption: SIGTERM to the whole job (a scheduler) or to one worker alone. Every rank stops
    at the same step, and only after saving it (checkpoint.every = 0: no checkpoint but this one);
    the run resumed from it ends equal to one never stopped."""
    STEPS = SIGTERM_STEPS
    (tmp_path / "slowmodel.py").write_text(SLOW_MODEL)
    cfg = write_config(tmp_path / "c.toml", config_text(steps=STEPS, every=0, pause=0.02))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "paratrain.cli", "run", str(cfg), "--run-dir", str(run_dir)],
        cwd=tmp_path,
        env={**os.environ, **CPU_ONLY},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").is_file() or len(metrics(run_dir)) < 10:
            assert proc.poll() is None and time.monotonic() < deadline, "no step 10 after 120 s"
            time.sleep(0.02)
        t0 = time.monotonic()
        if who == "process-group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(worker_pids(proc.pid)[1], signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, out + err
        assert time.monotonic() - t0 < 15, "stopping took too long"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
    saved = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert len(saved) == 1 and saved[0].startswith("step-"), saved
    step = int(saved[0].removeprefix("step-"))
    assert 10 <= step < STEPS and metrics(run_dir)[-1]["step"] == step, (step, metrics(run_dir)[-1])
    assert f"SIGTERM: stopped after step {step}" in out, out
    last = err.strip().splitlines()[-1]
    assert "stopped by SIGTERM" in last and saved[0] in last and "--resume auto" in last, err
    assert "Traceback" not in err, err

    check_ok(run_cli("run", str(cfg), "--resume", "auto", "--run-dir", str(run_dir), cwd=tmp_path))
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, STEPS + 1)), "every step is logged exactly once"
    a = final_weights(run_dir)
    assert all(torch.equal(a[k], never_stopped[k]) for k in a), "the resumed run differs from the uninterrupted one"


def test_a_reader_that_leaves_early_does_not_stop_the_run(tmp_path):
    """`paratrain run ... | head -1`: rank 0 died on a BrokenPipeError at its next step line and
    the command still exited 0, with no final model."""
    cfg = write_config(tmp_path / "c.toml", BASE.replace("log_every = 4", "log_every = 1"))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "paratrain.cli", "run", str(cfg), "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().startswith("step")
    proc.stdout.close()  # the reader leaves
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert [m["step"] for m in metrics(tmp_path / "run")] == list(range(1, 17))
    assert max_rel_error(final_weights(tmp_path / "run"), digits_mlp_reference(steps=16)) <= 1e-4


def test_resume_auto_with_nothing_to_resume_starts_a_fresh_log(tmp_path, gang):
    """It started fresh but appended to the earlier run's metrics.jsonl (steps 4, 8, 4, 8), which
    `paratrain report` then drew as one run."""
    cfg = write_config(tmp_path / "c.toml", BASE)
    sets = ["train.steps=8", "checkpoint.every=0"]
    gang(2).train(cfg, tmp_path / "run", sets)
    out = gang(2).train(cfg, tmp_path / "run", sets, resume="auto")
    assert "no checkpoint to resume from: starting fresh" in out
    assert [m["step"] for m in metrics(tmp_path / "run")] == [4, 8]


def test_stop_filter_keeps_a_record_whose_arguments_are_a_mapping():
    """The launcher's log filter reads a "failed (exitcode: ...)" record's first argument; a record
    logged with a mapping (logging keeps a lone dict as record.args itself) has no args[0], and the
    filter used to raise KeyError inside the logging call (found by mypy: `make typecheck`)."""
    import logging

    from paratrain.runtime.launch import _not_a_stop

    by_name = logging.LogRecord(
        "agent", logging.ERROR, __file__, 1, "failed (exitcode: %(code)s)", ({"code": 2},), None
    )
    assert isinstance(by_name.args, dict)
    assert _not_a_stop(by_name)
    by_position = logging.LogRecord("agent", logging.ERROR, __file__, 1, "failed (exitcode: %s)", (2,), None)
    assert not _not_a_stop(by_position)  # a worker that named bad input: the agent's traceback is dropped
