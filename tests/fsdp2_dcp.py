"""`python fsdp2_dcp.py FINAL DEST N_LAYER N_HEAD D_MODEL BLOCK_SIZE`: the built-in gpt with FINAL's
weights, sharded by FSDP2 (world 1, gloo, CPU) and saved as users of FSDP2 save it:
`dcp.save({"model": get_model_state_dict(model)})`. Its own process, so that the test's keeps no
process group."""

import sys

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard

from paratrain.models.gpt import gpt

final, dest, n_layer, n_head, d_model, block_size = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
weights = load_file(f"{final}/model.safetensors")
model = gpt(weights["embed.tok.weight"].shape[0], n_layer, n_head, d_model, block_size)
model.load_state_dict(weights)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
fully_shard(model)
dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=dest)
dist.destroy_process_group()
