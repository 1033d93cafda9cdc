"""Your code around a paratrain model (DESIGN.md, "Your code around the model is safe"): a loop
written as nanoGPT's train.py (tests/nanogpt_loop.py: tied embedding and head, AdamW's decay and
no-decay groups, gradient accumulation, torch's own clip_grad_norm_, the next batch fetched before
backward and before saving, model.state_dict() saved with torch.save and read by plain torch,
load_state_dict after setup) equals the same loop in one process of plain PyTorch under every
data-parallel strategy, saved and resumed included; what cannot be made right stops every rank with
one line."""

import re
from pathlib import Path

import pytest
import torch
from helpers import check_ok, max_rel_error, run_cli, run_torchrun
from nanogpt_loop import CLIP, GPT, TP_PLAN, data, hybrid_batches, hybrid_model, initial_state, reference
from safetensors.torch import load_file

SCRIPT = str(Path(__file__).resolve().parent / "nanogpt_loop.py")
TOL = 1e-4
STEPS, SAVE_AT = 6, 3


def saved(path: Path) -> dict:
    """A checkpoint the loop wrote with torch.save, read back by plain torch."""
    return torch.load(path, weights_only=True)["model"]


@pytest.fixture(scope="module")
def expected():
    return reference(STEPS, save_at=SAVE_AT)


@pytest.mark.parametrize(
    "strategy, world, eval_on, zero_grad_of",
    [
        ("dp", 2, "main", "optimizer"),  # nanoGPT's evaluation on rank 0 alone: no collective in a forward
        ("zero1", 2, "main", "model"),
        ("zero2", 2, "main", "optimizer"),
        ("zero3", 2, "all", "optimizer"),  # a forward gathers from every rank: all evaluate
        ("zero3", 3, "all", "model"),
        ("tp", 2, "all", "optimizer"),  # a split layer's forward meets the other tp rank: all evaluate
        ("tp", 2, "all", "model"),  # model.zero_grad() lets the split parameters' gradients go too
    ],
)
def test_a_nanogpt_loop_saved_and_resumed_equals_one_process(
    tmp_path, gang, expected, strategy, world, eval_on, zero_grad_of
):
    """torch's clip_grad_norm_, state_dict() (cloned, torch.saved, read by plain torch),
    load_state_dict() after setup, and a prefetching loop saved at step 3 and resumed."""
    final, at_save = expected
    ckpt, first, resumed = tmp_path / "ckpt", tmp_path / "first", tmp_path / "resumed"
    common = dict(strategy=strategy, steps=STEPS, ckpt=str(ckpt), save_at=SAVE_AT, eval_on=eval_on)
    common.update(zero_grad_of=zero_grad_of)
    if strategy == "tp":
        common.update(tp=2, tp_plan=TP_PLAN)
    gang(world).run("nanogpt_loop:job", out=str(first), **common)
    assert max_rel_error(saved(first / f"step-{SAVE_AT}.pt"), at_save) <= TOL
    assert max_rel_error(saved(first / "final.pt"), final) <= TOL
    # resumed from pt.save's checkpoint: the batch fetched ahead of the save is served again
    gang(world).run("nanogpt_loop:job", out=str(resumed), **common)
    assert max_rel_error(saved(resumed / "final.pt"), final) <= TOL


@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "zero3", "tp"])
def test_torchs_gradient_norm_is_the_global_one_and_pt_clip_grad_norm_s(gang, strategy):
    model = GPT()
    model.load_state_dict(initial_state())
    x, y = data().tensors
    model(x[:4], y[:4])[1].backward()
    one_process = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    for torch_norm, pt_norm, clipped in gang(2).run("nanogpt_loop:norms_job", strategy=strategy):
        assert torch_norm == pytest.approx(one_process, rel=1e-5) and pt_norm == pytest.approx(torch_norm, rel=1e-6)
        assert clipped == pytest.approx(CLIP, rel=1e-5)


@pytest.mark.parametrize("strategy, bf16", [("zero1", True), ("zero2", True), ("zero3", False)])
def test_load_state_dict_after_setup_reaches_every_shard(tmp_path, gang, strategy, bf16):
    """Under mixed precision the fp32 masters take the loaded values too (the export writes them)."""
    gang(2).run("nanogpt_loop:load_state_job", strategy=strategy, out=str(tmp_path), bf16=bf16)
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert max_rel_error(exported, initial_state()) == 0


@pytest.mark.parametrize(
    "strategy, call, codes, says",
    [
        (
            "zero2",
            "grad-arithmetic",
            [2, 2],
            "p.grad under zero2 holds this rank's shard of the gradient: torch's abs is",
        ),
        (
            "zero3",
            "eval-on-main",
            [2, 2],
            "zero3: the ranks ran different model calls: a forward under no_grad (call #1) on rank 0; a training "
            "forward (call #1) on rank 1: ",
        ),
        (
            "zero3",
            "state-dict-on-main",
            [2, 2],
            "zero3: the ranks ran different model calls: model.state_dict() (call #1) on rank 0; a training forward",
        ),
        ("zero2", "optimizer-state-on-main", [2, 0], "optimizer.state_dict() / load_state_dict() under zero2: "),
        ("tp", "optimizer-state-on-main", [2, 0], "optimizer.state_dict() / load_state_dict() under tp: "),
        (
            "zero3",
            "parameter-read",
            [2, 2],
            "transformer.wte.weight under zero3 holds no values outside a forward (they are sharded across ranks): "
            "torch's sum",
        ),
        (
            "tp",
            "parameter-read",
            [2, 2],
            "transformer.h.0.mlp.0.weight under tp holds this rank's slice: torch's sum cannot read the whole "
            "(64, 16) parameter outside a forward; read model.state_dict() on every rank",
        ),
        (
            "tp",
            "eval-on-main",
            [2, 2],
            "tp: the ranks ran different model calls: a forward under no_grad (call #1) on rank 0; a training "
            "forward (call #1) on rank 1: under tp every rank must run each forward, backward and state_dict of "
            "the model (a split layer all-reduces with the other tp ranks)",
        ),
        (
            "tp",
            "state-dict-on-main",
            [2, 2],
            "tp: the ranks ran different model calls: model.state_dict() (call #1) on rank 0; a training forward",
        ),
        (
            "zero3",
            "forward-on-main-then-done",
            [2, 0],
            "zero3: a training forward of the model (call #1) ran on rank 0, and not every other rank ran it "
            "within parallel.timeout_s = 2 s",
        ),
    ],
)
def test_what_cannot_be_made_right_stops_in_one_line(gang, strategy, call, codes, says):
    """Exit 2 (a usage error), one line: where every rank sees the same, rank 0 says it."""
    members = gang(2)  # the same gang for its outputs (gang(2) starts a fresh one after many jobs)
    assert members.run("nanogpt_loop:refused_job", strategy=strategy, call=call) == codes
    said = members.outputs
    (line,) = said[0].strip().splitlines()
    assert line.startswith(f"paratrain: error: {says}") and not said[1], said


def test_a_pipelines_state_dict_is_the_whole_model_on_every_rank(tmp_path, gang):
    """Under pp a rank holds one stage's layers (the others' on the meta device): state_dict()
    joins the stages on every rank, current after training, as the export has them."""
    states = gang(2).run("nanogpt_loop:pipeline_job", call="state-dict", out=str(tmp_path))
    exported = load_file(str(tmp_path / "model.safetensors"))
    for state in states:
        assert sorted(state) == sorted(exported) and max_rel_error(state, exported) == 0


def test_load_state_dict_after_setup_reaches_every_pipeline_stage(tmp_path, gang):
    gang(2).run("nanogpt_loop:pipeline_job", call="load", out=str(tmp_path))
    torch.manual_seed(0)  # the job's model: its initial weights
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16)))
    model.extend([torch.nn.Tanh(), torch.nn.Linear(16, 4)])
    assert max_rel_error(load_file(str(tmp_path / "model.safetensors")), model.state_dict()) == 0


def test_a_pipelined_model_called_whole_stops_in_one_line(gang):
    members = gang(2)
    assert members.run("nanogpt_loop:pipeline_job", call="forward") == [2, 2]
    (line,) = members.outputs[0].strip().splitlines()[-1:]
    assert line.startswith("paratrain: error: model(...) under pp with pp = 2: each rank holds one pipeline"), line
    assert "error" not in members.outputs[1], members.outputs[1]


@pytest.mark.parametrize(
    "plan",
    [{"transformer.h.*.c_attn": "colwise"}, {"transformer.h.*.c_attn": "colwise", "transformer.h.*.c_proj": "rowwise"}],
)
def test_a_fused_qkv_split_colwise_exits_2_in_one_line_naming_its_entry(gang, plan):
    """nanoGPT's fused c_attn split colwise (alone, or with c_proj rowwise as for separate q, k, v)
    makes the block's own forward fail ("not enough values to unpack"): the plan's check catches it
    there, runs the block whole, and names the entry."""
    members = gang(2)
    assert members.run("nanogpt_loop:fused_qkv_job", plan=plan) == [2, 2]
    (line,) = [line for said in members.outputs for line in said.strip().splitlines()]
    assert line.startswith("paratrain: error: parallel.tp_plan: the plan breaks 'transformer.h.0': "), line
    assert '"transformer.h.0.c_attn" = "colwise"' in line and "not enough values to unpack" in line, line


def test_a_hybrid_model_shows_the_unsplit_model_and_trains_as_one_process(gang):
    """tp 2 x pp 2: a rank holds a slice of its stage's layers; named_parameters() and state_dict()
    show the unsplit model on every rank, trained as one process trains it."""
    model = hybrid_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in hybrid_batches():
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    for shapes_kept, state in gang(4).run("nanogpt_loop:hybrid_job"):
        assert shapes_kept and max_rel_error(state, model.state_dict()) <= TOL


# -- the integration tier: the loop as a script, through `paratrain launch` and torchrun -------------
@pytest.mark.parametrize("launcher, strategy", [("paratrain launch", "zero3"), ("torchrun", "zero2")])
def test_the_nanogpt_script_launched_equals_one_process(tmp_path, expected, launcher, strategy):
    final, at_save = expected
    args = [SCRIPT, strategy, str(tmp_path / "out"), "--ckpt", str(tmp_path / "ckpt"), "--save-at", str(SAVE_AT)]
    if launcher == "torchrun":
        check_ok(run_torchrun(2, *args))
    else:
        check_ok(run_cli("launch", "--nproc", "2", *args, cwd=tmp_path))
    assert max_rel_error(saved(tmp_path / "out" / f"step-{SAVE_AT}.pt"), at_save) <= TOL
    assert max_rel_error(saved(tmp_path / "out" / "final.pt"), final) <= TOL


def test_evaluating_on_rank_0_alone_under_zero3_exits_2_in_one_line_not_on_a_signal(tmp_path):
    proc = run_cli("launch", "--nproc", "2", SCRIPT, "zero3", str(tmp_path / "out"), "--eval-on", "main", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "the ranks ran different model calls" in line]
    assert len(said) == 1 and re.match(
        r"paratrain: error: zero3: the ranks ran different model calls: a forward under no_grad \(call #(\d+)\) "
        r"on rank 0; a training forward \(call #\1\) on rank 1: ",
        said[0],
    ), proc.stderr
    assert "signal" not in proc.stderr.lower() and "Traceback" not in proc.stderr, proc.stderr
