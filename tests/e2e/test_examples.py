"""The examples run as shipped (in-process, CPU)."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_transforms_example_with_an_nn_module_trainer():
    summary = await _load("transforms_cpu").run(steps=2)
    assert summary["tp0/2"]["version"] == summary["tp1/2"]["version"] == summary["fp8"]["version"] == 2
    assert summary["tp0/2"]["bytes"] == summary["tp1/2"]["bytes"]
    assert summary["fp8"]["fp8"] == 8  # qkv, o, gate_up, down in each of 2 layers; norms/embed/lm_head stay bf16
    assert summary[2]["bytes"] == sum(summary[k]["bytes"] for k in ("tp0/2", "tp1/2", "fp8"))
