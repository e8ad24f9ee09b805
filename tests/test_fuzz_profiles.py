"""Issue 8: malformed device and cluster profiles never produce a traceback, a hang or an unvalidated exception.

The documents are mutations of the shipped `dgx-h100` cluster and `h100-sxm` device profiles, made with the
plan.json fuzzer's strategies (structural edits at any depth and byte-level damage, nesting included).
Each one goes through `soap profiles --check FILE --json` in-process: exit 0 with one JSON object, or
exit 2 with one `error:` line that is not the catch-all. A cluster file finds its device beside it
(`../devices/NAME.json`), so a damaged device is reached through an intact cluster too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from test_fuzz_plan_json import FUZZ, HANG_SECONDS, UNEXPECTED, damaged_bytes, mutated_plan, time_limit
from test_reliability_support import cli

from costmodel.profiles import PROFILES_DIR

SHIPPED = {"cluster": PROFILES_DIR / "clusters" / "dgx-h100.json", "device": PROFILES_DIR / "devices" / "h100-sxm.json"}


@pytest.fixture(scope="module")
def shipped() -> dict[str, dict]:
    return {kind: json.loads(path.read_text()) for kind, path in SHIPPED.items()}


def _layout(tmp: Path) -> dict[str, Path]:
    """tmp/clusters/dgx-h100.json and tmp/devices/h100-sxm.json, intact copies."""
    paths = {kind: tmp / f"{kind}s" / path.name for kind, path in SHIPPED.items()}
    for kind, path in paths.items():
        path.parent.mkdir(exist_ok=True)
        shutil.copyfile(SHIPPED[kind], path)
    return paths


def _check(raw: bytes, kind: str, tmp: Path) -> str:
    paths = _layout(tmp)
    paths[kind].write_bytes(raw)
    with time_limit(HANG_SECONDS):
        code, out, err = cli(["profiles", "--check", str(paths["cluster"]), "--json"])
    assert "Traceback" not in err, err
    if code == 0:
        assert json.loads(out) and not err.strip(), (out, err)
        return "ok"
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert UNEXPECTED not in lines[0], lines[0]
    assert out == ""
    return "error"


@pytest.mark.parametrize("kind", ["cluster", "device"])
def test_structurally_mutated_profiles_fail_cleanly(kind, shipped, tmp_path):
    @settings(FUZZ, max_examples=200)
    @given(doc=mutated_plan(shipped[kind]))
    def run(doc):
        _check(doc.encode(), kind, tmp_path)

    run()


@pytest.mark.parametrize("kind", ["cluster", "device"])
def test_byte_damaged_profiles_fail_cleanly(kind, shipped, tmp_path):
    @settings(FUZZ, max_examples=100)
    @given(raw=damaged_bytes(shipped[kind]))
    def run(raw):
        _check(raw, kind, tmp_path)

    run()


def test_the_intact_profiles_pass_the_check(tmp_path):
    assert _check(SHIPPED["cluster"].read_bytes(), "cluster", tmp_path) == "ok"
