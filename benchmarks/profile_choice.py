"""Which H100 compute terms does a cluster's own runs log agree with: the default's or the measured ones?

    python -m benchmarks.profile_choice RUNS.jsonl [--cluster dgx-h100]

The default `dgx-h100` prices an H100 with compute terms fitted to published runs (mostly torchtitan's 500 W
parts); `h100-x1-measured` with the compute terms a lent 700 W H100 measured in soap's own training steps
(docs/benchmarks.md, "One H100, 2026-11-26" and "The measured H100 against published runs"). On one GPU the
measured ones predict soap's runs at 5% where the default is at 16%; on 8 GPUs and more no run of soap's executor
on a DGX H100 has been measured, and the two disagree by 1.5x on the 8B (47% against 68% MFU).

A runs log written by `soap execute` on such a cluster (`benchmarks/dgx_8b_check.sh` writes one on a node of 8
H100) settles it: each run's plan is simulated again on `--cluster` as it is and on `--cluster` with its device
swapped for the measured one (`benchmarks.measured_h100_check`'s swap, nothing fitted), and the step-time errors
are printed side by side.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

MEASURED_DEVICE = "h100-x1-measured"


def compare(log: str, cluster: str) -> list[tuple[str, float, float, float]]:
    """(run, measured step, predicted on `cluster`, predicted with the measured device) for each run of `log`."""
    from benchmarks.measured_h100_check import swap_folder, with_device
    from costmodel.profiles import load_cluster
    from executor.runs_log import read_runs
    from executor.validation.refit import simulate_on, trace_plan_model
    from planner.plan import plan_from_dict

    with swap_folder() as folder:
        profiles = (load_cluster(cluster), load_cluster(with_device(cluster, MEASURED_DEVICE, folder)))
    out = []
    for record in read_runs(log):
        plan = plan_from_dict(record["plan"])
        steps = [simulate_on(plan, trace_plan_model(plan, c), c).step_time_s for c in profiles]
        out.append((record["name"].removesuffix(".plan"), record["step_time_s"], *steps))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="a runs log written by soap execute (SOAP_RUNS_LOG)")
    parser.add_argument("--cluster", default="dgx-h100", help="the cluster the runs ran on (default dgx-h100)")
    args = parser.parse_args()
    rows = compare(args.log, args.cluster)
    print(f"| run | measured step | `{args.cluster}` | with `{MEASURED_DEVICE}`'s compute |\n|---|---:|---:|---:|")
    for name, measured, default, with_measured in rows:
        print(f"| {name} | {measured:.3f} s | {default:.3f} s ({100 * (default / measured - 1):+.0f}%) | "
              f"{with_measured:.3f} s ({100 * (with_measured / measured - 1):+.0f}%) |")
    for i, title in ((2, args.cluster), (3, f"with {MEASURED_DEVICE}")):
        mape = sum(abs(r[i] / r[1] - 1) for r in rows) / len(rows)
        print(f"\n{title}: step-time MAPE {100 * mape:.1f}% over {len(rows)} runs")


if __name__ == "__main__":
    main()
