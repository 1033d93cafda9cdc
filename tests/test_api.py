"""The Python API (paratrain.init, the user's own loop) and `paratrain launch`: the same loop at any
world size, under dp and zero1-3, launched or not, equals plain single-process PyTorch."""

import sys
from pathlib import Path

import pytest
import torch
from helpers import CPU_ONLY, check_ok, max_rel_error, metrics, run_cli, run_torchrun
from own_loop_model import BATCH, build, make_model, reference
from safetensors.torch import load_file

import paratrain

SCRIPT = str(Path(__file__).resolve().parent / "own_loop_script.py")
TOL = 1e-4


def weights(out: Path) -> dict:
    return load_file(str(out / "model.safetensors"))


def trained(gang, world: int, tmp_path: Path, **kwargs) -> dict:
    """The own loop (own_loop_model.train) on a gang of `world`; its final weights."""
    gang(world).run("own_loop_model:job", out=str(tmp_path / "out"), run_dir=str(tmp_path / "run"), **kwargs)
    return weights(tmp_path / "out")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "zero3"])
def test_own_loop_at_world_2_equals_plain_pytorch(tmp_path, gang, strategy, optimizer):
    assert (
        max_rel_error(trained(gang, 2, tmp_path, strategy=strategy, optimizer=optimizer), reference(optimizer, 6))
        <= TOL
    )


@pytest.mark.parametrize("strategy", ["dp", "zero2"])
def test_clip_grad_norm_over_all_shards_equals_torch(tmp_path, gang, strategy):
    got = trained(gang, 2, tmp_path, strategy=strategy, optimizer="sgd", clip=0.05)
    assert max_rel_error(got, reference("sgd", 6, clip=0.05)) <= TOL


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_own_loop_under_mixed_precision_zero_trains_like_bf16_autocast(tmp_path, gang, strategy):
    """Under bf16, zero1/zero2 keep bf16 weights and the fp32 masters in the optimizer's shards
    (the user's optimizer, its param groups, steps pieces of them): within bf16's rounding of fp32
    weights under autocast; a checkpoint resumes exactly, the export is fp32."""
    ckpt, common = str(tmp_path / "ckpt"), dict(strategy=strategy, optimizer="adamw", steps=6, bf16=True)
    first = trained(gang, 2, tmp_path / "a", ckpt=ckpt, save_at=3, **common)
    assert all(v.dtype == torch.float32 for v in first.values())
    assert max_rel_error(first, reference("adamw", 6, bf16=True)) <= 2e-2
    assert max_rel_error(trained(gang, 2, tmp_path / "b", ckpt=ckpt, **common), first) == 0


@pytest.mark.parametrize("optimizer, world", [("sgd", 2), ("adamw", 4)])
def test_own_loop_under_tp_with_a_given_plan_equals_plain_pytorch(tmp_path, gang, optimizer, world):
    """tp = 2 (at world 4 also dp = 2) on the MLP with parallel.tp_plan: the user's optimizer and its
    param groups over the shards, the global norm clipped over them."""
    plan = {"0": "colwise", "2": "rowwise"}
    got = trained(gang, world, tmp_path, strategy="tp", tp=2, tp_plan=plan, optimizer=optimizer, clip=0.05)
    assert max_rel_error(got, reference(optimizer, 6, clip=0.05)) <= TOL


@pytest.mark.parametrize("model, optimizer", [("gpt", "adamw"), ("llama", "sgd")])
def test_own_loop_under_tp_with_the_models_own_plan_equals_plain_pytorch(tmp_path, gang, model, optimizer):
    """The built-in gpt's plan (vocabulary-parallel head: its logits gathered for the user's loss,
    split unevenly) and a transformers Llama's base_model_tp_plan; a checkpoint resumes exactly."""
    if model == "llama":
        pytest.importorskip("transformers")
    ckpt, common = str(tmp_path / "ckpt"), dict(strategy="tp", tp=2, model=model, optimizer=optimizer, steps=4)
    first = trained(gang, 2, tmp_path / "a", ckpt=ckpt, save_at=2, **common)
    # the gpt's key bias gets a gradient that is zero but for rounding (softmax ignores a shift
    # shared by all keys), which AdamW scales up: noise that differs with summation order
    expected = {k: v for k, v in reference(optimizer, 4, model=model).items() if not k.endswith("attn.k.bias")}
    assert max_rel_error({k: first[k] for k in expected}, expected) <= TOL
    assert max_rel_error(trained(gang, 2, tmp_path / "b", ckpt=ckpt, **common), first) == 0


TP_PLAN = {"0": "colwise", "2": "rowwise"}


def layout(strategy: str) -> dict:
    """The keys of a strategy at world 2 and over: tp splits the MLP by a given plan."""
    return dict(tp=2, tp_plan=TP_PLAN) if strategy == "tp" else {}


@pytest.mark.parametrize(
    "strategy, world",
    [
        ("dp", 1),
        ("dp", 2),
        ("dp", 3),
        ("zero1", 2),
        ("zero2", 2),
        ("zero3", 1),
        ("zero3", 2),
        ("zero3", 3),
        ("tp", 2),
        ("tp", 4),  # and dp = 2
    ],
)
def test_a_plain_loss_backward_averages_over_ranks_as_ddp_and_fsdp2_do(tmp_path, gang, strategy, world):
    """loss.backward() instead of pt.backward(loss): the reduction hangs on autograd."""
    got = trained(gang, world, tmp_path, strategy=strategy, optimizer="adamw", backward="plain", **layout(strategy))
    assert max_rel_error(got, reference("adamw", 6)) <= TOL


def test_a_gradient_rank_0_asks_of_autograd_alone_is_not_reduced(tmp_path, gang):
    """torch.autograd.grad returns gradients without accumulating them: no reduction starts on rank
    0 alone (it would meet the other rank's next one and average the wrong gradients)."""
    got = trained(gang, 2, tmp_path, strategy="dp", optimizer="adamw", backward="grad-on-main")
    assert max_rel_error(got, reference("adamw", 6)) <= TOL


@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "zero3", "tp"])
def test_a_transformers_loop_out_loss_backward_equals_one_process(tmp_path, gang, strategy):
    """`out = model(input_ids=x, labels=x); out.loss.backward()` on a tiny Llama (tp: its own plan)."""
    pytest.importorskip("transformers")
    common = dict(optimizer="sgd", model="llama", labels="all", steps=4)
    got = trained(
        gang, 2, tmp_path, strategy=strategy, backward="plain", **common, **(dict(tp=2) if strategy == "tp" else {})
    )
    assert max_rel_error(got, reference(**common)) <= TOL


@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_pt_backward_with_a_weight_gives_the_global_batchs_token_mean(tmp_path, gang, strategy):
    """pt.backward(loss, weight=n): the loss a mean over n label tokens (some masked, -100), the
    gradient the mean over the global batch's tokens, as one process's loss over the whole batch."""
    pytest.importorskip("transformers")
    common = dict(optimizer="sgd", model="llama", labels="masked", steps=4)
    got = trained(gang, 2, tmp_path, strategy=strategy, backward="weighted", **common)
    assert max_rel_error(got, reference(**common)) <= TOL


@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "zero3"])
def test_torchs_clip_grad_norm_at_world_1_clips_as_one_process(tmp_path, gang, strategy):
    """Plain python: every parameter's .grad holds its gradient after backward."""
    got = trained(gang, 1, tmp_path, strategy=strategy, optimizer="sgd", clip=0.05, clip_with="torch")
    assert max_rel_error(got, reference("sgd", 6, clip=0.05)) <= TOL


def test_a_zero3_checkpoint_of_world_2_resumed_at_world_1_clips_with_torch_as_one_process(tmp_path, gang):
    common = dict(strategy="zero3", optimizer="sgd", steps=6, ckpt=str(tmp_path / "ckpt"), clip=0.05)
    common.update(clip_with="torch", backward="plain")
    gang(2).run("own_loop_model:job", out=str(tmp_path / "first"), save_at=3, run_dir=str(tmp_path / "a"), **common)
    gang(1).run("own_loop_model:job", out=str(tmp_path / "resumed"), run_dir=str(tmp_path / "b"), **common)
    assert max_rel_error(weights(tmp_path / "resumed"), reference("sgd", 6, clip=0.05)) <= TOL


@pytest.mark.parametrize(
    "call, says",
    [
        ("pp-plain-backward", "optimizer.step() under 'pp': its schedule runs forward and backward"),
        ("pp-optimizer", "pt.setup: strategy 'pp' builds its optimizer from [train]: "),
        ("pp-uncut", "parallel.pp: pp = 2 needs a model that can be cut into layers"),
        ("dp-loads-zero3", "pt.load: checkpoint "),
        ("dp-setup-twice", "pt.setup: called once per pt"),
        ("dp-save-extras", "pt.save: extras must be JSON values"),
    ],
)
def test_what_the_api_refuses_exits_2_in_one_line(tmp_path, gang, call, says):
    """No traceback: one line (after pp's notes on its cut), said once where every rank says the same
    (setup's on each rank)."""
    ckpt = str(tmp_path / "ckpt")
    if call == "dp-loads-zero3":
        common = dict(strategy="zero3", optimizer="adamw", steps=2, save_at=2, ckpt=ckpt, run_dir=str(tmp_path))
        gang(2).run("own_loop_model:job", out=str(tmp_path / "out"), **common)
    members = gang(2)
    assert members.run("own_loop_model:refused_job", call=call, ckpt=ckpt) == [2, 2]
    line = members.outputs[0].strip().splitlines()[-1]
    assert line.startswith(f"paratrain: error: {says}") and "Traceback" not in members.outputs[0], members.outputs
    assert members.outputs[1].strip() in ("", line), members.outputs


def test_own_loop_collectives_name_the_step_a_hang_report_gives(tmp_path, gang):
    """A hang's report is the failed collective's describe(): its step counts optimizer steps, or
    is the step pt.log was given (3 batches: steps 0, 1, then pt.log(10))."""
    for seen in gang(2).run("own_loop_model:step_job", run_dir=str(tmp_path)):
        assert [line.rpartition(" at step ")[2] for line in seen] == ["0", "1", "10"], seen
        assert all("zero-grad-unit" in line for line in seen), seen  # the backward's own


def test_tp_on_a_model_without_a_plan_exits_2_naming_it(gang):
    assert gang(2).run("own_loop_model:tp_setup_job") == [2, 2]
    for said in gang(2).outputs:
        (line,) = said.strip().splitlines()
        assert line.startswith("paratrain: error: parallel.tp_plan: tp = 2 needs a plan for the model (Sequential"), (
            line
        )


def test_a_fused_projection_split_colwise_in_your_own_loop_exits_2_in_one_line(gang):
    """The plan's check after the first backward (shapes fit, values do not): one line, exit 2,
    naming the block's entries, not a traceback."""
    members = gang(2)
    assert members.run("own_loop_model:fused_gate_up_job") == [2, 2]
    (line,) = [line for said in members.outputs for line in said.strip().splitlines()]
    assert line.startswith("paratrain: error: parallel.tp_plan: the plan does not compute '0' as the whole"), line
    assert '"0.gate_up" = "colwise"' in line, line


@pytest.mark.parametrize("strategy, backward", [("dp", "pt"), ("zero3", "pt"), ("dp", "plain"), ("zero3", "plain")])
def test_unequal_shares_of_a_short_last_batch_still_give_the_global_mean(tmp_path, gang, strategy, backward):
    """40 samples in batches of 12 without drop_last: every fourth batch holds 4, shared 2-1-1."""
    common = dict(strategy=strategy, optimizer="adamw", steps=8, drop_last=False, backward=backward)
    got = trained(gang, 3, tmp_path, **common)
    assert max_rel_error(got, reference("adamw", 8, drop_last=False)) <= TOL


@pytest.mark.parametrize("strategy, world", [("dp", 4), ("zero2", 3), ("zero3", 4)])
def test_a_checkpoint_saved_at_world_2_resumes_at_another_world_and_ends_equal(tmp_path, gang, strategy, world):
    ckpt = str(tmp_path / "ckpt")
    common = dict(strategy=strategy, optimizer="adamw", steps=7, ckpt=ckpt)
    gang(2).run("own_loop_model:job", out=str(tmp_path / "first"), save_at=4, run_dir=str(tmp_path / "a"), **common)
    gang(world).run("own_loop_model:job", out=str(tmp_path / "resumed"), run_dir=str(tmp_path / "b"), **common)
    # the first run went on past its save to step 7; the second from its step 4, at the other world
    assert [m["step"] for m in metrics(tmp_path / "b")] == [5, 6, 7]
    assert max_rel_error(weights(tmp_path / "resumed"), reference("adamw", 7)) <= TOL
    assert max_rel_error(weights(tmp_path / "first"), reference("adamw", 7)) <= TOL


def test_train_step_under_pp_equals_one_process_and_own_loop_calls_name_it(tmp_path, gang):
    members = gang(2)
    codes = members.run(
        "own_loop_model:pipeline_job", out=str(tmp_path / "out"), steps=5, run_dir=str(tmp_path / "run")
    )
    assert max_rel_error(weights(tmp_path / "out"), reference("sgd", 5, groups=False)) <= TOL
    line = members.outputs[0].strip().splitlines()[-1]
    assert codes == [2, 2] and line.startswith("paratrain: error: pt.backward: ") and "train_step" in line, line
    assert "error" not in members.outputs[1], members.outputs[1]


def one_process_evaluation() -> tuple[list[float], torch.Tensor, float]:
    """evaluation_job's numbers on one process: the loss of each batch of 12 in order and the
    model's output on all 40 samples, at init; the first shuffled batch's loss."""
    model, _, loader = build("sgd", groups=False)
    x, y = loader.dataset.tensors
    with torch.no_grad():
        out = model(x)
        losses = [
            torch.nn.functional.mse_loss(out[i : i + BATCH], y[i : i + BATCH]).item() for i in range(0, 40, BATCH)
        ]
        first = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:BATCH]
        trained = torch.nn.functional.mse_loss(model(x[first]), y[first]).item()
    return losses, out, trained


@pytest.mark.parametrize(
    "strategy, keys",
    [
        ("pp", dict(pp=2, microbatches=2)),
        ("dp", {}),
        ("zero3", dict(bucket_mb=0.0005)),
        ("tp", dict(tp=2, tp_plan={"0": "colwise", "2": "rowwise"})),
    ],
)
def test_eval_step_and_train_step_give_one_processs_loss_on_every_rank(gang, strategy, keys):
    """pt.eval_step: each batch's loss (a short last one of 4 included) and, gathered, the model's
    output, on every rank; pt.train_step: the global batch's loss on every rank, under pp too."""
    losses, out, trained = one_process_evaluation()
    for rank_losses, rank_out, rank_trained in gang(2).run("own_loop_model:evaluation_job", strategy=strategy, **keys):
        assert rank_losses == pytest.approx(losses, rel=TOL)
        assert max_rel_error({"out": rank_out}, {"out": out}) <= TOL
        assert rank_trained == pytest.approx(trained, rel=TOL)


@pytest.mark.parametrize("strategy, batch_size", [("dp", 4), ("zero3", 13)])
def test_an_uneven_evaluation_set_is_gathered_whole_once_in_the_loaders_order(tmp_path, gang, strategy, batch_size):
    """27 samples with even_batches=False: in batches of 4 the last one of 3 is shared 2-1; in
    batches of 13 the last one of 1 leaves rank 1's share empty (its forward still runs). pt.log: the
    ranks' mean."""
    order = torch.randperm(27, generator=torch.Generator().manual_seed(0)).tolist()  # epoch 0, seed 0
    said = gang(2).run("own_loop_model:gather_job", strategy=strategy, batch_size=batch_size, run_dir=str(tmp_path))
    assert said == [order, order]
    assert [m["rank"] for m in metrics(tmp_path)] == [0.5]


def test_a_bad_key_exits_2_naming_it_before_joining(capsys):
    with pytest.raises(SystemExit) as exc:
        paratrain.init(strategy="zero2", bucket=1)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("paratrain: error: parallel.bucket: unknown key (known: strategy, tp, pp, "), line
    assert "bucket_mb" in line, line


def test_a_loader_whose_order_the_api_cannot_keep_is_refused(capsys):
    import torch
    from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

    from paratrain.api.loader import GlobalBatchLoader

    data = TensorDataset(torch.zeros(8, 1))
    loader = DataLoader(data, batch_size=4, sampler=WeightedRandomSampler([1.0] * 8, 8))
    with pytest.raises(SystemExit) as stopped:
        GlobalBatchLoader(loader, 0, place=None, share=None)
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("paratrain: error: pt.setup_dataloader: ") and "WeightedRandomSampler" in line, line


def test_srun_tasks_read_as_torchrun_workers_and_an_sbatch_shell_is_left_alone():
    from paratrain.runtime.schedulers import slurm_task

    step = dict(SLURM_STEP_ID="0", SLURM_PROCID="3", SLURM_STEP_NUM_TASKS="5", SLURM_NTASKS="9", SLURM_LOCALID="1")
    step.update(SLURM_NODEID="1", SLURM_STEP_NODELIST="gpu[07-09]", SLURM_STEP_TASKS_PER_NODE="2(x2),1")
    assert slurm_task({**step, "SLURM_JOB_ID": "1234"}) == dict(
        RANK="3", WORLD_SIZE="5", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="gpu07", MASTER_PORT="29734"
    )
    given = slurm_task({**step, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "4000"})
    assert (given["MASTER_ADDR"], given["MASTER_PORT"]) == ("10.0.0.7", "4000")
    batch_shell = {k: v for k, v in step.items() if not k.startswith("SLURM_STEP")}
    assert slurm_task(batch_shell) is None  # sbatch's shell: SLURM_PROCID=0 too, but no step
    assert slurm_task({**step, "RANK": "3"}) is None  # a launcher's worker


def test_import_paratrain_stays_free_of_torch():
    import subprocess

    code = "import sys, paratrain; assert 'torch' not in sys.modules; paratrain.init"
    check_ok(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True))


# -- the integration tier: the same script as a command ----------------------------------------------
def test_plain_python_runs_at_world_1_and_equals_plain_pytorch(tmp_path):
    import os
    import subprocess

    out = tmp_path / "out"
    check_ok(
        subprocess.run(
            [sys.executable, SCRIPT, "zero2", "adamw", str(out), "--run-dir", str(tmp_path / "run")],
            capture_output=True,
            text=True,
            env={**os.environ, **CPU_ONLY},
            timeout=120,
        )
    )
    assert max_rel_error(weights(out), reference("adamw", 6)) <= TOL
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 6


def test_paratrain_launch_at_world_2_equals_plain_pytorch(tmp_path):
    out = tmp_path / "out"
    check_ok(
        run_cli(
            "launch", "--nproc", "2", SCRIPT, "zero3", "sgd", str(out), "--run-dir", str(tmp_path / "run"), cwd=tmp_path
        )
    )
    assert max_rel_error(weights(out), reference("sgd", 6)) <= TOL


def test_torchrun_at_world_2_equals_plain_pytorch(tmp_path):
    out = tmp_path / "out"
    check_ok(run_torchrun(2, SCRIPT, "zero1", "adamw", str(out), "--run-dir", str(tmp_path / "run")))
    assert max_rel_error(weights(out), reference("adamw", 6)) <= TOL


def test_a_dead_worker_restarts_and_the_script_resumes_from_its_last_save(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    proc = check_ok(
        run_cli(
            "launch",
            "--nproc",
            "2",
            "--max-restarts",
            "1",
            SCRIPT,
            "dp",
            "adamw",
            str(out),
            "--ckpt",
            str(ckpt),
            "--save-at",
            "3",
            "--die-at",
            "5",
            "--run-dir",
            str(tmp_path / "run"),
            cwd=tmp_path,
        )
    )
    assert max_rel_error(weights(out), reference("adamw", 6)) <= TOL, proc.stderr
    # the first attempt logged steps 1-5 (rank 1 died after step 5), the restarted one 4-6
    steps = [m["step"] for m in metrics(tmp_path / "run")]
    assert steps[:5] == [1, 2, 3, 4, 5] and steps[-3:] == [4, 5, 6], steps
    said = proc.stderr.strip().splitlines()[-1]  # the agent's report of the failure, in a log it names
    assert said.startswith("paratrain: the elastic agent's log of this run: "), proc.stderr
    assert "failed (exitcode: 9) local_rank: 1" in Path(said.rpartition(": ")[2]).read_text()
    Path(said.rpartition(": ")[2]).unlink()  # in /tmp


def test_plain_python_under_srun_joins_the_step_and_equals_plain_pytorch(tmp_path):
    """Two tasks as `srun --ntasks 2 python own_loop_script.py ...` starts them (Slurm's variables,
    no RANK): each joins the group on the step's first node, at MASTER_PORT."""
    import os
    import subprocess

    from paratrain.runtime.process import free_port

    out, port = tmp_path / "out", str(free_port())
    slurm = dict(SLURM_JOB_ID="7", SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_NODEID="0", MASTER_PORT=port)
    slurm.update(SLURM_JOB_NODELIST="127.0.0.1", SLURM_TASKS_PER_NODE="2")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    argv = [sys.executable, SCRIPT, "zero2", "sgd", str(out), "--run-dir", str(tmp_path / "run")]
    tasks = [
        subprocess.Popen(
            argv,
            env={**env, **CPU_ONLY, **slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    said = [task.communicate(timeout=120)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], said
    assert max_rel_error(weights(out), reference("sgd", 6)) <= TOL


def test_paratrain_launch_exit_codes(tmp_path):
    assert run_cli("launch", "--nproc", "2", str(tmp_path / "missing.py")).returncode == 2
    failing = tmp_path / "fails.py"
    failing.write_text("import paratrain\npt = paratrain.init()\nraise SystemExit(3 if pt.rank == 1 else 0)\n")
    proc = run_cli("launch", "--nproc", "2", str(failing), cwd=tmp_path)
    assert proc.returncode == 1 and "rank 1 failed (exit code 3)" in proc.stderr, proc.stderr
    Path(proc.stderr.strip().rpartition("(the agent's log: ")[2].removesuffix(")")).unlink()  # in /tmp
    done = tmp_path / "done.py"
    done.write_text("import sys\nimport paratrain\npt = paratrain.init()\nsys.exit()\n")  # success, as under python
    assert run_cli("launch", "--nproc", "2", str(done), cwd=tmp_path, timeout=60).returncode == 0


def test_a_failing_script_shows_its_traceback_once_and_the_line_names_file_and_line(tmp_path):
    """The worker's traceback from the script down, as python shows it, then paratrain's line with
    the script's FILE:LINE; the elastic agent's own report of it (its every line prefixed
    `E1127 12:00:00.000 PID .../api.py:836]`, the traceback again) goes to a log the line names."""
    import re

    script = tmp_path / "fails_at_the_end.py"
    script.write_text("import paratrain\n\npt = paratrain.init()\nif pt.is_main:\n    print(f'done: {loss}')\n")
    proc = run_cli("launch", "--nproc", "2", script.name, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and lines[:3] == [
        "Traceback (most recent call last):",
        f'  File "{script}", line 5, in <module>',
        "    print(f'done: {loss}')",
    ], proc.stderr
    assert all(set(line) <= set(" ^") for line in lines[3:-2]), proc.stderr  # the carets under `loss`
    assert lines[-2] == "NameError: name 'loss' is not defined", proc.stderr
    said = re.fullmatch(
        r"paratrain: error: training failed: rank 0 failed \(exit code 1\) at fails_at_the_end\.py:5: "
        r"NameError: name 'loss' is not defined \(the agent's log: (.+)\)",
        lines[-1],
    )
    assert said, proc.stderr
    agent_log = Path(said.group(1))
    assert "failed (exitcode: 1)" in agent_log.read_text()
    agent_log.unlink()
    assert "Root Cause" not in proc.stderr and not re.search(r"^[EWIF]\d{4} ", proc.stderr, re.M), proc.stderr


def test_the_docs_script_runs_as_written_under_paratrain_launch(tmp_path):
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "own-loop.md").read_text()
    (tmp_path / "digits_own_loop.py").write_text(re.search(r"```python\n(.*?)```", page, re.S).group(1))
    proc = check_ok(run_cli("launch", "--nproc", "2", "digits_own_loop.py", cwd=tmp_path))
    assert "done: step 100" in proc.stdout
    assert (tmp_path / "runs" / "digits" / "final" / "model.safetensors").exists()
    again = check_ok(run_cli("launch", "--nproc", "2", "digits_own_loop.py", cwd=tmp_path))  # as users do
    assert "already complete: runs/digits is at step 100" in again.stdout, again.stdout


def _ranks_of(script_args: list[str], tmp_path: Path) -> list[tuple[int, str]]:
    """Two plain `python` processes of a script (RANK, WORLD_SIZE, MASTER_ADDR set by hand, as a
    scheduler does): each one's exit code and output."""
    import os
    import subprocess

    from paratrain.runtime.process import free_port

    env = {**os.environ, **CPU_ONLY, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, *script_args],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )
        for r in range(2)
    ]
    said = [rank.communicate(timeout=120)[0] for rank in ranks]
    return [(rank.returncode, out) for rank, out in zip(ranks, said)]


@pytest.mark.parametrize("how", ["end", "sys-exit"])
def test_a_script_that_ends_without_close_leaves_no_group_to_the_teardown(tmp_path, how):
    """The interpreter's teardown meeting a live gloo group can abort a finished job (SIGABRT,
    1 run in 10-20 under torchrun before): paratrain's exit handler has destroyed it by then."""
    ended = _ranks_of([str(Path(__file__).resolve().parent / "exit_script.py"), how], tmp_path)
    for code, out in ended:
        assert code == 0, out
        assert "group alive at teardown: False" in out, out


def test_a_rank_that_fails_at_the_end_does_not_hold_its_peers_exit(tmp_path):
    import time

    start = time.monotonic()
    (code0, out0), (code1, out1) = _ranks_of(
        [str(Path(__file__).resolve().parent / "exit_script.py"), "raise-on-1"], tmp_path
    )
    assert code1 == 1 and "the user's own error" in out1, out1
    assert code0 == 0 and "rank 0: left without its peers (a peer failed)" in out0, out0
    assert time.monotonic() - start < 60  # not the group's timeout (300 s)


@pytest.mark.parametrize(
    "how, strategy, on_0, on_1",
    [
        ("state-dict-on-0", "zero3", "model.state_dict()", "the end of the script"),
        ("state-dict-on-0-save-on-1", "zero3", "model.state_dict()", "pt.save"),
        ("save-on-0", "dp", "pt.save", "the end of the script"),
    ],
)
def test_a_call_some_ranks_make_alone_is_named_at_the_others_next_call(tmp_path, how, strategy, on_0, on_1):
    """Under zero3 model.state_dict() gathers from every rank, and pt.save meets them under every
    strategy: on rank 0 alone either would wait out parallel.timeout_s (300 s). The other ranks'
    next paratrain call, or their end, is checked in the same sequence: both stop at once, one line."""
    import time

    start = time.monotonic()
    ended = _ranks_of([str(Path(__file__).resolve().parent / "exit_script.py"), how, strategy], tmp_path)
    assert time.monotonic() - start < 60
    assert [code for code, _ in ended] == [2, 2], ended
    said = [line for _, out in ended for line in out.splitlines() if "paratrain: error" in line]
    assert len(said) == 1, ended
    assert f"{on_0} (call #" in said[0] and "on rank 0" in said[0], said
    assert f"{on_1} (call #" in said[0] and "on rank 1" in said[0], said


def test_a_models_output_crosses_ranks_as_tensors_and_json(gang):
    got = gang(2).run("own_loop_model:tree_job")
    assert got == [("CausalLMOutputWithPast", 2.5, True, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])] * 2


@pytest.mark.parametrize(
    "strategy, trainable_only", [("dp", False), ("zero1", True), ("zero2", False), ("zero3", False), ("zero3", True)]
)
def test_a_peft_model_trains_only_its_adapters_and_equals_plain_pytorch(tmp_path, gang, strategy, trainable_only):
    """A LoRA model wrapped by the user (peft) before pt.setup, with an optimizer over all its
    parameters or only the trainable ones: the adapters train as in one process, the frozen
    weights stay as they were with no optimizer state, and zero3 shards them like the rest (zero1
    and zero2 keep them whole on every rank, as they do the model's)."""
    from peft import PeftModel

    common = dict(strategy=strategy, optimizer="adamw", trainable_only=trainable_only)
    said = gang(2).run("own_loop_model:lora_job", out=str(tmp_path / "out"), run_dir=str(tmp_path / "run"), **common)
    got, want = weights(tmp_path / "out"), reference("adamw", 6, model="lora", trainable_only=trainable_only)
    assert max_rel_error(got, want) <= TOL
    model = build("adamw", model="lora")[0]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = {n: p for n, p in model.state_dict().items() if "lora_" not in n}
    assert all(torch.equal(got[n], p) for n, p in frozen.items())
    torch.manual_seed(0)  # the base model the loop started from
    adapter = PeftModel.from_pretrained(make_model("llama"), tmp_path / "out").state_dict()
    assert max_rel_error(adapter, got) <= TOL  # pt.export's adapter, in PEFT's format
    moments = [state for state, _ in said]
    assert moments == ([2 * trainable] * 2 if strategy == "dp" else [trainable, trainable])
    held, whole = [numbers for _, numbers in said], sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert held == [0, 0] if strategy != "zero3" else all(n < whole for n in held) and sum(held) >= whole


def test_a_peft_model_under_tp_exits_2_naming_model_lora(gang):
    assert gang(2).run("own_loop_model:tp_setup_job", model="lora") == [2, 2]
    for said in gang(2).outputs:
        (line,) = said.strip().splitlines()
        assert line.startswith("paratrain: error: model.lora: a peft model trains under dp | zero1"), line


def test_a_peft_model_resumes_under_zero3_at_another_world_and_ends_equal(tmp_path, gang):
    """zero3's checkpoint holds the frozen parameters' pieces beside the adapters' and their state."""
    ckpt, common = str(tmp_path / "ckpt"), dict(strategy="zero3", optimizer="adamw", model="lora")
    first = trained(gang, 2, tmp_path / "a", ckpt=ckpt, save_at=3, **common)
    assert max_rel_error(trained(gang, 1, tmp_path / "b", ckpt=ckpt, **common), first) <= TOL
