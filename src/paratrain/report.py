"""`paratrain report RUN_DIR`: plots and a markdown summary of a run directory.

Reads metrics.jsonl (loss, validation, throughput), profile.jsonl (per-rank time breakdown and
bytes) and trace.json (the timeline); writes RUN_DIR/report/:
    loss.png         training and validation loss against step
    throughput.png   samples/s against step
    breakdown.png    per rank: mean time per step by phase (stacked), bytes sent per step vs the minimum
    timeline.png     the last traced steps, one row per rank (the pipeline timeline when pp > 1)
    report.md        the numbers behind the plots
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import tomllib

from paratrain.metrics import read_jsonl
from paratrain.profile import PHASES

PHASE_ORDER = (*PHASES, "other")
PHASE_COLORS = {
    "data": "#8c8c8c",
    "forward": "#4c72b0",
    "backward": "#55a868",
    "compress": "#8172b2",
    "comm": "#c44e52",
    "optimizer": "#dd8452",
    "idle": "#f2f2f2",
    "other": "#ccb974",
}
TIMELINE_STEPS = 3


class NotARun(ValueError):
    pass


def load_run(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NotARun(f"{run_dir} is not a directory")
    missing = [name for name in ("config.toml", "metrics.jsonl") if not (run_dir / name).is_file()]
    if missing:
        raise NotARun(f"{run_dir} is not a paratrain run directory (no {' or '.join(missing)})")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    if not metrics:
        raise NotARun(f"{run_dir}/metrics.jsonl has no logged step yet")
    trace = []
    if (run_dir / "trace.json").is_file():
        text = (run_dir / "trace.json").read_text().rstrip()
        trace = json.loads(text if text.endswith("]") else text.rstrip(",") + "]")  # a crashed run leaves it open
    return {
        "dir": run_dir,
        "config": tomllib.loads((run_dir / "config.toml").read_text()),
        "metrics": metrics,
        "profile": read_jsonl(run_dir / "profile.jsonl"),
        "trace": trace,
    }


# -- numbers --------------------------------------------------------------------------------------
def world_of(record: dict) -> int:
    return record.get("world", len(record["ranks"]))  # records written before they carried it


def latest_world(profile: list[dict]) -> list[dict]:
    """The records of the world size the run ended at. A run resumed at another world size keeps
    the records of the steps before its checkpoint, which describe other ranks; a parameter server
    run whose worker left keeps its world size but lists fewer ranks."""
    start = len(profile)
    while start and world_of(profile[start - 1]) == world_of(profile[-1]):
        start -= 1
    return profile[start:]


def per_rank_breakdown(profile: list[dict]) -> list[dict]:
    """Per rank of the latest world size: mean seconds per step by phase, and mean bytes per step,
    over the steps it took part in (skipping the first: warm-up)."""
    records = latest_world(profile)
    records = records[1:] or records
    rows_of: dict[int, list[dict]] = {}
    for record in records:
        for row in record["ranks"]:
            rows_of.setdefault(row["rank"], []).append(row)
    out = []
    for rank, rows in sorted(rows_of.items()):
        phases = {p: statistics.fmean(row["phases"].get(p, 0.0) for row in rows) for p in PHASE_ORDER}
        ops = sorted({op for row in rows for op in row["comm"]})
        comm = {
            op: {
                k: statistics.fmean(row["comm"].get(op, {}).get(k, 0) for row in rows) for k in ("payload", "min_sent")
            }
            for op in ops
        }
        entry = {
            "rank": rank,
            "steps": len(rows),
            "step_s": statistics.fmean(row["step_s"] for row in rows),
            "phases": phases,
            "comm": comm,
            "bytes_min": statistics.fmean(row["bytes_min"] for row in rows),
        }
        if all("bytes_sent" in row for row in rows):
            entry["bytes_sent"] = statistics.fmean(row["bytes_sent"] for row in rows)
        out.append(entry)
    return out


# -- plots ----------------------------------------------------------------------------------------
def _figure(width=7.5, height=4.2, **kw):
    from paratrain.extras import require

    require("matplotlib", "report's plots")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(width, height), **kw)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(metrics: list[dict], name: str, path: Path) -> Path:
    plt, fig, ax = _figure()
    train = [(m["step"], m["loss"]) for m in metrics if "loss" in m]
    val = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]
    ax.plot(*zip(*train), marker="o", ms=3, label="training loss (mean since last log)")
    if val:
        ax.plot(*zip(*val), marker="s", ms=6, ls="--", label="validation loss")
    acc = [(m["step"], m["val_acc"]) for m in metrics if "val_acc" in m]
    if acc:
        ax.set_title(f"{name}: loss (final validation accuracy {acc[-1][1]:.1%})")
    else:
        ax.set_title(f"{name}: loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_throughput(metrics: list[dict], name: str, path: Path) -> Path:
    plt, fig, ax = _figure()
    points = [(m["step"], m["samples_per_s"]) for m in metrics if "samples_per_s" in m]
    ax.plot(*zip(*points), marker="o", ms=3, color="#4c72b0")
    ax.set_title(f"{name}: throughput (median {statistics.median(v for _, v in points):,.0f} samples/s)")
    ax.set_xlabel("step")
    ax.set_ylabel("samples / s (all ranks)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def plot_breakdown(ranks: list[dict], name: str, path: Path) -> Path:
    plt, fig, (ax, bx) = _figure(11, 4.5, ncols=2, gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"rank {r['rank']}" for r in ranks]
    bottom = [0.0] * len(ranks)
    for phase in PHASE_ORDER:
        ms = [r["phases"][phase] * 1e3 for r in ranks]
        if any(v > 0 for v in ms):
            ax.bar(labels, ms, bottom=bottom, label=phase, color=PHASE_COLORS[phase], edgecolor="#555555", lw=0.4)
            bottom = [b + v for b, v in zip(bottom, ms)]
    ax.set_ylabel("mean time per step (ms)")
    ax.set_title(f"{name}: where a step's time goes")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9, title="phase")

    width = 0.38
    xs = range(len(ranks))
    measured = all("bytes_sent" in r for r in ranks)
    top = max(max(r["bytes_min"], r.get("bytes_sent", 0)) for r in ranks)
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if top >= s), ("bytes", 1))
    bx.bar(
        [x - width / 2 for x in xs],
        [r["bytes_min"] / scale for r in ranks],
        width,
        label="theoretical minimum",
        color="#8172b2",
    )
    if measured:
        bx.bar(
            [x + width / 2 for x in xs],
            [r["bytes_sent"] / scale for r in ranks],
            width,
            label="measured (socket writes)",
            color="#c44e52",
        )
    bx.set_xticks(list(xs), labels)
    if top:
        bx.set_ylim(0, top / scale * 1.3)  # room for the legend above the bars
    else:  # a single rank: nothing to send
        bx.set_ylim(0, 1)
        bx.text(0.5, 0.5, "no communication", ha="center", va="center", transform=bx.transAxes)
    bx.set_ylabel(f"{unit} sent per step")
    bx.set_title("bytes each rank sent per step")
    bx.legend(fontsize=9)
    return _save(plt, fig, path)


def plot_timeline(trace: list[dict], pp: int, name: str, path: Path) -> Path | None:
    spans = [e for e in trace if e.get("ph") == "X"]
    steps = sorted({e["args"]["step"] for e in spans})
    if not steps:
        return None
    shown = set(steps[-TIMELINE_STEPS:])
    spans = [e for e in spans if e["args"]["step"] in shown]
    t0 = min(e["ts"] for e in spans)
    ranks = sorted({e["pid"] for e in spans})
    plt, fig, ax = _figure(11, 1.2 + 0.7 * len(ranks))
    min_label_ms = (max(e["ts"] + e["dur"] for e in spans) - t0) / 1e3 / 80  # narrower: no room for text
    seen = set()
    for e in sorted(spans, key=lambda e: (e["cat"] != "step", -e["dur"])):  # outer spans first, nested on top
        y = ranks.index(e["pid"])
        x, w = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        if e["cat"] == "step":
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolor="white", edgecolor="black", lw=0.8)
            continue
        label = e["name"] if e["name"] not in seen else None
        seen.add(e["name"])
        ax.broken_barh([(x, w)], (y - 0.3, 0.6), facecolor=PHASE_COLORS[e["name"]], label=label)
        if "index" in e["args"] and w >= min_label_ms:
            ax.text(x + w / 2, y, str(e["args"]["index"]), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms) from the start of step " + str(min(shown)))
    kind = "pipeline timeline" if pp > 1 else "timeline"
    ax.set_title(f"{name}: {kind} of steps {min(shown)}-{max(shown)} (white = step outside any phase)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9, title="phase")
    return _save(plt, fig, path)


# -- the whole report -----------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def _resumed_note(profile: list[dict]) -> list[str]:
    kept = latest_world(profile) if profile else []
    if len(kept) == len(profile):
        return []
    return [
        "",
        f"Resumed at another world size: steps {kept[0]['step']}-{kept[-1]['step']} ran at world size "
        f"{world_of(kept[-1])}; the per-rank tables and the breakdown plot leave out the {len(profile) - len(kept)} "
        f"steps before.",
    ]


def write_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    run = load_run(run_dir)
    out = Path(out_dir or Path(run_dir) / "report")
    out.mkdir(parents=True, exist_ok=True)
    cfg, metrics, profile = run["config"], run["metrics"], run["profile"]
    name = cfg.get("name", Path(run_dir).name)
    par = cfg.get("parallel", {})
    images = [plot_loss(metrics, name, out / "loss.png"), plot_throughput(metrics, name, out / "throughput.png")]
    ranks = per_rank_breakdown(profile) if profile else []
    world = world_of(profile[-1]) if profile else None
    if ranks:
        images.append(plot_breakdown(ranks, name, out / "breakdown.png"))
    timeline = plot_timeline(run["trace"], par.get("pp", 1), name, out / "timeline.png")
    if timeline:
        images.append(timeline)

    last = metrics[-1]
    lines = [
        f"# Run report: {name}",
        "",
        f"Run directory `{run['dir']}`: strategy `{par.get('strategy', 'dp')}`, "
        f"compression `{par.get('compression', 'none')}`, "
        f"{world or '?'} ranks, {last['step']} steps, global batch {cfg.get('data', {}).get('batch_size')}.",
        *_resumed_note(profile),
        "",
        "| final | value |",
        "|---|---:|",
        f"| training loss | {last.get('loss', float('nan')):.4f} |",
    ]
    for key in ("val_loss", "val_acc"):
        vals = [m[key] for m in metrics if key in m]
        if vals:
            lines.append(f"| {key.replace('_', ' ')} | {vals[-1]:.4f} |")
    sps = [m["samples_per_s"] for m in metrics if "samples_per_s" in m]
    lines += [f"| median samples/s | {statistics.median(sps):,.1f} |", ""]
    if ranks:
        lines += [
            "## Time per step by rank (ms, mean over the steps it took part in, after the first)",
            "",
            "| rank | steps | step | " + " | ".join(PHASE_ORDER) + " |",
            "|---:|---:|---:|" + "---:|" * len(PHASE_ORDER),
        ]
        for r in ranks:
            lines.append(
                f"| {r['rank']} | {r['steps']} | {r['step_s'] * 1e3:.2f} | "
                + " | ".join(f"{r['phases'][p] * 1e3:.2f}" for p in PHASE_ORDER)
                + " |"
            )
        comm_share = statistics.fmean(r["phases"]["comm"] / r["step_s"] for r in ranks if r["step_s"] > 0)
        lines += [
            "",
            f"Exposed communication (time blocked on collectives): {comm_share:.1%} of a step.",
            "",
            "## Bytes per step by rank (MiB)",
            "",
            "`payload` is what was handed to the collective, `minimum` the fewest bytes the rank must "
            "send for it (ring all-reduce 2(N-1)/N of the buffer), `measured` the socket writes of the "
            "process during the step (gloo on Linux).",
            "",
            "| rank | collective | payload | minimum sent |",
            "|---:|---|---:|---:|",
        ]
        for r in ranks:
            for op, c in r["comm"].items():
                lines.append(f"| {r['rank']} | {op} | {_mib(c['payload'])} | {_mib(c['min_sent'])} |")
        lines += ["", "| rank | minimum sent | measured sent | measured / minimum |", "|---:|---:|---:|---:|"]
        for r in ranks:
            sent = r.get("bytes_sent")
            ratio = f"{sent / r['bytes_min']:.2f}" if sent is not None and r["bytes_min"] else "-"
            lines.append(
                f"| {r['rank']} | {_mib(r['bytes_min'])} | {_mib(sent) if sent is not None else '-'} | {ratio} |"
            )
    else:
        lines += ["(no profile.jsonl: no per-rank breakdown)"]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in images]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
