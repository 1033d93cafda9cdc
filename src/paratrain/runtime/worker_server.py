"""The worker server's preload (see launch.py): what every worker needs, imported once, before
the server forks any worker; and a quick exit for the server itself.

Only the server imports this module. Its workers leave through os._exit when their function
returns, never through the exit handlers, so the handler below is the server's alone.
"""

import atexit
import os
import signal

from paratrain.runtime.launch import LAUNCHER_PID, die_with_parent

# A SIGKILLed launcher (an OOM killer, a scheduler) must not leave the server and its workers
# training on: each dies with its parent, the server with the launcher and each worker with the server.
# Set before the imports below, which take seconds, during which the launcher may die already.
die_with_parent(signal.SIGKILL, int(os.environ.get(LAUNCHER_PID, os.getppid())))
SERVER_PID = os.getpid()
_serving = True  # false in the workers: what they fork themselves (guard.py, data loaders) is theirs


def _die_with_server() -> None:
    global _serving
    if _serving:
        _serving = False
        die_with_parent(signal.SIGKILL, SERVER_PID)


os.register_at_fork(after_in_child=_die_with_server)

import torch._dynamo  # noqa: E402,F401  imported by torch.optim's step on its first call (~1 s)

# What the workers run (the trainer, the Python API) the server imports next, as its launcher named
# them (launch.start_worker_server's preload).

# The server is done when the command that started it is: skip the interpreter's teardown of
# torch (about a second), which the caller would otherwise wait for on the server's output pipes.
atexit.register(os._exit, 0)

# A SIGTERM sent to the whole process group (a scheduler stopping the job) must not take the server
# down before the workers it forked: the agent tracks them through the server's pipes, takes a
# vanished server for dead workers and leaves at once, while the workers are still saving their
# checkpoint (fault/stop.py). The server leaves anyway when the command does (its pipe closes).
# Workers forked from it put the default back first thing (trainer.run_worker).
signal.signal(signal.SIGTERM, signal.SIG_IGN)
