"""The process and its place in a job: joining the process group (process.py), starting workers
through PyTorch's elastic agent (launch.py), where a cluster scheduler put this node
(schedulers.py: Slurm, Kubeflow, PyTorchJob, SkyPilot), the run directory (run_dir.py), keeping a
crashing expendable worker from ending the job (guard.py), stopping at an agreed step on SIGTERM
(stop.py), and the fault points tests fire on purpose (faults.py)."""
