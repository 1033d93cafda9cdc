"""Documents as `data prepare` writes them for `train.loss = "model"`: each one token ids and labels
(-100 where nothing is learnt: prompts, the chat template's own tokens), cut into rows of block_size
(`input_ids`, `labels`, `attention_mask`) or packed several to a row (`input_ids`, `labels`,
`position_ids` that restart at each document).

A model given `position_ids` and no `attention_mask` keeps attention inside each document
(transformers finds the documents where the positions restart), and no document's first label is
learnt, so a row's loss never predicts one document from another.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from paratrain.errors import ConfigError

IGNORE = -100  # the label nothing is learnt from: torch's cross-entropy ignore_index, transformers' too
CHAT, PROMPT_COMPLETION = "chat", "prompt-completion"
SFT_FORMATS = (CHAT, PROMPT_COMPLETION)


@functools.lru_cache(maxsize=1)
def load_tokenizer(directory: str):
    """The Hugging Face tokenizer that `save_pretrained` wrote to `directory` (read here, never
    downloaded); a fast one, whose offsets place each token in the rendered chat."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError("--tokenizer", f"{directory} holds no tokenizer that loads: {exc}") from None
    if not tok.is_fast:
        raise ConfigError("--tokenizer", f"{directory} holds no tokenizer.json (a fast tokenizer's)")
    return tok


def end_of_document(tok) -> list[int]:
    return [] if tok.eos_token_id is None else [tok.eos_token_id]


def pad_id(tok) -> int:
    """The token of padding, which is never learnt nor attended to: any token does where the
    tokenizer names none (bytes and BPE tokens have no tokenizer here)."""
    for candidate in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)):
        if candidate is not None:
            return candidate
    return 0


def text_ids(tok, text: str) -> list[int]:
    """A plain document: the tokenizer's own special tokens around it, then end-of-sequence."""
    ids = tok(text)["input_ids"]
    return ids if ids[-1:] == end_of_document(tok) else ids + end_of_document(tok)


def prompt_completion_sample(tok, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """The two encoded apart (a token never straddles them) and joined; only the completion and
    its end-of-sequence are learnt."""
    prompt_ids = tok(prompt)["input_ids"]
    completion_ids = tok(completion, add_special_tokens=False)["input_ids"] + end_of_document(tok)
    return prompt_ids + completion_ids, [IGNORE] * len(prompt_ids) + completion_ids


def chat_sample(tok, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """The conversation rendered by the tokenizer's chat template; the tokens of each assistant
    message (its content and the template's end of turn, not the header that announces it) are
    learnt. An assistant message spans the characters from the render of the messages before it
    with the generation prompt to the render that ends with it."""

    from jinja2 import TemplateError

    def render(part: list[dict], prompt: bool = False) -> str:
        return tok.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt) if part else ""

    try:
        text = render(messages)
        turns = [
            (render(messages[:i], prompt=True), render(messages[: i + 1]))
            for i, m in enumerate(messages)
            if m["role"] == "assistant"
        ]
    except (ValueError, TypeError, TemplateError) as exc:  # no template, or one that refuses the conversation
        raise ConfigError("--tokenizer", f"its chat template cannot render {where}: {exc}") from None
    if not all(text.startswith(before) and upto.startswith(before) and text.startswith(upto) for before, upto in turns):
        raise ConfigError("--format", f"the chat template renders {where} otherwise than its turns one after another")
    spans = [(len(before), len(upto)) for before, upto in turns]
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.array([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
    learnt = np.zeros(len(starts), dtype=bool)
    for start, end in spans:
        learnt |= (starts >= start) & (starts < end)
    ids = enc["input_ids"]
    return ids, np.where(learnt, ids, IGNORE).tolist()


def read_messages(record: dict, where: str) -> list[dict]:
    messages = record.get("messages")
    if not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ConfigError("SRC", f"{where} has no `messages`: a list of {{role, content}} with text content")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError("SRC", f"{where} has no assistant message: nothing to learn")
    return messages


def read_prompt_completion(record: dict, where: str) -> tuple[str, str]:
    if not all(isinstance(record.get(k), str) for k in ("prompt", "completion")):
        raise ConfigError("SRC", f"{where} needs text fields `prompt` and `completion`")
    return record["prompt"], record["completion"]


@dataclass(frozen=True)
class Documents:
    """Documents end to end: their token ids, their labels and each one's length."""

    ids: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, samples: list[tuple[list[int], list[int]]]) -> Documents:
        lengths = np.array([len(ids) for ids, _ in samples], dtype=np.int64)
        ids = np.fromiter((t for s, _ in samples for t in s), dtype=np.uint32, count=int(lengths.sum()))
        labels = np.fromiter((t for _, s in samples for t in s), dtype=np.int32, count=int(lengths.sum()))
        return cls(ids, labels, lengths)

    @classmethod
    def concatenate(cls, parts: list[Documents]) -> Documents:
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("ids", "labels", "lengths")))


def rows(docs: Documents, block_size: int, pack: bool, pad_id: int) -> tuple[dict[str, np.ndarray], int]:
    """The documents as rows of block_size tokens, and how many were cut to block_size. Unpacked:
    one document a row, padded (attention_mask 0, labels -100). Packed: documents whole, in order,
    as many as fit in a row; the rest of a row is padding (labels -100, positions 0)."""
    starts = np.concatenate([[0], np.cumsum(docs.lengths)[:-1]])
    kept = np.minimum(docs.lengths, block_size)
    row_of, at = np.arange(len(kept)), np.zeros(len(kept), dtype=np.int64)
    if pack:
        row, used = 0, 0
        for d, n in enumerate(kept.tolist()):
            if used + n > block_size:
                row, used = row + 1, 0
            row_of[d], at[d], used = row, used, used + n
    n_rows = int(row_of[-1]) + 1 if len(kept) else 0
    out = {
        "input_ids": np.full((n_rows, block_size), pad_id, dtype=docs.ids.dtype),
        "labels": np.full((n_rows, block_size), IGNORE, dtype=np.int32),
    }
    extra = "position_ids" if pack else "attention_mask"
    out[extra] = np.zeros((n_rows, block_size), dtype=np.int32 if pack else np.uint8)
    for r, a, s, n in zip(row_of.tolist(), at.tolist(), starts.tolist(), kept.tolist()):
        out["input_ids"][r, a : a + n] = docs.ids[s : s + n]
        out["labels"][r, a : a + n] = docs.labels[s : s + n]
        out["labels"][r, a] = IGNORE  # a document's first token follows another document's last
        out[extra][r, a : a + n] = np.arange(n) if pack else 1
    return out, int((docs.lengths > block_size).sum())
