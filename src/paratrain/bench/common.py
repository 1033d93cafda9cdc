"""What every `paratrain bench X` shares: start its worker module on N processes with the options
the user gave, through the same elastic launch as training."""
from __future__ import annotations

import argparse
import json
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


def add_json_option(p) -> None:
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="also write the results as JSON (to stdout without PATH)")


def emit_json(result, dest: str | None) -> None:
    """The `--json` output: stdout for "-", else the file `dest`; nothing without the option."""
    if dest == "-":
        print(json.dumps(result))
    elif dest:
        with open(dest, "w") as fh:
            json.dump(result, fh, indent=1)
