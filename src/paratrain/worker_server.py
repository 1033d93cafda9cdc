"""The worker server's preload (see launch.py): what every worker needs, imported once, before
the server forks any worker; and a quick exit for the server itself.

Only the server imports this module. Its workers leave through os._exit when their function
returns, never through the exit handlers, so the handler below is the server's alone.
"""
import atexit
import os

import torch._dynamo  # noqa: F401  imported by torch.optim's step on its first call (~1 s)

import paratrain.trainer  # noqa: F401  torch, the training loop and what it imports

# The server is done when the command that started it is: skip the interpreter's teardown of
# torch (about a second), which the caller would otherwise wait for on the server's output pipes.
atexit.register(os._exit, 0)
