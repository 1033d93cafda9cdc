"""Test fixtures that are real systems: a Slurm cluster in network namespaces."""
