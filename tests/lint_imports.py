"""Run import-linter's contracts (setup.cfg) over the checkout, laid out as installed.

    .venv/bin/python tests/lint_imports.py            # exit status of lint-imports
    .venv/bin/python tests/lint_imports.py --plant weightsync/engine/plan/planner.py "import weightsync.roles"

How this works: in a checkout the layers live beside ``weightsync/`` and its ``__path__`` reaches them at
run time; import-linter reads files, not ``__path__``, so it would see no ``weightsync.engine`` at all.
This copies ``weightsync/``, ``engine/``, ``wire/`` and ``roles/`` into a temporary
``weightsync/{engine,wire,roles}`` (as a wheel installs them) and runs ``lint-imports`` there with
setup.cfg's contracts. ``--plant FILE LINE`` appends a line to one copied file first (the test that the
linter really fails on a forbidden import).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("engine", "wire", "roles")


def lay_out(dest: pathlib.Path) -> pathlib.Path:
    """``dest/weightsync`` as installed; returns ``dest``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "weightsync", dest / "weightsync", ignore=ignore)
    for layer in LAYERS:
        shutil.copytree(ROOT / layer, dest / "weightsync" / layer, ignore=ignore)
    return dest


def lint(dest: pathlib.Path) -> subprocess.CompletedProcess:
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(dest)}
    return subprocess.run([str(exe), "--no-cache", str(ROOT / "setup.cfg")], cwd=dest, env=env,
                          capture_output=True, text=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plant", nargs=2, metavar=("FILE", "LINE"), help="append LINE to FILE of the copy first")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dest = lay_out(pathlib.Path(tmp))
        if args.plant:
            with open(dest / args.plant[0], "a") as f:
                f.write("\n" + args.plant[1] + "\n")
        done = lint(dest)
    print(done.stdout, done.stderr, sep="")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
