"""`paratrain job` and the schedulers' environments: the Kubernetes manifests against the operators' own CRD
schemas, then each manifest's container command (and SkyPilot's run script) on two network namespace
hosts with the variables its operator injects; the schedulers' variables read by `paratrain run`; the
preflight that refuses a node whose config or versions differ; bad options."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import pytest
import yaml
from helpers import CPU_ONLY, ROOT, final_weights, max_rel_error, outputs_of, write_config
from reference import DIGITS_MLP, digits_mlp_reference

from paratrain.cli import main
from paratrain.errors import ConfigError
from paratrain.jobs.kubernetes import CONFIG_MOUNT
from paratrain.jobs.preflight import check_nodes
from paratrain.runtime.process import free_port
from paratrain.runtime.schedulers import detect, expand_nodelist
from paratrain.testing import netns

ok, why = netns.available()
# The operators' CRD schemas: the shared copy beside the repository (CI), else the one vendored here.
SCHEMAS = next(p for p in (ROOT.parent / "shared" / "schemas", ROOT / "tests" / "schemas") if p.is_dir())
CORE_SCHEMAS = ROOT / "tests" / "schemas"


def strict(schema):
    """A CRD's schema as `kubectl apply --validate=strict` reads it: a field it does not name is an
    error (the API server would drop it silently), except where the schema keeps unknown fields."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    return [strict(v) for v in schema] if isinstance(schema, list) else schema


def validate(document: dict) -> None:
    files = {
        "TrainJob": SCHEMAS / "trainer.kubeflow.org_trainjob_v1alpha1.json",
        "PyTorchJob": SCHEMAS / "kubeflow.org_pytorchjob_v1.json",
        "ConfigMap": CORE_SCHEMAS / "core_v1_configmap.json",
    }
    jsonschema.validate(document, strict(json.loads(files[document["kind"]].read_text())))
    # The CRDs' CEL rule on names (x-kubernetes-validations), which jsonschema does not run
    name = document["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name


def job_file(capsys, *args: str) -> str:
    assert main(["job", *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_kubernetes_manifests_validate_against_the_operators_schemas(tmp_path, capsys, kind):
    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP.replace('name = "equiv"', 'name = "Equiv_Run.1"'))
    docs = list(
        yaml.safe_load_all(
            job_file(
                capsys,
                "kubernetes",
                str(cfg),
                "--nodes",
                "3",
                "--kind",
                kind,
                "--image",
                "registry.example/paratrain:0.1",
                "--volume",
                "runs",
                "--gpus",
                "8",
                "--cpus",
                "16",
                "--memory",
                "64Gi",
            )
        )
    )
    assert [d["kind"] for d in docs] == ["ConfigMap", "TrainJob" if kind == "trainjob" else "PyTorchJob"]
    for doc in docs:
        validate(doc)
    assert docs[1]["metadata"]["name"] == "equiv-run-1"
    assert "lr = 0.1" in docs[0]["data"]["config.toml"]
    with pytest.raises(jsonschema.ValidationError):  # the check has teeth: a misspelt field fails
        validate({**docs[1], "spec": {**docs[1]["spec"], "replicas": 3}})


@pytest.mark.parametrize("scheduler", ["trainjob", "pytorchjob"])
@pytest.mark.skipif(not ok, reason=f"two-host test skipped: {why}")
def test_job_runs_on_two_hosts_with_the_operators_environment(tmp_path, capsys, scheduler):
    """Each node runs exactly the manifest's container command with the variables its operator sets,
    and nothing else: no flag says how many nodes or where."""
    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP.replace("steps = 20", "steps = 12"))
    run_dir = tmp_path / "run"  # the shared volume
    common = [str(cfg), "--nodes", "2", "--nproc", "1", "--run-dir", str(run_dir)]
    config_map, job = yaml.safe_load_all(job_file(capsys, "kubernetes", *common, "--image", "img", "--kind", scheduler))
    mounted = tmp_path / "configmap"  # what the kubelet mounts at CONFIG_MOUNT
    mounted.mkdir()
    for key, text in config_map["data"].items():
        (mounted / key).write_text(text)
    name = job["metadata"]["name"]
    if scheduler == "trainjob":
        command = job["spec"]["trainer"]["command"]
        aliases = ((f"{name}-node-0-0.{name}",), (f"{name}-node-0-1.{name}",))
        envs = [
            {
                "PET_NNODES": "2",
                "PET_NPROC_PER_NODE": str(job["spec"]["trainer"]["numProcPerNode"]),
                "PET_NODE_RANK": str(n),
                "PET_MASTER_ADDR": aliases[0][0],
                "PET_MASTER_PORT": "29500",
                "JOB_COMPLETION_INDEX": str(n),
            }
            for n in (0, 1)
        ]
    else:
        container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
        command = container["command"]
        aliases = ((f"{name}-master-0",), (f"{name}-worker-0",))
        # PET_NNODES as the operator versions that counted the master wrongly set it: not read
        envs = [
            {
                "MASTER_ADDR": aliases[0][0],
                "MASTER_PORT": str(container["ports"][0]["containerPort"]),
                "WORLD_SIZE": "2",
                "RANK": str(n),
                "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
                "PET_NNODES": "1",
                "PYTHONUNBUFFERED": "1",
            }
            for n in (0, 1)
        ]
    argv = [arg.replace(CONFIG_MOUNT, str(mounted)) for arg in command]
    bin_dir = str(Path(sys.executable).parent)  # the image's paratrain
    with netns.TwoHosts(aliases=aliases) as hosts:
        procs = [
            hosts.popen(
                n,
                argv,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), **CPU_ONLY, **envs[n]},
            )
            for n in (0, 1)
        ]
        outs = outputs_of(procs)
    assert "node 1 of 2, 1 process each (world 2)" in outs[1], outs[1]
    assert max_rel_error(final_weights(run_dir), digits_mlp_reference(steps=12)) <= 1e-4


def test_skypilot_task_runs_paratrain_on_each_node(tmp_path, capsys):
    """The task's run script under SkyPilot's variables: it writes the embedded config into the run
    directory and hands over to `paratrain run` (a stand-in here that records what it was given;
    the variables' reading is test_each_engines_environment_gives_the_nodes_and_the_rendezvous's)."""
    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP)
    task = yaml.safe_load(
        job_file(
            capsys,
            "skypilot",
            str(cfg),
            "--nodes",
            "2",
            "--gpus",
            "4",
            "--run-dir",
            str(tmp_path / "run"),
            "--image",
            "img",
        )
    )
    assert (task["name"], task["num_nodes"]) == ("equiv", 2)
    assert task["resources"] == {"accelerators": {"A100": 4}, "image_id": "docker:img"}
    stand_in = tmp_path / "bin" / "paratrain"
    stand_in.parent.mkdir()
    stand_in.write_text('#!/bin/sh\necho "$SKYPILOT_NODE_RANK $*" > "$HOME/called"\n')
    stand_in.chmod(0o755)
    done = subprocess.run(
        ["bash", "-c", task["run"]],
        capture_output=True,
        text=True,
        env={
            "PATH": f"{stand_in.parent}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2",
            "SKYPILOT_NODE_RANK": "1",
        },
    )
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "run"
    assert (tmp_path / "called").read_text().split() == [
        "1",
        "run",
        f"{run_dir}/job.toml",
        "--run-dir",
        str(run_dir),
        "--nproc",
        "4",
        "--max-restarts",
        "0",
    ]
    assert 'name = "equiv"' in (run_dir / "job.toml").read_text()


def test_slurm_nodelists_expand_without_scontrol():
    assert expand_nodelist("node[1-2]") == ["node1", "node2"]
    assert expand_nodelist("gpu[08-10,12],login-1") == ["gpu08", "gpu09", "gpu10", "gpu12", "login-1"]
    assert expand_nodelist("r[1-2]n[01-02]") == ["r1n01", "r1n02", "r2n01", "r2n02"]
    assert expand_nodelist("a.b.c,d") == ["a.b.c", "d"]
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        expand_nodelist("node[1-")


def test_each_engines_environment_gives_the_nodes_and_the_rendezvous():
    trainer = detect(
        {
            "PET_NNODES": "4",
            "PET_NPROC_PER_NODE": "8",
            "PET_NODE_RANK": "3",
            "PET_MASTER_ADDR": "job-node-0-0.job",
            "PET_MASTER_PORT": "29500",
        }
    )
    assert (trainer.scheduler, trainer.nnodes, trainer.node_rank, trainer.rdzv, trainer.nproc) == (
        "Kubeflow Trainer",
        4,
        3,
        "job-node-0-0.job:29500",
        8,
    )
    pytorchjob = detect(
        {
            "MASTER_ADDR": "job-master-0",
            "MASTER_PORT": "23456",
            "WORLD_SIZE": "3",
            "RANK": "2",
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "auto",
        }
    )
    assert (pytorchjob.scheduler, pytorchjob.nnodes, pytorchjob.node_rank, pytorchjob.nproc) == (
        "PyTorchJob",
        3,
        2,
        None,
    )
    slurm = detect(
        {"SLURM_JOB_NODELIST": "cn[007-009]", "SLURM_NNODES": "3", "SLURM_NODEID": "1", "SLURM_JOB_ID": "123456"}
    )
    assert (slurm.nnodes, slurm.node_rank, slurm.rdzv) == (3, 1, "cn007:29956")
    sky = detect(
        {
            "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n",
            "SKYPILOT_NODE_RANK": "1",
            "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "4",
        }
    )
    assert (sky.nnodes, sky.node_rank, sky.rdzv, sky.nproc) == (2, 1, "10.0.0.5:8008", 4)
    # a worker under plain torchrun: its RANK/WORLD_SIZE count workers, not nodes
    assert (
        detect(
            {
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
                "WORLD_SIZE": "4",
                "RANK": "3",
                "LOCAL_RANK": "1",
                "TORCHELASTIC_RUN_ID": "x",
            }
        )
        is None
    )
    with pytest.raises(ConfigError, match="SLURM_NNODES"):
        detect({"SLURM_JOB_NODELIST": "cn1", "SLURM_NNODES": "two", "SLURM_NODEID": "0"})
    with pytest.raises(ConfigError, match="node rank 5"):
        detect({"PET_NNODES": "2", "PET_NODE_RANK": "5", "PET_MASTER_ADDR": "h", "PET_MASTER_PORT": "1"})


def test_flags_win_over_the_engines_environment(monkeypatch, capsys):
    """--nnodes 1 given: the Slurm variables around are not read (no preflight, no rendezvous)."""
    from paratrain import cli

    seen = {}

    def stop_after_placement(args):
        seen.update(vars(args))
        raise ConfigError("stop", "here")

    monkeypatch.setattr(cli, "check_launch", stop_after_placement)
    for key, value in {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}.items():
        monkeypatch.setenv(key, value)
    assert main(["run", "--nnodes", "1"]) == 2
    assert (seen["nnodes"], seen["node_rank"], seen["rdzv"]) == (1, 0, None)
    assert main(["run"]) == 2
    assert (seen["nnodes"], seen["node_rank"], seen["rdzv"]) == (2, 1, "n1:29500")
    assert "Slurm" not in capsys.readouterr().err  # the scheduler line comes once the config is read


def _meet(facts: list[dict]) -> list[str]:
    """check_nodes on as many threads as nodes, on loopback: each node's error ('' for none)."""
    endpoint, errors = f"127.0.0.1:{free_port()}", [""] * len(facts)

    def node(rank):
        try:
            check_nodes(endpoint, len(facts), rank, facts[rank], timeout_s=30)
        except ConfigError as exc:
            errors[rank] = str(exc)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in range(len(facts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def test_preflight_refuses_a_node_whose_config_or_versions_differ():
    same = {
        "host": "a",
        "paratrain": "0.1.0",
        "torch": "2.13.0",
        "nproc": 2,
        "config": 'name = "x"\n[train]\nlr = 0.1\n',
    }
    assert _meet([same, {**same, "host": "b"}, {**same, "host": "c"}]) == ["", "", ""]
    errors = _meet([same, same, {**same, "host": "c", "config": same["config"].replace("0.1", "0.2")}])
    assert errors == ["preflight: node 2 differs from node 0: config differs (host c): train.lr = 0.2 against 0.1"] * 3
    errors = _meet([same, {**same, "host": "b", "torch": "2.12.0"}])
    assert errors == ["preflight: node 1 differs from node 0: torch 2.12.0 against 2.13.0 on node 0 (host b)"] * 2


def test_a_mismatched_node_is_refused_in_seconds_by_the_cli(tmp_path):
    """Two real `paratrain run` nodes on loopback, one with another learning rate: both exit 2 with the
    reason as soon as both are up, where the rendezvous would have waited or the first step failed."""
    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP)
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paratrain.cli",
                "run",
                str(cfg),
                "--nproc",
                "1",
                "--run-dir",
                str(tmp_path / "run"),
                "--set",
                f"train.lr={lr}",
            ],
            env={
                **os.environ,
                **CPU_ONLY,
                "PET_NNODES": "2",
                "PET_NODE_RANK": str(n),
                "PET_MASTER_ADDR": "127.0.0.1",
                "PET_MASTER_PORT": str(port),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n, lr in ((0, 0.1), (1, 0.2))
    ]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, results):
        assert p.returncode == 2, err
        assert err.splitlines()[-1] == (
            "paratrain: error: preflight: node 1 differs from node 0: config "
            f"differs (host {socket.gethostname()}): "
            "train.lr = 0.2 against 0.1"
        ), err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["slurm", "--nodes", "0"], "paratrain: error: --nodes: must be >= 1, got 0"),
        (
            ["lsf", "--nodes", "2"],
            "paratrain: error: SCHEDULER: unknown scheduler 'lsf': one of slurm, kubernetes, skypilot",
        ),
        (
            ["skypilot", "--nodes", "2", "--submit", "--out", "job.yaml"],
            "paratrain: error: --submit: sky is not installed here; write the file with --out and submit it where sky is",
        ),
        (
            ["kubernetes", "--nodes", "2"],
            "paratrain: error: --image: required for kubernetes: a container image with paratrain installed",
        ),
        (["slurm", "--nodes", "2", "--set", "parallel.tp=3"], None),
    ],
)
def test_bad_job_options_exit_2_with_one_line(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scheduler's tool here
    monkeypatch.chdir(tmp_path)
    assert main(["job", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == "" and not list(tmp_path.iterdir()), captured
    assert lines[0] == message if message else lines[0].startswith("paratrain: error: parallel.tp"), lines
