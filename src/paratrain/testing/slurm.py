"""A real two-node Slurm cluster inside this machine, for the tests: Debian's slurm-wlm (22.05) and munge,
slurmctld and one slurmd in each of two network namespaces (paratrain.testing.netns.TwoHosts).

    python -m paratrain.testing.slurm install     # apt-get, as root; nothing to do when installed

    with SlurmCluster(workdir) as cluster:
        cluster.sbatch(script, cwd=..., env=...)    # submitted from node1's namespace

What it takes, and why:
* `ip netns exec` mounts a fresh /sys, without cgroups, and slurmd wants them: each slurmd starts in a
  shell that mounts a tmpfs on /sys/fs/cgroup and the v1 controllers under it (cgroup.conf says v1).
* Process tracking by /proc (proctrack/linuxproc) and no task plugin: nothing more of cgroups is used.
* SlurmctldHost is this machine's host name, with node1's namespace address in parentheses; each
  slurmd is told its node name (-N), since both run on one host name.
* One munged for both nodes (its socket is a file, seen from every namespace), with its own key and
  socket in the work directory; --force lets it run as root with this layout.
* Each namespace's hosts file resolves node1/node2, and the host name to the namespace's own address.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paratrain.testing import netns

PACKAGES = ("slurm-wlm", "munge", "shellcheck")
TOOLS = ("sbatch", "srun", "slurmctld", "slurmd", "munged", "shellcheck")
NODES = ("node1", "node2")
CGROUP_CONTROLLERS = ("cpuset", "memory", "freezer", "devices")


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool, path=f"{os.environ.get('PATH', '')}:/usr/sbin") is None]


def install() -> None:
    """apt-get the packages when a tool is missing (root; a fresh machine or CI). RuntimeError if it fails."""
    if not missing_tools():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _tool(name: str) -> str:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin") or name


class SlurmCluster:
    def __init__(self, workdir: Path):
        self.dir = Path(workdir)
        self.conf = self.dir / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []
        self.hosts = netns.TwoHosts(aliases=((NODES[0],), (NODES[1],)))

    def env(self, base: dict | None = None) -> dict:
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> SlurmCluster:
        self.dir.mkdir(parents=True, exist_ok=True)
        # slurmstepd makes its sockets in the spool (NODE_JOBID.STEPID): the path must fit AF_UNIX's
        # 108 bytes, which a deep workdir (pytest-xdist's tmp_path) does not leave room for.
        self.spool = Path(tempfile.mkdtemp(prefix="pt-slurm-"))
        self.dir.chmod(0o700)  # munged refuses a socket or key in a directory others may write to
        self.hosts.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = self.dir / "munge.socket"
        self._daemon(
            "munged",
            [
                _tool("munged"),
                "--force",
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self.dir / 'munged.pid'}",
                f"--log-file={self.dir / 'munged.log'}",
                f"--seed-file={self.dir / 'munged.seed'}",
            ],
        )
        self._wait_for(self.munge_socket.exists, "munged's socket", self.dir / "munged.log")
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        self.conf.write_text(self._slurm_conf())
        self._daemon("slurmctld", self.hosts.command(0, [_tool("slurmctld"), "-D", "-f", str(self.conf)]))
        mounts = " && ".join(
            ["mount -t tmpfs cgroup_root /sys/fs/cgroup"]
            + [
                f"mkdir -p /sys/fs/cgroup/{c} && mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c}"
                for c in CGROUP_CONTROLLERS
            ]
        )
        for host, node in enumerate(NODES):
            self._daemon(
                f"slurmd-{node}",
                self.hosts.command(
                    host,
                    [
                        "sh",
                        "-c",
                        f'{mounts} && exec "$@"',
                        "slurmd",
                        _tool("slurmd"),
                        "-D",
                        "-N",
                        node,
                        "-f",
                        str(self.conf),
                    ],
                ),
            )
        self._wait_for(self._nodes_idle, "both nodes idle in sinfo", self.dir / "slurmctld.log")

    def _slurm_conf(self) -> str:
        d = self.dir
        lines = [
            "ClusterName=paratrain",
            f"SlurmctldHost={socket.gethostname()}({self.hosts.addr(0)})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CredType=cred/munge",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={self.spool / '%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SlurmdParameters=config_overrides",
            "KillWait=5",
            "MinJobAge=5",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
        ]
        lines += [
            f"NodeName={node} NodeAddr={self.hosts.addr(i)} CPUs={os.cpu_count() or 1} State=UNKNOWN"
            for i, node in enumerate(NODES)
        ]
        lines.append(f"PartitionName=main Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "ab")
        self.daemons.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env()))
        log.close()

    def _nodes_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(node) == "idle" for node in NODES)

    def _wait_for(self, ready, what: str, log: Path, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args for p in self.daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tail = log.read_text()[-3000:] if log.exists() else "(no log)"
                raise RuntimeError(
                    f"Slurm test cluster: no {what} ({'exited: ' + str(dead) if dead else 'timeout'})\n{tail}"
                )
            time.sleep(0.1)

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, sinfo, ...) from node1's namespace."""
        kwargs.setdefault("env", self.env())
        kwargs.setdefault("check", True)
        return self.hosts.run(0, [_tool(argv[0]), *argv[1:]], **kwargs)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        kwargs["env"] = self.env(kwargs.get("env"))
        return self.hosts.popen(0, [_tool(argv[0]), *argv[1:]], **kwargs)

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.daemons):
            proc.terminate()
        for proc in self.daemons:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.hosts.__exit__(None, None, None)  # and what the jobs left running in the namespaces
        shutil.rmtree(self.spool, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python -m paratrain.testing.slurm install")
    install()
