"""Fake-tensor traces played once per distinct shape: within one plan (`make_plan`) or one search
(`plan --search`, whose candidates differ only in [parallel] keys and train.recompute) the config's
model, data and loss stay the same, so every trace of a microbatch (activations.FakeRun and what is
played on it: activations saved, per-stage op costs, tp payloads, pipeline boundary bytes) depends
only on the keys below: recompute, the rows of a microbatch, parallel.cp (a rank runs its 1/C
of each sequence: planned_batch.context_chunks), the pipeline cut, tp's plan and the dtype of the
working parameters (mixed-precision ZeRO's bf16)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any


@contextlib.contextmanager
def memoised_traces():
    """Meanwhile, each fake-tensor run and trace below is built or played once per distinct key
    (the functions swapped for memoised ones in every module that calls them by a name of its
    own). A plan of a Megatron row played tp's all-reduces and built its fake model twice over
    without: a fifth of its time."""
    from paratrain.cost import activations, step_time
    from paratrain.parallel.registry import SPECS
    from paratrain.parallel.spec import load

    for spec in SPECS.values():  # import every module that calls them before they are swapped
        load(spec.footprint), load(spec.step_time)

    def cut(bounds):
        return None if bounds is None else tuple(bounds)

    def fake_run_key(cfg, rows, bounds=None, tp_plan=None, tp=1, working=None, sharding=None):
        """What a fake-tensor run of a microbatch depends on (FakeRun.build, step_memory); the
        sharding follows from tp_plan and tp."""
        plan = tuple(sorted((tp_plan or {}).items())) if tp > 1 else ()
        return cfg.train.recompute, cfg.parallel.cp, rows, cut(bounds), plan, tp, working

    # each function and its memo key; every module that calls it by a name of its own gets the memo
    keys = {
        (activations, "saved_activation_bytes"): lambda cfg, rows, bounds=None, working=None: (
            cfg.train.recompute,
            cfg.parallel.cp,
            rows,
            cut(bounds),
            working,
        ),
        (activations, "tp_all_reduces"): lambda cfg, rows, bounds, tp_plan: (
            cfg.train.recompute,
            cfg.parallel.cp,
            rows,
            cut(bounds),
            tuple(sorted(tp_plan.items())),
        ),
        (activations, "boundary_bytes"): lambda cfg, model, bounds, rows: (cfg.parallel.cp, rows, cut(bounds)),
        (activations, "step_memory"): fake_run_key,
        (step_time, "stage_ops"): lambda cfg, rows, bounds: (cfg.train.recompute, cfg.parallel.cp, rows, cut(bounds)),
    }
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("paratrain.") and m is not None]
    callers = {
        (home, name): [m for m in modules if getattr(m, name, None) is getattr(home, name)] for home, name in keys
    }
    # the attributes as stored (FakeRun.build: the classmethod itself), to put back
    stored: dict[tuple[Any, str], Any] = {
        (owner, name): vars(owner)[name] for (_, name), owners in callers.items() for owner in owners
    }
    stored[activations.FakeRun, "build"] = vars(activations.FakeRun)["build"]

    def memoised(original, key):
        seen = {}

        def call(*args, **kwargs):
            k = key(*args, **kwargs)
            if k not in seen:
                seen[k] = original(*args, **kwargs)
            return seen[k]

        return call

    try:
        # a method replaced for the search's length (put back below)
        activations.FakeRun.build = memoised(activations.FakeRun.build, fake_run_key)  # type: ignore[method-assign]
        for (home, name), key in keys.items():
            shared = memoised(getattr(home, name), key)
            for owner in callers[home, name]:
                setattr(owner, name, shared)
        yield
    finally:
        for (owner, name), original in stored.items():
            setattr(owner, name, original)
