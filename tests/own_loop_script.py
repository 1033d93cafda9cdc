"""The own-loop script the API tests run: plain python (world 1), `paratrain launch`, torchrun.

    own_loop_script.py STRATEGY OPTIMIZER OUT [--steps N] [--save-at K] [--resume DIR] [--ckpt DIR]
                       [--die-at K]

The model, optimizer and loader of own_loop_model.build; writes the final weights to
OUT/model.safetensors (pt.export)."""

import argparse
import os

from own_loop_model import build
from torch import nn

import paratrain

p = argparse.ArgumentParser()
p.add_argument("strategy")
p.add_argument("optimizer")
p.add_argument("out")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--ckpt", default=None)
p.add_argument("--save-at", type=int, default=0)
p.add_argument("--die-at", type=int, default=0)
p.add_argument("--clip", type=float, default=0.0)
args = p.parse_args()


pt = paratrain.init(strategy=args.strategy, bucket_mb=0.0005)
model, opt, loader = build(args.optimizer)
model, opt = pt.setup(model, opt)
loader = pt.setup_dataloader(loader)
step = 0
if args.ckpt:
    meta = pt.load(args.ckpt)
    step = meta["step"] if meta else 0
while step < args.steps:
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        pt.backward(loss)
        if args.clip:
            pt.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad()
        step += 1
        pt.log(step, loss=loss)
        if args.ckpt and step == args.save_at:
            pt.save(args.ckpt, step=step)
        if step == args.die_at and pt.rank == 1 and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
            os._exit(9)  # a dead worker, on the first attempt only
        if step == args.steps:
            break
pt.export(args.out, step=step)
