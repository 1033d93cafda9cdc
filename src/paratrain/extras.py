"""Optional extras: packages that only some commands need, and the one-line hint when one is missing.

    pip install 'paratrain[report]'     matplotlib (report plots, benchmark plots), tensorboard
    pip install 'paratrain[datasets]'   scikit-learn (the built-in digits dataset)
    pip install 'paratrain[hf]'         transformers ([model] factory = "hf")
    pip install 'paratrain[lora]'       peft ([model] lora = { ... })
    pip install 'paratrain[mlflow]'     mlflow-skinny ([log] mlflow = true)
    pip install 'paratrain[wandb]'      wandb ([log] wandb = true)

`make setup` installs them all (through the test extra)."""

from __future__ import annotations

from importlib.util import find_spec

# import name -> (distribution to install, extra that brings it)
EXTRAS = {
    "matplotlib": ("matplotlib", "report"),
    "tensorboard": ("tensorboard", "report"),
    "sklearn": ("scikit-learn", "datasets"),
    "transformers": ("transformers", "hf"),
    "peft": ("peft", "lora"),
    "mlflow": ("mlflow-skinny", "mlflow"),
    "wandb": ("wandb", "wandb"),
}


class MissingExtra(ImportError):
    """An optional package is not installed; the message says how to install it."""


def hint(module: str) -> str | None:
    """Why `module` cannot be used, or None when it is installed."""
    if find_spec(module) is not None:
        return None
    package, extra = EXTRAS[module]
    return f"needs {package}, which is not installed: pip install 'paratrain[{extra}]'"


def require(module: str, what: str) -> None:
    """Raise MissingExtra, naming `what` needs it, when `module` is not installed."""
    if why := hint(module):
        raise MissingExtra(f"{what} {why}")
