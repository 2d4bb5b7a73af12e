"""The suite mirrors the package layout (tests/wire, tests/engine/..., tests/roles) plus end-to-end
tests (tests/e2e); helper modules live here, at the top, importable from every folder."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run (deterministic seeds): a failure reproduces.
settings.register_profile("weightsync", derandomize=True)
settings.load_profile("weightsync")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_round_keeps_the_collector_paused():
    """Every controller and worker lets go of the garbage collector once its rounds end or it closes
    (``engine.aio.Collector``): after each test it runs again, as it did before."""
    yield
    from weightsync.engine.aio import Collector

    held = Collector.paused()
    Collector.resume(held)  # (so one leak fails one test, not every later one)
    assert held == 0 and gc.isenabled(), f"{held} round(s) left the garbage collector paused"
