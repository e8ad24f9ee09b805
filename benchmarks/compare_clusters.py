"""`soap compare` for the README: its real output and picture, and its wall time against `soap plan` runs.

1. `soap compare llama-3-70b --clusters dgx-a100-80g,dgx-h100,dgx-b200 --tokens 1e12 --price ...` (GPU
   counts searched: --gpus auto), its table written to docs/benchmarks.md and its picture to
   docs/compare-llama-3-70b.png. The prices are the shipped price file's (profiles/prices.json), given on
   the command line as the README shows; they are dated defaults, not current quotes.
2. The one-trace claim: `soap compare` of the three clusters at a fixed GPU count against three `soap plan`
   runs of the same model and count, each a subprocess, after one warm-up plan fills the tracer's disk
   cache (the best of `RUNS`, since the machine is shared).

    python -m benchmarks.compare_clusters
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import update_section

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama-3-70b"
CLUSTERS = ("dgx-a100-80g", "dgx-h100", "dgx-b200")
PRICES = "dgx-a100-80g=1.79,dgx-h100=2.99,dgx-b200=5.98"
PNG = "docs/compare-llama-3-70b.png"
FIXED_GPUS = 64
RUNS = 2


def soap(*argv: str) -> tuple[float, str]:
    env = {**os.environ, "COLUMNS": "200"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "soap", *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"soap {' '.join(argv)} failed: {done.stderr.strip().splitlines()[-1]}")
    return elapsed, done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    command = ["compare", MODEL, "--clusters", ",".join(CLUSTERS), "--tokens", "1e12", "--price", PRICES]
    soap("plan", MODEL, "--gpus", str(FIXED_GPUS), "--cluster", CLUSTERS[0], "--json")  # warm the trace cache
    load_before = os.getloadavg()[0]
    compare_s, plans_s = [], []
    for _ in range(RUNS):
        compare_s.append(soap(*command, "--gpus", str(FIXED_GPUS), "--json")[0])
        plans_s.append(sum(soap("plan", MODEL, "--gpus", str(FIXED_GPUS), "--cluster", c, "--json")[0]
                           for c in CLUSTERS))
    auto_s, table = soap(*command, "--png", PNG)
    print(table)
    timing = (
        f"| run | wall time (s), best of {RUNS} |\n|---|---|\n"
        f"| `soap compare {MODEL} --clusters {','.join(CLUSTERS)} --gpus {FIXED_GPUS}` | {min(compare_s):.1f} |\n"
        f"| three `soap plan {MODEL} --gpus {FIXED_GPUS} --cluster C` runs, one per cluster | {min(plans_s):.1f} |\n"
        f"\nLoad average before the runs: {load_before:.2f} (a shared machine). Each `soap plan` run starts a "
        "process and loads the model's trace from the disk cache; `soap compare` traces (or loads) once and "
        "shares the graphs across the clusters."
    )
    body = (
        "```\nsoap " + " ".join(command) + "\n```\n\n"
        f"GPU counts searched automatically (up to the default cap); finished in {auto_s:.0f} s. Output:\n\n"
        "```\n" + table.rstrip() + "\n```\n\n"
        f"![tokens/s against cost per million tokens]({Path(PNG).name})\n\n"
        "Read it with the profiles' caveats: dgx-h100 is fitted to published H100 runs; dgx-a100-80g is the "
        "A100's measured hardware with soap's executor's terms measured on Hopper (benchmarks/native_profiles.py); "
        "dgx-b200 is B200 peaks and MAMF with the fitted H100's efficiency terms borrowed, checked by no B200 run; "
        "prices are the shipped file's dated defaults.\n\n"
        "### One trace, shared: compare against three plans\n\n" + timing
    )
    if not args.no_write:
        update_section("compare-clusters", "soap compare: three clusters by time and cost", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
