"""Benchmark and shipping step: refit the local-cpu profile from the calibration plans' runs.

    flock -x /tmp/soap-cpu.lock python -m benchmarks.calibrate_from_runs [--steps 12] [--dry-run]

1. `soap validate --suite calibration` on `local-cpu-kernels` (this machine as `soap calibrate` measured it:
   microbenchmarks only): 11 plans on models and batch shapes the validation suite does not use, executed
   on 2 gloo ranks, each run appended to a fresh runs log.
2. `soap calibrate --from-runs` on that log (`executor.validation.refit.refit_cluster`): compute, kernel
   launch, communication and activation-collective multipliers and the runtime workspace, fitted on those
   runs only.
3. The refitted profile is written as `local-cpu` (profiles/devices and profiles/clusters), the profile
   `soap validate` and the tests use; `benchmarks/validate_suite.py` then judges it on the suite, none of
   whose plans or models it saw.
Writes section `calibrate_from_runs` of docs/benchmarks.md (the calibration plans before and after the
refit: this is the fit set, so its "after" column is in-sample).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERNELS = "local-cpu-kernels"
TARGET = "local-cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12, help="steps per plan (median of all but the first)")
    parser.add_argument("--dry-run", action="store_true", help="fit and report, but write neither profile nor docs")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    from costmodel.profiles import PROFILES_DIR, cluster_from_dict, load_cluster
    from executor.runs_log import read_runs
    from executor.validation.validate import ValidationConfig, compare_runs, run_validation
    from executor.validation.refit import refit_cluster
    from executor.validation.suite import build_case
    from tracer.files import write_atomic

    log = os.path.join(tempfile.gettempdir(), "soap-calibration-runs.jsonl")
    Path(log).unlink(missing_ok=True)
    config = ValidationConfig(steps=args.steps, suite="calibration", cluster=KERNELS, runs_log=log)
    before = run_validation(config, log=lambda m: print(m, file=sys.stderr))
    kernels = load_cluster(KERNELS)
    multipliers, refitted, _ = refit_cluster(read_runs(log), kernels)
    today = datetime.date.today().isoformat()
    refitted["name"] = TARGET
    refitted["description"] = (f"this machine: up to 4 ranks, collectives on gloo over 127.0.0.1; {KERNELS} (soap "
                               f"calibrate) refitted by soap calibrate --from-runs on the {len(before.rows)} "
                               f"calibration plans' runs (soap validate --suite calibration), {today}")
    device = refitted["device"]
    device["name"] = TARGET
    device["description"] = f"AMD EPYC (1 torch thread per rank): {KERNELS}'s device refitted from runs, {today}"
    refit = cluster_from_dict(refitted)
    graphs: dict = {}
    after = compare_runs([build_case(b.case, refit, graphs) for b in before.built], before.measurements)
    print(f"calibration plans: step MAPE {before.summary.step_mape_pct:.1f}% -> {after.summary.step_mape_pct:.1f}% "
          f"(in-sample); multipliers {multipliers.as_dict()}", file=sys.stderr)
    if args.dry_run:
        return
    write_atomic(PROFILES_DIR / "devices" / f"{TARGET}.json", json.dumps(device, indent=2) + "\n", what="device profile")
    write_atomic(PROFILES_DIR / "clusters" / f"{TARGET}.json",
                 json.dumps({**refitted, "device": TARGET}, indent=2) + "\n", what="cluster profile")
    from benchmarks.report import update_section

    update_section("calibrate_from_runs", "Calibration from runs: local-cpu refitted on the calibration plans",
                   body(before, after, multipliers, refit.device.runtime_workspace_bytes, args.steps))


def body(before, after, multipliers, workspace_bytes: int, steps: int) -> str:
    m = multipliers
    lines = [
        f"`benchmarks/calibrate_from_runs.py`: the {len(before.rows)} plans of `soap validate --suite calibration` "
        "(gpt2 / llama / bert at hidden 256, 3 layers, vocab 3072, MHA llama, and one gpt2 at hidden 32 whose step "
        "is per-op host time; DDP, ZeRO-2 with accumulation, ZeRO-3 with and without full checkpointing, TP, TP+SP, "
        "PP 1F1B and GPipe, selective checkpointing; none of them a suite plan or model), "
        f"executed on 2 gloo ranks ({steps} steps, median of the steps after the first), predicted first on "
        f"`{KERNELS}` (the microbenchmarks of `soap calibrate` alone), then refitted by `soap calibrate --from-runs` "
        "into the shipped `local-cpu`. The 'after' column is the fit set itself (in-sample); the held-out test is "
        "the validation suite below, which this refit never saw.",
        "",
        f"Fitted: compute x{m.compute:.3g}, kernel launch x{m.kernel_overhead:.3g}, communication "
        f"x{m.communication:.3g}, activation collectives (TP/SP) x{m.activation_communication:.3g}, runtime "
        f"workspace {workspace_bytes / 2**20:.1f} MiB.",
        "",
        "| plan | measured ms | kernels profile ms | error % | refitted ms | error % | measured MiB | refitted MiB | error % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b, a in zip(before.rows, after.rows):
        lines.append(f"| {b.name} | {b.measured_step_s * 1e3:.1f} | {b.predicted_step_s * 1e3:.1f} | "
                     f"{b.step_error_pct:+.1f} | {a.predicted_step_s * 1e3:.1f} | {a.step_error_pct:+.1f} | "
                     f"{a.measured_memory_bytes / 2**20:.1f} | {a.predicted_memory_bytes / 2**20:.1f} | "
                     f"{a.memory_error_pct:+.1f} |")
    lines += [
        "",
        f"Step MAPE {before.summary.step_mape_pct:.1f}% -> {after.summary.step_mape_pct:.1f}%, Kendall tau "
        f"{before.summary.step_kendall_tau:.2f} -> {after.summary.step_kendall_tau:.2f}, memory MAPE "
        f"{before.summary.memory_mape_pct:.1f}% -> {after.summary.memory_mape_pct:.1f}% (in-sample).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
