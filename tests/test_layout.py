"""Imports flow one way (DESIGN.md): tracer → costmodel → planner → executor, with soap/ on top; and
inside a layer, the stages kept in subpackages are only imported from above them: the cost model's
pricing and simulation never import calibration (calibration fits what they read), and the modules
that realize a plan never import validation (validation runs them). Every import counts, lazy ones
inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("tracer", "costmodel", "planner", "executor", "soap")
STAGES = {"costmodel.calibration": "costmodel", "executor.validation": "executor"}
"""A subpackage, and the layer whose other modules must not import it."""


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _sources() -> list[Path]:
    return sorted(p for layer in LAYERS for p in (ROOT / layer).rglob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_one_way(path):
    module = _module(path)
    rank = LAYERS.index(module.split(".")[0])
    upward = sorted(name for name in _imports(path) if name.split(".")[0] in LAYERS[rank + 1:])
    assert not upward, f"{module} imports from a later layer: {upward}"
    for stage, layer in STAGES.items():
        if module.startswith(layer + ".") and not (module == stage or module.startswith(stage + ".")):
            inward = sorted(name for name in _imports(path) if name == stage or name.startswith(stage + "."))
            assert not inward, f"{module} imports {stage}, a stage built on top of it: {inward}"
