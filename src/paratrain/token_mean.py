"""A loss that is a mean over label tokens (a model's own loss, the built-in cross_entropy, whose
ignore_index is -100), normalised by the label tokens of the whole global batch, over the
data-parallel ranks and the accumulation micro-batches: one process computing the loss over the
global batch (docs/fine-tuning.md).

Every strategy averages its micro-batches' losses, and the data-parallel ranks their gradients,
with equal weights: a mean over samples. Once prompt tokens are masked with -100, micro-batches
hold unequal numbers of label tokens, and a mean of their token means is not the global batch's
token mean. Each step therefore counts the global batch's label tokens (one all-reduce of one
number, on the device: no host sync) and divides it over the loss calls of all ranks: each
call's loss is its sum of token losses over its share, their equal-weight mean the global token
mean, the logged loss included. The validation loss is likewise the validation set's token mean
(GlobalTokenCount.evaluate).

  the model's own loss  transformers' losses take the count as `num_items_in_batch` (its Trainer
                        passes it for the same reason). It goes into the rank's dict batch before
                        the strategy cuts it, a 0-dim tensor, which each micro-batch takes whole
                        (data/batch.split), the last pipeline stage with the labels
                        (models/hf_pipeline.LOSS_KEYS), and parallel.cp divides over its ring
                        (parallel/context/hf.py).
  cross_entropy         on token targets (a sequence per sample): the count per sample reaches
                        the built-in loss for the step's duration (optim.LABEL_TOKENS_PER_SAMPLE),
                        which divides by it times its rows, divided over parallel.cp here (so
                        pieces of any size, as a validation chunk's, are weighed right). Class
                        targets (one per sample) are left as they are.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from paratrain.comm import collectives
from paratrain.config import Config, microbatch_count
from paratrain.data.batch import num_samples
from paratrain.optim import IGNORE_INDEX, LABEL_TOKENS_PER_SAMPLE

if TYPE_CHECKING:
    from paratrain.parallel.base import Strategy


class GlobalTokenCount:
    """The step's global label-token count per loss call, for `model_loss` (the model's own, given
    `num_items_in_batch`) or else the built-in cross_entropy on the targets."""

    def __init__(self, model_loss: bool, shifts_labels: bool = False):
        self.model_loss = model_loss
        # a causal-LM loss shifts the labels itself: a row's first label is never a target
        self.shifts_labels = shifts_labels

    def label_tokens(self, batch: tuple) -> torch.Tensor:
        """The label tokens the loss averages over in `batch`, counted as transformers' Trainer
        counts them (labels given already shifted, as `shift_labels`, taken as they are)."""
        inputs, targets = batch
        if not self.model_loss:
            labels = targets
        elif "shift_labels" in inputs:
            labels = inputs["shift_labels"]
        else:
            labels = inputs["labels"][..., 1:] if self.shifts_labels else inputs["labels"]
        return (labels != IGNORE_INDEX).sum().to(torch.float32)

    def evaluate(self, strategy: Strategy, batch: tuple, cfg: Config) -> torch.Tensor:
        """The strategy's eval_step on a validation chunk, its [loss x samples, samples, ...] turned
        into [loss x label tokens, label tokens, ...], so that the sums over chunks and ranks give
        the validation set's token mean. The built-in cross_entropy is normalised by the chunk's
        label tokens per sample, whatever pieces the strategy cuts the chunk into (a pipeline's
        microbatches); the model's own loss by the chunk's per piece where the pieces are equal,
        else each piece's own token mean (weighed by samples: exact where they hold equal numbers
        of label tokens, as unmasked samples do)."""
        tokens, rows, pieces = self.label_tokens(batch), num_samples(batch[0]), strategy.eval_microbatches
        per_call = tokens.clamp_min(1) / pieces if rows % pieces == 0 else None
        with self._normalised(batch, per_call, tokens.clamp_min(1) / max(rows, 1), cfg) as batch:
            sums = strategy.eval_step(*batch)
        if not sums[1]:  # a rank that reports no loss, or an empty chunk
            return sums
        tokens = tokens.to(sums)
        return torch.cat([(sums[0] / sums[1] * tokens).reshape(1), tokens.reshape(1), sums[2:]])

    @contextlib.contextmanager
    def over_global_batch(self, batch: tuple, cfg: Config, group=None) -> Iterator[tuple]:
        """The step on `batch`, this rank's share of the global batch, normalised by the global
        batch's label tokens. Every rank of `group` (None: the world) counts the share it reads,
        which the ranks of one model replica (tp, pp, cp) read alike: the sum over the group is the
        global count times the ranks per share. The loss calls number dp x micro-batches (each
        of the same samples): the model's loss takes the count per call, the sum over (group ranks
        x micro-batches); cross_entropy the count per sample, the sum over (group ranks x rows)."""
        count = self.label_tokens(batch)
        ranks = 1
        if torch.distributed.is_initialized():
            collectives.all_reduce(count, "label-tokens", group=group)
            ranks = torch.distributed.get_world_size(group)
        per_call, per_sample = count / (ranks * microbatch_count(cfg)), count / (ranks * num_samples(batch[0]))
        with self._normalised(batch, per_call, per_sample, cfg) as batch:
            yield batch

    @contextlib.contextmanager
    def _normalised(
        self, batch: tuple, per_call: torch.Tensor | None, per_sample: torch.Tensor, cfg: Config
    ) -> Iterator[tuple]:
        """The loss calls on `batch` divide their sums of token losses by a share of the label
        tokens: the model's own by `per_call`, as `num_items_in_batch` (None: its own count;
        parallel.cp divides it over its ranks, each computing a part of a sequence's loss), the
        built-in cross_entropy by `per_sample` times its rows (optim.LABEL_TOKENS_PER_SAMPLE)."""
        if self.model_loss:
            inputs, targets = batch
            yield ({**inputs, "num_items_in_batch": per_call} if per_call is not None else inputs), targets
            return
        token = LABEL_TOKENS_PER_SAMPLE.set(per_sample / cfg.parallel.cp)
        try:
            yield batch
        finally:
            LABEL_TOKENS_PER_SAMPLE.reset(token)


def over_global_batch(count: GlobalTokenCount | None, batch: tuple | None, cfg: Config, group=None):
    """`count.over_global_batch`; where there is no count (a loss left as it is) or no batch (a
    rank that reads none), the step on the batch as it is."""
    if count is None or batch is None:
        return contextlib.nullcontext(batch)
    return count.over_global_batch(batch, cfg, group)


def global_token_count(cfg: Config, model: nn.Module, sample) -> GlobalTokenCount | None:
    """The count for a token-mean loss on samples like `sample`: train.loss = "model" on dict
    samples with `labels`, where the model's forward takes `num_items_in_batch` (transformers'
    test: its `accepts_loss_kwargs`, else a forward with **kwargs), or cross_entropy on integer
    targets with a sequence per sample; None for every other loss and sample, left as they are."""
    if cfg.train.loss == "cross_entropy":
        target = sample[1] if isinstance(sample, (tuple, list)) and len(sample) == 2 else None
        tokens = isinstance(target, torch.Tensor) and target.dim() >= 1 and not target.is_floating_point()
        return GlobalTokenCount(model_loss=False) if tokens else None
    if cfg.train.loss != "model" or not (isinstance(sample, dict) and "labels" in sample):
        return None
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        params = inspect.signature(model.forward).parameters.values()
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    return GlobalTokenCount(model_loss=True, shifts_labels=_shifts_labels(model)) if accepts else None


def _shifts_labels(model: nn.Module) -> bool:
    """Whether the model's own loss is transformers' causal-LM loss, which shifts the labels
    (encoder-decoders' losses take theirs unshifted), as transformers' Trainer decides it."""
    if not type(model).__module__.startswith("transformers."):
        return False
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    config = getattr(model, "config", None)
    causal = LOSS_MAPPING.get(str(getattr(model, "loss_type", ""))) is ForCausalLMLoss
    return causal and not getattr(config, "is_encoder_decoder", False)
