"""ZeRO's spec: what stages 1-3 accept and cost (torch-free)."""

from __future__ import annotations

from paratrain.parallel.spec import Spec


class ZeroSpec(Spec):
    """ZeRO stage 1, 2 or 3: one replica's state sharded over every rank."""

    footprint = "paratrain.parallel.zero.footprint:zero"
    replica_footprint = "paratrain.parallel.zero.footprint:replica"
    step_time = "paratrain.parallel.zero.step_time:zero"
    codecs = ("none", "bf16", "fp16")  # a reduce-scatter sums shards: no codec of whole gradients
    materializes_models = True
    searched_as = "replica"
    takes_replicas = True
    degrees = ("cp", "ep")

    def __init__(self, stage: int):
        self.stage = stage
        self.name = self.checkpoint_family = f"zero{stage}"
        self.engine_path = f"paratrain.parallel.zero.stages:Zero{stage}"
        # zero3 frees and makes its units' full tensors every step: kept freed memory only adds to its peak
        self.gives_freed_memory_back = stage == 3

    def codec_refusal(self, compression: str) -> str:
        return (
            f"{compression!r} needs an all-reduce of whole gradients; {self.name}'s reduce-scatter "
            f"takes {', '.join(map(repr, self.codecs[:-1]))} or {self.codecs[-1]!r}"
        )
