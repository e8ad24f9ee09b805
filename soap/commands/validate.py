"""`soap validate`: run a suite of plans on this machine and compare the simulator with the measurements.

    soap validate                              # 12 plans, 2 gloo ranks on CPU, table on stderr
    soap validate --quick --png docs/validation.png
    soap validate --device cuda                # the same with NCCL on GPUs
    soap validate --nproc 1                    # 10 single-device plans (checkpointing, accumulation, ...)
    soap validate --device cuda --nproc 1      # the same on one GPU, larger bf16 models (local-cuda profile)
    soap validate --json                       # one object: per-plan errors, MAPEs, Kendall tau
    soap validate --suite calibration --runs-log runs.jsonl && soap calibrate --from-runs runs.jsonl
                                               # 10 other plans on other models; refit the profile from them

Each run is appended to the runs log ($SOAP_RUNS_LOG, default ~/.cache/soap/runs.jsonl), which
`soap calibrate --from-runs` refits the profile from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("validate", help="execute a suite of plans here and compare with the simulator",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (gloo, default) or cuda (NCCL)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per plan: 1 (the single-device suite), 2 (default) or 4")
    p.add_argument("--steps", type=int, default=6, help="steps per plan; the first is not timed (default 6)")
    p.add_argument("--quick", action="store_true", help="a 4-plan subset of the suite")
    p.add_argument("--suite", default="validation", choices=("validation", "calibration"),
                   help="validation (default): the suite; calibration: 10 other plans on other models, for "
                        "`soap calibrate --from-runs` to learn from while the suite stays held out")
    p.add_argument("--cluster", default=None, help="cluster profile for the predictions (default local-DEVICE)")
    p.add_argument("--png", default=None, metavar="FILE", help="write the predicted-vs-measured scatter plot")
    p.add_argument("--runs-log", default=None, metavar="FILE", help="runs log to append to (default $SOAP_RUNS_LOG "
                   "or ~/.cache/soap/runs.jsonl)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from rich.console import Console

    from executor.validation.validate import ValidationConfig, check_config, run_validation
    from tracer.files import check_writable

    config = ValidationConfig(device=args.device, nproc=args.nproc, steps=args.steps, quick=args.quick,
                              suite=args.suite, cluster=args.cluster or f"local-{args.device}", runs_log=args.runs_log)
    check_config(config)
    if args.png:
        check_writable(args.png, what="--png")
    console = Console(stderr=True)
    report = run_validation(config, log=lambda message: console.print(message, style="dim"))
    console.print(render_table(report))
    if args.png:
        from executor.validation.plot import scatter_png

        scatter_png(report.rows, report.summary, args.png, title=f"soap validate on {config.cluster}")
        console.print(f"wrote {args.png}")
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True))
    return 0


def render_table(report):
    from rich.table import Table

    table = Table(title="predicted vs measured", caption=(
        f"step MAPE {report.summary.step_mape_pct:.1f}%  memory MAPE {report.summary.memory_mape_pct:.1f}%  "
        f"Kendall tau {report.summary.step_kendall_tau:.2f}  ({report.summary.plans} plans"
        + (f", {len(report.failed)} failed: " + "; ".join(f"{n}: {e}" for n, e in report.failed) if report.failed else "")
        + ")"))
    for column in ("plan", "pred ms", "meas ms", "err %", "pred MiB", "meas MiB", "err %"):
        table.add_column(column, justify="left" if column == "plan" else "right")
    for r in report.rows:
        table.add_row(r.name, f"{r.predicted_step_s * 1e3:.1f}", f"{r.measured_step_s * 1e3:.1f}",
                      f"{r.step_error_pct:+.1f}", f"{r.predicted_memory_bytes / 2**20:.1f}",
                      f"{r.measured_memory_bytes / 2**20:.1f}", f"{r.memory_error_pct:+.1f}")
    return table
