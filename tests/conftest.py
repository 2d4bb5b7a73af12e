"""The suite mirrors the package layout (tests/wire, tests/engine/..., tests/roles) plus end-to-end
tests (tests/e2e); helper modules live here, at the top, importable from every folder."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run (deterministic seeds): a failure reproduces.
settings.register_profile("weightsync", derandomize=True)
settings.load_profile("weightsync")
