"""The planner's fast estimate against the simulator, on the candidates a search simulates.

    python -m benchmarks.estimate_accuracy [--no-docs]

`soap plan` estimates every candidate in closed form (`planner.estimate`) and simulates only the best-estimated
ones (`planner.search`), so an estimate that comes out above a candidate's simulated step can keep the fastest plan
from ever being simulated: the search takes the estimate as a lower bound. For each case (model, GPU count, cluster,
pins) this runs the search and sets each simulated candidate's estimate beside its simulated step: the median and
the largest error, how many estimates sit more than 1.5% above their simulation (the tolerance
`tests/test_search_ranking.py` holds), and whether the candidate with the best estimate among them is the one the
simulator ranks first. Each case pins torch.compile: where it is left free the search estimates every candidate
eager and simulates the best fitting ones again compiled (step 3b of `planner.search`), copies that carry their
eager estimate by design.
The table goes to docs/benchmarks.md ("estimate-accuracy").
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

LLAMA_1B = str(Path(__file__).resolve().parent / "configs" / "llama-3.2-1b.json")

OFF, ON = {"compile": "off"}, {"compile": "on"}
CASES = (  # (model, GPUs, cluster, pins): compile pinned, so that every simulated candidate was estimated as it runs
    ("gpt2", 1, "dgx-h100", OFF),
    (LLAMA_1B, 8, "dgx-h100", OFF),
    ("llama-3-8b", 8, "dgx-h100", OFF),
    ("llama-3-8b", 8, "dgx-h100", ON),
    ("llama-3-8b", 16, "dgx-h100", {"pp": 4, **OFF}),
    ("llama-3-8b", 64, "dgx-h100", OFF),
    ("llama-3-70b", 64, "dgx-h100", OFF),
    ("llama-3-70b", 512, "dgx-h100", ON),
    ("mixtral-8x7b", 64, "dgx-h100", OFF),
    ("llama-3-8b", 8, "dgx-a100-80g", OFF),
    ("llama-3-8b", 8, "dgx-h200", {"precision": "fp8", **ON}),
)
OVER = 0.015
"""An estimate this far above its simulation breaks the search's lower-bound assumption."""


def measure(model: str, gpus: int, cluster: str, pins: dict) -> dict:
    from planner.api import plan_report

    start = time.perf_counter()
    report = plan_report(model, gpus=gpus, cluster=cluster, **pins)
    seconds = time.perf_counter() - start
    simulated = [p for p in (report.chosen, *report.alternatives) if p.result is not None]
    ratios = [p.candidate.estimate.step_time_s / p.result.step_time_s - 1 for p in simulated]
    by_estimate = min(simulated, key=lambda p: p.candidate.estimate.step_time_s)
    by_simulation = min(simulated, key=lambda p: p.result.step_time_s)
    return dict(case=f"{Path(model).stem} on {gpus} ({cluster}{''.join(f', {k}={v}' for k, v in pins.items())})",
                simulated=len(simulated), median=statistics.median(abs(r) for r in ratios),
                worst=max(ratios, key=abs), over=sum(r > OVER for r in ratios),
                same_first=by_estimate is by_simulation,
                gap=by_estimate.result.step_time_s / by_simulation.result.step_time_s, seconds=seconds)


def markdown(rows: list[dict]) -> str:
    lines = ["| case | simulated candidates | median abs error | largest error | above by > 1.5% | "
             "best estimate is best simulated (its step over the best's) | planning (s) |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['simulated']} | {r['median']:.2%} | {r['worst']:+.2%} | {r['over']} | "
                     f"{'yes' if r['same_first'] else 'no'} ({r['gap']:.3f}) | {r['seconds']:.1f} |")
    lines += ["", f"{sum(r['over'] for r in rows)} of {sum(r['simulated'] for r in rows)} simulated candidates "
              f"estimated more than {OVER:.1%} above their simulation; the best estimate was the best simulation in "
              f"{sum(r['same_first'] for r in rows)} of {len(rows)} cases, and otherwise within "
              f"{max(r['gap'] for r in rows) - 1:.1%} of it.", "", READING]
    return "\n".join(lines)


READING = """Reading it (2026-11-28): the estimate decides which few candidates are simulated, the simulation which one
is picked. Until this benchmark, Mixtral 8x7B's expert-parallel candidates were estimated at a fifth of their simulated
step (8.1 s against 41.0 s on 64 H100s): the estimator divided an expert op's work by ep, where each rank receives
the tokens of all ep ranks routed to its experts (`costmodel.placement.OpSplit.local`), so the search ranked ep > 1
first whatever it cost. Then (commit 919cda7) the estimate was made to price what the simulator prices:

| case | before: median abs / largest error / above by > 1.5% / best estimate is best simulated |
|---|---|
| gpt2 on 1 | 0.49% / -30.52% / 0 / yes |
| llama-3-8b on 64 | 1.05% / -2.87% / 0 / yes |
| llama-3-70b on 64 | 1.90% / +2.08% / 5 / no (1.014) |
| llama-3-70b on 512 | 0.88% / -5.25% / 0 / yes |
| llama-3-8b on 8 (dgx-a100-80g) | 1.13% / -1.57% / 0 / no (1.013) |

- TP was two all-reduces per region at none of the device's `activation_collective_factor` (0.63 on the fitted H100
  and H200), which is what put Llama 3 70B's tp4 x pp4 candidates 2% above their simulation; sequence parallelism
  issues an all-gather and a reduce-scatter where the estimate counted one all-reduce, and the vocabulary-parallel
  embedding, head and loss add their own. It now takes the collectives of the simulator's placement
  (`costmodel.placement.block_placements`), each priced as the simulator prices it, host waits included, and the
  ops' local shapes from the same placement.
- The eager host floor (an eager chunk's kernels times `host_dispatch_s`) was the simulator's only: GPT-2's
  micro-batch-4 candidate was the -30%.
- ZeRO 3 hid all the data-parallel traffic behind all the compute; now each phase hides only its own, never the
  first unit's gather (it opens the forward) nor its sync (it closes the backward): -5.25% on 70B at 512 GPUs before.
Left: the simulator's per-chunk prefetch exposes more than those phase bounds where one unit's traffic outlasts its
neighbour's compute (Llama 3 8B at zero 3 on 128 GPUs: down to -5%), and a plan's block splits other than the
default placement (GPT-2's) are estimated at the default's collectives (+0.7%)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-docs", action="store_true", help="print the table only")
    args = parser.parse_args()
    rows = []
    for model, gpus, cluster, pins in CASES:
        rows.append(measure(model, gpus, cluster, pins))
        print(rows[-1], flush=True)
    body = markdown(rows)
    print(body)
    if not args.no_docs:
        from benchmarks.report import update_section

        update_section("estimate-accuracy", "The planner's estimate against the simulator", body)


if __name__ == "__main__":
    main()
