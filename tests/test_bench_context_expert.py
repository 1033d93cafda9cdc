"""`paratrain bench cp` and `paratrain bench ep` at world 2 on a tiny gpt: each runs its contenders
in interleaved rounds, prints its table and exits 0; the contenders that compute the same thing
agree on their first losses, cp's activation memory per rank falls with the ring's size, and the
ring and an all-to-all over heads compute the same attention."""

import json

import pytest
from helpers import check_ok, run_cli

from paratrain.cli import main

TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--steps", "1", "--rounds", "2", "--warmup", "2"]


def test_bench_cp_prints_its_table_at_world_2(tmp_path):
    out = tmp_path / "cp.json"
    proc = check_ok(
        run_cli("bench", "cp", "--nproc", "2", "--seq", "64", "--batch", "1", *TINY, "--json", str(out), timeout=120)
    )
    assert "paratrain dp x cp 2 (cp = world)" in proc.stdout and "paratrain dp, no cp (reference)" in proc.stdout
    assert "torch context_parallel: " in proc.stdout  # a contender, or the one line why not
    result = json.loads(out.read_text())
    assert result["max_loss_diff_vs_one_process"] <= 1e-4, result["first_losses"]
    memory = result["activation_bytes_per_rank"]
    assert memory["2"] < memory["1"], memory
    # the ring against an all-to-all over heads, one attention alone: the same function, both timed
    heads = result["attention_ring_vs_all_to_all_over_heads"]
    assert heads["max_difference"] <= 1e-5 and heads["ring_ms"] > 0 and heads["all_to_all_ms"] > 0, heads
    assert "is faster here" in proc.stdout


def test_bench_ep_prints_its_table_at_world_2(tmp_path):
    out = tmp_path / "ep.json"
    ep = ["--seq", "16", "--batch", "2", "--experts", "4", *TINY, "--json", str(out)]
    proc = check_ok(run_cli("bench", "ep", "--nproc", "2", *ep, timeout=120))
    for contender in ("paratrain dp, ep 2", "plain all-to-all MoE, ep 2", "paratrain dp, ep 1 (replicated)"):
        assert contender in proc.stdout
    result = json.loads(out.read_text())
    assert result["max_loss_diff"] <= 1e-4, result["first_losses"]
    assert result["ep_step_ms"] > 0 and result["plain_step_ms"] > 0 and result["dense_step_ms"] > 0


@pytest.mark.parametrize(
    "args, option",
    [
        (["cp", "--nproc", "3"], "--seq"),  # 6 chunks do not divide 1024 tokens
        (["cp", "--heads", "3"], "--heads"),
        (["ep", "--nproc", "3"], "--experts"),  # 3 ranks do not divide 8 experts
        (["ep", "--top-k", "9"], "--top-k"),
    ],
)
def test_a_layout_the_bench_cannot_split_exits_2_naming_the_option(capsys, args, option):
    """Checked before any worker starts (a worker would fail with a traceback)."""
    assert main(["bench", *args]) == 2
    assert f"paratrain: error: {option}:" in capsys.readouterr().err
