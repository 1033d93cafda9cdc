"""paratrain: distributed training of PyTorch models."""

__version__ = "0.1.0"
