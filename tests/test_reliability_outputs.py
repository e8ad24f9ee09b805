"""Issue 8: soap's output files are written whole or not at all, and a path that cannot be written is one
`error:` line, given before the work that produces the output; an error line stays one line whatever
the path it echoes holds.

`soap simulate` runs for real once (`--trace` and `--png` into a folder that does not exist yet); the
other cases stop before the expensive step: the simulation is replaced by its cached result, and the
search / launch / measurement of the other commands by a stop sign that must not be reached.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from test_reliability_support import assert_one_error_line, cli, gpt2_plan_text, tiny_plan

PREVIOUS = "previous content\n"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Reached(BaseException):
    """The expensive step started: the output path was not checked before it."""


def _stop(*args, **kwargs):
    raise Reached


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> dict:
    """`soap simulate gpt2.plan.json --trace new/dir/t.json --png new/dir/t.png --json`, run once."""
    root = tmp_path_factory.mktemp("outputs")
    plan = root / "gpt2.plan.json"
    plan.write_text(gpt2_plan_text())
    folder = root / "new" / "dir"
    code, out, err = cli(["simulate", str(plan), "--json", "--trace", str(folder / "t.json"),
                          "--png", str(folder / "t.png")])
    from planner.plan import load_plan
    from soap.commands.simulate import simulate_plan

    return {"root": root, "plan": plan, "folder": folder, "code": code, "out": out, "err": err,
            "graph_result": simulate_plan(load_plan(plan))}


@pytest.fixture
def cached_simulation(simulated, monkeypatch):
    import soap.commands.simulate

    monkeypatch.setattr(soap.commands.simulate, "simulate_plan", lambda plan: simulated["graph_result"])
    return simulated


def _blocker(tmp: Path) -> Path:
    """A regular file, so that `blocker/x` cannot be a path."""
    path = tmp / "blocker"
    path.write_text("a file, not a folder\n")
    return path


def test_simulate_writes_its_trace_and_png_whole_into_a_new_folder(simulated):
    assert simulated["code"] == 0, simulated["err"]
    folder = simulated["folder"]
    assert json.loads(simulated["out"])["step_time_s"] > 0
    trace = json.loads((folder / "t.json").read_text())
    assert trace["traceEvents"]
    assert (folder / "t.png").read_bytes().startswith(PNG_MAGIC)
    assert sorted(p.name for p in folder.iterdir()) == ["t.json", "t.png"], "a temporary file was left"
    umask = os.umask(0)
    os.umask(umask)
    for name in ("t.json", "t.png"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o666 & ~umask, "written with a temp file's mode"


@pytest.mark.parametrize("flag", ["--trace", "--png"])
def test_a_failed_simulate_write_keeps_the_previous_file(flag, cached_simulation, tmp_path, monkeypatch):
    out = tmp_path / "output"
    out.write_text(PREVIOUS)

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    code, _, err = cli(["simulate", str(cached_simulation["plan"]), "--json", flag, str(out)])
    line = assert_one_error_line(code, err, flag, "No space left on device", str(out))
    assert "(rerun with --debug" not in line
    assert out.read_text() == PREVIOUS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["output"], "a temporary file was left"


BAD_PATHS = {
    "parent is a file": (lambda t: str(_blocker(t) / "x.out"), "not a directory"),
    "a directory": (lambda t: str(t), "is a directory"),
    "name too long": (lambda t: str(t / ("x" * 300)), "File name too long"),
    "NUL byte": (lambda t: str(t / "a\x00b"), "NUL byte"),
}


@pytest.mark.parametrize("flag", ["--trace", "--png"])
@pytest.mark.parametrize("bad", list(BAD_PATHS), ids=list(BAD_PATHS))
def test_an_unwritable_simulate_output_is_refused_before_simulating(flag, bad, simulated, tmp_path, monkeypatch):
    import soap.commands.simulate

    monkeypatch.setattr(soap.commands.simulate, "simulate_plan", _stop)
    path, reason = BAD_PATHS[bad]
    code, _, err = cli(["simulate", str(simulated["plan"]), flag, path(tmp_path)])
    line = assert_one_error_line(code, err, flag, reason)
    assert "(rerun with --debug" not in line


def _plan_cmd(tmp: Path, out: str, monkeypatch) -> list[str]:
    import planner.pricing

    monkeypatch.setattr(planner.pricing, "run_search", _stop)
    monkeypatch.setenv("SOAP_CACHE_DIR", str(tmp / "cache"))
    return ["plan", "gpt2", "--gpus", "2", "-o", out]


def _execute_cmd(tmp: Path, out: str, monkeypatch) -> list[str]:
    import executor.launch

    monkeypatch.setattr(executor.launch, "run_plan", _stop)
    return ["execute", str(tiny_plan(tmp / "tiny.json")), "--steps", "2", "--report", out]


def _checkpoint_cmd(tmp: Path, out: str, monkeypatch) -> list[str]:
    import executor.launch

    monkeypatch.setattr(executor.launch, "run_plan", _stop)
    return ["execute", str(tiny_plan(tmp / "tiny.json")), "--steps", "2", "--checkpoint-dir", out]


def _calibrate_cmd(tmp: Path, out: str, monkeypatch) -> list[str]:
    import soap.commands.calibrate

    monkeypatch.setattr(soap.commands.calibrate, "calibrate", _stop)
    return ["calibrate", "--quick", "--nproc", "1", "-o", out]


def _validate_cmd(tmp: Path, out: str, monkeypatch) -> list[str]:
    import executor.validation.validate

    monkeypatch.setattr(executor.validation.validate, "run_validation", _stop)
    return ["validate", "--quick", "--png", out]


OTHER_WRITERS = [
    pytest.param(_plan_cmd, "-o", id="plan -o"),
    pytest.param(_execute_cmd, "--report", id="execute --report"),
    pytest.param(_checkpoint_cmd, "--checkpoint-dir", id="execute --checkpoint-dir"),
    pytest.param(_calibrate_cmd, "-o", id="calibrate -o"),
    pytest.param(_validate_cmd, "--png", id="validate --png"),
]


@pytest.mark.parametrize("command, flag", OTHER_WRITERS)
def test_every_other_output_path_is_checked_before_the_work(command, flag, tmp_path, monkeypatch):
    argv = command(tmp_path, str(_blocker(tmp_path) / "out"), monkeypatch)
    code, out, err = cli(argv)
    line = assert_one_error_line(code, err, flag, "not a directory")
    assert "(rerun with --debug" not in line


@pytest.mark.parametrize("path", ["a\nb.json", "a\rb.json", "\x1b[2Jclear.json", "a\u2028b.json", "a\x85b.json"],
                         ids=["newline", "carriage return", "ANSI escape", "line separator", "NEL"])
def test_an_error_line_stays_one_line_whatever_the_path_holds(path, tmp_path):
    code, _, err = cli(["simulate", str(tmp_path / path)])
    line = assert_one_error_line(code, err, "does not exist")
    assert len(err.splitlines()) == 1 and err.endswith("\n")
    odd = next(ch for ch in path if not ch.isprintable())
    assert odd not in err.removesuffix("\n") and odd.encode("unicode_escape").decode() in line


def test_the_catch_all_error_line_stays_one_line(monkeypatch):
    import planner.plan

    def crash(path):
        raise RuntimeError("first\x1bsecond\nthird")

    monkeypatch.setattr(planner.plan, "load_plan", crash)
    code, _, err = cli(["simulate", "p.json"])
    line = assert_one_error_line(code, err, "RuntimeError", "(rerun with --debug")
    assert "first\\x1bsecond" in line and "third" not in line


def test_a_file_given_as_the_checkpoint_directory_is_refused_before_training(tmp_path, monkeypatch):
    argv = _checkpoint_cmd(tmp_path, str(_blocker(tmp_path)), monkeypatch)
    code, _, err = cli(argv)
    assert_one_error_line(code, err, "--checkpoint-dir", "is not a directory")
