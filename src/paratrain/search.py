"""`paratrain plan --cluster FILE --search [--top K]`: the fastest layouts that fit.

Enumerates, for the config's model and global batch on the cluster's devices: dp x tp x pp (tp
within a node), for pure data parallelism the ZeRO stage (dp, zero1-3), for pipelines the
microbatch count (pp, 2pp, 4pp, 8pp where the batch allows) and the schedule (1f1b, interleaved
with 2 virtual stages), and recompute (none, full). Each candidate goes through the same checks as
`run` (an invalid one is dropped) and the same plan and prediction as `paratrain plan`; those that
do not fit the device's memory are dropped, the rest ranked by predicted step time.
"""

from __future__ import annotations

from itertools import product

from .config import ConfigError, load


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(batch: int, world: int, devices_per_node: int) -> list[list[str]]:
    """--set overrides of every layout to try (before the config's own checks)."""
    out = []
    for tp in [d for d in _divisors(world) if d <= devices_per_node]:
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            if batch % dp:
                continue
            for recompute in ("none", "full"):
                base = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"train.recompute='{recompute}'"]
                if tp == pp == 1:
                    out += [[*base, f"parallel.strategy='{s}'"] for s in ("dp", "zero1", "zero2", "zero3")]
                    continue
                if pp == 1:
                    out.append([*base, "parallel.strategy='hybrid'"])
                    continue
                per_replica = batch // dp
                for m, schedule in product((pp, 2 * pp, 4 * pp, 8 * pp), ("1f1b", "interleaved")):
                    if per_replica % m == 0:
                        out.append(
                            [
                                *base,
                                "parallel.strategy='hybrid'",
                                f"parallel.microbatches={m}",
                                f"parallel.schedule='{schedule}'",
                                "parallel.balance='params'",
                            ]
                        )
    return out


def search(config_path, overrides: list[str], cluster, top: int) -> list[dict]:
    """The `top` fastest layouts that fit, fastest first, as the contract's "layouts" entries (plus
    each one's step breakdown)."""
    import torch

    from .data import build_dataset
    from .models import build_model
    from .plan import make_plan
    from .preflight import preflight

    batch = load(config_path, overrides).data.batch_size
    found = []
    for sets in candidates(batch, cluster.world, cluster.devices_per_node):
        try:
            cfg = load(config_path, [*overrides, *sets])
            preflight(cfg, cluster.world)
            with torch.device("meta"):
                model = build_model(cfg, build_dataset(cfg, "train"))
            plan = make_plan(
                cfg, model, cluster.devices_per_node, cluster.nodes, "cuda" if cluster.is_gpu else "cpu", cluster
            )
        except ConfigError:
            continue
        if plan["predicted"] is None or not plan["capacity"]["fits"]:
            continue
        p = cfg.parallel
        found.append(
            {
                "parallel": {
                    "strategy": p.strategy,
                    "tp": p.tp,
                    "pp": p.pp,
                    "microbatches": p.microbatches,
                    "schedule": p.schedule,
                    "virtual_stages": p.virtual_stages,
                },
                "train": {"recompute": cfg.train.recompute},
                "predicted": plan["predicted"],
                "step_breakdown": plan["step_breakdown"],
            }
        )
    found.sort(key=lambda x: x["predicted"]["step_s"])
    return found[:top]


def _name(layout: dict) -> str:
    p = layout["parallel"]
    name = p["strategy"] if p["strategy"] != "hybrid" else f"tp {p['tp']} x pp {p['pp']}"
    if p["pp"] > 1:
        name += f", {p['microbatches']} mb {p['schedule']}"
    return name + (", recompute" if layout["train"]["recompute"] == "full" else "")


def render_search(layouts: list[dict]) -> list[str]:
    if not layouts:
        return ["search: no layout fits"]
    lines = [
        f"search: the {len(layouts)} fastest layouts that fit",
        f"{'layout':<44}{'step s':>9}{'MFU':>7}{'bubble s':>10}{'exposed comm s':>16}{'headroom GiB':>14}",
    ]
    for x in layouts:
        b = x["step_breakdown"]
        comm = b["tp_comm_s"] + b["p2p_s"] + b["exposed_dp_comm_s"]
        lines.append(
            f"{_name(x):<44}{x['predicted']['step_s']:>9.4g}{x['predicted']['mfu']:>7.1%}"
            f"{b['bubble_s']:>10.3g}{comm:>16.3g}{b['memory_headroom_gib']:>14.3g}"
        )
    if len(layouts) > 1:
        win, second = layouts[0]["step_breakdown"], layouts[1]["step_breakdown"]
        parts = [k for k in win if k.endswith("_s")]
        gap = max(parts, key=lambda k: second[k] - win[k])
        lines.append(
            f"why: {_name(layouts[0])} beats {_name(layouts[1])} most on "
            f"{gap[:-2].replace('_', ' ')} ({win[gap]:.3g} s against {second[gap]:.3g} s)"
        )
    return lines
