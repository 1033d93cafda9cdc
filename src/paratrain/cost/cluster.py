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
  * `paratrain plan --calibrate [FILE]` measures this machine instead (`calibrate`): three launches
    of --nproc gloo processes (two at least) on loopback, ten seconds each, timing matmuls, memory
    traffic and a small op at once (as the ranks share the machine in a run), all-reduces by size
    after compute (alpha-beta, and the ranks' skew) and a pipeline message's latency, the median of
    the three; it writes them as a cluster file that `--cluster FILE` reads back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import Any

from paratrain.config import read_toml
from paratrain.errors import ConfigError

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
    # a matrix product's fixed cost besides its arithmetic (a GPU kernel's launch and tail wave: a
    # few microseconds, an assumption), and every op's (on the CPU, eager dispatch: --calibrate
    # measures it; on a GPU the memory-bound kernels' launches are taken to overlap: 0)
    product_overhead_us: float = 5.0
    op_overhead_us: float = 0.0
    # a pipeline message between neighbours in one node (0: intra_latency_us; --calibrate measures
    # this machine's, whose pipeline exchanges through shared memory instead of gloo)
    p2p_latency_us: float = 0.0
    # per collective in a stream of asynchronous all-reduces started back to back (0: a ring
    # all-reduce's latency; --calibrate measures this machine's)
    stream_latency_us: float = 0.0
    # the framework's own cost of a step besides compute, communication and the optimizer's
    # arithmetic (--calibrate measures it with a tiny model through the trainer; 0 on GPUs, where
    # it hides behind the queued kernels)
    step_overhead_us: float = 0.0
    # a cpu cluster only: time the model's layers on this machine instead of modelling them
    # (layer_times; --calibrate writes it, the machine it measured being the one planned for)
    time_layers: bool = False
    # how much slower a process computes while all devices_per_node of them compute at once than
    # alone (shared caches and memory bandwidth; more processes than cores take turns): timed
    # layers are stretched by it; --calibrate measures it
    cpu_contention: float = 1.0
    # per second of compute between collectives, the seconds ranks that synchronize wait for the
    # last of them to arrive (on a shared machine one in a few is late: descheduled, or an idle
    # core waking); --calibrate measures it; 0 on GPUs, taken to run undisturbed
    sync_skew: float = 0.0
    # a large GEMM's share of peak_tflops; 1 where the peak is itself a measured matmul rate (the
    # cpu preset). The GPU kernel model's figures (cost/kernels.py; the presets say where each
    # comes from; `plan --calibrate` on a GPU measures them):
    gemm_efficiency: float = 0.85
    sm_count: float = 132  # streaming multiprocessors: a GEMM's last wave of tiles (wave quantization)
    hbm_efficiency: float = 0.9  # a memory-bound kernel's share of hbm_GBps (a device copy's)
    # fused attention's share of peak_tflops (FlashAttention's count: a causal kernel does half
    # the scores) at long sequences, forward and backward, and the sequence length at which each
    # runs at half that (a GPU's backward kernel can saturate later than its forward: measured so
    # on an H200, `plan --calibrate`)
    attention_fwd_efficiency: float = 0.354
    attention_bwd_efficiency: float = 0.334
    attention_half_seq: float = 430.0
    attention_bwd_half_seq: float = 430.0
    # the host's cost of one kernel in eager PyTorch (dispatch and the CUDA launch): a pass takes
    # at least its kernels' launches (a compiled model launches fewer: its fused chains)
    launch_us: float = 8.0


# The GPU presets' kernel figures:
#  * gemm_efficiency: the Maximum Achievable Matmul FLOPS table of Stas Bekman's Machine Learning
#    Engineering book (github.com/stas00/ml-engineering, compute/accelerator: bf16 mamf-finder over
#    shapes): A100 SXM 271 of 312 TFLOP/s (87 %), H100 SXM 794 of 989 (80 %), GH200 829 of 989
#    (84 %); measured here on one H200 (torch 2.11): an 8192^3 bf16 matmul at 769-798 TFLOP/s
#    (78-81 %): 0.80 for H100 and H200;
#  * sm_count: NVIDIA's data sheets (A100 108 SMs; H100 SXM and H200 132);
#  * hbm_efficiency: measured here on one H200, a device copy at about 4.3 of the data sheet's
#    4.8 TB/s counting bytes read and written (0.9), the same share taken for the others;
#  * attention: the FlashAttention-3 paper (Shah et al. 2024, arXiv 2407.08608), Fig. 5-6, its
#    FlashAttention-2 runs on an H100 SXM5 at head dim 128 (the kernel torch's sdpa runs): causal
#    forward 191 TFLOP/s at 512 tokens to 333 at 8k, backward 214 to 318: the curve
#    p * s / (s + s_half) through them, p 350 forward / 330 backward (0.354 and 0.334 of the 989
#    peak), s_half 430 (H200: the same SMs and clocks); A100: the FlashAttention-2 paper (Dao 2023,
#    arXiv 2307.08691) reaches 50-73 % of peak, taken as 70 % forward, 60 % backward;
#  * launch_us: an assumption (eager dispatch plus a CUDA launch, some 5-10 us an op on a server
#    CPU); `plan --calibrate` on a GPU measures an empty kernel's launch and eager dispatch.
_A100: dict[str, Any] = dict(
    gemm_efficiency=0.87, sm_count=108, attention_fwd_efficiency=0.70, attention_bwd_efficiency=0.60
)
_HOPPER: dict[str, Any] = dict(gemm_efficiency=0.80, sm_count=132)

PRESETS = {
    "a100-40gb": Device(312, 40, 1555, 300, 1600, 5, 2, **_A100),
    "a100-80gb": Device(312, 80, 2039, 300, 1600, 5, 2, **_A100),
    "h100-sxm": Device(989, 80, 3350, 450, 3200, 5, 2, **_HOPPER),
    "h200": Device(989, 141, 4800, 450, 3200, 5, 2, **_HOPPER),
    # peak and memory: this machine's, filled in by for_cpu
    "cpu": Device(0.0, 0.0, 20, 10, 10, 30, 5, product_overhead_us=0.0, op_overhead_us=5.0, gemm_efficiency=1.0),
}


@dataclass(frozen=True)
class Cluster:
    nodes: int
    devices_per_node: int
    device_name: str
    device: Device
    # time_layers: where the layers' timings are kept for later plans (times_file_for)
    times_file: str | None = None

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
    # what --calibrate measures besides the above (docs/planning.md)
    "hbm_GBps": float,
    "intra_latency_us": float,
    "op_overhead_us": float,
    "p2p_latency_us": float,
    "stream_latency_us": float,
    "step_overhead_us": float,
    "time_layers": bool,
    "cpu_contention": float,
    "sync_skew": float,
    # the GPU kernel model's (cost/kernels.py), which --calibrate measures on a GPU
    "gemm_efficiency": float,
    "sm_count": float,
    "hbm_efficiency": float,
    "attention_fwd_efficiency": float,
    "attention_bwd_efficiency": float,
    "attention_half_seq": float,
    "attention_bwd_half_seq": float,
    "launch_us": float,
    "product_overhead_us": float,
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


def parse_cluster(raw: object, where: str = "cluster") -> Cluster:
    """A [cluster] table (already parsed TOML) -> Cluster; ConfigError naming the key otherwise."""
    if not isinstance(raw, dict):
        raise ConfigError(where, "a [cluster] table is required")
    for key, value in raw.items():
        kind = _KEYS.get(key)
        if kind is None:
            raise ConfigError(f"{where}.{key}", f"unknown key (known: {', '.join(_KEYS)})")
        if kind in (str, bool):
            ok = isinstance(value, kind)
        else:
            ok = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
        if not ok:
            expected = {str: "a string", bool: "true or false"}.get(kind, "a number")
            raise ConfigError(f"{where}.{key}", f"expected {expected}, got {value!r}")
        if kind in (int, float) and value <= 0:
            raise ConfigError(f"{where}.{key}", f"must be > 0, got {value}")
    for key in ("nodes", "devices_per_node", "device"):
        if key not in raw:
            raise ConfigError(f"{where}.{key}", "required")
    name = raw["device"]
    if name not in PRESETS:
        raise ConfigError(f"{where}.device", f"unknown device {name!r} (presets: {', '.join(PRESETS)})")
    overrides = {f.name: _KEYS[f.name](raw[f.name]) for f in fields(Device) if f.name in raw}
    if overrides.get("time_layers") and name != "cpu":
        raise ConfigError(f"{where}.time_layers", f"times layers on this machine: device must be 'cpu', not {name!r}")
    device = replace(PRESETS[name], **overrides)
    if name == "cpu":
        device = for_cpu(device)
    return Cluster(raw["nodes"], raw["devices_per_node"], name, device)


def load_cluster(path: str) -> Cluster:
    doc = read_toml(path, "--cluster")
    extra = [k for k in doc if k != "cluster"]
    if extra:
        raise ConfigError(extra[0], "unknown table in a cluster file (only [cluster])")
    cluster = parse_cluster(doc.get("cluster"))
    if cluster.device.time_layers:
        cluster = replace(cluster, times_file=times_file_for(path))
    return cluster


def times_file_for(cluster_path: str) -> str:
    """Where the layers' timings (layer_times) are kept beside a cluster file: cluster.toml ->
    cluster.times.json."""
    from pathlib import Path

    path = Path(cluster_path)
    return str(path.with_name(path.stem + ".times.json"))


def this_machine(nnodes: int, nproc: int) -> Cluster:
    """Without --cluster: nnodes machines like this one, nproc processes each."""
    return Cluster(nnodes, nproc, "cpu", for_cpu(PRESETS["cpu"]))


def calibration_file(nproc: int):
    """Where `plan --calibrate --nproc N` keeps this host's figures for N processes, for the plans
    without --cluster that follow: the user's cache (XDG_CACHE_HOME, else ~/.cache), per host (a
    home directory may be shared by several)."""
    import os
    import socket
    from pathlib import Path

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "paratrain" / "calibration" / f"{socket.gethostname()}-{nproc}.toml"


def this_machines_cluster(nnodes: int, nproc: int) -> tuple[Cluster, str]:
    """Without --cluster on a CPU: this host's calibration for nproc processes where one was kept,
    else the cpu preset; and a line saying which figures the prediction uses."""
    path = calibration_file(nproc)
    if path.is_file():
        cluster = replace(load_cluster(str(path)), nodes=nnodes)
        return cluster, f"step times from this machine's calibration for {nproc} processes ({path})"
    return this_machine(nnodes, nproc), (
        "step times from the cpu preset (this machine's matmul rate, the rest assumed): "
        f"`paratrain plan --calibrate --nproc {nproc}` measures this machine for later plans"
    )
