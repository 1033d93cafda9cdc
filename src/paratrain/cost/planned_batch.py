"""The batch a planned rank runs: as the pipeline engine feeds a model cut into layers (its own
loss's labels carried apart), and as context parallelism cuts each sequence."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import Config


def cut_batch(cfg: Config, model: nn.Module, x, y, cut: bool):
    """(x, y, loss) as the pipeline engine runs a model cut into layers (`cut`): under train.loss =
    "model" a dict sample's labels become the target, and the loss the model's own loss_function on
    the last layer's logits (models/hf_pipeline.own_loss); else the batch and train.loss as given."""
    from paratrain.models.hf_pipeline import labels_apart, own_loss
    from paratrain.optim import build_loss

    own = own_loss(model) if cut and cfg.train.loss == "model" else None
    if own is not None and isinstance(x, dict) and "labels" in x:
        return *labels_apart(x), own
    return x, y, build_loss(cfg)


def context_chunks(cfg: Config, x, y):
    """parallel.cp = C: a rank holds 1/C of each sequence (2 chunks of T/2C) and its ring attention
    keeps only its own chunks' keys, values and outputs for backward: one microbatch's activations
    are those of sequences C times shorter, which a batch cut to its first T/C tokens gives."""
    from paratrain.data.batch import tree_map

    cp = cfg.parallel.cp
    first = x if isinstance(x, torch.Tensor) else None
    if cp == 1 or first is None or first.dim() < 2:
        return x, y
    length = first.shape[1]
    return tree_map(lambda t: t[:, : length // cp] if t.dim() >= 2 and t.shape[1] == length else t, (x, y))
