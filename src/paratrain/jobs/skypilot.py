"""The SkyPilot task YAML: `num_nodes` nodes, each running `paratrain run`, which reads
SKYPILOT_NODE_IPS (the head first) and SKYPILOT_NODE_RANK for the rendezvous and its rank.
"""

from __future__ import annotations

from paratrain import __version__
from paratrain.jobs.job import Job, shell_lines
from paratrain.jobs.kubernetes import dump


def run_script(job: Job) -> str:
    """The task's `run`: the embedded config into the run directory (shared storage, e.g. a bucket
    mounted with `file_mounts`), then this node's `paratrain run`."""
    write_config, argv = shell_lines(job)
    return "\n".join(
        [
            "set -euo pipefail",
            *write_config,
            f"exec {argv}",
            "",
        ]
    )


def task(job: Job) -> dict:
    resources: dict = {}
    if job.gpus:
        resources["accelerators"] = {"A100": job.gpus}  # the kind is the user's to choose: A100 is a placeholder
    if job.cpus:
        resources["cpus"] = f"{job.cpus}+"
    if job.memory:
        resources["memory"] = f"{job.memory.removesuffix('Gi').removesuffix('G')}+"
    if job.image:
        resources["image_id"] = f"docker:{job.image}"
    return {
        "name": job.name,
        "num_nodes": job.nodes,
        "resources": resources,
        "setup": f"command -v paratrain >/dev/null || pip install 'paratrain=={__version__}'\n",
        "run": run_script(job),
    }


def render(job: Job) -> str:
    return f"# Written by `paratrain job skypilot`: {job.name} on {job.nodes} nodes.\n" + dump([task(job)])
