"""Packaging and layering: one top-level import name, and arrows that point one way (roles -> engine -> wire)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import tempfile

import pytest

import lint_imports

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("wire", "engine", "roles")  # each may import only the ones before it


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_import_each_other_by_the_package_name(layer):
    """``import engine.x`` would work in a checkout and break in a wheel (the contracts below read
    ``weightsync.*`` only, so they would not see it either)."""
    bad = [f"{path.relative_to(ROOT)}: bare '{name}' (import weightsync.{name})"
           for path in sorted((ROOT / layer).rglob("*.py")) for name in _imports(path)
           if name.split(".")[0] in LAYERS]
    assert not bad, "\n".join(bad)


def test_the_import_contracts_hold():
    """setup.cfg's import-linter contracts: roles -> engine -> wire, wire sans-IO, the planner pure,
    transforms apart from the data path, no loops among the transports or the wire's modules."""
    with tempfile.TemporaryDirectory() as tmp:
        done = lint_imports.lint(lint_imports.lay_out(pathlib.Path(tmp)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 6 kept, 0 broken" in done.stdout


@pytest.mark.parametrize("where, line, contract", [
    ("weightsync/engine/plan/planner.py", "import weightsync.roles.controller", "roles -> engine -> wire"),
    ("weightsync/wire/codec.py", "import zmq", "wire is sans-IO"),
    ("weightsync/engine/plan/model.py", "import weightsync.engine.datapath.pipeline", "the planner is pure"),
    ("weightsync/engine/transports/tcp_frames.py", "import weightsync.engine.transports.tcp", "without loops"),
])
def test_a_planted_forbidden_import_breaks_the_contracts(where, line, contract):
    with tempfile.TemporaryDirectory() as tmp:
        dest = lint_imports.lay_out(pathlib.Path(tmp))
        with open(dest / where, "a") as f:
            f.write("\n" + line + "\n")
        done = lint_imports.lint(dest)
    assert done.returncode != 0
    broken = done.stdout[done.stdout.index("Broken contracts"):]
    assert contract in broken, done.stdout


def test_importing_weightsync_is_light_and_names_resolve():
    code = ("import sys, weightsync; assert 'torch' not in sys.modules, 'torch'; "
            "print(weightsync.WeightSender.__module__, weightsync.Controller.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.split() == ["weightsync.roles.sender", "weightsync.roles.controller"], out.stderr


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_package(tmp_path):
    """Build the wheel, install it into a bare folder, and import it from outside the repository."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("weightsync-*.whl")
    target = tmp_path / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr
    top = sorted(p.name for p in target.iterdir() if p.name != "bin")
    assert [n for n in top if not n.endswith(".dist-info")] == ["weightsync"], top
    assert (target / "weightsync" / "engine" / "transports" / "tcp.py").is_file()
    code = ("import weightsync, weightsync.engine.transports.tcp as t, weightsync.wire as w; "
            "from weightsync import Controller, WeightSender, WeightReceiver; "
            "print(weightsync.__file__); print(t.__file__); print(w.PROTOCOL_VERSION)")
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(str(target)) and lines[1].startswith(str(target)), lines
    entry = (target / "weightsync-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "weightsync = weightsync.roles.cli:main" in entry
    assert "[vllm.general_plugins]\nweightsync = weightsync.roles.integrations.vllm_backend:register" in entry


def test_the_vllm_plugin_is_declared_and_nothing_else_imports_vllm():
    """vLLM loads the backend through the entry point; importing weightsync and its integrations package
    (where vLLM is absent, as here, or present) never imports vLLM."""
    from importlib.metadata import entry_points

    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "weightsync"]
    assert plugin.value == "weightsync.roles.integrations.vllm_backend:register"
    code = ("import sys, weightsync, weightsync.roles.integrations, weightsync.roles.integrations.vllm_worker; "
            "assert 'vllm' not in sys.modules, 'vllm'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr


MAX_METHODS = 25  # a class in roles/ with more is doing several jobs: split it into parts it owns


def test_no_class_in_roles_has_more_than_25_methods():
    """The controller and the workers are made of parts; a class that grows past the limit names itself."""
    big = []
    for path in sorted((ROOT / "roles").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                count = sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for f in node.body)
                if count > MAX_METHODS:
                    big.append(f"{path.relative_to(ROOT)}: {node.name} has {count} methods")
    assert not big, "\n".join(big)
