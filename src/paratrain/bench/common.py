"""What every `paratrain bench X` shares: start its worker module on N processes with the options
the user gave, through the same elastic launch as training."""
from __future__ import annotations

import argparse
import sys


def relaunch(module: str, args, add_options, nproc: int, run_id: str) -> int:
    """`python -m module` on `nproc` workers, passing on every option `add_options` defines."""
    from ..launch import WorkerFailure, launch

    probe = argparse.ArgumentParser(add_help=False)
    add_options(probe)
    argv = []
    for dest in vars(probe.parse_args([])):
        value, flag = getattr(args, dest, None), "--" + dest.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv.append(f"{flag}={value}")
    try:
        launch(module, argv, nproc=nproc, run_id=run_id)
    except WorkerFailure as exc:
        print(f"paratrain: error: benchmark failed: {exc}", file=sys.stderr)
        return 1
    return 0
