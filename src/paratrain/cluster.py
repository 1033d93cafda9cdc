"""`paratrain plan --cluster FILE`: the machines a plan is for, as a TOML [cluster] table.

Each preset names a device's dense 16-bit peak, its memory and memory bandwidth, and the links of
the server it usually comes in. Where each number comes from:
  * peak TFLOP/s (dense bf16/fp16 tensor cores, no sparsity), memory and HBM bandwidth: the vendor's
    data sheets (NVIDIA A100: 312 TFLOP/s, 40 GB at 1,555 GB/s / 80 GB at 2,039 GB/s; H100 SXM:
    989 TFLOP/s, 80 GB at 3.35 TB/s; H200: 989 TFLOP/s, 141 GB at 4.8 TB/s);
  * intra-node bandwidth, per device and direction: NVLink 3 (A100, 600 GB/s both ways) and NVLink 4
    (H100, H200, 900 GB/s both ways), halved;
  * inter-node bandwidth, per node: a DGX's eight compute NICs (A100: 8 x 200 Gb/s HDR InfiniBand,
    H100 and H200: 8 x 400 Gb/s NDR);
  * latency: a few microseconds per message between nodes (InfiniBand, NCCL's ring), one to two
    within a node; these are typical figures, not measured here.
  * cpu: this machine; its peak is measured once per plan (a large fp32 matmul) since no data sheet
    applies, and its links are shared memory (intra) and a 10 Gb/s Ethernet (inter), both assumed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

import tomllib

from .config import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class Device:
    peak_tflops: float  # dense, at the run's precision (16-bit tensor cores on GPUs)
    memory_gib: float
    hbm_GBps: float  # device memory bandwidth, for memory-bound work (elementwise ops, the optimizer)
    intra_node_GBps: float  # per device, one direction
    inter_node_Gbps: float  # per node, all NICs together
    latency_us: float  # per message between nodes
    intra_latency_us: float


PRESETS = {
    "a100-40gb": Device(312, 40, 1555, 300, 1600, 5, 2),
    "a100-80gb": Device(312, 80, 2039, 300, 1600, 5, 2),
    "h100-sxm": Device(989, 80, 3350, 450, 3200, 5, 2),
    "h200": Device(989, 141, 4800, 450, 3200, 5, 2),
    "cpu": Device(0.0, 0.0, 20, 10, 10, 30, 5),  # peak and memory: this machine's, filled in by for_cpu
}


@dataclass(frozen=True)
class Cluster:
    nodes: int
    devices_per_node: int
    device_name: str
    device: Device

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def is_gpu(self) -> bool:
        return self.device_name != "cpu"

    @property
    def memory_bytes(self) -> int:
        return int(self.device.memory_gib * GIB)


_KEYS = {
    "nodes": int,
    "devices_per_node": int,
    "device": str,
    "peak_tflops": float,
    "memory_gib": float,
    "intra_node_GBps": float,
    "inter_node_Gbps": float,
    "latency_us": float,
}


@functools.cache
def this_machine_peak_tflops() -> float:
    """The rate of a 512^3 fp32 matmul on this CPU, the best of four (milliseconds; once a process)."""
    import time

    import torch

    a = torch.randn(512, 512)
    a @ a  # the kernel's one-time set-up
    best = float("inf")
    for _ in range(4):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * 512**3 / best / 1e12


def for_cpu(device: Device) -> Device:
    """The cpu preset with this machine's measured peak and host memory, unless overridden."""
    import os

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return replace(
        device, peak_tflops=device.peak_tflops or this_machine_peak_tflops(), memory_gib=device.memory_gib or host
    )


def parse_cluster(raw: dict, where: str = "cluster") -> Cluster:
    """A [cluster] table (already parsed TOML) -> Cluster; ConfigError naming the key otherwise."""
    if not isinstance(raw, dict):
        raise ConfigError(where, "a [cluster] table is required")
    for key, value in raw.items():
        kind = _KEYS.get(key)
        if kind is None:
            raise ConfigError(f"{where}.{key}", f"unknown key (known: {', '.join(_KEYS)})")
        ok = (
            isinstance(value, str)
            if kind is str
            else (isinstance(value, int) if kind is int else isinstance(value, (int, float)))
            and not isinstance(value, bool)
        )
        if not ok:
            raise ConfigError(f"{where}.{key}", f"expected {'a string' if kind is str else 'a number'}, got {value!r}")
        if kind is not str and value <= 0:
            raise ConfigError(f"{where}.{key}", f"must be > 0, got {value}")
    for key in ("nodes", "devices_per_node", "device"):
        if key not in raw:
            raise ConfigError(f"{where}.{key}", "required")
    name = raw["device"]
    if name not in PRESETS:
        raise ConfigError(f"{where}.device", f"unknown device {name!r} (presets: {', '.join(PRESETS)})")
    overrides = {f.name: float(raw[f.name]) for f in fields(Device) if f.name in raw}
    device = replace(PRESETS[name], **overrides)
    if name == "cpu":
        device = for_cpu(device)
    return Cluster(raw["nodes"], raw["devices_per_node"], name, device)


def load_cluster(path: str) -> Cluster:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ConfigError("--cluster", f"{path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--cluster", f"{path}: not valid TOML ({exc})") from None
    extra = [k for k in doc if k != "cluster"]
    if extra:
        raise ConfigError(extra[0], "unknown table in a cluster file (only [cluster])")
    return parse_cluster(doc.get("cluster"))


def this_machine(nnodes: int, nproc: int) -> Cluster:
    """Without --cluster: nnodes machines like this one, nproc processes each."""
    return Cluster(nnodes, nproc, "cpu", for_cpu(PRESETS["cpu"]))
