"""train.compile = true: torch.compile block by block, under every strategy.

Each block's forward is compiled in place (`block.forward = torch.compile(block.forward)`), once
the strategy has placed, sharded and cut the model (a strategy may run a block on the meta device
while it builds, which compiled code cannot take), so that:
  * the module objects, their names and parameters stay what every strategy and checkpoint knows;
  * a strategy's hooks run outside the compiled code, between blocks, as in eager mode: dp's
    gradient buckets still start their all-reduce while backward goes on, ZeRO-3 still gathers a
    unit just before its block and frees it after; tensor parallelism's sharded layers are traced
    inside their block; a pipeline stage runs its own blocks, compiled;
  * blocks of one kind share one compiled graph (torch's inline_inbuilt_nn_modules): the first step
    compiles each kind once.
The blocks: a model's pipeline_layers() (the built-in gpt: embedding, each transformer block,
head) or an nn.Sequential's children, those that hold parameters; else the elements of its
ModuleLists; else the whole model.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.errors import note


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The modules compile_blocks compiles, each once."""
    if hasattr(model, "pipeline_layers") or isinstance(model, nn.Sequential):  # the layers a pipeline cuts between
        layers = model.pipeline_layers() if hasattr(model, "pipeline_layers") else list(model)
        layers = [m for m in layers if any(True for _ in m.parameters())]
    else:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        inner = {id(m) for lst in lists for m in lst.modules() if m is not lst}
        layers = [m for lst in lists if id(lst) not in inner for m in lst] or [model]
    return list({id(m): m for m in layers}.values())


def compile_blocks(model: nn.Module) -> int:
    """Compile each block's forward in place (lazily: the first call traces it); how many blocks."""
    from torch._dynamo.utils import counters

    # A run of its own in a process that ran others (the test tier's gang, a bench): its graphs,
    # none of an earlier model's, and its own count of graphs and breaks
    torch._dynamo.reset()
    counters.clear()
    found = blocks_of(model)
    for block in found:
        block.forward = torch.compile(block.forward)
    return len(found)


def report_graph_breaks(is_main: bool, seconds: float) -> None:
    """Once, after the first step: what torch.compile made of the blocks, and the graph breaks it
    met (each one's code runs eagerly)."""
    from torch._dynamo.utils import counters

    if not is_main:
        return
    breaks = counters["graph_break"]
    line = f"torch.compile: {counters['stats']['unique_graphs']} graph(s) in the first step's {seconds:.1f}s"
    if breaks:
        first = next(iter(breaks)).splitlines()[0][:160]
        line += f"; {sum(breaks.values())} graph break(s) of {len(breaks)} kind(s), the first: {first}"
    note(line)
