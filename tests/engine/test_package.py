"""The packages' public names: importable from their top, loaded on first use."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import weightsync.engine as engine
import weightsync.roles as roles

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("package", [engine, roles])
def test_every_public_name_resolves_from_the_top(package):
    for name in package.__all__:
        assert getattr(package, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        package.nope


def test_importing_the_packages_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, weightsync.engine, weightsync.roles, weightsync.wire; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
