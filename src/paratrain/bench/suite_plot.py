"""The figure of `paratrain bench suite`: one panel per measurement of its result dict (step time
ours beside torch's, speed-up at equal loss, scaling, bus bandwidth). matplotlib is imported only
when a figure is drawn."""

from __future__ import annotations

from pathlib import Path


def plot(r: dict, path: Path) -> None:
    from paratrain.extras import require

    require("matplotlib", "the benchmark's plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ["step"] + (["equal"] if r.get("equal_loss") else []) + (["scaling"] if r.get("scaling") else []) + ["bus"]
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(4 + 4 * len(panels), 4.8),
        gridspec_kw={"width_ratios": [3 if p == "step" else 2 for p in panels]},
    )
    ax = dict(zip(panels, axes))
    labels, ours, peers = [], [], []
    for name, peer in r["pairs"]:
        labels.append(name.replace("paratrain ", ""))
        ours.append(r["contenders"][name]["step_ms"])
        t = r["contenders"].get(peer) if peer else None
        peers.append(t["step_ms"] if t and "error" not in t else 0.0)
    xs = range(len(labels))
    sx = ax["step"]
    sx.bar([x - 0.2 for x in xs], ours, 0.4, label="paratrain", color="#4c72b0")
    sx.bar([x + 0.2 for x in xs], peers, 0.4, label="torch DDP (+ equivalent hook)", color="#dd8452")
    for x, p in zip(xs, peers):
        if not p:
            sx.text(x + 0.2, 0, "n/a", ha="center", va="bottom", fontsize=8)
    floor = r["contenders"]["compute only"]["step_ms"]
    sx.axhline(floor, color="black", ls="--", lw=1, label="compute only (no communication)")
    sx.set_xticks(list(xs), labels)
    sx.set_ylabel("median step time (ms)")
    sx.set_title(f"(a, b) step time, {r['world_size']} processes, {r['setting'].split(' (')[0]}")
    sx.legend()
    if "equal" in panels:
        eq, base = r["equal_loss"], r["contenders"]["paratrain dp"]["step_ms"]
        names = list(eq["contenders"])
        ex = range(len(names))
        per_step = [base / r["contenders"][n]["step_ms"] for n in names]
        at_loss = [eq["contenders"][n]["speedup_at_equal_loss"] or 0.0 for n in names]
        qx = ax["equal"]
        qx.bar([x - 0.2 for x in ex], per_step, 0.4, label="per step", color="#4c72b0")
        qx.bar(
            [x + 0.2 for x in ex],
            at_loss,
            0.4,
            label=f"in time to dp's loss after {eq['dp_steps']} steps",
            color="#55a868",
        )
        for x, n in zip(ex, names):
            steps = eq["contenders"][n]["steps"]
            qx.text(
                x + 0.2,
                0,
                f"{steps} steps" if steps else "not reached",
                ha="center",
                va="bottom",
                fontsize=7,
                rotation=90,
                color="white" if steps else "black",
            )
        qx.axhline(1.0, color="black", ls="--", lw=1, label="uncompressed dp")
        qx.set_xticks(list(ex), [n.replace("paratrain ", "") for n in names])
        qx.set_ylabel("speed-up over paratrain dp")
        qx.set_title("(b) compression: per step and at equal loss")
        qx.set_ylim(0, 1.45 * max(per_step + at_loss + [1.0]))  # room above the bars for the legend
        qx.legend(fontsize=8, loc="upper left")
    if "scaling" in panels:
        cx = ax["scaling"]
        for name in r["scaling"][0]["contenders"]:
            pts = [(row["world_size"], row["contenders"][name]["samples_per_s"]) for row in r["scaling"]]
            cx.plot(*zip(*pts), marker="o", label=name)
        cx.set_xticks([row["world_size"] for row in r["scaling"]])
        cx.set_xlabel("processes")
        cx.set_ylabel("samples / s")
        cx.set_title("(c) scaling (one thread per process)")
        cx.legend(fontsize=8)
        cx.set_ylim(bottom=0)
    bx = ax["bus"]
    bw = r["bus_bandwidth"]
    bx.plot([b["mib"] for b in bw], [b["busbw_gbps"] for b in bw], marker="o", color="#c44e52")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("all-reduce size (MiB)")
    bx.set_ylabel("bus bandwidth (GB/s)")
    bx.set_title("(d) all-reduce bus bandwidth")
    bx.set_ylim(bottom=0)
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
