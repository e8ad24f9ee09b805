"""Wall time of `soap trace MODEL --json` as a fresh process (Python, torch and transformers imports
included), median of 3, cold (`--no-cache`) and warm (from the on-disk trace cache).

Run: flock -x /tmp/soap-cpu.lock python -m benchmarks.trace_speed
Writes the `trace-speed` section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import update_section

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"llama-3.1-405b": 5.0, "llama-3-8b": 3.0}
RUNS = 3


def wall(cmd: list[str], env: dict[str, str]) -> tuple[float, dict]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - start
    return elapsed, json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}


def main() -> None:
    cache = tempfile.mkdtemp(prefix="soap-trace-cache-")
    env = {**os.environ, "SOAP_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    startup = statistics.median(
        wall([sys.executable, "-c", "import soap.cli; soap.cli.build_parser()"], env)[0] for _ in range(RUNS))
    rows = []
    for model, target in TARGETS.items():
        cmd = [sys.executable, "-m", "soap", "trace", model, "--json"]
        cold = [wall(cmd + ["--no-cache"], env) for _ in range(RUNS)]
        wall(cmd, env)  # fill the cache
        warm = [wall(cmd, env)[0] for _ in range(RUNS)]
        cold_s = statistics.median(t for t, _ in cold)
        in_process = statistics.median(out["trace_time_s"] for _, out in cold)
        warm_s = statistics.median(warm)
        rows.append((model, target, cold_s, in_process, warm_s, cold[0][1]["frontend"]))
        print(f"{model}: cold {cold_s:.2f} s (trace {in_process:.2f} s), warm {warm_s:.2f} s", file=sys.stderr)
    lines = [
        "`soap trace MODEL --json` as a fresh process, median of 3. *Cold* traces afresh (`--no-cache`); "
        "*warm* reads the on-disk trace cache that the first run filled. *Trace* is the in-process time "
        "reported as `trace_time_s` (resolve, build on meta, capture, build the graph), excluding Python "
        f"start-up and the CLI's imports. `python -c 'import soap.cli; soap.cli.build_parser()'` alone takes "
        f"{startup:.2f} s here.",
        "",
        "| model | target | cold wall | of which trace | warm wall | front-end | meets target |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, target, cold_s, in_process, warm_s, frontend in rows:
        verdict = "yes" if cold_s <= target else ("warm only" if warm_s <= target else "no")
        lines.append(f"| {model} | ≤ {target:.0f} s | {cold_s:.2f} s | {in_process:.2f} s | {warm_s:.2f} s | "
                     f"{frontend} | {verdict} |")
    update_section("trace-speed", "Trace speed", "\n".join(lines))


if __name__ == "__main__":
    main()
