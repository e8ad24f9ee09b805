"""docs/walkthrough.md works as written: every ```bash block runs, in order, in an empty directory, with
`soap` being this checkout's CLI; the install block is checked against pyproject.toml (it is not run: no
network in tests). The run's stderr carries no warning raised from soap's own code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WALKTHROUGH = ROOT / "docs" / "walkthrough.md"
OWN_WARNING = re.compile(r"/(soap|tracer|costmodel|planner|executor)/[\w/]+\.py:\d+: \w*Warning")
"""A warning as `warnings` prints it, raised from a file of soap's own packages."""


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", WALKTHROUGH.read_text(), flags=re.S)


def test_the_install_block_installs_the_checkout_with_the_data_extra():
    install, = [block for block in bash_blocks() if block.startswith("pip install")]
    assert 'pip install -e ".[data]"' in install and "soap[" not in install
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("datasets") for dep in extras["data"])


@pytest.mark.slow
def test_every_walkthrough_command_runs(tmp_path):
    pytest.importorskip("datasets")
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    (bin_dir / "soap").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m soap "$@"\n')
    (bin_dir / "soap").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    outputs = []
    for block in bash_blocks():
        if block.startswith("pip install"):
            continue
        proc = subprocess.run(["bash", "-e", "-c", block], cwd=work, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"{block}\n{proc.stderr[-3000:]}"
        assert not OWN_WARNING.search(proc.stderr), proc.stderr[-3000:]
        outputs.append(proc)
    execute = next(p for p in outputs if "loss" in p.stderr and "report" in p.stderr)
    assert "wrote trained: config.json, model.safetensors and the tokenizer from tok" in execute.stderr
    assert "synthetic" not in execute.stderr
    assert outputs[-1].stdout.startswith("the cat sat on the")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (work / "trained").iterdir()}


def test_no_doc_or_help_installs_soap_from_the_registry():
    """`pip install 'soap[data]'` fetches another project named soap; the extra comes from the checkout."""
    from soap.cli import build_parser

    texts = {p: p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]}
    texts["soap execute --help"] = build_parser(["execute"]).commands["execute"].format_help()
    texts["executor/data.py"] = (ROOT / "executor" / "data.py").read_text()
    assert [name for name, text in texts.items() if re.search(r"install\s+['\"]?soap\[", text)] == []
    assert "-e '.[data]'" in texts["soap execute --help"]


def test_the_readme_says_a_plain_pytest_checks_torchtitan_exports_by_field_names_only():
    readme = (ROOT / "README.md").read_text()
    tests_section = readme[readme.index("Run the tests:"):readme.index("## What it does")]
    assert "torchtitan" in tests_section and ".ci/run" in tests_section
