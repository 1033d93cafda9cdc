"""The own-loop script the API tests run under plain python (world 1), `paratrain launch` and torchrun.

own_loop_script.py STRATEGY OPTIMIZER OUT [--steps N] [--ckpt DIR --save-at K] [--die-at K]
"""

import argparse

from own_loop_model import train

p = argparse.ArgumentParser()
p.add_argument("strategy")
p.add_argument("optimizer")
p.add_argument("out")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--ckpt", default=None)
p.add_argument("--save-at", type=int, default=0)
p.add_argument("--die-at", type=int, default=0)
p.add_argument("--run-dir", default=None)
args = p.parse_args()
train(args.strategy, args.optimizer, args.out, args.steps, args.ckpt, args.save_at, args.die_at, run_dir=args.run_dir)
