"""Shared helpers of the reliability tests (bad input, fuzzing, determinism, faults); holds no tests.

- `cli(argv)`: run `soap.cli.main` in-process, returning (exit code, stdout, stderr);
- `assert_one_error_line(...)`: soap's bad-input contract (exit 2, one `error: ...` line, no traceback);
- `gpt2_plan_text()`: the plan.json of `soap plan gpt2 --gpus 2`, searched once per test session;
- `tiny_plan(...)`: a tiny GPT-2 plan that `soap execute` trains on CPU in well under a second a step.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import tempfile
from pathlib import Path

from soap.cli import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `soap ARGV` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's --help exits; usage errors are turned into exit 2 by soap.cli
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def assert_one_error_line(code: int, err: str, *needles: str) -> str:
    """The bad-input contract: exit 2, exactly one stderr line `error: ...` naming the problem, no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit code {code}, stderr:\n{err}"
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), f"expected one `error: ...` line, got:\n{err}"
    for needle in needles:
        assert needle.lower() in lines[0].lower(), f"{needle!r} not named in: {lines[0]}"
    return lines[0]


@functools.cache
def gpt2_plan_text() -> str:
    """plan.json of `soap plan gpt2 --gpus 2 -o FILE` (searched once per session)."""
    path = Path(tempfile.mkdtemp(prefix="soap-rel-")) / "gpt2.plan.json"
    code, _, err = cli(["plan", "gpt2", "--gpus", "2", "-o", str(path)])
    assert code == 0, err
    return path.read_text()


def tiny_plan(path: Path, **overrides) -> Path:
    """A 2-rank DDP plan of a 4-layer, 32-wide GPT-2 (fp32) written to `path`."""
    from exec_helpers import make_plan

    make_plan("gpt2", **{"dp_replicate": 2, "micro_batch": 2, **overrides}).save(path)
    return path
