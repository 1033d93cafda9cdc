"""`paratrain job`: job files for cluster schedulers (command.py: the command and the Job it
fills; slurm.py, kubernetes.py, skypilot.py: one file format each; preflight.py: the nodes' checks
before a multi-node run)."""
