"""Replica groups (parallel.replicas): zero1-3 sharded inside each replica and averaged across them
(zero3 with replicas is HSDP) against one process; their checkpoints resume; the plan; bad input."""

import json

import pytest
from helpers import final_weights, max_rel_error, write_config
from reference import DIGITS_MLP, digits_mlp_reference

from paratrain.cli import main

EQUIV = (
    DIGITS_MLP
    + """
[parallel]
bucket_mb = 0.002   # a few KB: several units even for this small model
replicas = 2
"""
)

# zero3 also takes AdamW, clipping over the shards of every replica and gradient accumulation
HARDER = ["train.optimizer='adamw'", "train.lr=0.01", "train.clip_grad_norm=0.5", "train.grad_accum=2"]


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_replicas_of_zero_equal_one_process(tmp_path, gang, stage):
    """World 4 as 2 replicas of 2 ranks each."""
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    extra = HARDER if stage == "zero3" else []
    gang(4).train(cfg, tmp_path / "run", [f"parallel.strategy='{stage}'", *extra])
    want = digits_mlp_reference(optimizer="adamw", lr=0.01, clip=0.5) if extra else digits_mlp_reference()
    assert max_rel_error(final_weights(tmp_path / "run"), want) <= 1e-4


def test_hsdp_checkpoint_resumes_with_and_without_replicas(tmp_path, gang):
    """zero3 with 2 replicas at world 4 saves replica 0's 2 shards; the checkpoint resumes under the
    same layout and under plain zero3 at world 2, both ending where the uninterrupted run ends."""
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    sets = ["parallel.strategy='zero3'", "train.optimizer='adamw'", "train.lr=0.01", "checkpoint.every=10"]
    gang(4).train(cfg, tmp_path / "straight", sets)
    step10 = tmp_path / "straight" / "checkpoints" / "step-10"
    assert sorted(p.name for p in step10.glob("rank-*")) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    straight = final_weights(tmp_path / "straight")
    for world, layout in ((4, []), (2, ["parallel.replicas=1"])):
        run = tmp_path / f"resumed-{world}"
        out = gang(world).train(cfg, run, sets + layout, resume=str(step10))
        assert "at step 10 (saved by 2 ranks)" in out
        assert max_rel_error(final_weights(run), straight) <= 1e-4


def test_plan_shows_hsdp_against_zero3_over_the_world(tmp_path, capsys):
    """Inside a replica of 2 each rank holds half the model (not a quarter), and its gradient
    shards also cross to the other replica: an all-reduce over 2 ranks."""
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    plans = {}
    for replicas in (1, 2):
        out = tmp_path / f"plan-{replicas}.json"
        sets = ["--set", "parallel.strategy='zero3'", "--set", f"parallel.replicas={replicas}"]
        assert main(["plan", str(cfg), "--nproc", "4", *sets, "--json", str(out)]) == 0
        plans[replicas] = json.loads(out.read_text())
    assert "replicas 2 of 2 ranks" in capsys.readouterr().out
    world, hsdp = plans[1]["ranks"][0], plans[2]["ranks"][0]
    assert plans[2]["mesh"]["replicas"] == 2
    assert hsdp["param_bytes"] > 1.5 * world["param_bytes"]  # half of each unit instead of a quarter
    assert hsdp["grad_bytes"] > 1.5 * world["grad_bytes"]
    assert hsdp["comm"]["all_reduce"]["payload"] > world["comm"]["all_reduce"]["payload"]


@pytest.mark.parametrize(
    "override, why",
    [
        ("parallel.replicas=3", "does not divide the world size 4"),
        ("parallel.strategy='ps'", "must be 1 for strategy 'ps'"),
        # tp, pp and hybrid: the replicas are the mesh's dp copies, world / (tp x pp) of them
        ("parallel.strategy='tp'\nparallel.tp=2\nparallel.replicas=4", "4 ranks make 2 replicas, not 4"),
        ("parallel.replicas=0", "must be > 0"),
    ],
)
def test_bad_replicas_exit_2_naming_the_key(tmp_path, capsys, override, why):
    sets = [a for o in override.split("\n") for a in ("--set", o)]
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    code = main(["run", str(cfg), "--nproc", "4", "--run-dir", str(tmp_path / "r"), *sets])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "parallel.replicas" in err and why in err, err
