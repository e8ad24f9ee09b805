"""`soap calibrate`: microbenchmark this machine and write its device and cluster profiles.

    soap calibrate                      # CPU, collectives on 2 and 4 gloo ranks; writes local-cpu's device and
                                        # cluster profiles to ~/.cache/soap/profiles ($SOAP_PROFILES_DIR),
                                        # where --cluster local-cpu finds them before the shipped one
    soap calibrate --quick -o p.json    # seconds; one self-contained file (cluster, device inline)
    soap calibrate --device cuda --nproc 8
    soap validate --suite calibration --runs-log r.jsonl   # then learn from real training steps:
    soap calibrate --from-runs r.jsonl  # refit compute / launch / communication and the workspace
    soap calibrate --from-runs cluster-logs.jsonl --cluster dgx-h100   # runs from outside soap
    soap calibrate --from-runs titan.json:grand-teton-h100 nemo.json:dgx-h100 --cluster dgx-h100
    soap calibrate --from-nccl-tests all_reduce_perf-*.log all_gather_perf-*.log --cluster dgx-h100 -o my.json
                                        # the network from nccl-tests logs: latency, efficiency by size and the
                                        # fall-off with node count (costmodel/calibration/nccl_tests.py)

Outside run records (a published benchmark table, a cluster's own logs) are JSON Lines, or one JSON object
with `rows`; their schema is `executor.validation.run_records` (docs/calibration.md). They are planned as published on
their cluster profile (FILE:CLUSTER, the record's `cluster`, else --cluster); the fit writes --cluster's
profile refitted (as NAME, default CLUSTER-fitted) and prints in-sample and leave-one-out errors.

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

from costmodel.calibration.calibrate import CalibrationConfig, calibrate, check_config, planned_points, write_profiles
from costmodel.calibration.predict import summarize
from executor.validation.external import H100_ATTENTION_OVER_MATMUL
from tracer.errors import SoapError
from tracer.files import check_writable


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate", help="measure this machine and write its device + cluster profiles",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--nproc", type=int, default=None,
                   help="largest collective group: 2, 4, ... up to N ranks (default 4 on CPU, all GPUs on CUDA; 1: device only)")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="write one file: the cluster profile with its device inline (default: the two files in "
                        "~/.cache/soap/profiles, or $SOAP_PROFILES_DIR)")
    p.add_argument("--name", default=None, help="profile name (default local-cpu or local-cuda)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU (default 1: a rank is a core)")
    p.add_argument("--quick", action="store_true", help="a reduced sweep that takes seconds (for tests)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--from-runs", nargs="*", default=None, metavar="LOG",
                   help="refit the profile's compute/launch/communication terms from a runs log instead of "
                        "measuring (default log $SOAP_RUNS_LOG or ~/.cache/soap/runs.jsonl), or from files of "
                        "outside run records (FILE or FILE:CLUSTER)")
    p.add_argument("--attention-over-matmul", type=float, nargs="?", default=None, metavar="RATIO",
                   const=H100_ATTENTION_OVER_MATMUL,
                   help="with outside run records: pull the attention kernels' multiplier over the GEMMs' toward "
                        f"RATIO, as strongly as one run (default {H100_ATTENTION_OVER_MATMUL}: cuDNN's attention "
                        "over the GEMMs on an H100, measured); for runs that cannot tell the two apart (one "
                        "sequence length), whose attention is the kernel soap's executor runs or is stated "
                        "(a record's sdpa_backend)")
    p.add_argument("--cluster", default=None,
                   help="with outside run records or nccl-tests logs: the cluster profile to refit (and for records "
                        "that name none)")
    p.add_argument("--from-nccl-tests", nargs="+", default=None, metavar="LOG",
                   help="fit the cluster's network (latency, bandwidth efficiency by size, fall-off with node count) "
                        "to nccl-tests logs (all_reduce_perf, all_gather_perf, reduce_scatter_perf, alltoall_perf, "
                        "sendrecv_perf output; one per collective and node count); needs --cluster")
    p.add_argument("--collective", default=None,
                   help="with --from-nccl-tests: the collective of logs that name none (all_reduce, all_gather, ...)")
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
    if args.attention_over_matmul is not None and args.from_runs is None:
        raise SoapError("--attention-over-matmul needs --from-runs with outside run records")
    if args.from_nccl_tests is not None:
        return _from_nccl_tests(args)
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


def _outside_records(specs: list[str]) -> bool:
    """Whether --from-runs names outside run records rather than soap's own runs log (whose records hold
    their plan)."""
    from executor.runs_log import read_runs
    from executor.validation.external import split_path

    if len(specs) != 1 or split_path(specs[0])[1] is not None:
        return bool(specs)
    try:
        data = json.loads(Path(specs[0]).read_text())
        if isinstance(data, dict) and "rows" in data:
            return True
    except (OSError, ValueError):
        pass
    try:
        return not any("plan" in r for r in read_runs(specs[0]))
    except Exception:  # noqa: BLE001 - unreadable here: the record reader names the problem
        return True


def _ratios(args: argparse.Namespace) -> dict | None:
    """`--attention-over-matmul` as `external.fit`'s ratios (the measured value's log spread kept)."""
    from executor.validation.external import ATTENTION_OVER_MATMUL

    if args.attention_over_matmul is None:
        return None
    if not 0 < args.attention_over_matmul < 100:
        raise SoapError(f"--attention-over-matmul {args.attention_over_matmul}: a ratio of two multipliers, above 0")
    (key, (_, spread)), = ATTENTION_OVER_MATMUL.items()
    return {key: (args.attention_over_matmul, spread)}


def _from_outside(args: argparse.Namespace) -> int:
    from executor.validation.external import group_ranks, load_records, mape, refit_external, write_fitted

    records = load_records(args.from_runs, cluster=args.cluster)
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]fit"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=True) as bar:
        task = bar.add_task("planning the runs as published", total=len(records))
        refit = refit_external(records, target=args.cluster,
                               progress=lambda name: bar.update(task, advance=1, description=name[:50]),
                               ratios=_ratios(args))
    name = args.name or f"{refit.profile['name']}-fitted"
    written = write_fitted(refit.profile, name=name, output=args.output)
    stacks = sorted({r.stack for r in records})

    def by_stack(predictions) -> dict[str, float]:
        stack_of = {r.name: r.stack for r in records}
        return {s: round(mape([q for q in predictions if stack_of[q.name] == s]), 2) for s in stacks}

    summary = {"written": [str(p) for p in written], "runs": len(records),
               "multipliers": {k: round(v, 4) for k, v in refit.fit.multipliers.items()},
               "mape_before_pct": by_stack(refit.before), "mape_in_sample_pct": by_stack(refit.in_sample),
               "mape_leave_one_out_pct": {g: by_stack(p) for g, p in refit.leave_out.items()},
               "at_datasheet_peak": [" x ".join(params) for params in refit.fit.at_peak],
               "attention_over_matmul": args.attention_over_matmul}
    ranked = group_ranks(refit.prepared, refit.leave_out.get("run", refit.in_sample))
    summary["groups"] = [{"group": g.group, "runs": g.runs, "spearman": g.spearman, "pick_over_best": g.pick_over_best}
                         for g in ranked]
    if args.json:
        print(json.dumps(summary))
        return 0
    fitted = ", ".join(f"{k} x{v:.3g}" for k, v in refit.fit.multipliers.items())
    print(f"fitted on {len(records)} runs: {fitted}", file=sys.stderr)
    for label, values in (("before (profile as it was)", summary["mape_before_pct"]),
                          ("in-sample", summary["mape_in_sample_pct"]),
                          *((f"leave one {g} out", v) for g, v in summary["mape_leave_one_out_pct"].items())):
        print(f"tokens/s MAPE {label}: " + ", ".join(f"{s} {v:.1f}%" for s, v in values.items()), file=sys.stderr)
    if refit.fit.at_peak:
        print("note: held at the datasheet peak: " + "; ".join(" x ".join(p) for p in refit.fit.at_peak)
              + " (the runs ask for faster kernels than the device has: the model misses something there)",
              file=sys.stderr)
    for g in ranked:  # leave-one-run-out predictions: would the fit have picked the fastest run of the group?
        rho = "n/a" if g.spearman is None else f"{g.spearman:+.2f}"
        print(f"{g.group}: {g.runs} runs, rank correlation {rho}, pick/best {g.pick_over_best:.2f} "
              "(leave-one-run-out)", file=sys.stderr)
    for p in written:
        print(f"wrote {p}", file=sys.stderr)
    return 0


def _from_runs(args: argparse.Namespace) -> int:
    from executor.validation.refit import refit_profile

    if _outside_records(args.from_runs):
        return _from_outside(args)
    if args.attention_over_matmul is not None:
        raise SoapError("--attention-over-matmul applies to outside run records (FILE or FILE:CLUSTER), not to a runs "
                        "log: soap's own runs fit one compute factor")
    refit = refit_profile(args.from_runs[0] if args.from_runs else None, args.name or f"local-{args.device}", args.output)
    summary = {"written": [str(p) for p in refit.written], "runs": refit.runs,
               "multipliers": refit.multipliers.as_dict(), "at_physical_bound": list(refit.multipliers.at_bound),
               "fit_mape_before_pct": round(refit.before_mape_pct, 2),
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
        if m.bound_note():
            print(f"note: {m.bound_note()}", file=sys.stderr)
        if refit.allocator_reserve_fraction is not None:
            print(f"allocator reserve {refit.allocator_reserve_fraction:.1%} of allocated memory: memory predictions "
                  "are the allocator's reserved peak", file=sys.stderr)
        for p in refit.written:
            print(f"wrote {p}", file=sys.stderr)
    return 0


def _from_nccl_tests(args: argparse.Namespace) -> int:
    """`--from-nccl-tests LOG... --cluster NAME`: fit the network (`costmodel.calibration.nccl_tests`), print
    each log's error before and after, write the fitted cluster (inline device) to -o or the user's profiles."""
    from costmodel.calibration.nccl_tests import fit_nccl_logs, read_log
    from costmodel.profiles import cluster_to_dict, load_cluster, user_profile_paths
    from tracer.files import write_atomic

    if not args.cluster:
        raise SoapError("--from-nccl-tests needs --cluster NAME|FILE: the cluster whose network the logs measured")
    cluster = load_cluster(args.cluster)
    logs = [read_log(path, collective=args.collective) for path in args.from_nccl_tests]
    fit = fit_nccl_logs(logs, cluster, name=args.name)
    path = args.output or user_profile_paths(cluster.device.name, fit.cluster.name)[1]
    check_writable(path, what="-o")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(path), json.dumps(cluster_to_dict(fit.cluster), indent=2) + "\n", what="-o")
    rows = [{"log": p, "collective": log.collective, "ranks": log.ranks, "nodes": log.nodes,
             "error_before_pct": round(before, 2), "error_after_pct": round(after, 2)}
            for log, (p, (before, after)) in zip(logs, fit.errors.items())]
    scaling = fit.cluster.inter_node.node_scaling
    if args.json:
        print(json.dumps({"written": str(path), "cluster": fit.cluster.name, "logs": rows,
                          "node_scaling": [list(p) for p in scaling.points] if scaling else None}))
        return 0
    for row in rows:
        print(f"{row['log']}: {row['collective']} on {row['ranks']} ranks / {row['nodes']} node(s): "
              f"mean |error| {row['error_before_pct']:.1f}% -> {row['error_after_pct']:.1f}%", file=sys.stderr)
    if scaling:
        print("inter-node bandwidth by nodes spanned: " + ", ".join(f"{n:g}: x{f:.3g}" for n, f in scaling.points),
              file=sys.stderr)
    print(f"wrote {path} (use it as --cluster {path} or --cluster {fit.cluster.name})", file=sys.stderr)
    return 0
