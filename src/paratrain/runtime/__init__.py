"""The process and its place in a job: joining the process group (process.py), starting workers
through PyTorch's elastic agent (launch.py, and the worker server it forks them from:
worker_server.py), where a cluster scheduler put this node (schedulers.py: Slurm, Kubeflow,
PyTorchJob, SkyPilot), the machine a figure was measured on (machine.py), and the named points
where a test makes a rank fail on purpose (fault_points.py). Every failure path is in fault/."""
