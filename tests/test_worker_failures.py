"""A failed worker reads as one `error:` line (rank, exception, log file of every rank's traceback), with
torch's elastic logger kept off the terminal."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from exec_helpers import make_plan

from executor.launch import LaunchOptions, run_plan, worker_failure
from tracer.errors import SoapError


class ExplodingRun:
    """A run configuration whose every field raises: each worker fails inside `train` with a RuntimeError."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"exploding run config: {name} on purpose")


def test_the_rank_that_failed_first_is_named_with_its_message(tmp_path):
    (tmp_path / "rank-1.json").write_text(json.dumps({"error": "ValueError: bad shape", "traceback": "TB one"}))
    (tmp_path / "rank-0.json").write_text(json.dumps({"error": "RuntimeError: peer gone", "traceback": "TB zero"}))
    failures = {0: SimpleNamespace(timestamp=20, exitcode=1), 1: SimpleNamespace(timestamp=10, exitcode=1),
                2: SimpleNamespace(timestamp=30, exitcode=-15)}
    line = worker_failure(failures, tmp_path)
    assert line.startswith("a worker failed (rank 1): ValueError: bad shape;")
    log = tmp_path / "workers.log"
    assert str(log) in line and "\n" not in line
    text = log.read_text()
    assert text.index("=== rank 1") < text.index("=== rank 0") < text.index("=== rank 2 (exit code -15)")
    assert "TB one" in text and "TB zero" in text and "no Python exception" in text


def test_a_rank_killed_without_an_exception_is_named_with_its_exit_code(tmp_path):
    (tmp_path / "rank-0.json").write_text(json.dumps({"error": "RuntimeError: peer gone", "traceback": "TB zero"}))
    line = worker_failure({1: SimpleNamespace(timestamp=1, exitcode=-9)}, tmp_path)
    assert line.startswith("a worker failed (rank 1, exit code -9)") and str(tmp_path / "workers.log") in line
    text = (tmp_path / "workers.log").read_text()
    assert text.index("=== rank 1 (exit code -9)") < text.index("=== rank 0 (stopped after the first failure)")


@pytest.mark.slow
def test_a_raising_worker_gives_one_error_line_and_a_log_of_its_traceback(capfd):
    plan = make_plan("llama", dp_replicate=2, micro_batch=2)
    with pytest.raises(SoapError) as info:
        run_plan(plan, ExplodingRun(), LaunchOptions())
    message = str(info.value)
    assert "\n" not in message
    match = re.match(r"a worker failed \(rank (\d)\): RuntimeError: exploding run config: \w+ on purpose; "
                     r"the tracebacks of all ranks are in (\S+workers\.log)", message)
    assert match, message
    log = Path(match.group(2)).read_text()
    assert f"=== rank {match.group(1)}" in log and "Traceback (most recent call last)" in log
    shutil.rmtree(Path(match.group(2)).parent)
    captured = capfd.readouterr()
    assert "torch/distributed/elastic" not in captured.err and "Traceback" not in captured.err
