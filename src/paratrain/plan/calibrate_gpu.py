"""`paratrain plan --calibrate FILE` on a machine with a CUDA GPU: the GPU kernel model's figures
(cost/kernels.py) measured on this GPU in well under a minute, written as a cluster file that
names the GPU: bf16 GEMMs of a few shapes (gemm_efficiency: measured against the model's time at
efficiency 1, the median over the shapes), a causal sdpa attention at two sequence lengths,
forward and forward + backward (the attention curve through them), a device copy
(hbm_efficiency, bytes read and written) and a stream of tiny ops (launch_us: eager dispatch and
an empty kernel's launch, host-bound). The links stay the matching preset's (one GPU cannot
measure NVLink or the network alone).

The same measurements run on the CPU (`measure_kernels("cpu", ...)`, small shapes), which is how
the tests check them without a GPU."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

from paratrain.cost.cluster import GIB, PRESETS, Cluster, Device, load_cluster
from paratrain.errors import ConfigError


@dataclass(frozen=True)
class Sizes:
    """What is measured: GEMM shapes (m, n, k), attention (tokens, heads, head dim, two sequence
    lengths: a batch of tokens / seq sequences each, so that the short one's kernels are not too
    small to time), the copy's bytes, and how many tiny ops time a launch."""

    gemms: tuple = ((8192, 8192, 8192), (16384, 4096, 4096), (16384, 1024, 4096), (16384, 4096, 14336))
    attention: tuple = (32768, 16, 128, (1024, 4096))
    copy_bytes: int = 2**30
    launches: int = 2000
    repeats: int = 10


SMALL = Sizes(
    gemms=((256, 256, 256), (512, 128, 256)),
    attention=(256, 2, 32, (64, 256)),
    copy_bytes=2**22,
    launches=200,
    repeats=3,
)

# torch.cuda.get_device_name -> preset (the first whose words all appear in it)
GPU_NAMES = [
    (("H200",), "h200"),
    (("H100",), "h100-sxm"),
    (("A100", "80GB"), "a100-80gb"),
    (("A100",), "a100-40gb"),
]


def preset_for(gpu_name: str) -> str | None:
    upper = gpu_name.upper()
    for words, preset in GPU_NAMES:
        if all(w in upper for w in words):
            return preset
    return None


def _seconds(fn, device: str, repeats: int, calls: int = 1) -> float:
    """The median seconds of one call of `fn` (after two untimed calls), timed as `calls` calls
    between two synchronizations of the device: a kernel of a fraction of a millisecond queued
    behind the last one, not waiting for the host to launch it."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def measure_kernels(device: str, sizes: Sizes = Sizes()) -> dict:
    """Seconds of each measurement on `device` ("cuda" or "cpu"): {"gemm": [(m, n, k, s)],
    "attention": [(seq, batch, forward s, forward + backward s)], "copy_s", "launch_s"}; bf16 on a GPU,
    fp32 on the CPU. Each measurement's tensors are freed before the next (a GPU's memory)."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out: dict = {"dtype_bytes": torch.tensor([], dtype=dtype).element_size()}
    out["gemm"] = [(m, n, k, _gemm_s(m, n, k, device, dtype, sizes.repeats)) for m, n, k in sizes.gemms]
    tokens, heads, head_dim, seqs = sizes.attention
    out["attention_shape"] = (heads, head_dim)
    out["attention"] = [
        (seq, b, *_attention_s((b, heads, seq, head_dim), device, dtype, sizes.repeats))
        for seq, b in ((seq, max(1, tokens // seq)) for seq in seqs)
    ]
    out["copy_s"] = _copy_s(sizes.copy_bytes, device, sizes.repeats)
    out["copy_bytes"] = 2 * sizes.copy_bytes  # read and written
    tiny = torch.zeros(1, device=device)

    def stream():
        for _ in range(sizes.launches):
            tiny.add_(1)

    out["launch_s"] = _seconds(stream, device, 3) / sizes.launches
    return out


def _gemm_s(m: int, n: int, k: int, device: str, dtype, repeats: int) -> float:
    import torch

    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    return _seconds(lambda: a @ b, device, repeats)


def _attention_s(shape: tuple, device: str, dtype, repeats: int) -> tuple[float, float]:
    """(forward, forward + backward) seconds of a causal sdpa on (batch, heads, seq, head dim)."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both():
        forward().sum().backward()

    return _seconds(forward, device, repeats, calls=5), _seconds(both, device, repeats, calls=5)


def _copy_s(size: int, device: str, repeats: int) -> float:
    import torch

    x = torch.empty(size // 4, device=device)
    y = torch.empty_like(x)
    return _seconds(lambda: y.copy_(x), device, repeats)


def fitted(measured: dict, base: Device, peak_tflops: float, hbm_GBps: float) -> Device:
    """The device with the kernel model's figures fitted to `measured` (measure_kernels)."""
    from paratrain.cost.kernels import gemm_s
    from paratrain.cost.op_counts import Op

    unit = replace(base, peak_tflops=peak_tflops, hbm_GBps=hbm_GBps, gemm_efficiency=1.0, hbm_efficiency=1.0)
    size = measured["dtype_bytes"]
    ratios = []
    for m, n, k, seconds in measured["gemm"]:
        op = Op(2 * m * n * k, 0, size * (m * k + k * n + m * n), "gemm", (1, m, n, k))
        ratios.append(gemm_s(op, unit) / seconds)
    hbm_efficiency = measured["copy_bytes"] / measured["copy_s"] / (hbm_GBps * 1e9)
    # attention: FLOP/s as FlashAttention counts a causal kernel (half of 4 b h s^2 d forward,
    # 2.5 times that backward); per direction the curve p s / (s + s_half) through the two lengths
    (s1, b1, f1, both1), (s2, b2, f2, both2) = measured["attention"][:2]
    rates = {}
    for name, pick in (("fwd", lambda f, both: f), ("bwd", lambda f, both: max(both - f, 1e-12) / 2.5)):
        r1, r2 = (
            _attention_flops(measured, s, b) / 2 / pick(f, both)
            for s, b, f, both in ((s1, b1, f1, both1), (s2, b2, f2, both2))
        )
        rates[name] = _saturating(r1, s1, r2, s2, peak_tflops * 1e12)
    return replace(
        base,
        peak_tflops=peak_tflops,
        hbm_GBps=hbm_GBps,
        gemm_efficiency=statistics.median(ratios),
        hbm_efficiency=hbm_efficiency,
        attention_fwd_efficiency=rates["fwd"][0],
        attention_bwd_efficiency=rates["bwd"][0],
        attention_half_seq=rates["fwd"][1],
        attention_bwd_half_seq=rates["bwd"][1],
        launch_us=measured["launch_s"] * 1e6,
    )


def _saturating(r1: float, s1: int, r2: float, s2: int, peak: float) -> tuple[float, float]:
    """(plateau as a share of `peak`, s_half) of the curve p s / (s + s_half) through the rates
    r1 at s1 and r2 at s2 (s1 < s2). A rate that grows as fast as the length or faster (the short
    kernel held back by something else) has no such curve through both points: its plateau is
    taken as the peak, and the curve goes through the long length's rate, the one nearest to it."""
    if r2 <= r1:  # flat already: the plateau is reached
        return r2 / peak, 1.0
    half = (r2 - r1) / (r1 / s1 - r2 / s2) if r1 / s1 > r2 / s2 else float("inf")
    plateau = r1 * (s1 + half) / s1
    if plateau > peak:
        return 1.0, max(s2 * (peak / r2 - 1), 1.0)
    return plateau / peak, half


def _attention_flops(measured: dict, seq: int, batch: int) -> float:
    heads, head_dim = measured["attention_shape"]
    return 4 * batch * heads * seq * seq * head_dim


KEYS = (
    "peak_tflops",
    "memory_gib",
    "hbm_GBps",
    "gemm_efficiency",
    "sm_count",
    "hbm_efficiency",
    "attention_fwd_efficiency",
    "attention_bwd_efficiency",
    "attention_half_seq",
    "attention_bwd_half_seq",
    "launch_us",
)  # written to the cluster file


def cluster_text(name: str, preset: str, devices: int, device: Device, measured: dict, stamp: str) -> str:
    """The cluster file: the GPU named in its comments, the measured figures as keys."""
    import torch

    gemms = ", ".join(f"{m}x{n}x{k} {2 * m * n * k / s / 1e12:.0f}" for m, n, k, s in measured["gemm"])
    attention = ", ".join(
        f"s={s} x {b}: fwd {f * 1e3:.3f} ms, fwd+bwd {both * 1e3:.3f} ms" for s, b, f, both in measured["attention"]
    )
    lines = [
        f"# paratrain plan --calibrate: {name} (torch {torch.__version__}), {stamp}",
        f"# GEMMs (m x n x k, TFLOP/s): {gemms}",
        f"# causal sdpa {measured['attention_shape']} (heads, head dim), seq x batch: {attention}",
        f"# device copy: {measured['copy_bytes'] / measured['copy_s'] / 1e9:.0f} GB/s read+written;"
        f" a tiny op's launch: {measured['launch_s'] * 1e6:.1f} us",
        f"# links and latencies: the {preset} preset's (one GPU cannot measure them)",
        "[cluster]",
        "nodes = 1",
        f"devices_per_node = {devices}",
        f'device = "{preset}"',
    ]
    lines += [f"{key} = {getattr(device, key):.6g}" for key in KEYS]
    return "\n".join(lines) + "\n"


def calibrate_gpu(path: str, devices: int | None = None, sizes: Sizes = Sizes(), measure=measure_kernels) -> Cluster:
    """Measures this machine's first CUDA GPU and writes `path` (one node of `devices` of it,
    default every GPU here); ConfigError naming --calibrate without CUDA."""
    from datetime import datetime, timezone

    import torch

    if not torch.cuda.is_available():
        raise ConfigError("--calibrate", "measuring a GPU needs CUDA, and torch sees none here")
    name = torch.cuda.get_device_name(0)
    props = torch.cuda.get_device_properties(0)
    preset = preset_for(name)
    measured = measure("cuda", sizes)
    base = PRESETS[preset or "h100-sxm"]
    # a known GPU: the efficiencies against its data sheet's peak and bandwidth; another: the
    # measured rates are its peak and bandwidth (efficiencies 1), as the cpu preset takes its own
    device = fitted(measured, base, base.peak_tflops, base.hbm_GBps)
    if preset is None:
        device = replace(
            device,
            peak_tflops=base.peak_tflops * device.gemm_efficiency,
            gemm_efficiency=1.0,
            attention_fwd_efficiency=device.attention_fwd_efficiency / device.gemm_efficiency,
            attention_bwd_efficiency=device.attention_bwd_efficiency / device.gemm_efficiency,
            hbm_GBps=base.hbm_GBps * device.hbm_efficiency,
            hbm_efficiency=1.0,
        )
    device = replace(device, memory_gib=props.total_memory / GIB, sm_count=props.multi_processor_count)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = cluster_text(name, preset or "h100-sxm", devices or torch.cuda.device_count(), device, measured, stamp)
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as exc:
        raise ConfigError("--calibrate", f"{path}: {exc.strerror}") from None
    return load_cluster(path)
