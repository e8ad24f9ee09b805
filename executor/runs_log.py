"""The local runs log: one JSON line per executed run, for `soap calibrate --from-runs`.

Default path `~/.cache/soap/runs.jsonl`, overridden by the environment variable `SOAP_RUNS_LOG`.
A record holds the run report's measured numbers (`step_time_s`, `step_times_s`, `peak_memory_gib`
and its source, `losses`, `parallelism`, predicted numbers; on CUDA also `peak_memory_allocated_gib` and
`peak_memory_reserved_gib`, the caching allocator's two peaks) plus, when given, the plan itself (so the
refit can re-simulate it on a changed profile), a UTC timestamp and the host name.

Appends are atomic: the whole line is written with one `os.write` on a descriptor opened with
O_APPEND, under an exclusive `flock`, so concurrent runs never interleave or tear lines. A reader skips
lines that are not JSON objects (a crashed writer of an older version) instead of failing.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from tracer.errors import SoapError

ENV_VAR = "SOAP_RUNS_LOG"
REPORT_KEYS = ("step_time_s", "step_times_s", "peak_memory_gib", "peak_memory_source", "losses", "parallelism",
               "predicted_step_time_s", "predicted_peak_memory_gib", "tokens_per_s", "first_step",
               "peak_memory_allocated_gib", "peak_memory_reserved_gib")


def runs_log_path(path: str | os.PathLike[str] | None = None) -> Path:
    """`path`, else $SOAP_RUNS_LOG, else ~/.cache/soap/runs.jsonl."""
    if path:
        return Path(path)
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    return Path.home() / ".cache" / "soap" / "runs.jsonl"


def append_run(report: dict[str, Any], path: str | os.PathLike[str] | None = None, *, plan: Any = None,
               name: str | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Append one run (a `soap execute` run report) to the runs log; returns the log's path.

    `plan`: the executed `Plan` (stored inline, so the run can be re-simulated); `name`: a label;
    `extra`: more fields (e.g. the measured memory in bytes and how it was measured)."""
    record: dict[str, Any] = {k: report[k] for k in REPORT_KEYS if k in report}
    record["time"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record["host"] = socket.gethostname()
    if name:
        record["name"] = name
    if plan is not None:
        record["plan"] = json.loads(plan.to_json()) if hasattr(plan, "to_json") else plan
    record.update(extra or {})
    line = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
    target = runs_log_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line)
    finally:
        os.close(fd)
    return target


def read_runs(path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Every complete record of the runs log, oldest first."""
    target = runs_log_path(path)
    if not target.is_file():
        raise SoapError(f"runs log {target} does not exist; run `soap validate` or `soap execute` first "
                        f"(or point {ENV_VAR} / --from-runs at a log)")
    records = []
    for line in target.read_text().splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            records.append(value)
    return records
