"""Test fixtures that are real systems: fault injection (PARATRAIN_FAULTS), hosts in network
namespaces, a Slurm cluster in them."""
