"""Two test hosts inside this machine: network namespaces joined by a veth pair.

For multi-node tests and slow-link benchmarks without a second machine. Each host has its own
network stack (its own loopback and one veth end with a private address that exists only inside
these namespaces); `tc` can cap the link's rate with a token bucket (tbf; netem, for delay, is
not in every kernel, this one's included). Needs root and iproute2; `available()`
says why not otherwise. Everything is torn down on exit, also after an error.

    with TwoHosts(rate="1gbit") as hosts:
        p0 = hosts.popen(0, [sys.executable, "-m", "paratrain.cli", "run", ...], env=hosts.env(0))
        print(hosts.addr(0))   # 10.77.0.1

With `aliases`, each namespace gets a hosts file (/etc/netns/NAME/hosts, which `ip netns exec`
puts over /etc/hosts): host i's aliases resolve to its address in both, and this machine's host
name to the namespace's own address, as a real node's name does (gloo and c10d find a node's
address by its host name).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import uuid
from pathlib import Path

NETNS_ETC = Path("/etc/netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> tuple[bool, str]:
    """(True, "") when namespaces can be made here, else (False, the reason)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return False, "iproute2 (ip, tc) is not installed"
    probe = f"ptprobe{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return False, f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


class TwoHosts:
    def __init__(
        self,
        rate: str | None = None,
        subnet: str = "10.77.0",
        aliases: tuple[tuple[str, ...], tuple[str, ...]] | None = None,
    ):
        tag = uuid.uuid4().hex[:6]
        self.names = [f"pt{tag}a", f"pt{tag}b"]
        self.ifaces = [f"vpt{tag}a", f"vpt{tag}b"]  # interface names must stay under 16 characters
        self.addrs = [f"{subnet}.1", f"{subnet}.2"]
        self.rate = rate
        self.aliases = aliases

    def __enter__(self) -> TwoHosts:
        try:
            for ns in self.names:
                _ip("netns", "add", ns)
            _ip("link", "add", self.ifaces[0], "type", "veth", "peer", "name", self.ifaces[1])
            for ns, iface, addr in zip(self.names, self.ifaces, self.addrs):
                _ip("link", "set", iface, "netns", ns)
                self.run(self.names.index(ns), ["ip", "addr", "add", f"{addr}/24", "dev", iface])
                self.run(self.names.index(ns), ["ip", "link", "set", iface, "up"])
                self.run(self.names.index(ns), ["ip", "link", "set", "lo", "up"])
                if self.rate:
                    self.run(
                        self.names.index(ns),
                        [
                            "tc",
                            "qdisc",
                            "add",
                            "dev",
                            iface,
                            "root",
                            "tbf",
                            "rate",
                            self.rate,
                            "burst",
                            "256kb",
                            "latency",
                            "50ms",
                        ],
                    )
            if self.aliases:
                self._write_hosts_files()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _write_hosts_files(self) -> None:
        assert self.aliases is not None  # called only with aliases
        for host, ns in enumerate(self.names):
            lines = ["127.0.0.1 localhost", f"{self.addrs[host]} {socket.gethostname()}"]
            lines += [f"{addr} {' '.join(names)}" for addr, names in zip(self.addrs, self.aliases) if names]
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text("\n".join(lines) + "\n")

    def __exit__(self, *exc) -> None:
        for ns in self.names:
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():  # what still runs in it
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)  # deleting a namespace deletes the veth end inside it
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)

    def addr(self, host: int) -> str:
        return self.addrs[host]

    def iface(self, host: int) -> str:
        return self.ifaces[host]

    def env(self, host: int, base: dict | None = None) -> dict:
        """The environment for a process on `host`: gloo must use this host's veth interface."""
        return {
            **(os.environ if base is None else base),
            "GLOO_SOCKET_IFNAME": self.ifaces[host],
            "TP_SOCKET_IFNAME": self.ifaces[host],
            "NCCL_SOCKET_IFNAME": self.ifaces[host],
        }

    def command(self, host: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *argv]

    def run(self, host: int, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("check", True)
        return subprocess.run(self.command(host, argv), **kwargs)

    def popen(self, host: int, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kwargs)
