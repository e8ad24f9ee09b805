"""Benchmark: `soap validate`'s suite on this machine, and the refit from runs on held-out plans.

    flock -x /tmp/soap-cpu.lock python benchmarks/validate_suite.py [--steps 6] [--quick]

1. The suite (12 plans, 2 gloo ranks) simulated on the shipped local-cpu profile and executed: the
   table, MAPEs, Kendall tau and docs/validation.png.
2. Calibration from runs, two-fold: the runs of one half of the suite refit the profile
   (`executor.validation_refit.refit_cluster`), which then predicts the other half, and vice versa.
   Every plan's "after" prediction comes from a profile fitted without it; docs/validation-refit.png.
Writes section `validate` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DOCS = Path(__file__).resolve().parents[1] / "docs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    from benchmarks.report import update_section
    from costmodel.profiles import cluster_from_dict, load_cluster
    from executor.runs_log import read_runs
    from executor.validation import ValidationConfig, compare_runs, run_validation
    from executor.validation_plot import scatter_png
    from executor.validation_refit import refit_cluster
    from executor.validation_suite import build_case

    log = os.path.join(tempfile.gettempdir(), "soap-validate-suite-runs.jsonl")
    Path(log).unlink(missing_ok=True)
    config = ValidationConfig(steps=args.steps, quick=args.quick, runs_log=log)
    report = run_validation(config, log=lambda m: print(m, file=sys.stderr))
    records = {r["name"]: r for r in read_runs(log)}
    scatter_png(report.rows, report.summary, DOCS / "validation.png",
                title="soap validate: local-cpu profile as calibrated (2 gloo ranks)")

    cluster = load_cluster("local-cpu")
    graphs: dict = {}
    folds = [list(range(0, len(report.rows), 2)), list(range(1, len(report.rows), 2))]
    after_built = list(report.built)
    fits = []
    for fit_fold, test_fold in (folds, folds[::-1]):
        multipliers, refitted, _ = refit_cluster([records[report.rows[i].name] for i in fit_fold], cluster)
        fits.append((fit_fold, multipliers))
        refit = cluster_from_dict(refitted)
        for i in test_fold:
            after_built[i] = build_case(report.built[i].case, refit, graphs)
    after = compare_runs(after_built, report.measurements)
    scatter_png(after.rows, after.summary, DOCS / "validation-refit.png",
                title="after the refit from runs (each plan predicted by a profile fitted on the other half)")
    update_section("validate", "Validation: simulated against measured on this machine (soap validate)",
                   body(report, after, fits, config.steps))
    print(f"step MAPE {report.summary.step_mape_pct:.1f}% -> {after.summary.step_mape_pct:.1f}% (held out); "
          f"memory MAPE {report.summary.memory_mape_pct:.1f}%; tau {report.summary.step_kendall_tau:.2f} -> "
          f"{after.summary.step_kendall_tau:.2f}", file=sys.stderr)


def body(report, after, fits, steps: int) -> str:
    s, a = report.summary, after.summary
    lines = [
        f"`benchmarks/validate_suite.py`: {s.plans} plans on tiny gpt2 / llama / bert configs (hidden 192, 4 layers, "
        "vocab 2048, seq 128-256, fp32, AdamW) at 2 gloo ranks, one torch thread per rank, each built by "
        "`tracer.trace` + `simulate` + `plan_from_simulation` on `profiles/clusters/local-cpu.json` and executed "
        f"by `executor.train.train` ({steps} steps; measured: median of the steps after the first). "
        "Measured memory: peak RSS growth of each rank during the plan (VmHWM after a reset through "
        "/proc/self/clear_refs, minus VmRSS at the plan's start; glibc mmap threshold 64 KiB and malloc_trim "
        "between plans, so RSS follows live tensors), max over ranks; predicted: the simulator's peak over ranks "
        "without its per-process context overhead. The 2-D entry is 2-D in spirit (data parallel with "
        "accumulation and checkpointing): a real 2-D mesh needs 4 ranks, which on 2 cores measures oversubscription. "
        "Targets: step MAPE <= 15%, memory MAPE <= 15%, Kendall tau >= 0.7.",
        "",
        "| plan | predicted ms | measured ms | error % | after refit ms (held out) | error % | predicted MiB | measured MiB | error % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, q in zip(report.rows, after.rows):
        lines.append(f"| {r.name} | {r.predicted_step_s * 1e3:.1f} | {r.measured_step_s * 1e3:.1f} | "
                     f"{r.step_error_pct:+.1f} | {q.predicted_step_s * 1e3:.1f} | {q.step_error_pct:+.1f} | "
                     f"{r.predicted_memory_bytes / 2**20:.1f} | {r.measured_memory_bytes / 2**20:.1f} | "
                     f"{r.memory_error_pct:+.1f} |")
    lines += [
        "",
        "| figure | as calibrated | after refit from runs (held out) | target |",
        "|---|---:|---:|---:|",
        f"| step-time MAPE | {s.step_mape_pct:.1f}% | {a.step_mape_pct:.1f}% | <= 15% |",
        f"| memory MAPE | {s.memory_mape_pct:.1f}% | {a.memory_mape_pct:.1f}% (the refit changes times only) | <= 15% |",
        f"| Kendall tau (step time) | {s.step_kendall_tau:.2f} | {a.step_kendall_tau:.2f} | >= 0.7 |",
        "",
        "Refit (`soap calibrate --from-runs`, two-fold: each half's runs fit the multipliers that predict the other half):",
        "",
    ]
    for fold, m in fits:
        names = ", ".join(report.rows[i].name for i in fold)
        lines.append(f"- fitted on {names}: compute x{m.compute:.3g}, kernel launch x{m.kernel_overhead:.3g}, "
                     f"communication x{m.communication:.3g}")
    lines += ["", memory_notes(report)]
    if report.failed:
        lines += ["", "Plans that did not run: " + "; ".join(f"{n}: {e}" for n, e in report.failed)]
    lines += ["", "![predicted vs measured](validation.png)", "", "![after the refit](validation-refit.png)"]
    return "\n".join(lines)


def memory_notes(report) -> str:
    """The two memory error sources, in numbers measured above."""
    import statistics

    bucketed, plain = [], []
    for b, r in zip(report.built, report.rows):
        buffers = max(m.at_peak.buffers for m in b.result.memory)
        (bucketed if buffers >= 2**24 else plain).append((r, buffers))
    text = []
    if plain:
        gap = statistics.median((r.measured_memory_bytes - r.predicted_memory_bytes) / 2**20 for r, _ in plain)
        text.append(f"Plans without predicted gradient buckets are under-predicted by a median {gap:.1f} MiB per rank: "
                    "growth the model does not hold (gloo and autograd workspaces, DTensor/FSDP metadata, "
                    "initialization temporaries); the profile has no field for a per-process runtime workspace.")
    if bucketed:
        names = ", ".join(r.name for r, _ in bucketed)
        mib = statistics.median(buffers / 2**20 for _, buffers in bucketed)
        text.append(f"Plans with predicted gradient buckets ({names}) carry {mib:.0f} MiB of buffers "
                    "(`costmodel.memory`: two 25 MB DDP buckets), more than these models' gradients; DDP's "
                    "buckets are bounded by the gradient bytes, and FSDP2 without resharding (ZeRO-2) has none.")
    return " ".join(text)


if __name__ == "__main__":
    main()
