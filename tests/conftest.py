import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402

from paratrain.testing.gang import Gangs  # noqa: E402


@pytest.fixture(scope="session")
def gang():
    """`gang(world)`: a live gang of `world` worker processes for in-process runs (the fast tier;
    paratrain/testing/gang.py), one per world size and test process, kept for the whole session."""
    gangs = Gangs()
    yield gangs
    gangs.close()
