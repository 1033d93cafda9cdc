"""ModelParallel's state across layouts: resuming any (pp, dp, cp, tp) layout from a checkpoint of any
other, and handing the consolidated model to rank 0 a tensor at a time. `mp` is the ModelParallel of this rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain import checkpoint as ckpt
from paratrain.parallel.hybrid.parallelize import stage_of_keys
from paratrain.parallel.tensor.comm import gather_shards
from paratrain.parallel.tensor.experts import join_shards, shard_slice


def load_resharded(mp, reader) -> None:
    """Any layout resumes any other: each rank reads the saved shards of every stage, joins a
    tensor's tp shards when the saved tp differs from ours, and cuts out its own slice."""
    saved = reader.manifest["config"]["parallel"]
    old_tp, old_pp = int(saved.get("tp", 1)), int(saved.get("pp", 1))
    # the dp x cp replicas of a (pp, tp) position: position (q, t)'s writer (dp and cp rank 0) is
    # q * old_replicas * old_tp + t
    old_replicas = reader.world_size // (old_tp * old_pp)
    same_tp = old_tp == mp.mesh.tp
    pieces: dict[str, list[torch.Tensor]] = {}
    scalars, groups, old_dims = {}, None, {}
    for q in range(old_pp):
        for t in [mp.mesh.tp_rank] if same_tp else range(old_tp):
            tensors, meta = reader.load(rank=q * old_replicas * old_tp + t)
            for k, v in tensors.items():
                pieces.setdefault(k, []).append(v)
            scalars.update(meta["optimizer"]["scalars"])
            groups = groups or meta["optimizer"]["param_groups"]
            old_dims.update(meta.get("shard_dims", {}))

    def mine(key: str, name: str) -> torch.Tensor | None:
        """The saved tensor `key` (of parameter or buffer `name`) as this rank holds it."""
        parts = pieces.get(key)
        if parts is None or same_tp or parts[0].dim() == 0:
            return parts[0] if parts else None
        packs = mp.shard_packs.get(name, 1)  # a fused gate and up: split as each (tensor/experts.py)
        whole = join_shards(parts, old_dims[name], packs) if name in old_dims else parts[0]
        if name not in mp.shard_dims:
            return whole
        return shard_slice(whole, mp.shard_dims[name], mp.mesh.tp, mp.mesh.tp_rank, packs)

    local = mp._local_state()
    state = {k: mine(f"model.{k}", k) for k in local}
    missing = [k for k, v in state.items() if v is None]
    wrong = [k for k, v in state.items() if v is not None and v.shape != local[k].shape]
    if missing or wrong:
        raise ckpt.CheckpointMismatch(
            "resume", f"checkpoint does not match the model: missing {missing[:5]}, shape differs {wrong[:5]}"
        )
    with torch.no_grad():
        for k, t in local.items():
            t.copy_(state[k])
    optim = {}
    for name in mp.optimizer_names:
        # A tied parameter's state may be saved under another of its names: the name of the
        # copy a stage held, or the first name when one stage held all its uses.
        for saved in (name, *mp.tie_names.get(name, ())):
            prefix = f"optim.{saved}."
            found = {f"optim.{name}.{key[len(prefix) :]}": mine(key, saved) for key in pieces if key.startswith(prefix)}
            if found:
                optim.update(found)
                break
    ckpt.optimizer_from_tensors(mp.optimizer, mp.optimizer_names, optim, {"param_groups": groups, "scalars": scalars})


def model_chunks(mp):
    """Collective, a tensor at a time in the unsplit model's order: its tp shards joined inside its
    stage, then sent by the stage's leader to rank 0, which knows every shape from the meta copy."""
    mesh = mp.mesh
    full = mp.full_meta.state_dict()
    if mesh.dp_rank != 0 or mesh.cp_rank != 0:  # the dp x cp replicas hold the same
        return
    local = mp._local_state()
    stage_of_key = stage_of_keys(mp.full_meta, mp.cfg, mp.bounds)
    for k, meta in full.items():
        q = stage_of_key[k] % mesh.pp
        if mesh.pp_rank == q:
            t = local[k].detach()
            if k in mp.shard_dims:
                dim = mp.shard_dims[k]
                t = gather_shards(t, dim, meta.shape[dim], mesh.tp_group, mp.shard_packs.get(k, 1))
            if mp.rt.rank == 0:
                yield {k: t}
            elif mesh.tp_rank == 0:
                dist.send(t.contiguous(), dst=0)
        elif mp.rt.rank == 0:
            t = torch.empty(meta.shape, dtype=meta.dtype, device=mp.rt.device)
            dist.recv(t, src=mesh.global_rank(q, 0, 0))
            yield {k: t}
