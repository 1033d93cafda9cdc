"""LoRA through peft: `[model] lora = { r, alpha, dropout, target_modules }` wraps the factory's
model with peft's get_peft_model (only the adapters train), and the export of a peft model (the
config's, or one the user wrapped before pt.setup) writes beside final/model.safetensors:

    adapter_config.json, adapter_model.safetensors   the adapter in PEFT's format:
                                                     PeftModel.from_pretrained(base, final)
    merged/                                          the base model with the adapters merged in; for a
                                                     transformers model config.json + model.safetensors
                                                     (AutoModelForCausalLM.from_pretrained)

Both are written on rank 0 alone from the consolidated final/model.safetensors, read back a tensor
at a time (mmap): no rank holds the whole model for them, whatever the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from paratrain.checkpoint.format import FINAL_FILE, write_bytes_durably
from paratrain.checkpoint.writer import Layout, write_safetensors
from paratrain.errors import ConfigError
from paratrain.lora_keys import LORA_STRATEGIES
from paratrain.models.hf import model_files

PeftModel = Any  # peft's, whose attributes (peft_config, active_adapters) its types leave to __getattr__


def with_lora(model: nn.Module, table: dict) -> nn.Module:
    """`model` wrapped by peft with the LoRA adapters `table` (config.py's LORA_KEYS) describes."""
    from peft import LoraConfig, get_peft_model

    settings = dict(r=table.get("r", 8), lora_alpha=table.get("alpha", 16), lora_dropout=table.get("dropout", 0.0))
    config = LoraConfig(**settings, target_modules=table.get("target_modules"))
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as exc:  # no module of the model matches, or peft knows no default for it
        raise ConfigError("model.lora.target_modules", str(exc).splitlines()[0]) from None
    if why := unmergeable(wrapped):
        raise ConfigError("model.lora.target_modules", why)
    return wrapped


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def check_strategy(model: nn.Module, strategy: str) -> None:
    """A peft model the user wrapped trains where its frozen parameters take no gradient."""
    if is_peft_model(model) and strategy not in LORA_STRATEGIES:
        raise ConfigError(
            "model.lora", f"a peft model trains under {' | '.join(LORA_STRATEGIES)}, not {strategy} (yet)"
        )


def lora_layers(model: nn.Module) -> dict[str, Any]:
    """The model's LoRA layers (peft's LoraLayer), by module name."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def unmergeable(model: PeftModel) -> str | None:
    """Why write_merged cannot merge the model's adapters, or None: it merges plain LoRA in Linear
    (and transformers' Conv1D) layers, the adapters being all that trains."""
    from peft.tuners.lora import Linear

    name = adapter_name(model)
    if model.peft_config[name].modules_to_save:
        return "modules_to_save train whole copies of modules: plain LoRA adapters only (yet)"
    for module_name, layer in lora_layers(model).items():
        if not isinstance(layer, Linear):
            return f"{module_name} is a {type(layer).__name__}: LoRA on Linear layers only (yet)"
        if name in layer.lora_variant:  # DoRA and the like
            return f"{module_name} is a {type(layer.lora_variant[name]).__name__}: plain LoRA only (yet)"
    return None


def adapter_exports(model: PeftModel) -> Callable[[Path, Layout], list[str]] | None:
    """For a peft model whose adapters merge, what writes them and the merged model into an export
    folder (after its model.safetensors, of `layout`) and returns the names of the files written;
    None for any other model (a user's own peft setup, unmergeable: its model.safetensors alone)."""
    if not is_peft_model(model) or unmergeable(model):
        return None
    return lambda folder, layout: write_adapter(model, folder) + write_merged(model, folder, layout)


def adapter_keys(model: PeftModel) -> set[str]:
    """The adapters' names in the model's state_dict: its trainable parameters (peft freezes the rest)."""
    return {k for k, p in model.named_parameters() if p.requires_grad}


def adapter_name(model: PeftModel) -> str:
    return model.active_adapters[0]


def write_adapter(model: PeftModel, folder: Path) -> list[str]:
    """adapter_config.json (peft's own writing) and adapter_model.safetensors: the trainable
    tensors of folder/model.safetensors, keyed by peft's get_peft_model_state_dict."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    name = adapter_name(model)
    model.peft_config[name].save_pretrained(str(folder))
    with safe_open(str(folder / FINAL_FILE), framework="pt") as f:
        adapters = {k: f.get_tensor(k) for k in adapter_keys(model)}
    state = get_peft_model_state_dict(model, state_dict=adapters, adapter_name=name, save_embedding_layers=False)
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(folder / "adapter_model.safetensors"), {"format": "pt"}
    )
    return ["adapter_config.json", "adapter_model.safetensors"]


def write_merged(model: PeftModel, folder: Path, layout: Layout) -> list[str]:
    """folder/merged/: the base model's state_dict, each LoRA layer's weight W + scaling * B @ A
    (transposed where the layer stores W as fan_in x fan_out), and the base model's config files."""
    name = adapter_name(model)
    base = model.get_base_model()
    prefix = next(n for n, m in model.named_modules() if m is base) + "."
    layers = {f"{n}.base_layer.weight": layer for n, layer in lora_layers(model).items()}
    adapters = adapter_keys(model)
    merged = folder / "merged"
    merged.mkdir()
    with safe_open(str(folder / FINAL_FILE), framework="pt") as f:
        kept = [k for k in f.keys() if k not in adapters]

        def base_key(key: str) -> str:
            return key.removeprefix(prefix).replace(".base_layer.", ".")

        def value(key: str) -> torch.Tensor:
            weight, layer = f.get_tensor(key), layers.get(key)
            if layer is None:
                return weight
            owner = key.removesuffix(".base_layer.weight")
            a, b = (f.get_tensor(f"{owner}.lora_{ab}.{name}.weight").to(torch.float32) for ab in "AB")
            delta = (b @ a) * layer.scaling[name]
            return (weight.to(torch.float32) + (delta.T if layer.fan_in_fan_out else delta)).to(weight.dtype)

        def chunks() -> Iterator[dict[str, torch.Tensor]]:
            for key in kept:
                yield {base_key(key): value(key)}

        merged_layout = {base_key(key): layout[key] for key in kept}
        write_safetensors(merged / FINAL_FILE, merged_layout, chunks(), {"format": "pt"})
    files = model_files(base)
    for file_name, content in files.items():
        write_bytes_durably(merged / file_name, content)
    return [f"merged/{n}" for n in (FINAL_FILE, *files)]
