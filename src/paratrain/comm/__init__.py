"""Communication every strategy shares: collectives.py (every collective, timed and
hang-reported), grid.py (every process group, from one rank grid), shm.py (a shared-memory
transport between processes on one host), lockstep.py (the check that every rank runs the same
model call before the collectives it makes)."""
