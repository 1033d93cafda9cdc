"""Per-rank memory of dp and zero1/2/3 through `paratrain run`, beside PyTorch FSDP2 (`fully_shard`).

Each of ours is a whole `paratrain run` (its final export included) in fresh processes, so one
configuration's peak cannot hide in another's high-water mark. Every 50 ms the bench reads each
worker's resident memory (VmRSS) and high-water mark (VmHWM) from /proc: a worker's training peak is
its high-water mark when the last step's metrics appear (evaluation included; the sample before may
be up to 50 ms into the export), its export peak the largest resident memory sampled after, and its
whole-run peak its last high-water mark. FSDP2 is no paratrain strategy: it runs the same steps in
workers of its own, and has no export.

The model: the built-in MLP, or `--model module:function`, a user's factory (called with no
arguments; its model takes (batch, --in-features) inputs and returns logits over 10 classes),
materialised by zero1/2/3 as a training run does: its construction recorded on the meta device and
replayed a tensor at a time (models/materialize.py); FSDP2 runs each module's reset_parameters on
its shards. Data: `synthetic` inputs, AdamW.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.bench.common import COUNT, POSITIVE, add_json_option, one_or_more_of
from paratrain.errors import error, say
from paratrain.runtime.machine import emit_json

STRATEGIES = ["dp", "zero1", "zero2", "zero3", "fsdp2"]
SAMPLE_S = 0.05
MB = 2**20

CONFIG = """
[model]
factory = "{factory}"
{model_keys}
[data]
factory = "synthetic"
in_features = {in_features}
n_samples = {samples}
batch_size = {global_batch}
shuffle = false
[train]
optimizer = "adamw"
lr = 1e-4
steps = {steps}
log_every = 1
precision = "{precision}"
[parallel]
strategy = "{strategy}"
bucket_mb = {bucket_mb}
"""


def add_parser(which) -> None:
    p = which.add_parser("memory", help="per-rank memory through `paratrain run`: dp vs zero1/2/3 vs torch FSDP2")
    add_model_options(p)
    p.add_argument("--worlds", type=one_or_more_of(COUNT), default="2,4", help="comma-separated world sizes")
    p.add_argument("--strategies", type=one_or_more_of(STRATEGIES), default=",".join(STRATEGIES))
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="train.precision of our runs")
    add_json_option(p)
    p.set_defaults(func=run)


def add_model_options(p) -> None:
    p.add_argument(
        "--model",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a user's model factory (no arguments) instead of the built-in MLP",
    )
    p.add_argument("--in-features", type=COUNT, default=1024)
    p.add_argument("--hidden", type=COUNT, default=4096)
    p.add_argument("--layers", type=COUNT, default=4, help="hidden layers of the MLP (default: 54.6M parameters)")
    p.add_argument("--batch", type=COUNT, default=8, help="samples per rank")
    p.add_argument("--steps", type=COUNT, default=3, help="AdamW steps before the export")
    p.add_argument("--bucket-mb", type=POSITIVE, default=25.0)
    p.add_argument(
        "--pretrained",
        action="store_true",
        help="start from saved weights (model.pretrained, a folder of model.safetensors): the loading's peak counts",
    )


def run(args) -> int:
    from paratrain.errors import ConfigError
    from paratrain.resolve import resolve_callable

    if args.model:
        try:
            resolve_callable(args.model, "--model")
        except ConfigError as exc:
            error(f"{exc}")
            return 2
    results = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for strategy in args.strategies.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                measure = measure_fsdp2 if strategy == "fsdp2" else measure_run
                result = measure(strategy, world, args, Path(tmp))
            if result is None:
                return 1
            results.append(result)
            say(f"  measured {strategy} at world {world}")
    print_table(results)
    emit_json(results, args.json)
    return 0


def saved_weights(args, folder: Path) -> Path:
    """The model's initial weights as a fine-tuning run finds them: folder/model.safetensors, keyed
    like its state_dict (a paratrain final/ or a save_pretrained's weights). Made in this process:
    the bench's own memory is not the workers'."""
    from safetensors.torch import save_file

    from paratrain.models.mlp import mlp
    from paratrain.resolve import resolve_callable

    model = (
        resolve_callable(args.model, "--model")()
        if args.model
        else mlp(args.in_features, hidden=args.hidden, n_layers=args.layers, out_features=10)
    )
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def measure_run(strategy: str, world: int, args, tmp: Path) -> dict | None:
    """`paratrain run` of the model under `strategy`, its workers' memory sampled as it goes."""
    model_keys = (
        ""
        if args.model
        else f"hidden = {args.hidden}\nn_layers = {args.layers}\nout_features = 10"  # in_features: the data's
    )
    if getattr(args, "pretrained", False):
        model_keys += f'\npretrained = "{saved_weights(args, tmp / "start")}"'
    config = tmp / "job.toml"
    config.write_text(
        CONFIG.format(
            factory=args.model or "mlp",
            model_keys=model_keys,
            in_features=args.in_features,
            samples=args.batch * world * args.steps,
            global_batch=args.batch * world,
            steps=args.steps,
            precision=args.precision,
            strategy=strategy,
            bucket_mb=args.bucket_mb,
        )
    )
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "paratrain.cli", "run", str(config), f"--nproc={world}", f"--run-dir={run_dir}"]
    with open(tmp / "output.txt", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        trained, exported, peak = sample_workers(proc, world, run_dir / "metrics.jsonl", args.steps)
    if proc.returncode != 0:
        tail = (tmp / "output.txt").read_text().strip().splitlines()[-5:]
        error(f"{strategy} at world {world} failed (exit {proc.returncode}): " + " | ".join(tail))
        return None
    manifest = json.loads((run_dir / "final" / "manifest.json").read_text())
    return {
        **common_fields(strategy, world, args, manifest["parameters"]),
        "precision": args.precision,
        "train_peak_rss_bytes": trained,
        "export_peak_rss_bytes": exported,
        "peak_rss_bytes": peak,
    }


def sample_workers(proc: subprocess.Popen, world: int, metrics: Path, steps: int) -> tuple[list, list, list]:
    """Until `proc` ends, every SAMPLE_S: each worker's (named paratrain-rN) VmRSS and VmHWM. Per
    rank: the high-water mark when step `steps` was logged, the largest RSS after, the last
    high-water mark."""
    pids: dict[int, int] = {}  # rank -> pid
    hwm, export_rss, trained = [0] * world, [0] * world, None
    while proc.poll() is None:
        if trained is None and last_logged_step(metrics) >= steps:
            trained = list(hwm)
        if len(pids) < world:
            pids.update(find_workers(proc.pid))
        for rank, pid in pids.items():
            rss, high = read_status(pid)
            hwm[rank] = max(hwm[rank], high)
            if trained is not None:
                export_rss[rank] = max(export_rss[rank], rss)
        time.sleep(SAMPLE_S)
    return trained or list(hwm), export_rss, hwm


def last_logged_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    return json.loads(lines[-1]).get("step", 0) if lines else 0


def find_workers(root: int) -> dict[int, int]:
    """{rank: pid} of the workers under `root` (they name themselves paratrain-rN)."""
    parent, found = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                name = (entry / "comm").read_text().strip()
            except (OSError, ValueError, IndexError):
                continue
            if name.startswith("paratrain-r") and name[11:].isdigit():
                found[int(entry.name)] = int(name[11:])

    def under_root(pid: int) -> bool:
        while pid in parent and pid != root:
            pid = parent[pid]
        return pid == root

    return {rank: pid for pid, rank in found.items() if under_root(pid)}


def read_status(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of process `pid` in bytes; zeros once it is gone."""
    values = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values.get("VmRSS", 0), values.get("VmHWM", 0)


def common_fields(strategy: str, world: int, args, parameters: int) -> dict:
    return {
        "strategy": strategy,
        "world": world,
        "model": args.model or "MLP",
        "parameters": parameters,
        "batch": args.batch,
        "bucket_mb": args.bucket_mb,
    }


def measure_fsdp2(strategy: str, world: int, args, tmp: Path) -> dict | None:
    """FSDP2's steps in workers of its own (no export): each worker's peak RSS at the end."""
    from paratrain.runtime.launch import launch
    from paratrain.runtime.worker_failure import WorkerFailure

    out = tmp / "result.json"
    argv = [f"--out={out}"] + [
        f"--{dest.replace('_', '-')}={getattr(args, dest)}"
        for dest in ("in_features", "hidden", "layers", "batch", "steps", "bucket_mb", "model")
        if getattr(args, dest) is not None
    ]
    try:
        launch("paratrain.bench.memory", argv, nproc=world, run_id=f"bench-memory-fsdp2-{world}")
    except WorkerFailure as exc:
        error(f"fsdp2 at world {world} failed: {exc}")
        return None
    return json.loads(out.read_text())


def print_table(results: list[dict]) -> None:
    r0 = results[0]
    capability = torch.backends.cpu.get_cpu_capability()
    print(
        f"memory benchmark: {r0['parameters'] / 1e6:.1f}M-parameter {r0['model']}, AdamW, {r0['batch']} samples/rank, "
        f"bucket {r0['bucket_mb']:g} MB; per-rank peak RSS in MB (max over ranks), sampled every "
        f"{SAMPLE_S * 1000:.0f} ms; CPU capability {capability}"
    )
    print(f"{'world':>5} {'strategy':<9}{'precision':>10}{'training':>10}{'export':>10}{'whole run':>11}{'vs dp':>9}")
    for r in results:
        dp = next((x for x in results if x["world"] == r["world"] and x["strategy"] == "dp"), None)
        export = max(r["export_peak_rss_bytes"]) / MB if r.get("export_peak_rss_bytes") else None
        saved = f"{(max(r['peak_rss_bytes']) - max(dp['peak_rss_bytes'])) / MB:>+9.1f}" if dp else f"{'':>9}"
        print(
            f"{r['world']:>5} {r['strategy']:<9}{r.get('precision', 'fp32'):>10}"
            f"{max(r['train_peak_rss_bytes']) / MB:>10.1f}{f'{export:.1f}' if export else '-':>10}"
            f"{max(r['peak_rss_bytes']) / MB:>11.1f}{saved}"
        )


# -- FSDP2's worker ---------------------------------------------------------------------------------
def rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process, from /proc (kB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def build_model(args):
    """The model on the meta device, as FSDP2's documentation builds it."""
    from paratrain.models.mlp import mlp
    from paratrain.resolve import resolve_callable

    torch.manual_seed(0)
    with torch.device("meta"):
        if args.model:
            return resolve_callable(args.model, "--model")()
        return mlp(in_features=args.in_features, hidden=args.hidden, n_layers=args.layers, out_features=10)


def fsdp2(args, step_args) -> int:
    """FSDP2 as its documentation recommends: meta build, fully_shard every Linear and the root,
    to_empty, then each module's reset_parameters on its shards; the steps. Its parameters."""
    from torch.distributed.fsdp import fully_shard

    from paratrain.optim import cross_entropy

    model = build_model(args)
    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = step_args
    for _ in range(args.steps):
        cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()  # set_to_none: FSDP2 frees its sharded gradients
    return sum(p.numel() for p in model.parameters())  # global (DTensor) sizes


def worker(argv=None) -> None:
    from paratrain.runtime import process

    p = argparse.ArgumentParser()
    add_model_options(p)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rt = process.init("cpu")
    g = torch.Generator().manual_seed(1 + rt.rank)
    step_args = (
        torch.randn(args.batch, args.in_features, generator=g),
        torch.randint(0, 10, (args.batch,), generator=g),
    )
    n_params = fsdp2(args, step_args)
    peaks = [torch.zeros(1, dtype=torch.float64) for _ in range(rt.world_size)]
    dist.all_gather(peaks, torch.tensor([float(rss_bytes("VmHWM"))], dtype=torch.float64))
    if rt.is_main:
        peak = [int(t.item()) for t in peaks]
        fields = common_fields("fsdp2", rt.world_size, args, n_params)
        result = {**fields, "precision": "fp32", "train_peak_rss_bytes": peak, "export_peak_rss_bytes": None}
        Path(args.out).write_text(json.dumps({**result, "peak_rss_bytes": peak}))
    process.shutdown(together=True)


if __name__ == "__main__":
    from paratrain.runtime import process

    worker()
    process.leave()
