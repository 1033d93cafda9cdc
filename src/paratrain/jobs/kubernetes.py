"""Kubernetes manifests: a ConfigMap holding the config, plus a Kubeflow Trainer v2 TrainJob (runtime
`torch-distributed`) or, with --kind pytorchjob, a Kubeflow PyTorchJob v1.

Either operator starts one pod per node and injects the variables `paratrain run` reads
(paratrain.runtime.schedulers): the TrainJob's PET_*, the PyTorchJob's MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK.
The ConfigMap is mounted at CONFIG_MOUNT; --volume CLAIM mounts a PersistentVolumeClaim at RUNS_MOUNT
for the run directory, which the pods must share for checkpoints and restarts.
"""

from __future__ import annotations

import yaml

from paratrain.jobs.job import Job

CONFIG_MOUNT = "/etc/paratrain"
RUNS_MOUNT = "/paratrain-runs"
# The port the PyTorchJob operator passes as MASTER_PORT (the master container's `pytorchjob-port`).
PYTORCHJOB_PORT = 29500
TRAINER_RUNTIME = "torch-distributed"


def config_map(job: Job) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{job.name}-config"},
        "data": {"config.toml": job.config_toml},
    }


def _resources(job: Job) -> dict:
    amounts = {}
    if job.cpus:
        amounts["cpu"] = str(job.cpus)
    if job.memory:
        amounts["memory"] = job.memory
    if job.gpus:
        amounts["nvidia.com/gpu"] = str(job.gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _volumes(job: Job) -> tuple[list[dict], list[dict]]:
    """(the pod's volumes, the container's mounts): the config, and the run directory's claim."""
    volumes = [{"name": "paratrain-config", "configMap": {"name": f"{job.name}-config"}}]
    mounts = [{"name": "paratrain-config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
    if job.volume:
        volumes.append({"name": "paratrain-runs", "persistentVolumeClaim": {"claimName": job.volume}})
        mounts.append({"name": "paratrain-runs", "mountPath": RUNS_MOUNT})
    return volumes, mounts


def _command(job: Job) -> list[str]:
    return job.run_argv(f"{CONFIG_MOUNT}/config.toml", job.run_dir)


def trainjob(job: Job) -> dict:
    volumes, mounts = _volumes(job)
    trainer: dict[str, object] = {
        "image": job.image,
        "command": _command(job),
        "numNodes": job.nodes,
        "numProcPerNode": job.nproc,
    }
    if _resources(job):
        trainer["resourcesPerNode"] = _resources(job)
    # The torch-distributed runtime's pods are the replicated job `node`, container `node`: the volumes
    # are patched into them.
    pod = {"volumes": volumes, "containers": [{"name": "node", "volumeMounts": mounts}]}
    patch = {
        "manager": "paratrain",
        "trainingRuntimeSpec": {
            "template": {
                "spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}
            }
        },
    }
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": job.name},
        "spec": {"runtimeRef": {"name": TRAINER_RUNTIME}, "trainer": trainer, "runtimePatches": [patch]},
    }


def pytorchjob(job: Job) -> dict:
    volumes, mounts = _volumes(job)
    container: dict[str, object] = {
        "name": "pytorch",
        "image": job.image,
        "command": _command(job),
        "volumeMounts": mounts,
        "ports": [{"name": "pytorchjob-port", "containerPort": PYTORCHJOB_PORT}],
    }
    if _resources(job):
        container["resources"] = _resources(job)

    def replicas(count: int) -> dict:
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {"spec": {"containers": [container], "volumes": volumes}},
        }

    specs = {"Master": replicas(1)}
    if job.nodes > 1:
        specs["Worker"] = replicas(job.nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job.name},
        "spec": {"nprocPerNode": str(job.nproc), "pytorchReplicaSpecs": specs},
    }


def manifests(job: Job) -> list[dict]:
    return [config_map(job), pytorchjob(job) if job.kind == "pytorchjob" else trainjob(job)]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config) as literal blocks, readable in the file as they are in TOML; a
    part shared by two replicas written out twice, not as a YAML alias a reader must resolve."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def dump(documents: list[dict]) -> str:
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def render(job: Job) -> str:
    head = f"# Written by `paratrain job kubernetes`: {job.name} on {job.nodes} nodes, {job.nproc} process(es) each.\n"
    return head + dump(manifests(job))
