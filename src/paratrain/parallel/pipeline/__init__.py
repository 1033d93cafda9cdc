"""Pipeline parallelism's pieces, run by the hybrid engine: cut.py (where the model is cut),
schedules.py (gpipe, 1f1b, interleaved), runner.py (a schedule's actions on one rank), comm.py
(activations and gradients between stages), footprint.py (schedule peaks and messages)."""
