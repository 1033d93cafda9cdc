"""The test tools, real systems all: fault injection (faults.py: PARATRAIN_FAULTS, which `paratrain
run` installs at the training code's fault points), the fast tier's gang of long-lived workers
(gang.py), hosts in network namespaces (netns.py) and a Slurm cluster in them (slurm.py)."""
