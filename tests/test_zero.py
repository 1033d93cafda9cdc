"""ZeRO stages 1-3 against single-process PyTorch and dp; resharding resume; inspect; bad input."""

import shutil

import pytest
import torch
from helpers import check_ok, final_weights, max_rel_error, metrics, run_cli, write_config
from reference import DIGITS_MLP, digits_mlp_reference
from torch import nn

from paratrain.cli import main
from paratrain.models.cnn import cnn
from paratrain.models.gpt import gpt
from paratrain.models.materialize import materialize, record_on_meta
from paratrain.models.mlp import mlp

EQUIV = (
    DIGITS_MLP
    + """
[parallel]
strategy = "zero1"
bucket_mb = 0.002   # a few KB: several units even for this small model
"""
)

# World 3 also exercises AdamW, global-norm clipping across shards and gradient accumulation.
# zero3 at world 2 takes the model from a user factory (its construction recorded on the meta device
# and replayed a tensor at a time) instead of the built-in one (built on the meta device and its
# initialisation replayed shard by shard).
USER_MODEL = ["model.factory='paratrain.models.mlp:mlp'", "model.in_features=64", "model.out_features=10"]
WORLD3 = ["train.optimizer='adamw'", "train.lr=0.01", "train.clip_grad_norm=0.5", "train.grad_accum=2"]


def reference(optimizer="sgd", lr=0.1, clip=0.0):
    return digits_mlp_reference(lr=lr, optimizer=optimizer, clip=clip)


@pytest.fixture(scope="module")
def dp_weights(tmp_path_factory, gang):
    tmp = tmp_path_factory.mktemp("dp")
    cfg = write_config(tmp / "c.toml", EQUIV)
    gang(2).train(cfg, tmp / "run", ["parallel.strategy='dp'"])
    return final_weights(tmp / "run")


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("world", [2, 3])
def test_zero_equals_single_process_and_dp(tmp_path, gang, dp_weights, stage, world):
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    extra = WORLD3 if world == 3 else USER_MODEL if stage == "zero3" else []
    gang(world).train(cfg, tmp_path / "run", [f"parallel.strategy='{stage}'", *extra])
    got = final_weights(tmp_path / "run")
    if world == 3:
        assert max_rel_error(got, reference("adamw", lr=0.01, clip=0.5)) <= 1e-4
    else:
        assert max_rel_error(got, reference()) <= 1e-4
        assert max_rel_error(got, dp_weights) <= 1e-5


def test_lora_on_a_builtin_model_under_zero3_equals_dp(tmp_path, gang):
    """peft initialises its adapters its own way: a built-in model under LoRA is materialised as a
    user factory is (its construction replayed), not by replaying its own initialisation."""
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    for strategy in ("dp", "zero3"):
        gang(2).train(
            cfg, tmp_path / strategy, [f"parallel.strategy='{strategy}'", "model.lora={r=4, target_modules=['0', '2']}"]
        )
    assert max_rel_error(final_weights(tmp_path / "zero3"), final_weights(tmp_path / "dp")) <= 1e-4


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_with_native_collectives_equals_single_process(tmp_path, stage):
    """NCCL's path: the native reduce-scatter and all-gather, in place (output = this rank's slice
    of the input), taken on gloo here by PARATRAIN_NATIVE_COLLECTIVES=1."""
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    check_ok(
        run_cli(
            "run",
            str(cfg),
            "--nproc",
            "2",
            "--set",
            f"parallel.strategy='{stage}'",
            "--run-dir",
            str(tmp_path / "run"),
            env={"PARATRAIN_NATIVE_COLLECTIVES": "1"},
        )
    )
    assert max_rel_error(final_weights(tmp_path / "run"), reference()) <= 1e-4


GPT = """
name = "zero-gpt"
[model]
factory = "gpt"
n_layer = 2
n_head = 2
d_model = 32
block_size = 16
[data]
factory = "corpus"
block_size = 16
max_chars = 20000
batch_size = 8
shuffle = false
[train]
steps = 8
optimizer = "sgd"
lr = 0.3
precision = "bf16"
grad_accum = 2
log_every = 4
[parallel]
strategy = "dp"
bucket_mb = 0.01
"""


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_mixed_precision_zero_trains_like_bf16_autocast(tmp_path, gang, stage):
    """Under bf16, every stage keeps bf16 working parameters and gradients and the fp32 master
    copy only in each rank's optimizer shard: the same training as dp's fp32 weights under bf16
    autocast within bf16's rounding, an export in fp32, and a checkpoint that resumes exactly."""
    cfg = write_config(tmp_path / "c.toml", GPT)
    gang(2).train(cfg, tmp_path / "dp", ["parallel.strategy='dp'"])
    sets = [f"parallel.strategy='{stage}'", "checkpoint.every=4"]
    gang(2).train(cfg, tmp_path / stage, sets)
    dp, mixed = final_weights(tmp_path / "dp"), final_weights(tmp_path / stage)
    assert all(v.dtype == torch.float32 for v in mixed.values())
    keep = [k for k in dp if not k.endswith("attn.k.bias")]  # rounding noise: see the test below
    assert max_rel_error({k: mixed[k] for k in keep}, {k: dp[k] for k in keep}) <= 2e-2
    resumed = tmp_path / "resumed"
    gang(2).train(cfg, resumed, sets, resume=str(tmp_path / stage / "checkpoints" / "step-4"))
    assert max_rel_error(final_weights(resumed), mixed) == 0


def test_meta_materialisation_equals_a_normal_build():
    for build in (lambda: mlp(64, 32, 2, 10), lambda: cnn(), lambda: gpt(50, 2, 4, 32, 16)):
        torch.manual_seed(7)
        normal = build()
        expected = {id(t): v for t, v in zip(list(normal.parameters()), normal.state_dict().values())}
        with torch.device("meta"):
            meta = build()
        got = {}
        materialize(meta, 7, lambda meta_tensor, value, got=got: got.__setitem__(id(meta_tensor), value.clone()))
        names = [n for n, _ in meta.named_parameters()]
        assert all(p.is_meta for p in meta.parameters())
        by_name = dict(zip(names, (got[id(p)] for p in meta.parameters())))
        assert all(torch.equal(by_name[n], normal.state_dict()[n]) for n in names), build
        assert len(expected) == len(got)


BUILT: list[nn.Module] = []  # the layers of user_factory's latest build, as it makes them


def user_factory() -> nn.Module:
    """A user's model with initialisation of its own: re-drawn weights, a random buffer, a
    parameter copied from another, a numpy draw."""
    import numpy as np

    BUILT.clear()
    layers = []
    for width in (48, 64, 64, 32):
        layers += [nn.Linear(layers[-2].out_features if layers else 40, width), nn.Tanh()]
        BUILT.append(layers[-2])
    model = nn.Sequential(*layers)
    nn.init.xavier_normal_(model[2].weight)
    model.register_buffer("scale", torch.randn(5) * float(np.random.rand()))
    with torch.no_grad():
        model[4].bias.copy_(model[2].bias)
    return model


def _real_bytes_held() -> int:
    return sum(p.untyped_storage().nbytes() for layer in BUILT for p in layer.parameters() if not p.is_meta)


def test_user_factory_replay_equals_a_normal_build_a_tensor_at_a_time():
    """zero materialises a user's model from its recorded meta-device construction: the values are
    those of a normal build from the same random state (torch, random, numpy), the random streams
    go on as after a normal build, and no more than one layer is ever whole at once."""
    import random

    import numpy as np

    def seed():
        torch.manual_seed(3), random.seed(3), np.random.seed(3)

    seed()
    normal = user_factory()
    after_normal = (torch.rand(1), random.random(), np.random.rand())
    seed()
    meta = record_on_meta(user_factory)
    assert all(t.is_meta for t in meta.state_dict().values())
    torch.manual_seed(99)  # the replay starts from the recorded state, whatever the state is now
    names = {id(t): n for n, t in [*meta.named_parameters(), *meta.named_buffers()]}
    got, held = {}, []

    def keep(meta_tensor, value):
        got[names[id(meta_tensor)]] = value
        held.append(_real_bytes_held())

    materialize(meta, 0, keep)
    assert got.keys() == normal.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in normal.state_dict().items())
    drawn = torch.rand(1)  # the caller's stream goes on untouched
    torch.manual_seed(99)
    assert torch.equal(drawn, torch.rand(1))
    largest = max(p.untyped_storage().nbytes() for p in normal.parameters())
    assert max(held) <= largest + 64 * 4, f"replay held {max(held)} bytes of parameters at once"
    seed()
    user_factory()
    assert (torch.rand(1), random.random(), np.random.rand()) == after_normal


def test_user_factory_that_branches_on_the_device_still_equals_a_normal_build():
    """Construction that differs on the meta device (torch's orthogonal_ does nothing there) makes
    the replay run other ops than the recording: it falls back to a normal build, values unchanged."""

    def factory():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        nn.init.orthogonal_(model[0].weight)
        return model

    torch.manual_seed(5)
    normal = factory()
    torch.manual_seed(5)
    meta = record_on_meta(factory)
    names = {id(t): n for n, t in meta.named_parameters()}
    got = {}
    materialize(meta, 0, lambda m, v: got.__setitem__(names[id(m)], v.clone()))
    assert all(torch.equal(got[k], v) for k, v in normal.state_dict().items())


RESUME = """
name = "zero-resume"
[model]
factory = "mlp"
hidden = 32
[data]
factory = "digits"
batch_size = 60
shuffle = true
[train]
steps = 12
optimizer = "adamw"
lr = 0.01
warmup_steps = 4
log_every = 4
[parallel]
strategy = "zero3"
bucket_mb = 0.002
[checkpoint]
every = 6
"""


@pytest.fixture(scope="module")
def straight(tmp_path_factory, gang):
    """12 uninterrupted steps at world 2, leaving its step-6 checkpoint behind."""
    tmp = tmp_path_factory.mktemp("resume")
    cfg = write_config(tmp / "c.toml", RESUME)
    gang(2).train(cfg, tmp / "straight")
    return cfg, tmp / "straight"


@pytest.mark.parametrize("world", [1, 3])
def test_resume_at_another_world_size_equals_never_stopping(tmp_path, gang, straight, world):
    cfg, run = straight
    out = gang(world).train(cfg, tmp_path / "resumed", resume=str(run / "checkpoints" / "step-6"))
    assert "at step 6 (saved by 2 ranks)" in out
    assert max_rel_error(final_weights(tmp_path / "resumed"), final_weights(run)) <= 1e-4


def test_each_rank_writes_only_its_shards(straight):
    from paratrain.checkpoint.reader import CheckpointReader

    _, run = straight
    reader = CheckpointReader(run / "checkpoints" / "step-6")
    sizes = {}
    for rank in range(2):
        tensors, meta = reader.load(rank)
        sizes[rank] = sum(t.numel() for k, t in tensors.items() if k.startswith("zero.param."))
    n_params = sum(p.numel() for p in mlp(64, 32, 2, 10).parameters())
    assert sum(sizes.values()) == n_params and max(sizes.values()) <= n_params // 2 + 1


def test_inspect_lists_and_verifies(tmp_path, straight, capsys):
    _, run = straight
    step6 = run / "checkpoints" / "step-6"
    assert main(["inspect", str(step6)]) == 0
    out = capsys.readouterr().out
    assert "step 6 | world size 2 | strategy zero3" in out and "all checksums ok" in out
    assert "rank-00000.safetensors" in out and "rank-00001.safetensors" in out and "zero.param" in out
    broken = tmp_path / "broken"
    shutil.copytree(step6, broken)
    data = bytearray((broken / "rank-00001.safetensors").read_bytes())
    data[-5] ^= 0xFF
    (broken / "rank-00001.safetensors").write_bytes(bytes(data))
    assert main(["inspect", str(broken)]) == 2
    captured = capsys.readouterr()
    assert "CORRUPT" in captured.out and "rank-00001" in captured.out
    assert main(["inspect", str(tmp_path)]) == 2
    capsys.readouterr()
    # the final export, and a whole run directory: a line for each checkpoint and the export
    assert main(["inspect", str(run / "final")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("final export") and "model.safetensors" in out and "all checksums ok" in out
    assert main(["inspect", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == [
        f"checkpoints/{p.name}" for p in sorted((run / "checkpoints").iterdir(), key=lambda p: int(p.name[5:]))
    ] + ["final"] and all(line.endswith("| ok") for line in lines[1:])
    shutil.copytree(run, tmp_path / "run")
    shutil.copy(broken / "rank-00001.safetensors", tmp_path / "run" / "checkpoints" / "step-6")
    assert main(["inspect", str(tmp_path / "run")]) == 2
    out = capsys.readouterr().out
    assert "checkpoints/step-6" in out and "INVALID" in out and "sha256" in out


def test_resume_with_another_strategy_exits_2(tmp_path, straight, capsys):
    cfg, run = straight
    code = main(
        [
            "run",
            str(cfg),
            "--set",
            "parallel.strategy='zero2'",
            "--resume",
            str(run / "checkpoints" / "step-6"),
            "--run-dir",
            str(tmp_path / "r"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "'zero3'" in err and "'zero2'" in err


def test_resume_from_a_final_export_exits_2_saying_what_it_is(tmp_path, straight, capsys):
    cfg, run = straight
    code = main(["run", str(cfg), "--resume", str(run / "final"), "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "--resume" in err and "is a final export" in err and "checkpoints" in err


def test_resume_with_another_model_exits_2_naming_the_parameters(tmp_path, straight, capsys):
    cfg, run = straight
    code = main(
        [
            "run",
            str(cfg),
            "--set",
            "model.hidden=48",
            "--resume",
            str(run / "checkpoints" / "step-6"),
            "--run-dir",
            str(tmp_path / "r"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "shape differs: 0.bias (32,) vs (48,), 0.weight (32, 64) vs (48, 64)" in err
    code = main(
        [
            "run",
            str(cfg),
            "--set",
            "model.n_layers=3",
            "--resume",
            str(run / "checkpoints" / "step-6"),
            "--run-dir",
            str(tmp_path / "r"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "missing from checkpoint: 6.bias, 6.weight" in err, err


# Digits keeps round(1797 x fraction) samples for validation, dealt round-robin and evaluated
# 4 x batch_size / world = 48 at a time at world 2: 0.054 keeps 97, two chunks on rank 0 and one on
# rank 1; 0.001 keeps 2, so at world 3 one rank has none.
@pytest.mark.parametrize("strategy, world, fraction", [("zero3", 2, 0.054), ("zero3", 3, 0.001), ("dp", 3, 0.001)])
def test_validation_shares_that_differ_between_ranks_give_the_true_loss(tmp_path, gang, strategy, world, fraction):
    """Where the validation set does not split evenly, zero3's ranks must still run the same
    number of evaluation forwards (each gathers parameters from all: it hung until the timeout), and a
    rank with no validation sample at all must not turn the loss into NaN."""
    from paratrain.data.datasets import digits

    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP)
    sets = [f"parallel.strategy='{strategy}'", f"data.val_fraction={fraction}", "train.steps=2"]
    gang(world).train(cfg, tmp_path / "run", sets, timeout=60)
    model = mlp(64, hidden=32, n_layers=2, out_features=10)  # the loss the final weights really have
    model.load_state_dict(final_weights(tmp_path / "run"))
    x, y = digits("val", val_fraction=fraction).tensors
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x), y).item()
    assert metrics(tmp_path / "run")[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("codec, tolerance", [("none", 1e-5), ("bf16", 1e-2)])
def test_zero3_holds_at_most_two_units_gathered_or_reduced_at_once(codec, tolerance):
    """zero3's transient memory on gloo: the units gathered plus the full gradients it holds stay
    within twice the largest unit at every hook of a step (a unit and its gradients; then those
    gradients in flight beside the next unit's gather), not three (a unit, the prefetched next one
    and a flat copy of its gradients). The weights still equal plain single-process AdamW (up to the
    rounding of the 16-bit copies that parallel.compression reduces)."""
    import torch.distributed as dist

    from paratrain import config as config_mod
    from paratrain.optim import build_optimizer, cross_entropy
    from paratrain.parallel.zero.stages import Zero3
    from paratrain.runtime.process import Runtime

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)]  # one unit each
    model = nn.Sequential(*blocks, nn.Linear(256, 10))
    plain = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)], nn.Linear(256, 10))
    plain.load_state_dict(model.state_dict())
    cfg = config_mod.from_dict(
        {
            "data": {"batch_size": 8},
            "train": {"optimizer": "adamw"},
            "parallel": {"strategy": "zero3", "bucket_mb": 0.3, "compression": codec},
        }
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:

        class Gathering(Zero3):  # world 1 without the shard as the full parameter: the gathers' path
            shard_is_full_alone = False

        zero = Gathering(model, cross_entropy, cfg, Runtime(0, 1, 0, torch.device("cpu"), "gloo", 0))
        held = []

        def sample(*_):
            gathered = sum(u.full.untyped_storage().nbytes() for u in zero.units)
            grads = [g for u in zero.units for g in [u.grad_full, *u.grads]] + [p.grad for p in model.parameters()]
            held.append(gathered + sum(g.nbytes for g in grads if g is not None))

        for p in model.parameters():  # after the strategy's own hooks
            p.register_post_accumulate_grad_hook(sample)
        for m in model.modules():
            m.register_forward_pre_hook(sample)
            m.register_full_backward_pre_hook(sample)
        optimizer = build_optimizer(plain.parameters(), cfg.train)
        for step in range(2):
            x, y = torch.randn(8, 256, generator=torch.Generator().manual_seed(step)), torch.arange(8)
            zero.train_step((x, y))
            cross_entropy(plain(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        largest = max(u.full_nbytes() for u in zero.units)
        assert len(zero.units) == 5 and max(held) > largest
        assert max(held) <= 2 * largest, f"held {max(held)} bytes at once, largest unit {largest}"
        assert max_rel_error(zero.full_model_state(), plain.state_dict()) <= tolerance
    finally:
        dist.destroy_process_group()


def test_zero3_keeps_the_strategys_lockstep_flag():
    """Strategy.lockstep says whether every rank steps together (the trainer reads it as a bool);
    zero3 stored its LockstepCheck under that name, over it (found by mypy: `make typecheck`)."""
    import torch.distributed as dist

    from paratrain import config as config_mod
    from paratrain.comm.lockstep import LockstepCheck
    from paratrain.optim import cross_entropy
    from paratrain.parallel.zero.stages import Zero3
    from paratrain.runtime.process import Runtime

    cfg = config_mod.from_dict({"data": {"batch_size": 8}, "parallel": {"strategy": "zero3"}})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

        class Gathering(Zero3):  # world 1 without the shard as the full parameter: the gathers' path
            shard_is_full_alone = False

        zero = Gathering(model, cross_entropy, cfg, Runtime(0, 1, 0, torch.device("cpu"), "gloo", 0))
        assert zero.lockstep is True and isinstance(zero.lockstep_check, LockstepCheck)
    finally:
        dist.destroy_process_group()


def mixed_zero3_job(rt):
    """zero3 under bf16 in the user's own loop: the state_dict after loading a float32 model, after a
    step, and the export of that step."""
    import paratrain

    pt = paratrain.init(strategy="zero3", train={"precision": "bf16"}, bucket_mb=0.001)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    given = {k: v.clone() + 1e-4 for k, v in model.state_dict().items()}  # not bf16-representable
    model, optimizer = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=torch.nn.functional.mse_loss)
    model.load_state_dict(given)
    loaded = model.state_dict()
    gen = torch.Generator().manual_seed(1)
    pt.train_step((torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)))
    return given, loaded, model.state_dict(), pt.rank


def test_zero3_under_bf16_keeps_float32_masters_the_user_reads_and_loads(gang, tmp_path):
    """Mixed precision under zero3: units gathered and computed in bf16, the masters float32.
    model.load_state_dict(float32) keeps the values as given (not rounded to bf16) and
    model.state_dict() gives them back in float32 on every rank, as FSDP2's state_dict gives its
    float32 parameters; after a step, the same on every rank."""
    results = gang(2).run("test_zero:mixed_zero3_job")
    (given, loaded, stepped, _), (_, loaded_1, stepped_1, _) = results
    assert all(v.dtype == torch.float32 for v in [*loaded.values(), *stepped.values()])
    assert all(torch.equal(loaded[k], given[k]) for k in given), "loaded values rounded"
    assert all(torch.equal(loaded_1[k], given[k]) for k in given)
    assert all(torch.equal(stepped[k], stepped_1[k]) for k in stepped)
    assert any(not torch.equal(stepped[k], given[k]) for k in given)  # the step moved them


def world_one_zero3_job(rt, precision):
    """zero3 alone (world 1): three SGD steps of a small MLP in the user's own loop; whether every
    parameter lives in its unit's shard, the parameter gathers issued, and the state dict."""
    import paratrain
    from paratrain.comm.collectives import LOG

    pt = paratrain.init(strategy="zero3", train={"precision": precision}, bucket_mb=0.001)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model, optimizer = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=torch.nn.functional.mse_loss)
    gen = torch.Generator().manual_seed(1)
    before = LOG.seq
    for _ in range(3):
        pt.train_step((torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)))
    gathers = [r.what for r in LOG.records if r.seq >= before and "params" in r.what]
    units = pt.strategy.units
    in_shards = all(
        u.full.untyped_storage().data_ptr() == u.shard.untyped_storage().data_ptr()
        and all(p.untyped_storage().data_ptr() == u.shard.untyped_storage().data_ptr() for p in u.params)
        for u in units
    )
    return in_shards, gathers, len(units), model.state_dict()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_alone_gathers_nothing_and_trains_as_plain_pytorch(gang, precision):
    """At world 1 a unit's full parameter is its shard: the model's parameters live in the shards,
    no gather is issued in three steps (several units), and the model trains as plain PyTorch's
    (fp32: exactly; bf16: within bf16's rounding, the state dict the float32 masters)."""
    ((in_shards, gathers, units, state),) = gang(1).run("test_zero:world_one_zero3_job", precision=precision)
    assert in_shards and gathers == [] and units > 1, (in_shards, gathers, units)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(plain(x), y).backward()
        optimizer.step()
    assert all(v.dtype == torch.float32 for v in state.values())
    tolerance = 0 if precision == "fp32" else 2e-2
    assert max_rel_error(state, plain.state_dict()) <= tolerance
