"""Plan quality on a real cluster: the Ultra-Scale Playbook's 1B grid (issue 28, item 6).

    flock -x /tmp/soap-cpu.lock python -m benchmarks.playbook_grid [--dry-run]

The grid (../shared/published-runs/nanotron-playbook-1b-h100.json): 527 configurations of one 1B Llama-shaped
model that ran on 1 to 64 nodes of 8 H100 (EFA between nodes), nanotron, global batch 1M tokens.

1. The network from that cluster's collective measurements alone (nanotron-playbook-h100-collectives.json:
   median bus bandwidth of all-reduce, all-gather and reduce-scatter at 1 to 64 nodes), as a user with
   nccl-tests would: the medians become logs (`costmodel.calibration.nccl_tests.logs_from_bus_bandwidth`) and
   `soap calibrate --from-nccl-tests`'s fit (`fit_nccl_logs`, bandwidth only: e(S) scaled, s(N) and each
   collective's own s(N) fitted) calibrates `dgx-h100`'s links (same line rates: NVLink4 450 GB/s, 8 x 400 Gb/s
   per node; EFA's 3,200 Gb/s per p5 node is the same 50 GB/s per GPU).
2. Every configuration that ran, priced as published (`executor.validation.grid.price_row`): nanotron's own TP
   with sequence parallelism, 1F1B, ZeRO-0/1, no recompute, no compile, bf16.
3. Per node count: Spearman's rank correlation of predicted vs measured tokens/s per GPU, and pick/best (the
   measured throughput of the configuration soap predicts fastest over the best measured), and their geometric
   means over node counts. Before (datasheet `dgx-h100`), collectives only, and after the full fit
   (`soap calibrate --from-runs`'s `executor.validation.external.fit` on the collectives-calibrated cluster),
   leave-one-node-count-out: each node count predicted by a fit on the others.
Writes section `playbook-grid` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "published-runs"
GRID = CORPUS / "nanotron-playbook-1b-h100.json"
COLLECTIVES = CORPUS / "nanotron-playbook-h100-collectives.json"
BASE = "dgx-h100"
TARGETS = {"pick/best (geometric mean)": 0.95, "pick/best (worst node count)": 0.85, "rank correlation": 0.8}


def collectives_cluster(path: Path = COLLECTIVES, base: str = BASE):
    """`base` with its network fitted to the median bus bandwidths of `path` (module docstring, step 1); returns
    the fit (`NcclFit`: the cluster and each table entry's error before and after)."""
    from costmodel.calibration.nccl_tests import fit_nccl_logs, logs_from_bus_bandwidth
    from costmodel.profiles import load_cluster

    data = json.loads(Path(path).read_text())
    table = {kind: {int(n): gbps * 1e9 for n, gbps in zip(data["nodes"], values)}
             for kind, values in data["median_GBps"].items()}
    logs = logs_from_bus_bandwidth(table, ranks_per_node=8, source=Path(path).name)
    return fit_nccl_logs(logs, load_cluster(base), name=f"{base}-playbook-efa", bandwidth_only=True)


def _score_lines(title: str, scores) -> tuple[list[str], float, float]:
    from executor.validation.grid import geometric_mean

    rho = geometric_mean([s.spearman for s in scores])
    pick = geometric_mean([s.pick_best for s in scores])
    return [f"| {title} | " + " | ".join(f"{s.spearman:.2f} / {s.pick_best:.2f}" for s in scores)
            + f" | {rho:.2f} / {pick:.2f} | {min(s.pick_best for s in scores):.2f} |"], rho, pick


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print, but do not write docs")
    args = parser.parse_args()

    from costmodel.profiles import load_cluster
    from executor.validation.external import fit, leave_out, predict
    from executor.validation.grid import group_scores, load_grid, prepare_row, price_row

    start = time.perf_counter()
    ran, crashed = load_grid(GRID, cluster=BASE)
    graphs: dict = {}
    datasheet = load_cluster(BASE)
    before = [price_row(r, datasheet, graphs=graphs).tokens_per_s_per_gpu for r in ran]
    network = collectives_cluster()
    calibrated = network.cluster
    prepared = [prepare_row(r, calibrated, graphs=graphs) for r in ran]
    from executor.validation.external import predict as simulate

    collectives_only = [simulate(p, None).predicted_tokens for p in prepared]
    print(f"priced {len(ran)} rows twice in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    held = {q.name: q.predicted_tokens for q in leave_out(prepared, "gpus")}
    full_out = [held[r.name] for r in ran]
    everything = fit(prepared)
    in_sample = [predict(p, everything).predicted_tokens for p in prepared]
    elapsed = time.perf_counter() - start

    runs = {"datasheet `dgx-h100`": before, "network from collectives only": collectives_only,
            "full fit, leave one node count out": full_out, "full fit, in-sample": in_sample}
    scores = {title: group_scores(ran, values) for title, values in runs.items()}
    groups = [s.group for s in next(iter(scores.values()))]
    rows = ["| profile | " + " | ".join(f"{g} node{'s' if g != '1' else ''}" for g in groups)
            + " | geometric mean | worst pick/best |", "|---|" + "---:|" * (len(groups) + 2)]
    summary = {}
    for title, group in scores.items():
        lines, rho, pick = _score_lines(title, group)
        rows += lines
        summary[title] = (rho, pick)
    picks = ["| node count | measured best | soap's pick (collectives only) | its measured tok/s/GPU | best's |",
             "|---:|---|---|---:|---:|"]
    measured = {r.name: r.measured_tokens_per_s_per_gpu for r in ran}
    for s in scores["network from collectives only"]:
        picks.append(f"| {s.group} | {s.best} | {s.picked} | {measured[s.picked]:,.0f} | {measured[s.best]:,.0f} |")
    errors = ["| collective @ nodes x 8 | datasheet error | fitted error |", "|---|---:|---:|"]
    errors += [f"| {Path(p).name.split(':')[-1]} | {a:.1f}% | {b:.1f}% |" for p, (a, b) in network.errors.items()]
    link = calibrated.inter_node
    curves = [f"| {kind} | " + " | ".join(f"{link.scale_at(n, kind):.3g}" for n in (2, 4, 8, 16, 32, 64)) + " |"
              for kind in ("all_reduce", "all_gather", "reduce_scatter")]
    multipliers = ", ".join(f"{k} x{v:.3g}" for k, v in everything.multipliers.items())
    body = "\n".join([
        f"`benchmarks/playbook_grid.py`: the Ultra-Scale Playbook's 1B grid ({len(ran)} configurations that ran on "
        f"1-64 nodes of 8 H100 with EFA, nanotron; {len(crashed)} crashed or ran out of memory, not scored), each "
        "priced as published (`executor.validation.grid`). Each cell: Spearman rank correlation of predicted vs "
        "measured tokens/s per GPU / pick/best (measured tokens/s of soap's fastest-predicted configuration over "
        f"the best measured in that node count). Targets: pick/best >= {TARGETS['pick/best (geometric mean)']} "
        f"geometric mean, none below {TARGETS['pick/best (worst node count)']}; rank correlation >= "
        f"{TARGETS['rank correlation']}. {elapsed:.0f} s in all.",
        "",
        *rows,
        "",
        "Network from collectives only: the cluster's median bus bandwidths (all-reduce, all-gather, reduce-scatter "
        "at 1-64 nodes; message size not stated) become nccl-tests logs at bandwidth-bound sizes and `soap calibrate "
        "--from-nccl-tests` fits `dgx-h100`'s links (one factor on each level's e(S), alpha kept; inter-node fall-off "
        "s(N) and each collective's own). The fit's error on each median:",
        "",
        *errors,
        "",
        "Fitted fall-off (factor on the inter-node bandwidth against nodes spanned, relative to 2 nodes):",
        "",
        "| collective | 2 | 4 | 8 | 16 | 32 | 64 |", "|---|---:|---:|---:|---:|---:|---:|",
        *curves,
        "",
        f"Full fit (`soap calibrate --from-runs` multipliers on the collectives-calibrated cluster, all rows): "
        f"{multipliers}. Leave one node count out refits without that node count's rows and predicts them.",
        "",
        *picks,
    ])
    print(body)
    if not args.dry_run:
        from benchmarks.report import update_section

        update_section("playbook-grid", "Plan quality on the Ultra-Scale Playbook's 1B grid (8-512 H100)", body)


if __name__ == "__main__":
    main()
