"""Shared test helpers: run the real CLI in subprocesses, write configs, read results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# The suite tests the CPU path (gloo), the same on every machine: its processes see no GPU.
# tests/test_gpu.py covers CUDA and NCCL where there is a GPU.
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None, gpus: bool = False
) -> subprocess.CompletedProcess:
    """`paratrain ARGS` in a fresh process (which starts real workers on a free port), on CPU
    unless `gpus`."""
    full_env = {**os.environ, **({} if gpus else CPU_ONLY), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "paratrain.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_torchrun(nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node NPROC ARGS` in a fresh process, on CPU."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **CPU_ONLY},
    )


def check_ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def max_rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], floor: float = 1e-12) -> float:
    """Largest per-tensor relative error; a tensor whose norm is under `floor` is compared by its
    error against `floor`."""
    assert a.keys() == b.keys(), f"keys differ: {sorted(set(a) ^ set(b))}"
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(floor)).item() for k in a)


def complete_lines(path) -> list[str]:
    """The complete lines of a file another process is appending to (none yet: no lines)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return text.splitlines()[:-1] if not text.endswith("\n") else text.splitlines()


def descendants(root: int) -> set[int]:
    """`root` and every process under it (children, grandchildren, ...)."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parent.items() if p == pid and c not in found]
        found.update(children)
        frontier += children
    return found


def listening_addresses(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in state LISTEN that one of `pids` holds, read from the
    TCP tables of each process's own network namespace (/proc/PID/net/tcp*)."""
    import ipaddress

    def address(hex_addr: str) -> str:  # 32-bit words in host (little-endian) byte order
        raw = bytes.fromhex(hex_addr)
        return str(ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))))

    def socket_inodes(pid: int) -> set[str]:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
        return inodes

    found = set()
    for pid in pids:
        try:
            inodes = socket_inodes(pid)
            tables = [Path(f"/proc/{pid}/net/{t}").read_text() for t in ("tcp", "tcp6")]
        except OSError:  # the process is gone
            continue
        for line in (row for table in tables for row in table.splitlines()[1:]):
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                host, port = fields[1].split(":")
                found.add((address(host), int(port, 16)))
    return sorted(found)


def is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (
        isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback
    )


def outputs_of(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    """Each process's output once all have exited with 0 (assertion error with the output of one that
    did not); killed if they outlast `timeout`."""
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    return outs


def rel_error(a: dict, b: dict) -> float:
    """Largest per-tensor relative error. The attention's key bias gets an exactly zero gradient
    (softmax ignores a shift shared by all keys), so it holds only rounding noise of ~1e-12 that
    differs with summation order: tensors that small are compared by absolute error instead."""
    return max_rel_error(a, b, floor=1e-6)
