"""How one bucket of gradients is averaged across a group: the interface of every codec
(codecs/basic.py names them, powersgd.py is the one with most arithmetic).

The seam (like a DDP comm hook): before the backward, a strategy clears each bucket's flat gradient
buffer with `codec.reset(key, flat, shapes)` (not zero_(): codecs with error feedback keep last
step's error there, so backward accumulates grad + error at no extra pass over memory). It then hands
it to `codec.launch(key, flat, shapes, group, profiler)` the moment the bucket is ready and keeps the
returned handle. After the backward it calls `handle.advance()` on every bucket (a codec with a
second round of communication starts it there, so that round overlaps the next buckets' work), then
`handle.wait()`, after which `codec.result(key, flat)` holds the average over the group (exactly,
or approximately for lossy codecs): `flat` itself, or for PowerSGD a second buffer, since `flat`
keeps the error; `codec.result_norm(key)` is its 2-norm where the codec took it on the way (else
None). `key` names the bucket across steps, so codecs with memory (error feedback, warm
start) keep per-bucket state; after a step skipped for a non-finite gradient, `codec.discard(key)` (with
`flat` zeroed) drops that memory, which the bad gradient would otherwise poison for good.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.comm.collectives import Handle


class Codec:
    """What a codec does unless it says otherwise: no memory between steps (reset zeroes the bucket,
    the result is the bucket itself), and in a group of one nothing to send."""

    def reset(self, key, flat: torch.Tensor, shapes) -> None:
        flat.zero_()

    def launch(self, key, flat: torch.Tensor, shapes, group, profiler) -> Handle:
        world = dist.get_world_size(group)
        if world == 1:
            return Handle()
        return self.start(key, flat, shapes, group, profiler, world)

    def start(self, key, flat: torch.Tensor, shapes, group, profiler, world: int) -> Handle:
        """Start averaging `flat` over `group` (of `world` ranks, more than one)."""
        raise NotImplementedError

    def result(self, key, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def result_norm(self, key) -> torch.Tensor | None:
        """The 2-norm of result(key) where the codec had it at hand anyway, else None."""
        return None

    def discard(self, key) -> None:
        pass

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        pass
