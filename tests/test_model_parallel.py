"""tp, pp (gpipe, 1f1b, interleaved) and hybrid dp x tp x pp against single-process training.

World-4 runs on 2 cores are slow, so each run checks several things: final weights against the
reference, the validation loss against the reference model's, and (where a checkpoint is written)
resuming it at another layout.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import final_weights, metrics, rel_error, write_config
from reference import DIGITS_MLP, digits_mlp_reference, train_reference

from paratrain.cli import main
from paratrain.data import load_batch
from paratrain.data.datasets import corpus
from paratrain.models.gpt import gpt

STEPS, BATCH = 20, 8
GPT = f"""
name = "mp"
[model]
factory = "gpt"
n_layer = 2
n_head = 4
d_model = 32
[data]
factory = "corpus"
block_size = 16
max_chars = 20000
batch_size = {BATCH}
shuffle = false
[train]
steps = {STEPS}
optimizer = "sgd"
lr = 0.1
log_every = 10
[parallel]
microbatches = 4
"""


@pytest.fixture(scope="module")
def gpt_reference():
    train = corpus("train", block_size=16, max_chars=20000)
    x, y = load_batch(train, torch.arange(STEPS * BATCH) % len(train))
    torch.manual_seed(0)
    model = gpt(train.vocab_size, n_layer=2, n_head=4, d_model=32, block_size=16)
    weights = train_reference(model, x, y, steps=STEPS, batch_size=BATCH, lr=0.1)
    val = corpus("val", block_size=16, max_chars=20000)
    vx, vy = load_batch(val, torch.arange(len(val)))
    with torch.no_grad():
        logits = model(vx)
        val_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), vy.reshape(-1)).item()
    return weights, val_loss


def run(gang, tmp_path, name, world, *sets, resume=None, env=None) -> str:
    """GPT trained on a gang of `world`; rank 0's output."""
    cfg = write_config(tmp_path / "gpt.toml", GPT)
    return gang(world).train(cfg, tmp_path / name, sets, resume=str(resume) if resume else "none", env=env)


def check_equal(tmp_path, name, reference):
    weights, val_loss = reference
    assert rel_error(final_weights(tmp_path / name), weights) <= 1e-4, name
    assert abs(metrics(tmp_path / name)[-1]["val_loss"] - val_loss) <= 1e-4 * val_loss, name


def test_tensor_parallel_then_hybrid_resumes(tmp_path, gang, gpt_reference):
    """tp = 2 equals one process; its step-10 checkpoint resumes at world 4 both as tp 2 x pp 2
    (the same shards, now cut into stages) and as dp 2 x pp 2 (shards joined: tp 2 -> 1), and
    both still end equal to one process. The three names are one engine: a checkpoint written under
    one resumes under the others."""
    run(gang, tmp_path, "tp", 2, "parallel.strategy='tp'", "parallel.tp=2", "checkpoint.every=10")
    check_equal(tmp_path, "tp", gpt_reference)
    step10 = tmp_path / "tp" / "checkpoints" / "step-10"
    out = run(
        gang,
        tmp_path,
        "tp-pp",
        4,
        "parallel.strategy='hybrid'",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.schedule='gpipe'",
        resume=step10,
    )
    assert "at step 10" in out
    check_equal(tmp_path, "tp-pp", gpt_reference)
    # dp 2 x pp 2: gradients all-reduced over the dp sub-group only, per chunk, in its last backward
    run(gang, tmp_path, "dp-pp", 4, "parallel.strategy='pp'", "parallel.pp=2", "parallel.microbatches=2", resume=step10)
    check_equal(tmp_path, "dp-pp", gpt_reference)


def test_pipeline_schedules(tmp_path, gang, gpt_reference):
    """pp = 2 with each schedule; interleaved runs 2 virtual stages per rank (4 stages, one layer
    each); gpipe resumes interleaved's checkpoint under another cut, balanced by parameters."""
    pp = ["parallel.strategy='pp'", "parallel.pp=2"]
    out = run(gang, tmp_path, "interleaved", 2, *pp, "parallel.schedule='interleaved'", "checkpoint.every=10")
    assert "pipeline split by time into 4 stages" in out
    check_equal(tmp_path, "interleaved", gpt_reference)
    run(gang, tmp_path, "1f1b", 2, *pp, "parallel.schedule='1f1b'")
    check_equal(tmp_path, "1f1b", gpt_reference)
    out = run(
        gang,
        tmp_path,
        "gpipe",
        2,
        *pp,
        "parallel.schedule='gpipe'",
        "parallel.balance='params'",
        resume=tmp_path / "interleaved" / "checkpoints" / "step-10",
    )
    assert "pipeline split by params into 2 stages" in out and "at step 10" in out
    check_equal(tmp_path, "gpipe", gpt_reference)


def test_interleaved_in_nccl_message_order(tmp_path, gang, gpt_reference):
    """NCCL ignores tags and matches a rank pair's messages in posting order. With every tag 0
    (PARATRAIN_P2P_TAGS=0 does that on gloo), interleaved (8 microbatches, 2 chunks per rank) must
    still equal one process: each rank posts a neighbour's messages in the neighbour's order.
    (Through gloo, not shared memory, which matches in order anyway and checks every tag.)"""
    run(
        gang,
        tmp_path,
        "untagged",
        2,
        "parallel.strategy='pp'",
        "parallel.pp=2",
        "parallel.schedule='interleaved'",
        "parallel.microbatches=8",
        env={"PARATRAIN_P2P_TAGS": "0", "PARATRAIN_P2P_SHM": "0"},
    )
    check_equal(tmp_path, "untagged", gpt_reference)


FOUR_LAYERS = """
from torch import nn


def build():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 10))
"""


def test_a_stage_without_parameters(tmp_path, gang):
    """Interleaved pp = 2 cuts these four layers into four stages of one: the ReLU's stage has no
    parameters, so no gradient to average and a norm of zero (it crashed the step), and the run
    still equals one process."""
    import runpy

    from paratrain.data.datasets import digits

    (tmp_path / "fourlayers.py").write_text(FOUR_LAYERS)
    job = DIGITS_MLP.replace('factory = "mlp"\nhidden = 32', 'factory = "fourlayers:build"')
    cfg = write_config(
        tmp_path / "c.toml",
        job + "clip_grad_norm = 0.5\n[parallel]\nstrategy = 'pp'\npp = 2\nschedule = 'interleaved'\n",
    )
    out = gang(2).train(cfg, tmp_path / "run")
    assert "layers 1-1" in out, out  # the ReLU, alone
    torch.manual_seed(0)
    x, y = digits("train").tensors
    ref = train_reference(
        runpy.run_path(str(tmp_path / "fourlayers.py"))["build"](), x, y, steps=20, batch_size=24, lr=0.1, clip=0.5
    )
    assert rel_error(final_weights(tmp_path / "run"), ref) <= 1e-4


TIED = """
from torch import nn


def build():
    shared, tied = nn.Linear(32, 32), nn.Linear(32, 32)
    tied.weight = shared.weight  # one parameter, used by layers 2 and 4
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), shared, nn.ReLU(), tied, nn.ReLU(), nn.Linear(32, 32),
                         nn.ReLU(), nn.Linear(32, 10))


def both_ends():
    same = nn.Linear(64, 64)  # the first and the last layer
    return nn.Sequential(same, nn.ReLU(), same)
"""


def test_tied_weights_split_across_stages_equal_one_process(tmp_path, gang, capsys):
    """A parameter two layers share (an embedding tied to the output projection): split between
    stages, each rank trained its own copy and the copies drifted apart, silently. Now the stages
    holding a copy sum its gradient every step (balanced by parameters, the cut falls between the
    two layers), and the run equals one process, with clipping on the global norm, which counts the
    parameter once. A module used twice cannot be split (its weights leave a rank with either use):
    too few layers then exits 2 saying why; so does a tp plan that would shard a tied parameter."""
    import runpy

    from paratrain.data.datasets import digits

    (tmp_path / "tied.py").write_text(TIED)
    job = (
        DIGITS_MLP.replace('factory = "mlp"\nhidden = 32', 'factory = "tied:both_ends"')
        + "clip_grad_norm = 0.1\n[parallel]\nstrategy = 'pp'\npp = 2\nbalance = 'params'\n"
    )
    cfg = write_config(tmp_path / "c.toml", job)
    assert main(["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "parallel.pp" in err and "layers 0-2 share 0.weight (tied weights)" in err, err
    # tp cannot shard a tied parameter: one holder got a shard and the other the whole (it drifted 0.29)
    tp = [
        "--set",
        "parallel.strategy='tp'",
        "--set",
        "parallel.pp=1",
        "--set",
        "parallel.tp=2",
        "--set",
        "parallel.tp_plan={'2'='colwise','4'='rowwise'}",
    ]
    cfg = write_config(tmp_path / "c.toml", job.replace("tied:both_ends", "tied:build"))
    assert main(["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), *tp]) == 2
    err = capsys.readouterr().err
    assert "parallel.tp_plan" in err and "'2' shares its weight with '4'" in err, err

    out = gang(2).train(cfg, tmp_path / "run")
    assert "stage 0 (rank 0): layers 0-2, " in out, out
    assert "tied weights: 2.weight is shared by stages [0, 1]" in out, out
    torch.manual_seed(0)
    x, y = digits("train").tensors
    ref = train_reference(
        runpy.run_path(str(tmp_path / "tied.py"))["build"](), x, y, steps=20, batch_size=24, lr=0.1, clip=0.1
    )
    weights = final_weights(tmp_path / "run")
    assert torch.equal(weights["2.weight"], weights["4.weight"])
    # 4e-8 here; 2e-4 with the tied parameter's gradient counted twice in the clipping norm
    assert rel_error(weights, ref) <= 1e-6


def test_gpt_with_tied_embeddings_under_tp_pp_and_zero3(tmp_path, gang, capsys):
    """model.tie_embeddings (GPT-2's tying of the head to the token embedding): tp keeps the tie
    (both shard the same vocabulary rows), pp sums the copies' gradients across the first and last
    stage, tp x pp sums each tp rank's shard of them (clipped: the norm counts the tie once), zero3
    rebuilds the tied weight on the meta device as a plain build makes it; each equals one process.
    Interleaved stages cannot split it: exit 2 naming the tie."""
    train = corpus("train", block_size=16, max_chars=20000)
    x, y = load_batch(train, torch.arange(STEPS * BATCH) % len(train))
    torch.manual_seed(0)
    model = gpt(train.vocab_size, n_layer=2, n_head=4, d_model=32, block_size=16, tie_embeddings=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    reference = train_reference(model, x, y, steps=STEPS, batch_size=BATCH, lr=0.1)
    model.load_state_dict(state)
    clipped = train_reference(model, x, y, steps=STEPS, batch_size=BATCH, lr=0.1, clip=0.05)
    tied = "model.tie_embeddings=true"
    cfg = write_config(tmp_path / "gpt.toml", GPT)
    assert (
        main(
            [
                "run",
                str(cfg),
                "--nproc",
                "2",
                "--run-dir",
                str(tmp_path / "r"),
                "--set",
                tied,
                "--set",
                "parallel.strategy='pp'",
                "--set",
                "parallel.pp=2",
                "--set",
                "parallel.schedule='interleaved'",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "parallel.pp" in err and "share embed.tok.weight (tied weights)" in err, err
    for name, world, sets, ref in [
        ("tp", 2, ["parallel.strategy='tp'", "parallel.tp=2"], reference),
        ("pp", 2, ["parallel.strategy='pp'", "parallel.pp=2"], reference),
        (
            "tpxpp",
            4,
            ["parallel.strategy='hybrid'", "parallel.tp=2", "parallel.pp=2", "train.clip_grad_norm=0.05"],
            clipped,
        ),
        ("zero3", 2, ["parallel.strategy='zero3'"], reference),
    ]:
        out = run(gang, tmp_path, name, world, tied, *sets)
        weights = final_weights(tmp_path / name)
        assert torch.equal(weights["embed.tok.weight"], weights["head.lm_head.weight"]), name
        assert rel_error(weights, ref) <= 1e-4, name
        if name == "tpxpp":
            assert "tied weights: embed.tok.weight is shared by stages [0, 1]" in out, out


MLP = (
    DIGITS_MLP
    + """clip_grad_norm = 0.5
[parallel]
strategy = "tp"
tp = 2
tp_plan = { "0" = "colwise", "2" = "rowwise", "4" = "colwise" }
"""
)


def test_user_model_tp_plan(tmp_path, gang):
    """An nn.Sequential split by a tp_plan (its output split too: the loss gathers nothing, it is
    vocab-parallel), with gradient clipping over the global norm of all shards."""
    cfg = write_config(tmp_path / "mlp.toml", MLP)
    gang(2).train(cfg, tmp_path / "run")
    ref = digits_mlp_reference(clip=0.5)
    assert rel_error(final_weights(tmp_path / "run"), ref) <= 1e-4


@pytest.mark.parametrize(
    "sets, key",
    [
        (["parallel.strategy='pp'", "parallel.tp=1", "parallel.pp=2", "model.n_layers=0"], "parallel.pp"),  # 1 Linear
        (
            [
                "parallel.strategy='pp'",
                "parallel.pp=2",
                "parallel.schedule='interleaved'",
                "parallel.virtual_stages=3",
                "model.n_layer=2",
            ],
            "parallel.pp",
        ),  # 6 stages, 4 layers
        (["parallel.strategy='tp'", "parallel.tp=2", "model.n_head=3", "model.d_model=24"], "parallel.tp"),
        (["parallel.strategy='pp'", "parallel.pp=2", "parallel.microbatches=3"], "parallel.microbatches"),
        (
            ["parallel.strategy='pp'", "parallel.pp=2", "parallel.schedule='interleaved'", "parallel.microbatches=1"],
            "parallel.microbatches",
        ),
        (["parallel.strategy='tp'", "parallel.tp=2", "parallel.tp_plan={nope='colwise'}"], "parallel.tp_plan"),
        (
            ["parallel.strategy='tp'", "parallel.tp=2", "parallel.tp_plan={'blocks.0.ln1'='colwise'}"],
            "parallel.tp_plan",
        ),
        (
            ["parallel.strategy='tp'", "parallel.tp=2", "parallel.tp_plan={'head.lm_head'='diagonal'}"],
            "parallel.tp_plan",
        ),
        (["parallel.strategy='hybrid'", "parallel.tp=3"], "parallel.tp"),  # tp x pp does not divide 2
        (["parallel.strategy='pp'", "parallel.pp=3"], "parallel.pp"),  # the degree that was set
        (["parallel.strategy='pp'", "parallel.pp=2", "parallel.balance='flops'"], "parallel.balance"),
    ],
)
def test_bad_model_parallel_config_exits_2(tmp_path, capsys, sets, key):
    cfg = write_config(tmp_path / "c.toml", MLP if "model.n_layers=0" in sets else GPT)
    args = ["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], lines


def test_user_plan_must_divide_evenly(tmp_path, capsys):
    cfg = write_config(tmp_path / "mlp.toml", MLP.replace("hidden = 32", "hidden = 33"))
    assert main(["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r")]) == 2
    assert "parallel.tp" in capsys.readouterr().err


def _channel_worker(rank: int, port: int, capacity: int) -> None:
    """Rank 0 sends 120 messages (more bytes than the ring holds) to rank 1, which starts late and
    receives them into buffers of its own, one of them not contiguous; then a message out of order."""
    import os
    import time

    import torch.distributed as dist

    from paratrain.comm import shm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    senders, receivers = shm.connect(None, {1 - rank}, timeout_s=30, capacity=capacity)
    assert set(senders) == set(receivers) == {1 - rank}
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, capacity // 8, (120,), generator=g).tolist()
    messages = [
        torch.randn(n, generator=g).to(torch.bfloat16 if i % 3 == 0 else torch.float32) for i, n in enumerate(sizes)
    ]
    assert sum(t.nbytes for t in messages) > 10 * capacity
    if rank == 0:
        for i, t in enumerate(messages):
            senders[1].send(t, tag=i)  # blocks whenever the ring is full, until rank 1 takes some
        senders[1].send(torch.ones(4), tag=1000)
    else:
        time.sleep(0.5)  # rank 0 fills the ring meanwhile
        bufs = [torch.empty_like(t) for t in messages]
        bufs[7] = torch.empty(2, messages[7].numel(), dtype=messages[7].dtype)[0]  # a strided view
        bufs[8] = torch.empty(messages[8].numel() * 2, dtype=messages[8].dtype)[::2]  # not contiguous
        posted = [receivers[0].post(b, i) for i, b in enumerate(bufs)]
        for i, (r, t) in enumerate(zip(posted, messages)):
            r.wait()
            assert torch.equal(r.buf, t), f"message {i} differs"
        with pytest.raises(shm.ChannelError, match="different orders"):
            receivers[0].post(torch.empty(4), tag=999).wait()
    dist.destroy_process_group()


def test_shared_memory_channel_moves_every_message_in_order():
    """The same-host pipeline transport: a small ring (wrap-around, a sender that waits for space),
    bf16 and fp32 payloads, a non-contiguous receive buffer, and a tag that does not match."""
    import torch.multiprocessing as mp

    from paratrain.runtime.process import free_port

    mp.start_processes(_channel_worker, args=(free_port(), 64 * 1024), nprocs=2, start_method="spawn")


def _schedule_plays_out(schedule, p: int, m: int, v: int) -> None:
    """Run every rank's action list against its neighbours' with the engine's rules: an action
    waits only for the message it needs, and each rank pair's messages must be received in the
    order they were sent (how NCCL and the shared-memory channel match them)."""
    from paratrain.parallel.pipeline.schedules import SCHEDULES

    n_stages = p * v
    actions = {r: SCHEDULES[schedule](p, r, m, v) for r in range(p)}
    sent = {}  # (src, dst) -> messages in sending order
    received = {}  # (src, dst) -> messages in the order the receiver needs them
    done, position = set(), {r: 0 for r in range(p)}
    while any(position[r] < len(actions[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(actions[r]):
                a = actions[r][position[r]]
                s = a.chunk * p + r
                need = (
                    (("F", s - 1, a.mb) if s > 0 else None)
                    if a.kind == "F"
                    else (("B", s + 1, a.mb) if s < n_stages - 1 else ("F", s, a.mb))
                )
                if need is not None and need not in done:
                    break
                if need is not None and need[1] != s:
                    received.setdefault(((r - 1) % p if a.kind == "F" else (r + 1) % p, r), []).append(need)
                neighbour = s + 1 if a.kind == "F" else s - 1
                if 0 <= neighbour < n_stages:
                    sent.setdefault((r, neighbour % p), []).append((a.kind, s, a.mb))
                done.add((a.kind, s, a.mb))
                position[r] += 1
                progressed = True
        assert progressed, f"{schedule} p={p} m={m} v={v} deadlocks at {position}"
    assert sent == received, f"{schedule} p={p} m={m} v={v}: a rank receives in another order than it is sent"
    for r in range(p):  # every forward and backward of this rank's stages, once each
        assert sorted(actions[r]) == sorted({(k, c, mb) for k in "FB" for c in range(v) for mb in range(m)})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_every_schedule_completes_and_keeps_message_order(schedule):
    """For many shapes, not only the ones the process tests run: no rank waits forever, and every
    rank pair's messages arrive in sending order, which tag-less matching relies on."""
    for p in (2, 3, 4):
        for v in (1, 2, 3) if schedule == "interleaved" else (1,):
            for m in (p, 2 * p, 3 * p, 4 * p) if schedule == "interleaved" else (1, p - 1, p, 2 * p + 1):
                _schedule_plays_out(schedule, p, m, v)
