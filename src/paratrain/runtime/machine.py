"""The machine a figure was measured on, and the `--json` writer that records it with the figures
(benchmarks and `paratrain plan` alike): a figure holds for that machine only."""

from __future__ import annotations

import json
import os

import torch


def cpu_multiplies_bf16_natively() -> bool:
    """AVX512-BF16 or AMX: the CPU instructions that make a bf16 matrix product faster than fp32.
    Decided from the CPU's flags (as torch reads them), not measured: a timing taken while other
    processes load the machine could pick differently on every rank."""
    flags = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(flag is not None and flag() for flag in flags)


def machine() -> dict:
    """What a figure was measured on, recorded with every bench table (a figure holds for that
    machine only): the CPU model, torch's CPU capability and whether the CPU multiplies bf16
    natively (paratrain's PowerSGD picks its arithmetic by it), torch's version, and the GPU if any."""
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    return {
        "cpu": model,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bf16": cpu_multiplies_bf16_natively(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def emit_json(result, dest: str | None) -> None:
    """The `--json` output: stdout for "-", else the file `dest`; nothing without the option. The
    machine goes with the figures: into the result, or into each row of a list of results."""
    if not dest:
        return
    m = machine()
    result = [{**row, "machine": m} for row in result] if isinstance(result, list) else {**result, "machine": m}
    if dest == "-":
        print(json.dumps(result))
    else:
        with open(dest, "w") as fh:
            json.dump(result, fh, indent=1)
