"""Tensor parallelism (Megatron-style): layers.py (column / row / vocabulary-parallel layers and
the plans that place them) and comm.py (the paired autograd operators), applied by the hybrid engine."""
