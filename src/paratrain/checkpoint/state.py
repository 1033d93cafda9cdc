"""A model's and an optimizer's state as named tensors and JSON, and back (no pickle)."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.checkpoint.format import CheckpointMismatch
from paratrain.checkpoint.reader import describe_mismatch


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load with a clear list of what does not match, instead of a traceback."""
    differs = describe_mismatch(
        {k: v.shape for k, v in model.state_dict().items()}, {k: v.shape for k, v in state.items()}
    )
    if differs:
        raise CheckpointMismatch("resume", differs)
    model.load_state_dict(state)


def optimizer_to_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict, dict]:
    """`names` follows the optimizer's parameters in param_groups order. The class's state_dict and
    load_state_dict, not the instance's: a strategy refuses those to the user's code (their state
    is this rank's part) while its own checkpoints read and write them."""
    sd = type(optimizer).state_dict(optimizer)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict] = {}
    for index, state in sd["state"].items():
        name = names[index]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{name}.{key}"] = value
            else:
                scalars.setdefault(name, {})[key] = value
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


# how an optimizer computes its update, not what it has learnt: never taken from a checkpoint
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict, meta: dict) -> None:
    current = type(optimizer).state_dict(optimizer)
    state: dict[int, dict] = {}
    for index, name in enumerate(names):
        prefix = f"optim.{name}."
        entry = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        entry.update(meta["scalars"].get(name, {}))
        if entry:
            state[index] = entry
    # hyperparameters come from the checkpoint; how the update is computed (fused or not, ...) is
    # this process's choice, so a run saved on one kind of machine resumes on another
    groups = [
        dict(saved, params=cur["params"], **{k: cur[k] for k in _IMPLEMENTATION_KEYS if k in cur})
        for saved, cur in zip(meta["param_groups"], current["param_groups"])
    ]
    type(optimizer).load_state_dict(optimizer, {"state": state, "param_groups": groups})
