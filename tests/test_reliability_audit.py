"""Issue 8 §4: nothing in soap's packages reads a file with pickle or eval.

An AST scan of every module of the installed packages (soap, tracer, costmodel, planner, executor; not
tests, not benchmarks) fails on: importing pickle-like modules (pickle, cPickle, dill, cloudpickle,
marshal, shelve, joblib), calling eval / exec / compile / __import__, `torch.load` without
`weights_only=True`, `numpy.load(..., allow_pickle=True)`, and `yaml.load` / `yaml.unsafe_load`.
Docstrings and comments do not count, so "never pickles" in a docstring is fine.

Known and outside soap's code: torch.distributed.checkpoint stores its `.metadata` with pickle and
reads it back with `pickle.load` on `--resume` (see docs/reliability.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("soap", "tracer", "costmodel", "planner", "executor")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
DYNAMIC_CODE = {"eval", "exec", "compile", "__import__"}


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_reads(source: str, filename: str = "<source>") -> list[str]:
    """`file:line: what` for every unsafe construct in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
            if isinstance(func, ast.Name) and name in DYNAMIC_CODE:
                found.append(f"{where}: {name}()")
            elif owner == "builtins" and name in DYNAMIC_CODE:
                found.append(f"{where}: builtins.{name}()")
            elif owner == "torch" and name == "load" and not _is_true(_keyword(node, "weights_only")):
                found.append(f"{where}: torch.load without weights_only=True")
            elif owner in ("np", "numpy") and name == "load" and _is_true(_keyword(node, "allow_pickle")):
                found.append(f"{where}: numpy.load(allow_pickle=True)")
            elif owner == "yaml" and name in ("load", "unsafe_load", "full_load"):
                found.append(f"{where}: yaml.{name}")
    return found


def test_the_scan_catches_what_it_looks_for():
    bad = ("import pickle\nfrom dill import loads\nx = eval('1')\nexec('y=1')\nimport torch\n"
           "torch.load('f')\ntorch.load('f', weights_only=False)\nimport numpy as np\nnp.load('f', allow_pickle=True)\n")
    assert len(unsafe_reads(bad)) == 7
    good = ('"""never pickles or evals"""\nimport torch\ntorch.load("f", weights_only=True)\n'
            "import numpy as np\nnp.load('f', mmap_mode='r')\nimport json\njson.loads('{}')\n")
    assert unsafe_reads(good) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_pickle_or_eval_in_soap_packages(package):
    found = [hit for path in _modules() if path.relative_to(ROOT).parts[0] == package
             for hit in unsafe_reads(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


def test_every_package_is_scanned():
    assert {p.relative_to(ROOT).parts[0] for p in _modules()} == set(PACKAGES)
