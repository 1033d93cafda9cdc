"""ZeRO stages 1-3: spec.py, engine.py (the strategies), comm.py (flat units, reduce-scatters,
gathers), gather.py (stage 3's per-module units gathered around their forward and backward),
reshard.py (checkpoints across world sizes), footprint.py and step_time.py (what it costs)."""
