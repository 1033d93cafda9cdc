"""The tokenizers `paratrain data prepare --tokenizer` names: bytes, a byte-level BPE learnt from
the documents themselves (bpe:VOCAB), or a Hugging Face tokenizer directory (the model's own)."""

from __future__ import annotations

from pathlib import Path

from paratrain.data.sources import read_documents
from paratrain.errors import ConfigError

END_OF_TEXT = "<|endoftext|>"


def parse_tokenizer(spec: str) -> int | None:
    """None for bytes, the vocabulary size for bpe:VOCAB."""
    if spec == "bytes":
        return None
    kind, _, vocab = spec.partition(":")
    if kind != "bpe" or not vocab.isdigit():
        raise ConfigError("--tokenizer", f"expected bytes or bpe:VOCAB, got {spec!r}")
    if int(vocab) < 257:
        raise ConfigError(
            "--tokenizer", f"a BPE vocabulary holds the 256 bytes and {END_OF_TEXT}: at least 257, got {vocab}"
        )
    return int(vocab)


def tokenizer_directory(spec: str) -> str | None:
    """The Hugging Face tokenizer directory that --tokenizer names; None for bytes and bpe:VOCAB."""
    if spec == "bytes" or spec.startswith("bpe:"):
        return None
    if not Path(spec).is_dir():
        raise ConfigError("--tokenizer", f"expected bytes, bpe:VOCAB or a tokenizer directory, got {spec!r}")
    return spec


def train_bpe(files: list[str], fmt: str, field: str, vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained on the documents themselves; its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((doc for f in files for doc in read_documents(f, fmt, field)), trainer)
    return tok.to_str()


def bpe_vocab_size(tokenizer_json: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json).get_vocab_size()
