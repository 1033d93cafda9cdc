"""What a job file holds (Job), whichever scheduler's format writes it, and the shell lines every
format runs on a node."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass


@dataclass
class Job:
    name: str  # the config's name, as a DNS label (Kubernetes names, Slurm's job name)
    config_toml: str  # the resolved config, embedded in the file
    nodes: int
    nproc: int
    run_dir: str
    max_restarts: int
    image: str | None
    gpus: int
    cpus: int | None
    memory: str | None
    volume: str | None
    kind: str

    def run_argv(self, config_path: str, run_dir: str) -> list[str]:
        """The command each node runs: no --nnodes/--node-rank/--rdzv, those come from the scheduler."""
        return [
            "paratrain",
            "run",
            config_path,
            "--run-dir",
            run_dir,
            "--nproc",
            str(self.nproc),
            "--max-restarts",
            str(self.max_restarts),
        ]


# A file's embedded config ends at a line holding this alone (a quoted heredoc: nothing in it expands).
CONFIG_END = "PARATRAIN_CONFIG"


def shell_lines(job: Job) -> tuple[list[str], str]:
    """The shell that puts the embedded config into the run directory as job.toml, and the node's
    `paratrain run` command line reading it (for Slurm's and SkyPilot's scripts)."""
    write = [
        f"run_dir={shlex.quote(job.run_dir)}",
        'mkdir -p "$run_dir"',
        f"cat > \"$run_dir/job.toml\" <<'{CONFIG_END}'",
        job.config_toml.rstrip("\n"),
        CONFIG_END,
    ]
    # shell words already (the run directory's variable), numbers and fixed words else: nothing to quote
    return write, " ".join(job.run_argv('"$run_dir/job.toml"', '"$run_dir"'))


def dns_label(name: str) -> str:
    """`name` as an RFC 1035 label (lower-case letters, digits, '-', a letter first, at most 63)."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not label or not label[0].isalpha():
        label = f"paratrain-{label}".strip("-")
    return label[:63].rstrip("-")
