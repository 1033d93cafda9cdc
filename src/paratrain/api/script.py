"""`paratrain launch [--nproc N] [--nnodes ...] [--max-restarts K] script.py [ARGS]`: the user's
own-loop script on every worker, through the elastic agent as `paratrain run` starts its workers
(loopback-only locally; --nnodes/--node-rank/--rdzv from a cluster scheduler's environment).

Each worker runs the script as `python script.py ARGS` would (its folder first on sys.path,
__name__ == "__main__"), forked from the worker server that has imported torch once. The script's
pt = paratrain.init(...) reads the torchrun environment the agent gives it; after a failure with
--max-restarts K, the agent starts the whole group again and the script resumes itself (pt.load).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import tempfile
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record


@record
def run_script(path: str, *argv: str) -> None:
    """A worker: the script, as `python path argv...` runs it."""
    from paratrain.runtime.launch import prepare_forked_worker

    prepare_forked_worker(f"paratrain-r{os.environ.get('RANK', '?')}")
    # the worker server ignores them; a script stops on them as under plain python
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = [path, *argv]
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        # sys.exit() is success, as under python; raised on, a code of None left the agent
        # waiting for a return value that never came (torch's record passes only a 0 as one)
        if exc.code not in (None, 0):
            raise


def launch_script(args) -> None:
    """Start args.nproc x args.nnodes workers of args.script (WorkerFailure, Interrupted as launch)."""
    from paratrain.errors import note
    from paratrain.runtime.launch import launch, start_worker_server

    start_worker_server(preload=("paratrain",))  # what a script imports: the API, torch and the trainer's stack
    # the script picks its run directory, which the launcher does not know
    agent_log = Path(tempfile.gettempdir()) / f"paratrain-launch-{Path(args.script).stem}-{os.getpid()}.log"
    launch(
        run_script,
        [str(Path(args.script).resolve()), *args.script_args],
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv=args.rdzv,
        max_restarts=args.max_restarts,
        run_id=Path(args.script).stem,
        agent_log=agent_log,
    )
    if agent_log.exists():  # it logged a warning, as for a failed worker it restarted (--max-restarts)
        note(f"the elastic agent's log of this run: {agent_log}")
