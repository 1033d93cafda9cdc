"""`[model] factory = "hf"`: a Hugging Face transformers model, unmodified (extra `paratrain[hf]`).

    [model]
    factory = "hf"
    task = "causal-lm"                 # a head as transformers' Auto classes name them (TASKS)
    config = { model_type = "llama", hidden_size = 64, num_hidden_layers = 2, ... }   # random init
    # or: pretrained = "DIR"           # a local directory written by save_pretrained (never a download)

The model is built from the seeded random-number stream like any factory's, so every strategy
starts from the same weights. `final/` of such a run is also a Hugging Face model directory:
`model_files` adds its `config.json` beside `model.safetensors`."""

from __future__ import annotations

import os

import torch
from torch import nn

from paratrain.checkpoint.weights import DcpWeights, is_dcp
from paratrain.config import ArgumentError, require
from paratrain.extras import require as require_extra
from paratrain.models.pretrained import check_weights, load_weights, pretrained_dir, shapes_only, without_weights

# task -> the Auto class that builds it and loads final/ back (`AutoModelFor...from_pretrained`)
TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "masked-lm": "AutoModelForMaskedLM",
    "question-answering": "AutoModelForQuestionAnswering",
    "image-classification": "AutoModelForImageClassification",
    "base": "AutoModel",
}


def hf(config: dict | None = None, pretrained: str = "", task: str = "causal-lm") -> nn.Module:
    """A transformers model for `task`: from `config` at random init, or loaded from `pretrained`."""
    require(task in TASKS, "task", f"must be one of {' | '.join(TASKS)}, got {task!r}")
    require(
        config is None or isinstance(config, dict), "config", f"must be a table {{ model_type = ... }}, got {config!r}"
    )
    require(bool(config) != bool(pretrained), "config", "give either config = { model_type = ... } or pretrained")
    require_extra("transformers", '[model] factory = "hf"')
    import transformers

    try:
        return _build(transformers, TASKS[task], config, pretrained)
    except (ImportError, RuntimeError) as exc:  # transformers imports a model's class when first asked
        if not _failed_import(exc):
            raise  # the model's own construction (fake tensors under `plan`, say): the caller's to handle
        raise ArgumentError("factory", import_failure(exc)) from None


def worker_modules(config: dict | None = None, task: str = "causal-lm", pretrained="", **_) -> tuple[str, ...]:
    """The transformers modules each worker imports to build this model (`[model]`'s keys), for the
    worker server to import once before it forks them (launch.start_worker_server's preload): about
    8 s of CPU a worker here, above torch's own import. The family's module is named as transformers
    names it for most model types (a pretrained directory's from its config.json); a name that does
    not import is skipped by the server, and the worker imports what it needs itself."""
    if not isinstance(task, str) or task not in TASKS:  # the preflight, after, names the key
        return ()
    modules = ["transformers.models.auto.configuration_auto", "transformers.models.auto.modeling_auto"]
    if config is None and isinstance(pretrained, str) and pretrained:
        config = _saved_config(pretrained)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    family = model_type.replace("-", "_") if isinstance(model_type, str) else ""
    if family.isidentifier():
        modules.append(f"transformers.models.{family}.modeling_{family}")
    return tuple(modules)


def _saved_config(pretrained: str) -> dict | None:
    """A pretrained directory's config.json, or None where it has none that reads (the preflight,
    after, names the key)."""
    import json

    try:
        return json.loads((pretrained_dir(pretrained) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _build(transformers, auto_name: str, config: dict | None, pretrained: str) -> nn.Module:
    auto = getattr(transformers, auto_name)
    if pretrained:
        path = pretrained_dir(pretrained)
        require((path / "config.json").is_file(), "pretrained", f"{path} holds no config.json (save_pretrained's)")
        try:
            # no weight is needed (from_pretrained refuses a meta device), materialize reads them, or
            # they are in torch's format, read below
            if not (shapes_only() or without_weights() or is_dcp(path)):
                return auto.from_pretrained(str(path), local_files_only=True)
            model = auto.from_config(transformers.AutoConfig.from_pretrained(str(path), local_files_only=True))
        except (OSError, ValueError) as exc:
            raise ArgumentError("pretrained", f"{path}: {str(exc).splitlines()[0]}") from None
        if is_dcp(path):  # the model's own names, beside save_pretrained's config.json
            weights = DcpWeights(path)
            check_weights(model, weights)  # from DCP's metadata: before any worker starts, on meta
            if not (shapes_only() or without_weights()):
                load_weights(model, weights)
        return model
    assert config is not None  # hf() requires config without pretrained
    settings = dict(config)
    model_type = settings.pop("model_type", None)
    require(isinstance(model_type, str), "config", "needs model_type (e.g. model_type = 'llama')")
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **settings)
        return auto.from_config(hf_config)
    except (ValueError, KeyError, TypeError, AssertionError) as exc:  # torch's modules assert their sizes
        raise ArgumentError("config", f"{model_type}: {str(exc).splitlines()[0]}") from None


def _failed_import(exc: BaseException | None) -> bool:
    """Whether `exc` says an import failed (transformers wraps one in RuntimeError)."""
    while exc is not None:
        if isinstance(exc, ImportError) or str(exc).startswith("Failed to import"):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def import_failure(exc: BaseException) -> str:
    """One line for transformers failing to import a model's class, naming the root cause: the
    innermost exception of the chain, where transformers' own only says "Could not import module".
    A torchvision built for another torch (a CUDA wheel beside the CPU torch) breaks every
    transformers model, since transformers imports it for its image utilities: said so."""

    root = exc
    while (parent := root.__cause__ or root.__context__) is not None:
        root = parent
    files, tb = [], root.__traceback__
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    first = (str(exc).splitlines() or [type(exc).__name__])[0].split(". ")[0]  # less transformers' advice
    why = (str(root).splitlines() or [""])[0]
    line = f"transformers cannot import the model ({first}), because of {type(root).__name__}: {why}"
    if any(f"{os.sep}torchvision{os.sep}" in f for f in files) or "torchvision" in str(root):
        line += (
            f"; it comes from torchvision, which transformers imports for every model: an installed torchvision "
            f"that does not match torch {torch.__version__} breaks them all (install the matching torchvision, "
            f"or uninstall it)"
        )
    return line


def model_files(model: nn.Module) -> dict[str, bytes]:
    """The files beside model.safetensors that make `final/` a Hugging Face model directory
    (`from_pretrained(RUN_DIR / "final")`): a transformers model's config.json; none for others."""
    config = getattr(model, "config", None)
    if not (hasattr(model, "save_pretrained") and hasattr(config, "to_json_string")):
        return {}
    assert config is not None  # it has to_json_string
    files = {"config.json": config.to_json_string().encode()}
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "to_json_string"):
        files["generation_config.json"] = generation.to_json_string().encode()
    return files


# transformers' experts modules (Mixtral's, Qwen2-MoE's and most MoE families'
# `@use_experts_implementation` classes): all experts' weights as 3-D stacks, called by their MoE
# block with each token's top-k expert indices and routing weights (parallel/expert/hf_experts.py)
EXPERTS_INTERFACE = ["self", "hidden_states", "top_k_index", "top_k_weights"]


def hf_experts(model: nn.Module) -> list[nn.Module]:
    """The model's transformers experts modules (parallel.ep splits them; plan times their tokens)."""
    return [m for m in model.modules() if _is_routed_experts(m)]


def _is_routed_experts(module: nn.Module) -> bool:
    import inspect

    # `_is_expert_parallel` is what transformers' use_experts_implementation sets on its classes;
    # the forward's parameters (wraps keeps the original's) say how tokens and weights come in
    if "_is_expert_parallel" not in vars(module) or not isinstance(getattr(module, "num_experts", None), int):
        return False
    return list(inspect.signature(type(module).forward).parameters)[:4] == EXPERTS_INTERFACE
