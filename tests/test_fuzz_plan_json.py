"""Issue 8 §2: malformed plan.json documents never produce a traceback, a hang or a half-written file.

The documents are mutations of one real plan (`soap plan gpt2 --gpus 2`, searched once per session):
structural edits (drop, rename, retype, out-of-range numbers, wrong schema versions, 1-3 edits at any
depth, including the inline model config and cluster profile) and byte-level damage (truncation, random
bytes, flipped bytes, odd encodings). Each document goes through `planner.plan.load_plan`, which must
return a Plan or raise SoapError and nothing else, and through `soap simulate PLAN --json --trace FILE`
in-process, which must exit 0 or 2 with one `error: ...` line, raise no unexpected exception, and leave
`--trace FILE` either absent or complete JSON.
"""

from __future__ import annotations

import json
import math
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_reliability_support import cli, gpt2_plan_text

from planner.plan import Plan, load_plan
from tracer.errors import SoapError

HANG_SECONDS = 20
UNEXPECTED = "(rerun with --debug for the traceback)"
"""soap.cli's suffix for an exception that is not a SoapError: an input nobody validated."""
FUZZ = settings(max_examples=800, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
"""Derandomized so CI is reproducible; no deadline (a shared 2-core box stalls), hangs are cut by SIGALRM."""


@contextmanager
def time_limit(seconds: float):
    def hang(signum, frame):
        raise TimeoutError(f"hung for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def valid_plan() -> dict:
    """The plan as a dict (the first simulation of it warms the in-memory trace cache for the rest)."""
    return json.loads(gpt2_plan_text())


def _paths(node, prefix=()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += _paths(value, (*prefix, index))
    return out


ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, -1, 1, 2, 3, 7, 2**31, 2**63, -(2**63), 10**30]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["", "fp4", "ZigZag", "sample", "colwise", "../../etc/passwd", "sha256:00", "1e309"]),
    st.lists(st.integers(-3, 9), max_size=6), st.dictionaries(st.text(max_size=6), st.integers(), max_size=3),
)


@st.composite
def mutated_plan(draw, plan: dict) -> str:
    doc = json.loads(json.dumps(plan))
    top = _paths(doc)
    shallow = [p for p in top if p[0] not in ("model", "cluster") or len(p) <= 2 or p[1] not in ("config", "profile")]
    for _ in range(draw(st.integers(1, 3))):
        pool = shallow if draw(st.integers(0, 3)) else top
        path = draw(st.sampled_from(pool))
        parent = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            last = path[-1]
            parent[last]  # noqa: B018 - the path may have been removed by an earlier edit
        except (KeyError, IndexError, TypeError):
            continue
        action = draw(st.sampled_from(["drop", "rename", "retype", "number", "version", "shrink"]))
        if action == "drop":
            del parent[last]
        elif action == "rename" and isinstance(parent, dict):
            parent[draw(st.sampled_from([f"{last}_", str(last).upper(), "", "__class__"]))] = parent.pop(last)
        elif action == "number":
            parent[last] = draw(st.sampled_from([0, -1, -2**40, 2**40, 1.5, -0.0, 1e308, math.inf, math.nan]))
        elif action == "version":
            doc["schema_version"] = draw(st.sampled_from([0, 2, -1, 99, "1", 1.0, 1.5, None, True, [1]]))
        elif action == "shrink" and isinstance(parent[last], (list, dict, str)):
            value = parent[last]
            parent[last] = value[: draw(st.integers(0, max(0, len(value) - 1)))] if not isinstance(value, dict) \
                else dict(list(value.items())[: draw(st.integers(0, max(0, len(value) - 1)))])
        else:
            parent[last] = draw(ODD_VALUES)
    return json.dumps(doc, allow_nan=True)


@st.composite
def damaged_bytes(draw, plan: dict) -> bytes:
    text = json.dumps(plan, indent=2, sort_keys=True).encode()
    kind = draw(st.sampled_from(["truncate", "flip", "insert", "random", "encoding", "wrap"]))
    if kind == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))]
    if kind == "flip":
        at = draw(st.integers(0, len(text) - 1))
        return text[:at] + bytes([draw(st.integers(0, 255))]) + text[at + 1:]
    if kind == "insert":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.binary(min_size=1, max_size=8)) + text[at:]
    if kind == "random":
        return draw(st.binary(max_size=200))
    if kind == "encoding":
        return text.decode().encode(draw(st.sampled_from(["utf-16", "utf-32", "latin-1"])))
    return draw(st.sampled_from([b"[", b"null", b"1", b'"plan"', b"[" * 500 + b"]" * 500, b"\xef\xbb\xbf{}", b""]))


def _check_document(raw: bytes, tmp: Path) -> None:
    path = tmp / "plan.json"
    trace = tmp / "trace.json"
    path.write_bytes(raw)
    trace.unlink(missing_ok=True)
    with time_limit(HANG_SECONDS):
        try:
            assert isinstance(load_plan(path), Plan)
        except SoapError as exc:
            assert "\n" not in str(exc).strip(), f"multi-line error: {exc}"
        code, out, err = cli(["simulate", str(path), "--json", "--trace", str(trace)])
    event(f"soap simulate exit {code}")
    assert "Traceback" not in err
    assert code in (0, 2), (code, err)
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert UNEXPECTED not in lines[0], f"an exception nobody validated: {lines[0]}"
        assert out == ""
    else:
        json.loads(out)
    if trace.exists():
        json.loads(trace.read_text())  # complete, never half-written


def test_structurally_mutated_plans_fail_cleanly(valid_plan, tmp_path):
    @FUZZ
    @given(doc=mutated_plan(valid_plan))
    def run(doc: str) -> None:
        _check_document(doc.encode(), tmp_path)

    run()


def test_byte_damaged_plans_fail_cleanly(valid_plan, tmp_path):
    @settings(FUZZ, max_examples=300)
    @given(raw=damaged_bytes(valid_plan))
    def run(raw: bytes) -> None:
        _check_document(raw, tmp_path)

    run()


@pytest.mark.parametrize("raw", [b"[" * 100_000, b"{" + b'"a":{' * 50_000], ids=["arrays", "objects"])
def test_deeply_nested_json_is_a_clean_error(raw, tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(raw)
    try:
        load_plan(path)
    except SoapError:
        return
    except RecursionError as exc:
        raise AssertionError("RecursionError escaped load_plan") from exc


def test_the_unmutated_plan_loads_and_simulates(valid_plan, tmp_path):
    """The fuzz's baseline must succeed, or every mutation would fail for the wrong reason."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(valid_plan))
    assert load_plan(path).world_size == 2
    code, out, err = cli(["simulate", str(path), "--json"])
    assert code == 0, err
    assert json.loads(out)["parallelism"]["dp"] * json.loads(out)["parallelism"]["tp"] >= 1
