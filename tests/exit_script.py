"""A short own loop that ends without pt.close(), as most scripts do: `exit_script.py HOW`, HOW one
of `end` (the script just ends), `sys-exit` (sys.exit()), `raise-on-1` (rank 1 raises after the
step), `state-dict-on-0` (rank 0 alone calls model.state_dict()), `state-dict-on-0-save-on-1`
(rank 1 calls pt.save meanwhile), `save-on-0` (rank 0 alone calls pt.save); then a strategy
(default zero3). An exit handler registered before paratrain's runs after it, and says whether the process
group was still alive when the interpreter's teardown began."""

import atexit
import sys

import torch
import torch.distributed as dist

atexit.register(lambda: print(f"group alive at teardown: {dist.is_initialized()}", flush=True))

import paratrain  # noqa: E402

pt = paratrain.init(strategy=sys.argv[2] if len(sys.argv) > 2 else "zero3")
model = torch.nn.Linear(4, 2)
model, optimizer = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
loss = model(torch.ones(3, 4)).square().mean()
pt.backward(loss)
optimizer.step()
if sys.argv[1] == "sys-exit":
    sys.exit()
if sys.argv[1] == "raise-on-1" and pt.rank == 1:
    raise RuntimeError("the user's own error, after the last step")
if sys.argv[1] == "state-dict-on-0" and pt.is_main:  # a collective under zero3: the others just end
    model.state_dict()
if sys.argv[1] == "state-dict-on-0-save-on-1":  # each rank's own collective, then the end
    model.state_dict() if pt.is_main else pt.save("ckpt", step=1)
if sys.argv[1] == "save-on-0" and pt.is_main:  # under dp: the others just end
    pt.save("ckpt", step=1)
