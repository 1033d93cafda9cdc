"""strategy = "federated": equivalence with synchronous SGD, exact resume, secure aggregation, a
client rank killed mid-round, bad [federated] keys, and the server optimizers."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import check_ok, final_weights, max_rel_error, metrics, run_cli, write_config

from paratrain import config as config_mod
from paratrain.cli import main
from paratrain.data.datasets import digits
from paratrain.models.mlp import mlp
from paratrain.parallel.federated import secagg
from paratrain.parallel.federated.partition import deal_clients, local_batches
from paratrain.parallel.federated.server import owner_of, sample_clients

FED = """
name = "fed"
[model]
factory = "mlp"
hidden = 32
[data]
factory = "digits"
batch_size = 8
[train]
steps = 4
optimizer = "sgd"
lr = 0.1
eval_every = 2
[parallel]
strategy = "federated"
[checkpoint]
every = 2
[federated]
clients = 2                 # 1438 training digits: 719 each, equal partitions
clients_per_round = 2
local_steps = 1
partition = "iid"
server_lr = 1.0
"""


def sgd_on_the_clients_samples(cfg, rounds: int) -> dict[str, torch.Tensor]:
    """Plain single-process SGD whose step r reads the union of every client's round-r batch."""
    data = digits("train")
    x, y = data.tensors
    parts, _ = deal_clients(cfg, data)
    fed = cfg.federated
    torch.manual_seed(cfg.train.seed)
    model = mlp(64, hidden=32, n_layers=2, out_features=10)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
    for r in range(rounds):
        clients = sample_clients(cfg.train.seed, r, fed.clients, fed.clients_per_round)
        idx = torch.from_numpy(
            np.concatenate([local_batches(parts[c], 1, cfg.data.batch_size, cfg.train.seed, r, c)[0] for c in clients])
        )
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fedavg_equals_sgd_and_resumes_exactly(tmp_path, gang):
    cfg_path = write_config(tmp_path / "fed.toml", FED)
    run = tmp_path / "run"
    out = gang(3).train(cfg_path, run)
    cfg = config_mod.load(cfg_path)
    assert max_rel_error(final_weights(run), sgd_on_the_clients_samples(cfg, 4)) <= 1e-4
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3, 4] and all(m["clients"] == 2 for m in lines)
    assert "val_acc" in lines[1] and "val_acc" in lines[3]
    report = json.loads((run / "partitions.json").read_text())
    assert [c["samples"] for c in report["per_client"]] == [719, 719]
    assert sum(report["per_client"][0]["labels"]) == 719 and "client 0: 719 samples" in out
    # a round-level checkpoint resumes exactly, here at another world size (the server holds it all)
    resumed = tmp_path / "resumed"
    gang(2).train(cfg_path, resumed, resume=str(run / "checkpoints" / "step-2"))
    assert all(torch.equal(a, b) for a, b in zip(final_weights(run).values(), final_weights(resumed).values()))
    assert [m["step"] for m in metrics(resumed)] == [3, 4]


def run_server_and_two_workers(cfg_path, run, faults: str):
    return check_ok(
        run_cli("run", str(cfg_path), "--nproc", "3", "--run-dir", str(run), env={"PARATRAIN_FAULTS": faults})
    )


def test_killed_client_rank_is_dropped_and_secure_aggregation_recovers_its_clients(tmp_path):
    cfg_path = write_config(
        tmp_path / "fed.toml",
        FED.replace("clients = 2 ", "clients = 12")
        .replace("clients_per_round = 2", "clients_per_round = 6")
        .replace("local_steps = 1", "local_steps = 5")
        .replace("server_lr = 1.0", "secure_aggregation = true\nround_timeout_s = 60"),
    )
    workers = [1, 2]
    # rank 2 SIGKILLs itself in round 3 after training one of its two clients there (a mid-round
    # death, after both were masked), and is gone for round 4; in round 1 one client of rank 1
    # drops after masking
    lost = [c for c in sample_clients(0, 2, 12, 6) if owner_of(c, workers) == 2]
    assert len(lost) == 2
    dropper = next(c for c in sample_clients(0, 0, 12, 6) if owner_of(c, workers) == 1)
    run = tmp_path / "run"
    proc = run_server_and_two_workers(cfg_path, run, f"fed_kill@rank=2,round=2;fed_drop@client={dropper},round=0")
    assert "worker rank 2" in proc.stderr
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert lines[0]["dropped_clients"] == [dropper] and lines[0]["clients"] == 5
    assert lines[1]["dropped_clients"] == [] and lines[1]["clients"] == 6
    assert lines[2]["dropped_clients"] == lost and lines[2]["clients"] == 4
    assert lines[3]["dropped_clients"] == [c for c in sample_clients(0, 3, 12, 6) if owner_of(c, workers) == 2]
    assert "no update" not in proc.stderr  # every round's masked sum was unmasked and applied
    assert all(np.isfinite(m["loss"]) for m in lines) and lines[3]["val_loss"] < lines[1]["val_loss"]
    assert (run / "final" / "model.safetensors").is_file()


def test_stalled_client_rank_is_dropped_at_the_round_timeout_and_the_run_goes_on(tmp_path):
    timeout_s = 2.0
    cfg_path = write_config(
        tmp_path / "fed.toml",
        FED.replace("steps = 4", "steps = 3")
        .replace("eval_every = 2", "eval_every = 0")
        .replace("every = 2", "every = 0")
        .replace("clients = 2 ", "clients = 4")
        .replace("clients_per_round = 2", "clients_per_round = 4")
        .replace("server_lr = 1.0", f"round_timeout_s = {timeout_s}"),
    )
    stalled = [c for c in range(4) if owner_of(c, [1, 2]) == 2]
    run = tmp_path / "run"
    # rank 2 answers round 2 only after 1.5 round_timeout_s: a server that waited for it would
    # take that long and count its clients
    proc = run_server_and_two_workers(cfg_path, run, "fed_stall@rank=2,round=1")
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert lines[0]["dropped_clients"] == [] and lines[0]["clients"] == 4
    assert lines[1]["dropped_clients"] == stalled and lines[1]["clients"] == 2
    assert timeout_s <= lines[1]["round_s"] < 1.5 * timeout_s, lines[1]
    assert lines[2]["dropped_clients"] == stalled  # dropped for good: the run goes on without it
    assert "worker rank 2 did not answer within federated.round_timeout_s" in proc.stderr
    assert all(np.isfinite(m["loss"]) for m in lines) and (run / "final" / "model.safetensors").is_file()


def test_secure_aggregation_equals_plain_sum_survives_two_dropouts_and_hides_updates():
    torch.manual_seed(0)
    updates = {i: torch.randn(5000) * 0.05 for i in range(8)}
    dropped = {2, 5}
    view = []
    total, present = secagg.run_in_process({i: secagg.quantise(u) for i, u in updates.items()}, dropped, view)
    assert present == [0, 1, 3, 4, 6, 7]
    plain = sum(updates[i].double() for i in present)
    step = 2.0**-secagg.FRAC_BITS
    assert (secagg.dequantise(total) - plain).abs().max() <= len(present) * step / 2 + 1e-12
    # the server's view: each masked update is unrelated to the client's own, and none of its
    # coordinates came through in the clear
    masked = {m[1]: m[2] for m in view if m[0] == "masked"}
    assert sorted(masked) == present
    for i, y in masked.items():
        own = secagg.quantise(updates[i])
        assert (y == own).float().mean() < 0.01
        corr = torch.corrcoef(torch.stack([secagg.dequantise(y), updates[i].double()]))[0, 1]
        assert abs(corr) < 0.05
    # what it routes of the key shares is encrypted: no share it saw rebuilds a client's key
    assert all(m[0] in ("keys", "shares", "masked", "revealed") for m in view)
    # with too few survivors for the threshold the round refuses to unmask
    assert secagg.run_in_process({i: secagg.quantise(u) for i, u in updates.items()}, {0, 1, 2, 3, 4})[0] is None


@pytest.mark.parametrize(
    "override, key",
    [
        ("federated.algorithm='fedsgd'", "federated.algorithm"),
        ("federated.clients_per_round=200", "federated.clients_per_round"),
        ("federated.clientz=3", "federated.clientz"),
        ("federated.alpha=0.05", "federated.alpha"),  # a Dirichlet draw below min_samples: no re-draw
        ("federated.mu=0.1", "federated.mu"),  # fedprox's key with fedavg
        ("federated.round_timeout_s=0", "federated.round_timeout_s"),
        ("federated.clients=2000", "federated.clients"),  # more clients than samples
    ],
)
def test_bad_federated_keys_exit_2_naming_the_key(tmp_path, capsys, override, key):
    cfg = write_config(
        tmp_path / "fed.toml",
        FED.replace("clients = 2 ", "clients = 100")
        .replace("clients_per_round = 2", "clients_per_round = 10")
        .replace('partition = "iid"', 'partition = "dirichlet"\nalpha = 0.3\nmin_samples = 2'),
    )
    code = main(["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), "--set", override])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"paratrain: error: {key}:"), err


@pytest.fixture
def one_thread():
    """Tiny client steps: a second intra-op thread only adds contention on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "algorithm, extra",
    [("fedprox", {"mu": 0.01}), ("fedadam", {"server_lr": 0.03}), ("fedavg", {"secure_aggregation": True})],
)
def test_algorithms_train_in_one_process(algorithm, extra, one_thread):
    """One process plays server and clients (world 1): each algorithm lowers the clients' loss,
    and fedadam's server moments are part of the checkpoint."""
    import tomllib

    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.optim import build_loss
    from paratrain.parallel.registry import build_strategy
    from paratrain.runtime import process

    raw = tomllib.loads(FED)
    raw["train"]["lr"] = 0.5
    raw["federated"].update(
        clients=20,
        clients_per_round=5,
        local_steps=5,
        partition="dirichlet",
        alpha=1.0,
        min_samples=5,
        algorithm=algorithm,
        **extra,
    )
    cfg = config_mod.from_dict(raw)
    process.seed_everything(0)
    model = build_model(cfg, build_dataset(cfg, "train"))
    strategy = build_strategy(model, build_loss(cfg), cfg, process.Runtime(0, 1, 0, torch.device("cpu"), "gloo", 0))
    losses = [float(strategy.train_step(None)) for _ in range(8)]
    assert np.mean(losses[-2:]) < 0.95 * np.mean(losses[:2]), losses
    tensors, meta = strategy.state_dict()
    assert meta["federated"]["round"] == 8
    assert ("server_opt.m" in tensors) == (algorithm == "fedadam")
