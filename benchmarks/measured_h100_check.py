"""The measured H100's compute terms against published runs, with nothing fitted to them.

    flock -x /tmp/soap-cpu.lock python -m benchmarks.measured_h100_check [--dry-run]

`h100-x1-measured` (`benchmarks/h100_measured.py`) is soap calibrate's microbenchmarks on a lent H100 80GB HBM3
(700 W) with three terms measured in soap's own training steps on the same GPU (fused AdamW at model sizes, a
step factor on memory-bound kernels, the executor's host floor). The default `dgx-h100` (device
`h100-sxm-fitted`) is the datasheet refitted to published runs (`benchmarks/published_runs.py`). On one profiled
step of Llama-3-8B's layers the two disagree kernel by kernel (docs, "One H100, 2026-11-26"): the default's GEMMs
1.6x and attention 2.3x slower than measured, its memory-bound kernels 2.3x faster.

This script asks which compute terms the published runs agree with. Each published run is priced as published
(`executor.validation.external.prepare`), on its own cluster's links, with the device swapped for one of the two
(`DEVICES`) and no multiplier, stack factor or refit applied:

1. the corpus rows (torchtitan on `grand-teton-h100`: H100 96GB HBM2e at 500 W; NeMo on DGX H100): predicted over
   published tokens/s per GPU, per source, model and precision (median, range);
2. the Ultra-Scale Playbook grid (nanotron, 1-64 nodes of p5 H100 SXM) on `h100-efa-playbook`'s links with each
   device: rank correlation and pick/best per node count, with nanotron's host floor and pipelined wait fitted as
   `benchmarks.playbook_grid` fits them, and the median predicted over measured;
3. what each predicts for `soap plan llama-3-8b` on 8 and 64 GPUs.

Writes section `measured-h100-check` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "published-runs"
FILES = (("torchtitan-llama3-8b-h100.json", "grand-teton-h100"), ("nvidia-dgxc-8b-15b-h100.json", "dgx-h100-datasheet"))
DEVICES = {"h100-sxm-fitted": "default (`h100-sxm-fitted`)", "h100-x1-measured": "measured (`h100-x1-measured`)"}
PLAYBOOK = "h100-efa-playbook"
DGX = "dgx-h100"


@contextmanager
def swap_folder() -> Iterator[Path]:
    """A temporary profiles folder for `with_device`'s clusters, `$SOAP_PROFILES_DIR` while in use (the shipped
    devices are found behind it), the variable restored after."""
    previous = os.environ.get("SOAP_PROFILES_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SOAP_PROFILES_DIR"] = tmp
        try:
            yield Path(tmp)
        finally:
            if previous is None:
                os.environ.pop("SOAP_PROFILES_DIR", None)
            else:
                os.environ["SOAP_PROFILES_DIR"] = previous


def with_device(cluster: str, device: str, folder: Path) -> str:
    """Write `cluster` with `device` under `folder` (a profiles dir); return its name."""
    data = json.loads((ROOT / "profiles" / "clusters" / f"{cluster}.json").read_text())
    name = f"{cluster}--{device}"
    data.update(name=name, device=device)
    (folder / "clusters").mkdir(parents=True, exist_ok=True)
    (folder / "clusters" / f"{name}.json").write_text(json.dumps(data))
    return name


def corpus(device: str, folder: Path) -> dict[tuple[str, str, str], list[float]]:
    """Predicted over published tokens/s per GPU, grouped by (source, model, precision)."""
    from executor.validation.external import load_records, predict, prepare

    specs = [f"{CORPUS / name}:{with_device(cluster, device, folder)}" for name, cluster in FILES]
    graphs: dict = {}
    out: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for record in load_records(specs, cluster=None):
        prediction = predict(prepare(record, graphs=graphs), None)
        model = record.name.split(" BF16")[0].split(" FP8")[0]
        source = "torchtitan, 500 W H100 96GB" if record.stack == "torch-native" else "NeMo, DGX H100"
        out[(source, model, record.precision)].append(prediction.predicted_tokens / prediction.measured_tokens)
    return out


def playbook(device: str, folder: Path) -> tuple[list, float, float, float, float]:
    """Group scores with nanotron's floor and wait fitted, and the median predicted / measured (all, one node)."""
    from benchmarks.playbook_grid import GRID, SYNC_FIT_NODES, fit_pipelined_sync, with_pipelined_sync
    from benchmarks.vtrain_tp import fit_host, step_times, with_host
    from costmodel.profiles import load_cluster
    from executor.validation.grid import graph_key, group_scores, load_grid, price_row

    cluster = load_cluster(with_device(PLAYBOOK, device, folder))
    ran, _ = load_grid(GRID, cluster=cluster.name)
    graphs: dict = {}
    priced = [price_row(r, cluster, graphs=graphs) for r in ran]
    plans = [(p.plan, graphs[graph_key(p.plan, cluster)]) for p in priced]
    one = [i for i, r in enumerate(ran) if r.nodes == 1]
    host = fit_host([ran[i] for i in one], [plans[i] for i in one], cluster)
    floored = with_host(cluster, host)
    small = [i for i, r in enumerate(ran) if r.nodes <= SYNC_FIT_NODES]
    delta = fit_pipelined_sync([ran[i] for i in small], [plans[i] for i in small], floored)
    tokens = [r.batch * r.seq / (t * r.gpus) for r, t in
              zip(ran, step_times(plans, with_pipelined_sync(floored, delta)))]
    ratios = [t / r.measured_tokens_per_s_per_gpu for r, t in zip(ran, tokens)]
    return (group_scores(ran, tokens), statistics.median(ratios),
            statistics.median(q for q, r in zip(ratios, ran) if r.nodes == 1), host, delta)


def reference_plans(device: str, folder: Path) -> list[str]:
    from planner.api import plan

    cluster = with_device(DGX, device, folder)
    cells = []
    for gpus in (8, 64):
        p = plan("llama-3-8b", gpus=gpus, cluster=cluster, precision="bf16")
        mfu = p.predicted["model_tflops_per_gpu"] / 989
        par = p.predicted["parallelism"]
        shape = " ".join(f"{k}{par[k]}" for k in ("dp", "tp", "pp", "zero") if par.get(k, 1) != 1 and par.get(k))
        shape += f" mb{par['micro_batch']}" + (" compile" if par.get("compile") else "") + (
            f" recompute {par['recompute']}" if par.get("recompute", "none") != "none" else "")
        cells.append(f"{100 * mfu:.1f}% ({shape})")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print, but do not write docs")
    args = parser.parse_args()
    from executor.validation.grid import geometric_mean

    start = time.perf_counter()
    with swap_folder() as folder:
        rows = {d: corpus(d, folder) for d in DEVICES}
        grids = {d: playbook(d, folder) for d in DEVICES}
        plans = {d: reference_plans(d, folder) for d in DEVICES}
    elapsed = time.perf_counter() - start

    def cell(ratios: list[float]) -> str:
        return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"

    keys = sorted(next(iter(rows.values())))
    lines = [f"`benchmarks/measured_h100_check.py` ({elapsed:.0f} s): published runs priced as published on their own "
             "cluster's links with the device swapped, nothing fitted (module docstring). Predicted over published "
             "tokens/s per GPU, median (range):", "",
             "| runs | model | precision | rows | " + " | ".join(DEVICES.values()) + " |",
             "|---|---|---|---:|" + "---:|" * len(DEVICES)]
    for key in keys:
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {len(rows[next(iter(DEVICES))][key])} | "
                     + " | ".join(cell(rows[d][key]) for d in DEVICES) + " |")
    lines += ["", "The Playbook grid (527 configurations, 1-64 nodes; nanotron's host floor fitted on one node and its "
              "pipelined wait on 1-8 nodes, as `benchmarks/playbook_grid.py` does), rank correlation / pick/best:", ""]
    groups = [s.group for s in grids[next(iter(DEVICES))][0]]
    lines += ["| device | " + " | ".join(f"{g} nodes" for g in groups) + " | geometric mean | predicted / measured, "
              "all (one node) | floor, wait |", "|---|" + "---:|" * (len(groups) + 3)]
    for d, (scores, median, one, host, delta) in grids.items():
        lines.append(f"| {DEVICES[d]} | " + " | ".join(f"{s.spearman:.2f} / {s.pick_best:.2f}" for s in scores)
                     + f" | {geometric_mean([max(s.spearman, 1e-3) for s in scores]):.2f} / "
                     f"{geometric_mean([s.pick_best for s in scores]):.2f} | {median:.2f} ({one:.2f}) | "
                     f"{host * 1e6:.0f} us, {delta * 1e6:.0f} us |")
    lines += ["", "`soap plan llama-3-8b` (bf16, the plan soap picks) on `dgx-h100`'s links, MFU against the "
              "989 TFLOP/s datasheet peak:", "", "| device | 8 GPUs | 64 GPUs |", "|---|---|---|"]
    lines += [f"| {DEVICES[d]} | {cells[0]} | {cells[1]} |" for d, cells in plans.items()]
    body = "\n".join(lines)
    print(body)
    if not args.dry_run:
        from benchmarks.report import update_section

        update_section("measured-h100-check", "The measured H100 against published runs, nothing fitted", body)


if __name__ == "__main__":
    main()
