"""User model factories (`module:function`), as a user's own code would define them: built by their
own construction code, not by paratrain's built-ins."""

import numpy as np
import torch
from torch import nn


def wide_mlp(in_features: int = 1024, hidden: int = 4096, layers: int = 4, classes: int = 10) -> nn.Sequential:
    """A plain nn.Sequential MLP; at the defaults 54.6M parameters (the memory benchmark's size)."""
    widths = [in_features] + [hidden] * layers
    blocks = []
    for a, b in zip(widths, widths[1:]):
        blocks += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(widths[-1], classes))


class TwoHalves(nn.Module):
    """A classifier of 8x8 digits given as two halves of 32 pixels, called with two arguments
    (`model(left, right)` or `model(**{"left": ..., "right": ...})`). It returns its logits, or
    with `labels` or a `key` a dict of them under `key` (and its own loss, as Hugging Face models do)."""

    def __init__(self, key: str = ""):
        super().__init__()
        self.left, self.right = nn.Linear(32, 16), nn.Linear(32, 16)
        self.head = nn.Linear(16, 10)
        self.key = key or "logits"
        self.as_dict = bool(key)

    def forward(self, left, right, labels=None):
        logits = self.head(torch.relu(self.left(left) + self.right(right)))
        if labels is None and not self.as_dict:
            return logits
        loss = {} if labels is None else {"loss": nn.functional.cross_entropy(logits, labels)}
        return {self.key: logits, **loss}


def two_halves(key: str = "") -> TwoHalves:
    return TwoHalves(key)


class DigitHalves(torch.utils.data.Dataset):
    """The built-in digits as user samples of each supported structure (`layout`): `tuple`
    ((left, right), y), `dict` ({"left", "right"}, y), `labelled` {"left", "right", "labels"}."""

    def __init__(self, split: str, layout: str):
        from paratrain.data.datasets import digits

        self.x, self.y = digits(split).tensors
        self.layout = layout

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        left, right, y = self.x[i, :32], self.x[i, 32:], self.y[i]
        if self.layout == "tuple":
            return (left, right), y
        if self.layout == "dict":
            return {"left": left, "right": right}, y
        if self.layout == "labelled":
            return {"left": left, "right": right, "labels": y}
        return left  # any other layout: a bare tensor, which is no sample paratrain takes


def digit_halves(split: str = "train", layout: str = "tuple") -> DigitHalves:
    return DigitHalves(split, layout)


def bn_cnn(channels: int = 4) -> nn.Sequential:
    """A small CNN with batch norm over 8x8 digits given as 64 pixels (Conv, BatchNorm2d, ReLU, and
    a BatchNorm1d before the head): the layer whose statistics span the batch."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, channels, 3, padding=1),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(channels * 64, 16),
        nn.BatchNorm1d(16, momentum=None),
        nn.ReLU(),
        nn.Linear(16, 10),
    )


class TokenBlocks(torch.utils.data.Dataset):
    """Random token blocks (a fixed seed per split) as a language model's or classifier's samples
    (`layout`): `pair` (ids, next ids); `labelled` {"input_ids", "labels"} (the model shifts and
    computes its own loss); `ids` {"input_ids"} alone; `classify` ({"input_ids", "attention_mask"}, a class of 3)."""

    def __init__(self, split: str, layout: str, vocab: int, block: int, n: int):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.tokens = torch.randint(vocab, (n, block + 1), generator=g)
        self.lengths = torch.randint(block // 2, block + 1, (n,), generator=g)
        self.layout = layout

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        ids = self.tokens[i, :-1]
        if self.layout == "pair":
            return ids, self.tokens[i, 1:]
        if self.layout == "labelled":
            return {"input_ids": ids, "labels": ids}
        if self.layout == "ids":
            return {"input_ids": ids}
        mask = (torch.arange(len(ids)) < self.lengths[i]).long()
        return {"input_ids": ids, "attention_mask": mask}, self.tokens[i, -1] % 3


def token_blocks(split: str = "train", layout: str = "pair", vocab: int = 64, block: int = 16, n: int = 96):
    return TokenBlocks(split, layout, vocab, block, n)


class ForgetfulStack(nn.Module):
    """Two Linear layers and a learned scale between them, whose pipeline_layers() leaves the
    scale out (as a hand-cut GPT-2 that forgot its position embedding)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(64, 32), nn.Linear(32, 10)
        self.scale = nn.Parameter(torch.ones(32))

    def forward(self, x):
        return self.second(self.first(x) * self.scale)

    def pipeline_layers(self):
        return [self.first, self.second]


def forgetful_stack() -> ForgetfulStack:
    return ForgetfulStack()


class TinyImages(torch.utils.data.Dataset):
    """Random 3x8x8 images (a fixed seed per split) and a class of 3: pixel-value samples
    `(pixel_values, label)` for an image classifier."""

    def __init__(self, split: str, n: int):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.pixels = torch.randn(n, 3, 8, 8, generator=g)
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.pixels)

    def __getitem__(self, i):
        return self.pixels[i], self.labels[i]


def tiny_images(split: str = "train", n: int = 96) -> TinyImages:
    return TinyImages(split, n)


class ClippedMLP(nn.Module):
    """An MLP whose forward reads values for its control flow (`.item()`) and through numpy, as
    custom code does: no fake tensor can run it, a real batch can."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.first(x))
        if h.abs().max().item() > 1e3:  # a guard against blow-ups, read as a Python float
            h = h / 1e3
        if np.isnan(h.detach().numpy()).any():  # a check through numpy
            raise FloatingPointError("nan in the hidden layer")
        return self.second(h)


def clipped_mlp() -> ClippedMLP:
    return ClippedMLP()


class SkippingStack(nn.Module):
    """Two Linear layers with a tanh between them in its forward, which its pipeline_layers() does
    not carry: a pipeline cut between them would drop it."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))

    def pipeline_layers(self):
        return [self.first, self.second]


def skipping_stack() -> SkippingStack:
    return SkippingStack()


class PromptCompletions(torch.utils.data.Dataset):
    """Token blocks whose prompt, the first 0 to block - 2 tokens (a different number in each), is
    masked with -100 in the labels: a completion-only loss counts a different number of tokens in
    each sample. `layout`: `labelled` {"input_ids", "labels"} (the model shifts them), or `pair`
    (ids, the next ids): the same token targets shifted here, the last one -100. `vocab_size` is
    declared, as shards declare their tokenizer's, unless `declared` is false."""

    def __init__(self, vocab: int, block: int, n: int, declared: bool, layout: str):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(vocab, (n, block), generator=g)
        self.prompts = torch.randint(block - 1, (n,), generator=g)
        self.layout = layout
        if declared:
            self.vocab_size = vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[: self.prompts[i]] = -100
        if self.layout == "pair":
            return self.ids[i], torch.cat([labels[1:], torch.tensor([-100])])
        return {"input_ids": self.ids[i], "labels": labels}


def prompt_completions(
    split: str = "train", vocab: int = 64, block: int = 16, n: int = 64, declared: bool = True, layout: str = "labelled"
) -> PromptCompletions:
    return PromptCompletions(vocab, block, n, declared, layout)
