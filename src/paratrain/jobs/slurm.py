"""The sbatch script: one `paratrain run` per node through srun.

The batch step (on the first node) writes the embedded config into the run directory, which every node
must see; srun then starts one task per node, and each task's `paratrain run` finds its node rank and
the rendezvous (the first node of SLURM_JOB_NODELIST, expanded without scontrol) in Slurm's
environment. The script is shellcheck-clean.
"""

from __future__ import annotations

from paratrain import __version__
from paratrain.jobs.job import Job, shell_lines


def render(job: Job) -> str:
    directives = [f"--job-name={job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1", "--output=%x-%j.out"]
    if job.cpus:
        directives.append(f"--cpus-per-task={job.cpus}")
    if job.gpus:
        directives.append(f"--gpus-per-node={job.gpus}")
    if job.memory:
        directives.append(f"--mem={job.memory.removesuffix('i')}")  # Slurm writes 32G where Kubernetes writes 32Gi
    write_config, argv = shell_lines(job)
    return "\n".join(
        [
            "#!/bin/bash",
            f"# Written by `paratrain job slurm` (paratrain {__version__}): {job.name} on {job.nodes} nodes, "
            f"{job.nproc} process(es) each.",
            *(f"#SBATCH {d}" for d in directives),
            "set -euo pipefail",
            "",
            "# On storage every node sees: the config, checkpoints and metrics live here.",
            *write_config,
            "",
            "# One task per node; each reads its node rank and the rendezvous from Slurm's environment.",
            "# A task that fails for good (after its --max-restarts) stops the others.",
            f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {argv}",
            "",
        ]
    )
