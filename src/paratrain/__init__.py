"""paratrain: distributed training of PyTorch models.

`paratrain.init(...)` starts the Python API for your own training loop (paratrain/api); it is
imported when first asked for, so `import paratrain` (and the CLI's checks) stays free of torch."""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "init":
        from paratrain.api.handle import init

        return init
    raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
