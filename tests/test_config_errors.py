"""Bad input exits 2 with one line naming the key, before any worker starts."""

import time

import pytest
import tomllib
from helpers import write_config
from reference import DIGITS_MLP

from paratrain.cli import main

DIGITS = """
name = "bad"
[model]
factory = "mlp"
[data]
factory = "digits"
batch_size = 32
[train]
steps = 2
"""


def run_main(capsys, *args):
    code = main(list(args))
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lrr=0.1", "train.lrr"),  # unknown key
        ("parallel.foo=1", "parallel.foo"),  # unknown key in a closed section
        ("train.lr='fast'", "train.lr"),  # wrong type
        ("train.steps=1.5", "train.steps"),  # wrong type
        ("train.shuffle_it=true", "train.shuffle_it"),
        ("data.shuffle=3", "data.shuffle"),  # wrong type
        ("train.optimizer='lion'", "train.optimizer"),  # bad value
        ("train.grad_accum=0", "train.grad_accum"),  # bad value
        ("parallel.bucket_mb=-1", "parallel.bucket_mb"),
        ("data.batch_size=33", "data.batch_size"),  # not divisible by 2 ranks
        ("data.batch_size=5000", "data.batch_size"),  # more than the 1,438 training samples
        ("model.factory='nosuchmodule:build'", "model.factory"),  # not importable
        ("model.factory='os.path:join'", "model.factory"),  # fails when called
        ("model.factory='builtins:object'", "model.factory"),  # returns an object, not a Module
        ("model.hiddn=3", "model.hiddn"),  # the factory takes no such argument
        ("data.factory='json:loads'", "data.factory"),
        ("train.loss='nosuch:fn'", "train.loss"),
        ("parallel.strategy='sharded'", "parallel.strategy"),
    ],
)
def test_bad_config_exits_2_naming_the_key(tmp_path, capsys, override, key):
    cfg = write_config(tmp_path / "c.toml", DIGITS)
    code, err = run_main(capsys, "run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), "--set", override)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.hidden=0", "model.hidden"),  # built-in factories check their arguments
        ("model.n_layers=-1", "model.n_layers"),
        ("model.in_features=10", "model.in_features"),  # the digits have 64
        ("model.out_features=5", "model.out_features"),  # ... and 10 classes
        ("model.factory='cnn'\nmodel.channels=0", "model.channels"),
        ("data.val_fraction=1.2", "data.val_fraction"),
        ("data.val_fraction=-0.1", "data.val_fraction"),
        ("data.factory='synthetic'\ndata.task='ranking'", "data.task"),
        ("data.factory='synthetic'\ndata.task='regression'", "train.loss"),  # cross_entropy on real targets
        ("model.hidden='64'", "model.hidden"),  # of the annotated type (it named model.factory)
        ("model.hidden=64.5", "model.hidden"),
        ("data.val_fraction='x'", "data.val_fraction"),
        ("train.loss='mse'", "train.loss"),  # class indices against 10 outputs (the workers failed)
        (
            "data.factory='synthetic'\ndata.task='regression'\ntrain.loss='mse'\nmodel.in_features=32\n"
            "model.out_features=3",
            "train.loss",
        ),  # 3 outputs against 10 targets
        # a colwise Linear's split output must go to a rowwise one (the workers failed on a shape)
        ("parallel.strategy='tp'\nparallel.tp=2\nparallel.tp_plan={'0'='colwise'}", "parallel.tp_plan"),
        ("parallel.strategy='tp'\nparallel.tp=2\nparallel.tp_plan={'2'='rowwise'}", "parallel.tp_plan"),
    ],
)
def test_bad_builtin_arguments_exit_2_naming_the_key(tmp_path, capsys, override, key):
    sets = [a for o in override.split("\n") for a in ("--set", o)]
    cfg = write_config(tmp_path / "c.toml", DIGITS)
    code, err = run_main(capsys, "run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), *sets)
    assert code == 2 and len(err.strip().splitlines()) == 1 and key in err, err


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.n_head=3", "model.n_head"),  # 128 wide
        ("model.d_model=0", "model.d_model"),
        ("model.block_size=16", "model.block_size"),  # shorter than the data's blocks of 64
        ("model.vocab_size=10", "model.vocab_size"),  # fewer symbols than the corpus has
        ("data.block_size=0", "data.block_size"),
        ("data.max_chars=0", "data.max_chars"),
        ("data.val_fraction=1", "data.val_fraction"),
        ("data.path='/nonexistent/text.txt'", "data.path"),
        ("data.path='memory://nonexistent.txt'", "data.path"),  # an fsspec URL
        ("data.path='nosuch://text.txt'", "data.path"),  # a scheme fsspec does not know
        ("data.path='dropbox://text.txt'", "data.path"),  # ... or whose package is not installed
        ("model.n_head=4.0", "model.n_head"),  # a float: the workers' tensor views failed
        ("model.tie_embeddings='false'", "model.tie_embeddings"),  # a string: it tied the weights
        ("model.tie_embeddings=0", "model.tie_embeddings"),
        ("data.block_size='64'", "data.block_size"),
    ],
)
def test_bad_default_job_arguments_exit_2_naming_the_key(tmp_path, capsys, override, key):
    code, err = run_main(capsys, "run", "--nproc", "2", "--run-dir", str(tmp_path / "r"), "--set", override)
    assert code == 2 and len(err.strip().splitlines()) == 1 and key in err, err


def test_unreadable_inputs_exit_2_naming_the_key(tmp_path, capsys, monkeypatch):
    """Not UTF-8 text, and a user factory whose import fails: one line each, not a traceback."""
    (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)))
    code, err = run_main(
        capsys, "run", "--run-dir", str(tmp_path / "r"), "--set", f"data.path='{tmp_path / 'binary.txt'}'"
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "data.path" in err and "UTF-8" in err, err
    (tmp_path / "needs.py").write_text("def build(split='train'):\n    import a_package_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for key, builtin in (("data.factory", "digits"), ("model.factory", "mlp")):
        cfg = write_config(tmp_path / "c.toml", DIGITS.replace(f'factory = "{builtin}"', 'factory = "needs:build"'))
        code, err = run_main(capsys, "run", str(cfg), "--run-dir", str(tmp_path / "r"))
        assert code == 2 and len(err.strip().splitlines()) == 1 and key in err and "a_package_not_installed" in err, err


@pytest.mark.parametrize(
    "options, key",
    [
        (["--nnodes", "2"], "--rdzv"),  # the nodes would never find each other
        (["--nnodes", "2", "--rdzv", "node0"], "--rdzv"),
        (["--nnodes", "2", "--rdzv", "node0:70000"], "--rdzv"),
        (["--nnodes", "2", "--rdzv", "node0:29400", "--node-rank", "2"], "--node-rank"),
        (["--max-restarts", "-1"], "--max-restarts"),
    ],
)
def test_bad_launch_options_exit_2_naming_the_option(tmp_path, capsys, options, key):
    cfg = write_config(tmp_path / "c.toml", DIGITS)
    code, err = run_main(capsys, "run", str(cfg), "--run-dir", str(tmp_path / "r"), *options)
    assert code == 2 and len(err.strip().splitlines()) == 1 and key in err, err


def test_bad_toml_and_missing_file(tmp_path, capsys):
    bad = write_config(tmp_path / "bad.toml", "name = [unclosed")
    code, err = run_main(capsys, "run", str(bad))
    assert code == 2 and "not valid TOML" in err
    code, err = run_main(capsys, "run", str(tmp_path / "missing.toml"))
    assert code == 2 and "not found" in err


@pytest.mark.parametrize(
    "override, says",
    [
        ('name="a\nb"', "control characters"),  # a line break typed inside the quotes
        ("name=a\rb", "control characters"),  # ... or in a bare word
        ('name="a\u001bb"', "control characters"),  # an escape sequence through TOML's own escape
        ('model.sizes=["a\tb"]', "control characters"),  # inside a list
        ('name="abc', "unbalanced"),  # the shell's --set name='"abc': was taken verbatim as the name `"abc`
        ("name='abc", "unbalanced"),
        ("model.sizes=[1, 2", "unbalanced"),
        ("model.opts={a = 1", "unbalanced"),
    ],
)
def test_hostile_set_values_exit_2_naming_the_set_and_leave_the_run_dir_alone(tmp_path, capsys, override, says):
    """A --set value that no TOML file could hold is refused naming the --set, before the run
    directory's config.toml (here a valid one of an earlier run) is touched."""
    cfg = write_config(tmp_path / "c.toml", DIGITS)
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    earlier = write_config(run_dir / "config.toml", DIGITS).read_bytes()
    code, err = run_main(capsys, "run", str(cfg), "--run-dir", str(run_dir), "--set", override)
    key = override.split("=")[0]
    assert code == 2 and one_line(err).startswith(f"paratrain: error: --set {key}: ") and says in err, err
    assert (run_dir / "config.toml").read_bytes() == earlier


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "command, make_input, key",
    [
        ("run", lambda d: (d / "bin.toml").write_bytes(bytes(range(256))) or d / "bin.toml", "config"),
        ("plan", lambda d: (d / "bin.toml").write_bytes(b"\xff\xfe\x00name") or d / "bin.toml", "config"),
        ("run", lambda d: d, "config"),  # a directory
        ("plan", lambda d: d, "config"),
        ("run", lambda d: d / "missing.toml", "config"),
    ],
)
def test_unreadable_config_files_exit_2_in_one_line(tmp_path, capsys, command, make_input, key):
    code, err = run_main(capsys, command, str(make_input(tmp_path)), "--nproc", "2")
    assert code == 2 and one_line(err).startswith(f"paratrain: error: {key}: "), err


@pytest.mark.parametrize(
    "option, make_input",
    [
        ("--cluster", lambda d: d),  # a directory
        ("--cluster", lambda d: (d / "bin.toml").write_bytes(bytes(range(256))) or d / "bin.toml"),
        ("--json", lambda d: d / "no-such-folder" / "plan.json"),
        ("--json", lambda d: d),  # a directory where the file would go
    ],
)
def test_plan_inputs_and_outputs_exit_2_in_one_line(tmp_path, capsys, option, make_input):
    cfg = write_config(tmp_path / "c.toml", DIGITS)
    code, err = run_main(capsys, "plan", str(cfg), "--nproc", "2", option, str(make_input(tmp_path)))
    assert code == 2 and one_line(err).startswith(f"paratrain: error: {option}: "), err


def test_a_config_toml_holds_any_string_the_config_may_carry(tmp_path):
    """Escapes in a config file's strings are written back as escapes: the run directory's
    config.toml always parses, to the same config."""
    from paratrain import config as config_mod

    cfg = config_mod.from_dict(
        {"name": "odd 'name' \"quoted\"", "model": {"factory": "mlp", "note": "tab\there\nline\u001b\u007f"}}
    )
    assert config_mod.from_dict(tomllib.loads(config_mod.to_toml(cfg))) == cfg


def test_nan_weights_are_called_not_finite_not_negative(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.toml", DIGITS.replace('factory = "mlp"', 'factory = "gpt"\nn_experts = 2'))
    code, err = run_main(
        capsys, "plan", str(cfg), "--nproc", "1", "--set", "data.factory='corpus'", "--set", "model.moe_aux_loss=nan"
    )
    assert code == 2 and "model.moe_aux_loss" in one_line(err) and "finite" in err, err


TINY_GPT = """
name = "tiny-gpt"
[model]
factory = "gpt"
n_layer = 1
n_head = 2
d_model = 16
[data]
factory = "corpus"
block_size = 16
max_chars = 20000
batch_size = 8
"""


@pytest.mark.parametrize(
    "sets, key",
    [
        (["model.n_experts=100000000"], "model.n_experts"),
        (["model.vocab_size=10000000000"], "model.vocab_size"),
        (["model.n_layer=100000", "model.d_model=65536", "model.n_head=1"], "model.n_layer"),
    ],
)
def test_a_model_too_large_for_this_machine_exits_2_before_it_is_built(tmp_path, capsys, sets, key):
    """Building it, even on the meta device, took minutes while memory grew; a worker then died in
    the allocator. The bound comes from the config alone, with the figures."""
    cfg = write_config(tmp_path / "c.toml", TINY_GPT)
    overrides = [arg for s in sets for arg in ("--set", s)]
    start = time.monotonic()
    code, err = run_main(capsys, "run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), *overrides)
    assert code == 2 and one_line(err).startswith(f"paratrain: error: {key}: ") and "GiB" in err, err
    assert time.monotonic() - start < 30


def test_the_gpus_a_node_trains_on_count_toward_the_memory_a_model_must_fit(monkeypatch):
    """The GPU branch, run here with the GPUs simulated (make gpu-check runs it on real ones)."""
    from types import SimpleNamespace

    import torch

    from paratrain.preflight import this_machine_memory

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30))
    host, kind = this_machine_memory("cpu", 2)
    assert host > 0 and kind == "host memory"
    assert this_machine_memory("cuda", 2) == (host + 160 * 2**30, "host and GPU memory (2 GPUs)")


def test_unwritable_run_dir(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.toml", DIGITS)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err = run_main(capsys, "run", str(cfg), "--run-dir", str(blocker / "sub"))
    assert code == 2 and "--run-dir" in err


def test_user_factories_resolve_next_to_the_config(tmp_path, capsys, monkeypatch):
    (tmp_path / "mymodels.py").write_text("def not_a_model():\n    return 42\n")
    cfg = write_config(tmp_path / "c.toml", DIGITS.replace('factory = "mlp"', 'factory = "mymodels:not_a_model"'))
    monkeypatch.chdir("/")
    code, err = run_main(capsys, "run", str(cfg), "--run-dir", str(tmp_path / "r"))
    assert code == 2 and "model.factory" in err and "int" in err


def test_overrides_parse_toml_values():
    from paratrain.config import apply_overrides

    raw = apply_overrides({}, ["train.lr=0.5", "name=plain", "train.shuffle=false", "model.sizes=[1, 2]"])
    assert raw == {"train": {"lr": 0.5, "shuffle": False}, "name": "plain", "model": {"sizes": [1, 2]}}


def test_nodes_sharing_a_run_dir_prepare_it_at_once(tmp_path):
    """The nodes of a multi-node run may share one run folder (a shared file system, or the
    two-namespace test on one machine): preparing it at the same moment must not fail either."""
    from concurrent.futures import ThreadPoolExecutor

    from paratrain import config as config_mod
    from paratrain.run_dir import prepare_run_dir

    cfg = config_mod.load(write_config(tmp_path / "c.toml", ""))

    def prepare(node_rank):
        for _ in range(200):
            prepare_run_dir(tmp_path / "shared", cfg, "auto", node_rank)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(prepare, range(4)))  # re-raises the first error of any node
    assert config_mod.load(tmp_path / "shared" / "config.toml") == cfg
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["config.toml"]


def test_cuda_without_a_gpu_per_process_exits_2(tmp_path, capsys):
    """NCCL takes one GPU per rank, so train.device = 'cuda' with more processes than this node has
    GPUs (on a machine with none, one is already too many) is refused before any worker starts."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cfg = write_config(tmp_path / "c.toml", DIGITS)
    code, err = run_main(
        capsys,
        "run",
        str(cfg),
        "--nproc",
        str(gpus + 1),
        "--run-dir",
        str(tmp_path / "r"),
        "--set",
        'train.device="cuda"',
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "train.device" in err, err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "gpus, device, nproc, expected",
    [
        (0, "auto", 2, "cpu"),
        (1, "auto", 1, "cuda"),
        (1, "auto", 2, "cpu (note)"),
        (4, "auto", 4, "cuda"),
        (1, "cuda", 1, "cuda"),
        (1, "cuda", 2, "exit 2"),
        (0, "cuda", 1, "exit 2"),
        (2, "cpu", 1, "cpu"),
    ],
)
def test_device_resolution_against_the_gpus_a_node_has(monkeypatch, gpus, device, nproc, expected):
    """The rule behind train.device (CI has no GPU, so the GPU count is made up): CUDA only with a
    GPU for each of the node's processes; 'auto' falls back to CPU and says so, 'cuda' is an error."""
    import torch

    from paratrain.errors import ConfigError
    from paratrain.runtime.process import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if expected == "exit 2":
        with pytest.raises(ConfigError, match="train.device"):
            resolve_device(device, nproc)
        return
    chosen, note = resolve_device(device, nproc)
    assert chosen == expected.split()[0]
    assert (note is not None) == expected.endswith("(note)")
    if note:
        assert f"{nproc} processes per node but {gpus} GPU" in note


def test_a_worker_under_plain_torchrun_that_falls_back_to_cpu_says_so(monkeypatch, capsys):
    """Under torchrun each worker resolves 'auto' itself (pick_device): two processes on a
    one-GPU node train on CPU, and local rank 0 says why in one line (the GPU count made up)."""
    import torch

    from paratrain.runtime.process import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("auto", 0, 2) == torch.device("cpu")
    err = capsys.readouterr().err
    assert err.startswith("paratrain: train.device 'auto': 2 processes per node but 1 GPU") and err.count("\n") == 1
    assert pick_device("auto", 1, 2) == torch.device("cpu") and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "args, option",
    [
        (["dp", "--steps", "0"], "--steps"),
        (["pipeline", "--microbatches", "-2"], "--microbatches"),
        (["suite", "--topk-ratio", "1.5"], "--topk-ratio"),
        (["suite", "--powersgd-rank", "0"], "--powersgd-rank"),
        (["suite", "--equal-loss-steps", "0"], "--equal-loss-steps"),
        (["ps", "--factor", "0"], "--factor"),
        (["zero", "--hidden", "wide"], "--hidden"),
        (["pipeline", "--schedules", "gpipe,bogus"], "--schedules"),
        (["memory", "--strategies", "zero9"], "--strategies"),
        (["memory", "--worlds", "2,x"], "--worlds"),
    ],
)
def test_bad_benchmark_options_exit_2_naming_the_option(capsys, args, option):
    """Before any benchmark worker starts (they failed, each with a traceback, and the bench exit 1)."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *args])
    assert exit_.value.code == 2 and f"argument {option}:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, option",
    [
        (["--layers", "3", "--schedules", "interleaved"], "--layers"),
        (["--microbatches", "3", "--schedules", "interleaved"], "--microbatches"),
        (["--nproc", "3", "--microbatches", "2", "--schedules", "1f1b"], "--microbatches"),
    ],
)
def test_a_pipeline_benchmark_no_schedule_can_run_exits_2(capsys, args, option):
    """Checked before its workers start: they failed each with a traceback (a layer count too small
    for the stages, microbatches the schedule cannot take)."""
    assert main(["bench", "pipeline", *args]) == 2
    assert f"paratrain: error: {option}:" in capsys.readouterr().err


SAMPLES = """
import torch


class Items(torch.utils.data.Dataset):
    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 100

    def __getitem__(self, i):
        if self.item == "broken":
            raise KeyError("no such sample")
        x, y = torch.zeros(64), i % 10
        return {"dict": {"x": x, "y": y}, "triple": (x, y, i)}[self.item]


def dicts():
    return Items("dict")


def triples():
    return Items("triple")


def broken():
    return Items("broken")
"""


@pytest.mark.parametrize(
    "factory, says",
    [
        ("dicts", "got a dict with keys ['x', 'y']"),
        ("triples", "got a tuple of 3"),
        ("broken", "reading sample 0 failed: KeyError"),
    ],
)
def test_samples_that_are_not_input_target_pairs_exit_2(tmp_path, capsys, factory, says):
    """Caught from the first sample before any worker starts (each worker failed at its first step)."""
    (tmp_path / "samples.py").write_text(SAMPLES)
    cfg = write_config(tmp_path / "c.toml", DIGITS.replace('factory = "digits"', f'factory = "samples:{factory}"'))
    code, err = run_main(capsys, "run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"))
    assert code == 2 and "data.factory" in err and says in err, err


@pytest.mark.parametrize(
    "world, sets",
    [
        (2, []),  # dp: rank 0 saves the whole model
        (2, ["parallel.strategy='tp'", "parallel.tp=2"]),  # tp shards: whole shapes are their sum
        (3, ["parallel.strategy='ps'"]),  # a server saves parameters only
    ],
)
def test_resume_with_another_model_exits_2_before_any_worker_starts(tmp_path, capsys, gang, world, sets):
    """A checkpoint whose parameter names or shapes are not the model's is refused up front under
    every strategy (only ZeRO did; dp and pp workers each printed the error, ps failed with exit 1)."""
    sets = [
        "train.steps=2",
        "checkpoint.every=2",
        "model.d_model=32",
        "model.block_size=16",
        "data.block_size=16",
        "data.max_chars=20000",
        *sets,
    ]
    gang(world).train(None, tmp_path / "run", sets)  # the default job, as `paratrain run` without a config
    args = ["--nproc", str(world), "--run-dir", str(tmp_path / "run"), *(a for s in sets for a in ("--set", s))]
    code, err = run_main(
        capsys, "run", *args, "--set", "train.steps=4", "--set", "model.d_model=64", "--resume", "auto"
    )
    assert code == 2, err
    (line,) = err.strip().splitlines()  # one line, printed by the CLI, not by each worker
    assert (
        line.startswith("paratrain: error: --resume: ")
        and "checkpoint does not match the model: shape differs: " in line
    )
    assert "(32,) vs (64,)" in line and " more" in line, line


def test_a_missing_optional_package_exits_2_saying_how_to_install_it(tmp_path, capsys, monkeypatch):
    """matplotlib and tensorboard come with paratrain[report], scikit-learn with paratrain[datasets],
    peft with paratrain[lora], MLflow and wandb with paratrain[mlflow] and paratrain[wandb]: a
    command that needs one that is missing says so in one line, not with an ImportError."""
    from paratrain import extras

    monkeypatch.setattr(extras, "find_spec", lambda name: None)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('name = "r"\n')
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "lr": 0.1, "samples_per_s": 1.0, "time": 0.1}\n')
    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP)
    for args, extra in [
        (["report", str(run)], "report"),
        (["run", str(cfg), "--set", "log.tensorboard=true", "--run-dir", str(tmp_path / "r")], "report"),
        (["plan", str(cfg)], "datasets"),
        (["run", str(cfg), "--set", "model.lora={r=4}", "--run-dir", str(tmp_path / "r")], "lora"),
        (["run", str(cfg), "--set", "log.mlflow=true", "--run-dir", str(tmp_path / "r")], "mlflow"),
        (["run", str(cfg), "--set", "log.wandb=true", "--run-dir", str(tmp_path / "r")], "wandb"),
    ]:
        code, err = run_main(capsys, *args)
        assert code == 2 and len(err.strip().splitlines()) == 1 and f"pip install 'paratrain[{extra}]'" in err, err
