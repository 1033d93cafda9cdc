"""torch DDP on the same data split as paratrain dp: `train(out)` on every member of a gang (its
process group is the world's), writing the final weights to OUT on rank 0."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP

from paratrain.data.datasets import digits
from paratrain.models.mlp import mlp


def train(rt, out: str, steps: int = 20, batch: int = 24, lr: float = 0.1) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = digits("train").tensors
    torch.manual_seed(0)
    model = DDP(mlp(64, hidden=32, n_layers=2, out_features=10))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    share = batch // world
    for step in range(steps):
        idx = (torch.arange(step * batch, (step + 1) * batch) % len(x))[rank * share : (rank + 1) * share]
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in model.module.state_dict().items()}, out)
    dist.barrier()
