"""Plan quality: the chosen plan's simulated throughput against every baseline's.

For every model x GPU count x cluster, `soap plan` picks a plan; its simulated tokens/s must be at
least each baseline's (DDP, FSDP/ZeRO-3, the best Megatron tp x pp x dp grid, the guide's rules of
thumb), since the search space contains every baseline. A combination where nothing fits is reported
as infeasible with the planner's error. The table goes to docs/benchmarks.md ("plan-quality").

    python -m benchmarks.plan_quality [--models gpt2,llama-3-8b] [--gpus 1,8] [--clusters dgx-h100]
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.report import update_section
from planner.api import plan_report
from planner.report import describe
from tracer.errors import SoapError

MODELS = ("gpt2", "bert-large-uncased", "llama-3-8b", "llama-3-70b", "mixtral-8x7b", "llama-3.1-405b")
GPUS = (1, 8, 64, 512, 4096)
CLUSTERS = ("dgx-h100", "dgx-a100-80g")
BASELINES = ("DDP", "FSDP / ZeRO-3", "Megatron grid", "rules of thumb")


def _tokens(p) -> str:
    return f"{p.result.tokens_per_s:,.0f}" if p is not None else "does not fit"


def run(models, gpus, clusters) -> tuple[str, int]:
    rows = []
    violations = 0
    for model in models:
        for cluster in clusters:
            for n in gpus:
                start = time.perf_counter()
                try:
                    report = plan_report(model, gpus=n, cluster=cluster)
                except SoapError as exc:
                    rows.append("| " + " | ".join([model, str(n), cluster, f"infeasible: {exc}"] + [""] * 7) + " |")
                    print(f"{model} {n} {cluster}: infeasible", file=sys.stderr)
                    continue
                chosen = report.chosen
                by_name = dict(report.baselines)
                worst = [by_name.get(b) for b in BASELINES]
                ok = all(b is None or chosen.result.tokens_per_s >= b.result.tokens_per_s for b in worst)
                violations += not ok
                speedups = [f"{b.step_time_s / chosen.step_time_s:.2f}x" if b else "-" for b in worst]
                rows.append(
                    f"| {model} | {n} | {cluster} | {describe(chosen)} | {_tokens(chosen)} | "
                    f"{100 * chosen.result.to_contract()['mfu']:.1f}% | "
                    + " | ".join(f"{_tokens(b)} ({s})" if b else "does not fit" for b, s in zip(worst, speedups))
                    + f" | {'yes' if ok else 'NO'} |"
                )
                print(f"{model} {n} {cluster}: {describe(chosen)} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    header = (
        "| model | GPUs | cluster | chosen plan | tokens/s | MFU | DDP | FSDP / ZeRO-3 | Megatron grid | "
        "rules of thumb | chosen >= all |\n|" + "---|" * 11
    )
    body = (
        "Simulated throughput (tokens/s) of the plan `soap plan MODEL --gpus N --cluster C` chooses, against "
        "each baseline's best configuration that fits (in parentheses: the chosen plan's speedup over it). "
        "Defaults: sequence min(max positions, 4096), global batch ~4M tokens rounded up to a multiple of the "
        "GPU count, bf16 (fp8 is opt-in with `--precision auto` or `fp8`), adamw; baselines at the chosen plan's "
        "precision and optimizer, without optimizer offload.\n\n"
        f"{header}\n" + "\n".join(rows) + f"\n\nCombinations where a baseline beat the chosen plan: {violations}."
    )
    return body, violations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--gpus", default=",".join(map(str, GPUS)))
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--no-write", action="store_true", help="print instead of updating docs/benchmarks.md")
    args = parser.parse_args()
    body, violations = run(args.models.split(","), [int(g) for g in args.gpus.split(",")], args.clusters.split(","))
    if args.no_write:
        print(body)
    else:
        update_section("plan-quality", "Plan quality: chosen plan vs baselines (simulated)", body)
    assert violations == 0, f"{violations} combinations where a baseline beat the chosen plan"
    return 0


if __name__ == "__main__":
    sys.exit(main())
