"""`paratrain bench`: ours against the PyTorch peer, side by side in one run."""
from __future__ import annotations


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks: paratrain against its PyTorch peer")
    which = b.add_subparsers(dest="bench", required=True)
    from . import dp

    dp.add_parser(which)
