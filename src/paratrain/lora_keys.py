"""[model] lora's keys: what each must be, checked with the rest of the config before any worker
starts (torch-free, like config.py); models/lora.py wraps the model with them."""

from __future__ import annotations

from paratrain.errors import ConfigError
from paratrain.extras import hint

# each key: (whether a value fits, what a value must be)
LORA_KEYS = {
    "r": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
    "alpha": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "a number > 0"),
    "dropout": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1, "in [0, 1)"),
    "target_modules": (
        lambda v: isinstance(v, list) and bool(v) and all(isinstance(m, str) and m for m in v),
        "a non-empty list of module names",
    ),
}
# the strategies that train a LoRA model: its frozen parameters take no gradient there (tp and pp
# know nothing of them yet)
LORA_STRATEGIES = ("dp", "zero1", "zero2", "zero3")


def check_lora(v):
    """Keys among r, alpha, dropout, target_modules; peft must be installed (`pip install 'paratrain[lora]'`)."""
    for key, value in v.items():
        if key not in LORA_KEYS:
            raise ConfigError(f"model.lora.{key}", f"unknown key (known: {', '.join(LORA_KEYS)})")
        fits, what = LORA_KEYS[key]
        if not fits(value):
            raise ConfigError(f"model.lora.{key}", f"must be {what}, got {value!r}")
    return hint("peft") if v else None
