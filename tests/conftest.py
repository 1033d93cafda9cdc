"""Two tiers. The fast tier runs strategies in worker processes that stay up (the `gang` fixture):
no command, no elastic agent. The integration tier starts real commands and processes: `paratrain
run` and its launches, torchrun, kills, signals, clusters. A test is in the integration tier when
it, or a function of its module it calls (a fixture, a helper), starts one: it is marked
`integration` at collection, so a new test lands in the right tier by itself.

    make test        both tiers
    make test-fast   the fast tier (pytest -m "not integration")
"""

import inspect
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the tests' own cache of machine calibrations (a `plan --calibrate` kept in the user's would
# change what every later `plan` without --cluster predicts, and time layers there)
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="paratrain-tests-cache-")

# One compute thread per process: the two test processes (make test) share the machine's cores and
# each starts workers of its own, and OpenMP's threads spin while they wait for a core: the pipeline
# oracle (tests/fake_ranks.py) took 25 s of CPU with two threads and 9 s with one, for the same counts.
# A launch gives its workers this count (launch.py sets OMP_NUM_THREADS only where it is unset).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from paratrain.models.hf import worker_modules  # noqa: E402
from paratrain.testing.gang import Gangs  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # this process's own work: references, plans

# what starts a command or an interpreter of its own
LAUNCHES = re.compile(
    r"\brun_cli\(|\brun_torchrun\(|\bsubprocess\.|\bPopen\(|\brun_and_kill\(|\bstart_processes\(|\bspawn\(|\boutputs_of\("
)
NAME = re.compile(r"\b([A-Za-z_]\w*)\b")


def _launches(function, module, seen: set) -> bool:
    """Whether `function` starts a process, itself or through a function of `module` it names."""
    if function in seen:
        return False
    seen.add(function)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    if LAUNCHES.search(source):
        return True
    for name in set(NAME.findall(source)):
        other = getattr(module, name, None)
        other = getattr(other, "__wrapped__", other)  # a fixture's function
        if inspect.isfunction(other) and other.__module__ == module.__name__ and _launches(other, module, seen):
            return True
    return False


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: starts real commands or processes (the integration tier)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module
        seen: set = set()
        fixtures = [getattr(module, name, None) for name in getattr(item, "fixturenames", ()) if hasattr(module, name)]
        functions = [item.function, *(getattr(f, "__wrapped__", f) for f in fixtures if f is not None)]
        if any(inspect.isfunction(f) and _launches(f, module, seen) for f in functions):
            item.add_marker(pytest.mark.integration)
    # The longest modules first: `make test` hands whole modules to its two processes in this
    # order, and a long module handed out last kept one process busy while the other sat idle
    # (test_continue alone for the last two minutes). A test that starts commands weighs about ten
    # in-process ones; one skipped here (no GPU) nothing.
    weight: dict[str, int] = {}
    for item in items:
        skipped = any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))
        cost = 0 if skipped else 10 if item.get_closest_marker("integration") else 1
        weight[item.module.__name__] = weight.get(item.module.__name__, 0) + cost
    items.sort(key=lambda item: -weight[item.module.__name__])  # stable: a module's own order kept


@pytest.fixture(autouse=True)
def environment_restored():
    """Each test starts from the environment the session started with: a command run in this
    process (main(["run", ...])) sets variables for its workers (GLOO_SOCKET_IFNAME=lo for a local
    run, OMP_NUM_THREADS) that would otherwise reach the processes a later test starts (a two-node
    Slurm job then bound loopback on both nodes)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# The transformers modules the tests' most used Hugging Face families build from, imported once by the
# gang's fork server instead of by every member (about 2.7 s of CPU each; a gang starts afresh after
# 40 jobs and after a failed one, which many tests mean to cause).
HF_PRELOAD = tuple(
    dict.fromkeys(
        m
        for family in ("llama", "mixtral", "qwen2", "qwen2_moe", "gpt2", "bert")
        for m in worker_modules(config={"model_type": family})
    )
)


@pytest.fixture(scope="session")
def gang():
    """`gang(world)`: a live gang of `world` worker processes for in-process runs (the fast tier;
    paratrain/testing/gang.py), one per world size and test process, kept for the whole session."""
    gangs = Gangs(preload=HF_PRELOAD)
    yield gangs
    gangs.close()
