"""dp against single-process PyTorch, torch DDP, and itself (accumulation, resume)."""

import pytest
import torch
from helpers import check_ok, final_weights, max_rel_error, metrics, run_torchrun, write_config
from reference import DIGITS_MLP, digits_mlp_reference

from paratrain.cli import main

EQUIV = (
    DIGITS_MLP
    + """
[parallel]
strategy = "dp"
bucket_mb = 0.002   # a few KB: many buckets even for this small model
"""
)


@pytest.fixture(scope="module")
def reference_weights():
    return digits_mlp_reference()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_dp_equals_single_process(tmp_path, gang, reference_weights, world):
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    gang(world).train(cfg, tmp_path / "run")
    assert max_rel_error(final_weights(tmp_path / "run"), reference_weights) <= 1e-4


def test_dp_equals_torch_ddp(tmp_path, gang):
    out = tmp_path / "ddp.safetensors"
    gang(2).run("ddp_oracle:train", out=str(out))  # torch's DDP in the gang's live processes
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    gang(2).train(cfg, tmp_path / "run")
    from safetensors.torch import load_file

    assert max_rel_error(final_weights(tmp_path / "run"), load_file(str(out))) <= 1e-5


def test_grad_accumulation_equals_one_big_batch(tmp_path, gang, reference_weights):
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    gang(2).train(cfg, tmp_path / "run", ["train.grad_accum=3"])
    assert max_rel_error(final_weights(tmp_path / "run"), reference_weights) <= 1e-4


RESUME = """
name = "resume"
[model]
factory = "mlp"
hidden = 32
[data]
factory = "digits"
batch_size = 200   # 1437 samples: epochs end mid-batch, so the sampler position matters
shuffle = true
[train]
steps = 16
optimizer = "adamw"
lr = 0.01
warmup_steps = 4
log_every = 4
[checkpoint]
every = 4
keep = 2
"""


def test_resume_equals_uninterrupted(tmp_path, gang):
    cfg = write_config(tmp_path / "c.toml", RESUME)
    gang(2).train(cfg, tmp_path / "straight")
    # Stop after 8 steps, then continue to 16 from the newest checkpoint.
    gang(2).train(cfg, tmp_path / "split", ["train.steps=8"])
    out = gang(2).train(cfg, tmp_path / "split", resume="auto")
    assert "resumed from" in out and "at step 8" in out
    assert "done: steps 9-16 in" in out  # what this run trained, and its samples/s
    straight, split = final_weights(tmp_path / "straight"), final_weights(tmp_path / "split")
    assert all(torch.equal(straight[k], split[k]) for k in straight), "resumed run differs from uninterrupted"
    # keep = 2: only the newest two checkpoints remain; metrics continue without duplicate steps
    steps = sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir())
    assert steps == ["step-12", "step-16"]
    logged = [m["step"] for m in metrics(tmp_path / "split")]
    assert logged == sorted(set(logged)) and logged[-1] == 16


def test_resume_at_another_world_size(tmp_path, gang):
    cfg = write_config(tmp_path / "c.toml", RESUME)
    gang(2).train(cfg, tmp_path / "straight")
    gang(2).train(cfg, tmp_path / "split", ["train.steps=8"])
    gang(1).train(cfg, tmp_path / "one", resume=str(tmp_path / "split" / "checkpoints" / "step-8"))
    assert max_rel_error(final_weights(tmp_path / "one"), final_weights(tmp_path / "straight")) <= 1e-4
    # In place: the run directory keeps the first 8 steps' profile at world 2, and its report
    # describes the world it ended at.
    gang(1).train(cfg, tmp_path / "split", resume="auto")
    assert max_rel_error(final_weights(tmp_path / "split"), final_weights(tmp_path / "straight")) <= 1e-4
    assert main(["report", str(tmp_path / "split")]) == 0
    text = (tmp_path / "split" / "report" / "report.md").read_text()
    assert "1 ranks, 16 steps" in text and "steps 9-16 ran at world size 1" in text


def test_under_plain_torchrun_with_adamw_and_clipping(tmp_path):
    """The worker entry runs under torchrun as is; clipping uses the global norm of the averaged gradients."""
    cfg = write_config(
        tmp_path / "c.toml",
        EQUIV.replace('optimizer = "sgd"\nlr = 0.1', 'optimizer = "adamw"\nlr = 0.01\nclip_grad_norm = 0.5'),
    )
    check_ok(run_torchrun(2, "-m", "paratrain.trainer", str(cfg), "--run-dir", str(tmp_path / "run")))
    expected = digits_mlp_reference(lr=0.01, optimizer="adamw", clip=0.5)
    assert max_rel_error(final_weights(tmp_path / "run"), expected) <= 1e-4


PARTLY_USED = """
import torch
import torch.distributed as dist
from torch import nn


class PartlyUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(64, 10)
        self.never = nn.Linear(64, 10)       # no gradient on any rank, ever
        self.rank0_only = nn.Linear(10, 10)  # a gradient on rank 0 only

    def forward(self, x):
        out = self.body(x)
        if dist.is_initialized() and dist.get_rank() == 0:
            out = out + self.rank0_only(out)
        return out


def build():
    return PartlyUsed()
"""


def test_parameters_without_gradient_neither_hang_nor_corrupt(tmp_path, gang):
    (tmp_path / "partly.py").write_text(PARTLY_USED)
    cfg = write_config(tmp_path / "c.toml", EQUIV.replace('factory = "mlp"\nhidden = 32', 'factory = "partly:build"'))
    gang(2).train(cfg, tmp_path / "run", ["parallel.timeout_s=30"], timeout=60)
    weights = final_weights(tmp_path / "run")
    torch.manual_seed(0)
    initial = {
        k: v for k, v in __import__("runpy").run_path(str(tmp_path / "partly.py"))["build"]().state_dict().items()
    }
    assert torch.equal(weights["never.weight"], initial["never.weight"])
    assert not torch.equal(weights["rank0_only.weight"], initial["rank0_only.weight"])
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_cnn_in_bf16(tmp_path, gang):
    cfg = write_config(
        tmp_path / "c.toml", EQUIV.replace('factory = "mlp"\nhidden = 32', 'factory = "cnn"\nchannels = 8')
    )
    gang(2).train(cfg, tmp_path / "run", ["train.precision='bf16'", "train.steps=30"])
    log = metrics(tmp_path / "run")
    assert log[-1]["loss"] < log[0]["loss"] and all(
        torch.isfinite(w).all() for w in final_weights(tmp_path / "run").values()
    )


def test_optimizer_state_resumes_across_fused_and_foreach():
    """A checkpoint keeps hyperparameters and state, not how this machine computes the update: state
    saved by a foreach AdamW resumes into a fused one (and back) and steps identically."""
    import torch

    from paratrain import checkpoint as ckpt

    def trained(**impl):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8, 8))
        opt = torch.optim.AdamW([p], lr=0.01, **impl)
        for _ in range(3):
            p.grad = torch.randn(8, 8)
            opt.step()
        return p, opt

    for saved_impl, resumed_impl in (({"foreach": True}, {"fused": True}), ({"fused": True}, {"foreach": True})):
        p, opt = trained(**saved_impl)
        tensors, meta = ckpt.optimizer_to_tensors(opt, ["w"])
        tensors = {k: v.clone() for k, v in tensors.items()}  # as read back from the checkpoint file
        q = torch.nn.Parameter(p.detach().clone())
        resumed = torch.optim.AdamW([q], lr=0.5, **resumed_impl)
        ckpt.optimizer_from_tensors(resumed, ["w"], tensors, meta)
        group = resumed.param_groups[0]
        assert group["lr"] == 0.01 and bool(group["fused"]) == ("fused" in resumed_impl)
        p.grad = q.grad = torch.randn(8, 8)
        opt.step()
        resumed.step()
        assert torch.allclose(p, q, rtol=0, atol=1e-6)
