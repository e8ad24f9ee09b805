"""`soap calibrate`: microbenchmark this machine and write its device and cluster profiles.

    soap calibrate                      # CPU, collectives on 2 and 4 gloo ranks; writes
                                        # profiles/devices/local-cpu.json + profiles/clusters/local-cpu.json
    soap calibrate --quick -o p.json    # seconds; one self-contained file (cluster, device inline)
    soap calibrate --device cuda --nproc 8
    soap validate --suite calibration --runs-log r.jsonl   # then learn from real training steps:
    soap calibrate --from-runs r.jsonl  # refit compute / launch / communication and the workspace

Progress goes to stderr; `--json` prints one object on stdout with the files written and the held-out
median errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from costmodel.calibrate import CalibrationConfig, calibrate, check_config, planned_points, write_profiles
from costmodel.calibrate_predict import summarize
from tracer.files import check_writable


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate", help="measure this machine and write its device + cluster profiles",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--nproc", type=int, default=None,
                   help="largest collective group: 2, 4, ... up to N ranks (default 4 on CPU, all GPUs on CUDA; 1: device only)")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="write one file: the cluster profile with its device inline (default: the two files under profiles/)")
    p.add_argument("--name", default=None, help="profile name (default local-cpu or local-cuda)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU (default 1: a rank is a core)")
    p.add_argument("--quick", action="store_true", help="a reduced sweep that takes seconds (for tests)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--from-runs", nargs="?", const="", default=None, metavar="LOG",
                   help="refit the profile's compute/launch/communication terms from a runs log instead of "
                        "measuring (default log $SOAP_RUNS_LOG or ~/.cache/soap/runs.jsonl)")
    return p


def _config(args: argparse.Namespace) -> CalibrationConfig:
    nproc = args.nproc
    if nproc is None:
        import torch

        nproc = torch.cuda.device_count() if args.device == "cuda" and torch.cuda.is_available() else 4
    config = CalibrationConfig(device=args.device, nproc=nproc, quick=args.quick, threads=args.threads,
                               name=args.name or f"local-{args.device}", rounds=1 if args.quick else 2,
                               reference_precision="bf16" if args.device == "cuda" else "fp32")
    check_config(config)
    return config


def run(args: argparse.Namespace) -> int:
    if args.output is not None:
        check_writable(args.output, what="-o")
    if args.from_runs is not None:
        return _from_runs(args)
    config = _config(args)
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]calibrate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=False) as bar:
        task = bar.add_task("", total=planned_points(config))
        result = calibrate(config, lambda label: bar.update(task, advance=1, description=label))
        bar.update(task, description="fitting done")
    paths = write_profiles(result, args.output)
    kernel = summarize(result.kernel_errors)
    comm = summarize(result.comm_errors)
    if args.json:
        print(json.dumps({
            "written": [str(p) for p in paths],
            "heldout_kernel_median_abs_pct": {s.family: round(s.median_abs_pct, 2) for s in kernel},
            "heldout_collective_median_abs_pct": {s.family: round(s.median_abs_pct, 2) for s in comm},
        }))
    else:
        for p in paths:
            print(f"wrote {p}", file=sys.stderr)
    for title, rows in (("kernels", kernel), ("collectives", comm)):
        overall = next((s for s in rows if s.family == "all"), None)
        if overall:
            detail = ", ".join(f"{s.family} {s.median_abs_pct:.1f}%" for s in rows if s.family != "all")
            console.print(f"held-out {title}: median |error| {overall.median_abs_pct:.1f}% over {overall.points} points ({detail})")
    return 0


def _from_runs(args: argparse.Namespace) -> int:
    from executor.validation_refit import refit_profile

    refit = refit_profile(args.from_runs or None, args.name or f"local-{args.device}", args.output)
    summary = {"written": [str(p) for p in refit.written], "runs": refit.runs,
               "multipliers": refit.multipliers.as_dict(), "fit_mape_before_pct": round(refit.before_mape_pct, 2),
               "fit_mape_after_pct": round(refit.after_mape_pct, 2),
               "allocator_reserve_fraction": refit.allocator_reserve_fraction}
    if args.json:
        print(json.dumps(summary))
    else:
        m = refit.multipliers
        print(f"refit from {refit.runs} runs: compute x{m.compute:.3g}, kernel launch x{m.kernel_overhead:.3g}, "
              f"communication x{m.communication:.3g}, activation collectives x{m.activation_communication:.3g}; "
              f"step MAPE on those runs {refit.before_mape_pct:.1f}% -> "
              f"{refit.after_mape_pct:.1f}%", file=sys.stderr)
        if refit.allocator_reserve_fraction is not None:
            print(f"allocator reserve {refit.allocator_reserve_fraction:.1%} of allocated memory: memory predictions "
                  "are the allocator's reserved peak", file=sys.stderr)
        for p in refit.written:
            print(f"wrote {p}", file=sys.stderr)
    return 0
