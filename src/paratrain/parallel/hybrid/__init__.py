"""Tensor x pipeline x context x data parallelism on one (pp, dp, cp, tp) mesh: strategies tp, pp and hybrid.
spec.py, engine.py (ModelParallel), hybrid/parallelize.py (the apply steps, in order), state.py (its
checkpoints across layouts), footprint.py and step_time.py (what the grid costs)."""
