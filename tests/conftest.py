"""The suite mirrors the package layout (tests/wire, tests/engine/..., tests/roles) plus end-to-end
tests (tests/e2e); helper modules live here, at the top, importable from every folder."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
