"""`soap validate`'s single-device suite on one GPU, and the refit from its runs on held-out plans.

    python -m benchmarks.gpu_validate --out DIR       # on a CUDA machine: run, write DIR/section.md + PNGs
    python -m benchmarks.gpu_validate --record DIR    # here: copy the PNGs into docs/, write the section

The suite (`soap validate --device cuda --nproc 1`: gpt2, llama and bert configs in bf16, plain,
checkpointing, accumulation, micro-batch sizes) is simulated on the measured `h100-x1-measured`
profile and executed on NCCL. Then the two-fold refit of `benchmarks/validate_suite.py`: each half's runs
fit the profile's compute / launch multipliers (`soap calibrate --from-runs`), which predict the other half.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
CLUSTER = "h100-x1-measured"
PNGS = ("validation-cuda.png", "validation-cuda-refit.png")


def measure(out: Path, steps: int, *, device: str = "cuda", cluster_name: str = CLUSTER, quick: bool = False) -> None:
    from benchmarks.report import machine_description
    from costmodel.profiles import cluster_from_dict, load_cluster
    from executor.runs_log import read_runs
    from executor.validation.validate import ValidationConfig, compare_runs, run_validation
    from executor.validation.plot import scatter_png
    from executor.validation.refit import refit_cluster
    from executor.validation.suite import build_case

    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    config = ValidationConfig(device=device, nproc=1, steps=steps, cluster=cluster_name, runs_log=str(log), quick=quick)
    report = run_validation(config, log=lambda m: print(m, file=sys.stderr))
    scatter_png(report.rows, report.summary, out / PNGS[0], title=f"soap validate on one H100 ({CLUSTER} profile)")
    records = {r["name"]: r for r in read_runs(str(log))}
    cluster = load_cluster(cluster_name)
    folds = [list(range(0, len(report.rows), 2)), list(range(1, len(report.rows), 2))]
    after_built, graphs, fits = list(report.built), {}, []
    for fit_fold, test_fold in (folds, folds[::-1]):
        multipliers, refitted, _ = refit_cluster([records[report.rows[i].name] for i in fit_fold], cluster)
        fits.append((fit_fold, multipliers))
        for i in test_fold:
            after_built[i] = build_case(report.built[i].case, cluster_from_dict(refitted), graphs)
    after = compare_runs(after_built, report.measurements)
    scatter_png(after.rows, after.summary, out / PNGS[1], title="after the refit from runs (held out)")
    (out / "section.json").write_text(json.dumps({"machine": machine_description(), "body": body(report, after, fits, steps)}))


def body(report, after, fits, steps: int) -> str:
    s, a = report.summary, after.summary
    lines = [
        f"`benchmarks/gpu_validate.py`: {s.plans} single-GPU plans (`soap validate --device cuda --nproc 1`), bf16, "
        f"AdamW, {steps} steps each (measured: median after the first), predicted on the measured `{CLUSTER}` profile. "
        "Measured memory: torch.cuda max_memory_allocated.",
        "",
        "| plan | predicted ms | measured ms | error % | after refit ms (held out) | error % | predicted MiB | measured MiB | error % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, q in zip(report.rows, after.rows):
        lines.append(f"| {r.name} | {r.predicted_step_s * 1e3:.1f} | {r.measured_step_s * 1e3:.1f} | "
                     f"{r.step_error_pct:+.1f} | {q.predicted_step_s * 1e3:.1f} | {q.step_error_pct:+.1f} | "
                     f"{r.predicted_memory_bytes / 2**20:.0f} | {r.measured_memory_bytes / 2**20:.0f} | "
                     f"{r.memory_error_pct:+.1f} |")
    lines += [
        "",
        "| figure | as calibrated | after refit from runs (held out) |",
        "|---|---:|---:|",
        f"| step-time MAPE | {s.step_mape_pct:.1f}% | {a.step_mape_pct:.1f}% |",
        f"| memory MAPE | {s.memory_mape_pct:.1f}% | {a.memory_mape_pct:.1f}% |",
        f"| Kendall tau (step time) | {s.step_kendall_tau:.2f} | {a.step_kendall_tau:.2f} |",
        "",
    ]
    for fold, m in fits:
        lines.append(f"- fitted on {', '.join(report.rows[i].name for i in fold)}: compute x{m.compute:.3g}, "
                     f"kernel launch x{m.kernel_overhead:.3g}")
    if report.failed:
        lines += ["", "Plans that did not run: " + "; ".join(f"{n}: {e}" for n, e in report.failed)]
    lines += ["", f"![predicted vs measured on one H100]({PNGS[0]})", "", f"![after the refit]({PNGS[1]})"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--record", type=Path)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cuda", help="cuda; cpu (with --cluster local-cpu) only checks the script")
    parser.add_argument("--cluster", default=CLUSTER)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.out:
        measure(args.out, args.steps, device=args.device, cluster_name=args.cluster, quick=args.quick)
    if args.record:
        from benchmarks.report import update_section

        for png in PNGS:
            shutil.copyfile(args.record / png, DOCS / png)
        data = json.loads((args.record / "section.json").read_text())
        update_section("validate_cuda", "Validation on one H100 (soap validate --device cuda --nproc 1)",
                       data["body"], machine=data["machine"])


if __name__ == "__main__":
    main()
