"""`[model] factory = "hf"`: a Hugging Face transformers model, unmodified (extra `paratrain[hf]`).

    [model]
    factory = "hf"
    task = "causal-lm"                 # causal-lm | sequence-classification | masked-lm | base
    config = { model_type = "llama", hidden_size = 64, num_hidden_layers = 2, ... }   # random init
    # or: pretrained = "DIR"           # a local directory written by save_pretrained (never a download)

The model is built from the seeded random-number stream like any factory's, so every strategy
starts from the same weights. `final/` of such a run is also a Hugging Face model directory:
`model_files` adds its `config.json` beside `model.safetensors`."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from paratrain.config import ArgumentError, require
from paratrain.extras import require as require_extra
from paratrain.resolve import CONFIG_DIR_ENV

TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "masked-lm": "AutoModelForMaskedLM",
    "base": "AutoModel",
}


def hf(config: dict | None = None, pretrained: str = "", task: str = "causal-lm") -> nn.Module:
    """A transformers model for `task`: from `config` at random init, or loaded from `pretrained`."""
    require(task in TASKS, "task", f"must be one of {', '.join(TASKS)}, got {task!r}")
    require(bool(config) != bool(pretrained), "config", "give either config = { model_type = ... } or pretrained")
    require_extra("transformers", '[model] factory = "hf"')
    import transformers

    auto = getattr(transformers, TASKS[task])
    if pretrained:
        path = Path(pretrained)
        if not path.is_absolute() and os.environ.get(CONFIG_DIR_ENV):
            path = Path(os.environ[CONFIG_DIR_ENV]) / path
        require((path / "config.json").is_file(), "pretrained", f"{path} holds no config.json (save_pretrained's)")
        try:
            return auto.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ArgumentError("pretrained", f"{path}: {str(exc).splitlines()[0]}") from None
    settings = dict(config)
    model_type = settings.pop("model_type", None)
    require(isinstance(model_type, str), "config", "needs model_type (e.g. model_type = 'llama')")
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **settings)
        return auto.from_config(hf_config)
    except (ValueError, KeyError, TypeError, AssertionError) as exc:  # torch's modules assert their sizes
        raise ArgumentError("config", f"{model_type}: {str(exc).splitlines()[0]}") from None


def model_files(model: nn.Module) -> dict[str, bytes]:
    """The files beside model.safetensors that make `final/` a Hugging Face model directory
    (`from_pretrained(RUN_DIR / "final")`): a transformers model's config.json; none for others."""
    config = getattr(model, "config", None)
    if not (hasattr(model, "save_pretrained") and hasattr(config, "to_json_string")):
        return {}
    files = {"config.json": config.to_json_string().encode()}
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "to_json_string"):
        files["generation_config.json"] = generation.to_json_string().encode()
    return files
