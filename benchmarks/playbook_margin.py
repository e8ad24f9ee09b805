"""Room for the allocator, judged on the Playbook's grid: which configurations would soap refuse?

    python -m benchmarks.playbook_margin [--max-nodes N]     # writes a docs section

The Ultra-Scale Playbook's 1B grid (../shared/published-runs/nanotron-playbook-1b-h100.json) lists 527
configurations that ran on nodes of 8 H100 80GB and 266 that crashed or ran out of memory (the source does not
say which). Each is planned as published (every choice pinned, no memory limit) on the `dgx-h100` profile and
its predicted peak memory per GPU compared with a limit: the device's memory less a margin
(`costmodel.allocator`). A good memory model and margin refuse many crashed configurations and none that ran.
The margin the search keeps by default is `DEFAULT_MARGIN`; the table shows what others would do.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

GRID = Path(__file__).resolve().parents[2] / "shared" / "published-runs" / "nanotron-playbook-1b-h100.json"
CLUSTER = "dgx-h100"
MARGINS = (0.0, 0.05, 0.10, 0.15, 0.20)
GIB = 2**30


def predicted_peaks(max_nodes: int) -> list[dict]:
    from costmodel.profiles import load_cluster
    from executor.validation.grid import load_grid, price_row
    from tracer.errors import SoapError

    cluster, graphs, out = load_cluster(CLUSTER), {}, []
    ran, crashed = load_grid(GRID)
    for status, records in (("ran", ran), ("crashed", crashed)):
        for record in records:
            nodes = record.gpus // 8
            if nodes > max_nodes:
                continue
            try:  # priced as published; 1F1B with fewer micro-batches than stages as GPipe (the same timeline)
                price = price_row(record, cluster, graphs=graphs)
            except SoapError as err:  # refused by the plan rules: reported, not dropped
                out.append(dict(name=record.name, status=status, nodes=nodes, error=str(err)[:160]))
                continue
            out.append(dict(name=record.name, status=status, nodes=nodes, predicted_gib=price.peak_memory_gib,
                            first_rank_gib=price.first_rank_memory_gib,
                            measured_gb=record.memory_gib * 1.074 if record.memory_gib else None,
                            group=_group(record)))
            print(f"{status} {record.name}: {price.peak_memory_gib:.1f} GiB", file=sys.stderr)
    return out


def _group(record) -> str:
    """Which of three kinds of step a configuration runs: a pipeline of one micro-batch per step, another
    pipeline, or none."""
    if (record.pp or 1) == 1:
        return "no pipeline"
    return "pipeline, one micro-batch per step" if record.grad_accum == 1 else "pipeline, 2 or more micro-batches"


def markdown(rows: list[dict], device_gib: float, elapsed: float) -> str:
    from costmodel.allocator import DEFAULT_MARGIN

    priced = [r for r in rows if "predicted_gib" in r]
    ran = [r for r in priced if r["status"] == "ran"]
    crashed = [r for r in priced if r["status"] == "crashed"]
    ruled = {status: [r for r in rows if "error" in r and r["status"] == status] for status in ("ran", "crashed")}
    all_ran, all_crashed = len(ran) + len(ruled["ran"]), len(crashed) + len(ruled["crashed"])
    lines = [f"`benchmarks/playbook_margin.py`: {all_ran} configurations that ran and {all_crashed} that crashed or ran "
             f"out of memory (nodes of 8 H100 80GB), each planned as published on `{CLUSTER}` ({device_gib:.0f} GiB "
             f"per GPU) in {elapsed:.0f} s. A 1F1B pipeline with fewer micro-batches than stages, which torch's "
             "Schedule1F1B refuses and nanotron ran, is priced as GPipe (the same timeline). Refused: by the plan rules "
             f"before any pricing ({len(ruled['crashed'])} crashed, {len(ruled['ran'])} ran), or with a predicted peak "
             "above the device's memory less the margin.", "",
             "| margin | limit GiB | crashed refused | ran refused |", "|---:|---:|---:|---:|"]
    for margin in MARGINS:
        limit = device_gib * (1 - margin)
        refused_crashed = sum(r["predicted_gib"] > limit for r in crashed) + len(ruled["crashed"])
        refused_ran = sum(r["predicted_gib"] > limit for r in ran) + len(ruled["ran"])
        mark = " (default)" if abs(margin - DEFAULT_MARGIN) < 1e-9 else ""
        lines.append(f"| {margin:.0%}{mark} | {limit:.1f} | {refused_crashed} of {all_crashed} | "
                     f"{refused_ran} of {all_ran} |")
    worst = sorted(ran, key=lambda r: r["predicted_gib"], reverse=True)[:5]
    lines += ["", "The ran configurations predicted highest (predicted GiB / published GB, whose kind the source "
              "does not state): " + "; ".join(f"{r['name']} {r['predicted_gib']:.1f} / {r['measured_gb']:.1f}" for r in worst)
              + "."]
    errors = [r["predicted_gib"] / r["measured_gb"] - 1 for r in ran if r.get("measured_gb")]
    if errors:
        errors.sort()
        lines.append(f"Predicted over published memory of the runs: median {errors[len(errors) // 2]:+.1%}, "
                     f"5th-95th percentile {errors[len(errors) // 20]:+.1%} to {errors[-len(errors) // 20 - 1]:+.1%}.")
        groups = sorted({r["group"] for r in ran})
        lines += ["", "Predicted over published memory by kind of step: the worst pipeline rank's peak, and pipeline "
                  "rank 0's (the first stage's, whose peak nanotron's `log_memory` prints, `rank=0`). In 1F1B the first "
                  "stage holds min(pp, micro-batches) micro-batches of activations and the last one micro-batch and the "
                  "loss: alike with 2 or more micro-batches on 2 stages, not with one.", "",
                  "| runs | count | worst rank / published, median (5th-95th) | rank 0 / published, median (5th-95th) |",
                  "|---|---:|---:|---:|"]

        def spread(values: list[float]) -> str:
            values = sorted(values)
            return f"{values[len(values) // 2]:.2f} ({values[len(values) // 20]:.2f}-{values[-len(values) // 20 - 1]:.2f})"

        for group in groups:
            rows_ = [r for r in ran if r["group"] == group and r.get("measured_gb")]
            lines.append(f"| {group} | {len(rows_)} | {spread([r['predicted_gib'] / r['measured_gb'] for r in rows_])} | "
                         f"{spread([r['first_rank_gib'] / r['measured_gb'] for r in rows_])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-nodes", type=int, default=64)
    parser.add_argument("--dry-run", action="store_true", help="print, write no docs")
    args = parser.parse_args()
    from benchmarks.report import update_section
    from costmodel.profiles import load_cluster

    start = time.perf_counter()
    rows = predicted_peaks(args.max_nodes)
    text = markdown(rows, load_cluster(CLUSTER).device.memory_bytes / GIB, time.perf_counter() - start)
    print(text)
    if not args.dry_run:
        update_section("playbook-margin", "Room for the allocator on the Playbook's 1B grid: crashed against ran", text)


if __name__ == "__main__":
    main()
