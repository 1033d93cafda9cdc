"""`paratrain bench`: ours against the PyTorch peer, side by side in one run."""

from __future__ import annotations

import importlib

from paratrain.bench.common import heading_with_machine

# Each module under bench/ named here adds its sub-command with add_parser(subparsers).
BENCHMARKS = [
    "dp",
    "memory",
    "zero",
    "recovery",
    "ps",
    "suite",
    "pipeline",
    "federated",
    "data",
    "plan_megatron",
    "plan",
    "tax",
    "context",
    "experts",
    "exits",
]


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks: paratrain against its PyTorch peer")
    which = b.add_subparsers(dest="bench", required=True)
    for name in BENCHMARKS:
        before = set(which.choices)
        importlib.import_module(f"{__name__}.{name}").add_parser(which)
        for added in set(which.choices) - before:  # a module's sub-command may be spelt otherwise (plan-megatron)
            parser = which.choices[added]
            parser.set_defaults(func=heading_with_machine(parser.get_default("func")))
