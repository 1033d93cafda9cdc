"""A model's own loss that is a mean over label tokens, normalised by the label tokens of the whole
global batch (over the data-parallel ranks and the accumulation micro-batches): one process
computing the loss over the global batch (docs/fine-tuning.md).

Every strategy averages its micro-batches' losses, and the data-parallel ranks their gradients,
with equal weights: a mean over samples. Once prompt tokens are masked with -100, micro-batches
hold unequal numbers of label tokens, and a mean of their token means is not the global batch's
token mean. A transformers model's own loss takes `num_items_in_batch`, the count its sum of token
losses is divided by (transformers' Trainer passes it for the same reason): given the global
batch's count divided by the number of micro-batches over all ranks, each micro-batch's loss is its
sum over that, and their equal-weight mean is the global token mean, the logged loss included.

The count goes into the rank's batch before the strategy cuts it, as a 0-dim tensor, which each
micro-batch takes whole (data/batch.split), the last pipeline stage with the labels
(models/hf_pipeline.LOSS_KEYS), and parallel.cp divides over its ring (parallel/context/hf.py).
It stays on the device: one all-reduce of one number a step, no host sync."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from paratrain.comm import collectives
from paratrain.config import Config, microbatch_count

IGNORE = -100  # the ignore_index of transformers' losses and torch's cross_entropy: a label no loss counts


class GlobalTokenCount:
    """Puts `num_items_in_batch` into a rank's dict batch of every step (see the module's docstring)."""

    def __init__(self, shifts_labels: bool):
        # a causal-LM loss shifts the labels itself: a row's first label is never a target
        self.shifts_labels = shifts_labels

    def label_tokens(self, inputs: dict) -> torch.Tensor:
        """The label tokens the model's loss averages over in `inputs`, counted as transformers'
        Trainer counts them (labels given already shifted as `shift_labels` taken as they are)."""
        if "shift_labels" in inputs:
            labels = inputs["shift_labels"]
        else:
            labels = inputs["labels"][..., 1:] if self.shifts_labels else inputs["labels"]
        return (labels != IGNORE).sum().to(torch.float32)

    def __call__(self, batch: tuple, cfg: Config, group=None) -> tuple:
        """`batch`, this rank's share of the global batch, with the global count per micro-batch:
        every rank of `group` (None: the world) counts the share it reads, which the ranks of one
        model replica (tp, pp, cp) read alike, so the sum over the group is the global batch's
        count times the ranks per share, and the micro-batches over all ranks number
        dp x micro_batches: the count per micro-batch is the sum over group ranks x micro_batches."""
        inputs, targets = batch
        count = self.label_tokens(inputs)
        ranks = 1
        if torch.distributed.is_initialized():
            collectives.all_reduce(count, "label-tokens", group=group)
            ranks = torch.distributed.get_world_size(group)
        return {**inputs, "num_items_in_batch": count / (ranks * microbatch_count(cfg))}, targets


def global_token_count(cfg: Config, model: nn.Module, sample) -> GlobalTokenCount | None:
    """The normalisation for train.loss = "model" on dict samples with `labels`, where the model's
    forward takes `num_items_in_batch` (transformers' test: its `accepts_loss_kwargs`, else a
    forward with **kwargs); None for every other loss and model, whose batches stay as they are."""
    if cfg.train.loss != "model" or not (isinstance(sample, dict) and "labels" in sample):
        return None
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        params = inspect.signature(model.forward).parameters.values()
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    return GlobalTokenCount(_shifts_labels(model)) if accepts else None


def _shifts_labels(model: nn.Module) -> bool:
    """Whether the model's own loss is transformers' causal-LM loss, which shifts the labels
    (encoder-decoders' losses take theirs unshifted), as transformers' Trainer decides it."""
    if not type(model).__module__.startswith("transformers."):
        return False
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    config = getattr(model, "config", None)
    causal = LOSS_MAPPING.get(str(getattr(model, "loss_type", ""))) is ForCausalLMLoss
    return causal and not getattr(config, "is_encoder_decoder", False)
