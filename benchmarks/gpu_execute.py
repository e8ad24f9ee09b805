"""Plan, execute and compare on one GPU: predicted against measured step time and peak memory.

    python -m benchmarks.gpu_execute --out DIR            # on a CUDA machine
    python -m benchmarks.gpu_execute --out DIR --clusters dgx-h200 h200.json --precisions bf16 fp8
    python -m benchmarks.gpu_execute --record DIR         # here: write DIR/gpu_execute.json into docs

For each model and each cluster profile (the datasheet `dgx-h100` and the calibrated `h100-x1-measured`),
`soap plan MODEL --gpus 1 --precision bf16` picks micro-batch, accumulation and recompute for a fixed
global batch; `soap execute` then trains that plan for a few steps on NCCL (one rank), and the run
report gives measured step time (median of the timed steps) and peak memory (torch.cuda max allocated)
next to what the simulator predicted. Plans that come out identical under both profiles are executed
once. Nothing here is hard-coded: every figure comes from the run reports written under DIR.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"
CASES = (  # (label, MODEL argument, global batch, sequence length)
    ("gpt2", "gpt2", 32, 1024),
    ("bert-large", "bert-large-uncased", 64, 512),
    ("llama-3.2-1b", str(CONFIGS / "llama-3.2-1b.json"), 16, 2048),
    ("gpt2-xl", "gpt2-xl", 16, 1024),
)
CLUSTERS = ("dgx-h100", "h100-x1-measured")
STEPS = 6


def _soap(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "soap", *args, "--json"], capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        cause = next((l for l in reversed(lines) if "Error:" in l and "error: a worker failed" not in l), lines[-1] if lines else "")
        raise RuntimeError(f"soap {args[0]}: {cause.split('] ')[-1][:160]}")
    return json.loads(done.stdout)


def measure(out: Path, clusters: tuple[str, ...] = CLUSTERS, precisions: tuple[str, ...] = ("bf16",)) -> list[dict]:
    rows = []
    for (label, model, batch, seq), precision in ((c, p) for p in precisions for c in CASES):
        executed: dict[str, dict] = {}
        for cluster_arg in clusters:
            cluster = Path(cluster_arg).stem if cluster_arg.endswith(".json") else cluster_arg
            plan_path = out / f"{label}-{cluster}-{precision}.plan.json"
            row = dict(model=label, cluster=cluster, global_batch=batch, seq_len=seq, precision=precision)
            try:
                _soap("plan", model, "--gpus", "1", "--cluster", cluster_arg, "--precision", precision,
                      "--global-batch", str(batch), "--seq-len", str(seq), "-o", str(plan_path))
                plan = json.loads(plan_path.read_text())
                key = json.dumps(plan["parallelism"], sort_keys=True)
                if key not in executed:
                    executed[key] = _soap("execute", str(plan_path), "--steps", str(STEPS),
                                          "--report", str(out / f"{label}-{cluster}-{precision}.run.json"))
                run = executed[key]
                t = plan["parallelism"]
                row.update(plan=f"mb{t['micro_batch']}x{t['num_microbatches']} recompute {t['recompute']}",
                           predicted_step_s=plan["predicted"]["step_time_s"], measured_step_s=run["step_time_s"],
                           predicted_memory_gib=plan["predicted"]["peak_memory_gib"],
                           measured_memory_gib=run["peak_memory_gib"], memory_source=run.get("peak_memory_source"),
                           tokens_per_s=run.get("tokens_per_s"),
                           measured_reserved_gib=run.get("peak_memory_reserved_gib"),
                           device_memory_gib=plan["cluster"]["profile"]["device"]["memory_gib"]["value"])
            except (RuntimeError, KeyError, json.JSONDecodeError) as exc:
                row.update(error=str(exc))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def _pct(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.1f}%"


def markdown(rows: list[dict], machine: str) -> str:
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    lines = [
        f"One GPU, NCCL, AdamW; {STEPS} steps per run, the first untimed; the plan is what `soap plan MODEL --gpus 1 "
        f"--precision P` picked on each profile ({', '.join(f'`{c}`' for c in clusters)}; `*-measured` is this GPU "
        "calibrated by `soap calibrate --device cuda --nproc 1`). Memory: torch.cuda max allocated, and max reserved "
        "(what the caching allocator took) beside it.", "",
        "| model | profile | precision | global batch × seq | plan | step predicted | step measured | error | "
        "memory predicted | allocated | error | reserved |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        precision = r.get("precision", "bf16") + (" compile" if r.get("compile") else "")
        head = f"| {r['model']} | {r['cluster']} | {precision} | {r['global_batch']} × {r['seq_len']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} ||||||||")
            continue
        reserved = r.get("measured_reserved_gib")
        lines.append(
            f"{head} {r['plan']} | {r['predicted_step_s']:.3f} s | {r['measured_step_s']:.3f} s | "
            f"{_pct(r['predicted_step_s'], r['measured_step_s'])} | {r['predicted_memory_gib']:.1f} GiB | "
            f"{r['measured_memory_gib']:.1f} GiB | {_pct(r['predicted_memory_gib'], r['measured_memory_gib'])} | "
            + (f"{reserved:.1f} GiB |" if reserved is not None else "— |"))
    ok = [r for r in rows if "error" not in r]
    for cluster in clusters:
        errs = sorted(abs(r["predicted_step_s"] - r["measured_step_s"]) / r["measured_step_s"] for r in ok if r["cluster"] == cluster)
        mems = sorted(abs(r["predicted_memory_gib"] - r["measured_memory_gib"]) / r["measured_memory_gib"] for r in ok if r["cluster"] == cluster)
        if errs:
            lines.append(f"\n`{cluster}`: step-time MAPE {100 * sum(errs) / len(errs):.1f}%, memory MAPE "
                         f"{100 * sum(mems) / len(mems):.1f}% over {len(errs)} runs.")
    gaps = [r["measured_reserved_gib"] / r["measured_memory_gib"] - 1 for r in ok if r.get("measured_reserved_gib")]
    if gaps:
        lines.append(f"\nReserved over allocated: {100 * min(gaps):.1f}% to {100 * max(gaps):.1f}% "
                     f"(median {100 * sorted(gaps)[len(gaps) // 2]:.1f}%) over {len(gaps)} runs.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="measure here (needs CUDA)")
    parser.add_argument("--record", type=Path, nargs="+", help="write DIR/gpu_execute.json (rows of every DIR) into docs/benchmarks.md")
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS), help="cluster names or profile files")
    parser.add_argument("--precisions", nargs="+", default=["bf16"])
    parser.add_argument("--section", default="gpu_execute", help="docs/benchmarks.md section to write")
    parser.add_argument("--title", default="One H100: predicted against measured (soap plan + soap execute)")
    args = parser.parse_args()
    if args.out:
        from benchmarks.report import machine_description

        args.out.mkdir(parents=True, exist_ok=True)
        rows = measure(args.out, tuple(args.clusters), tuple(args.precisions))
        (args.out / "gpu_execute.json").write_text(json.dumps({"machine": machine_description(), "rows": rows}, indent=1))
    if args.record:
        from benchmarks.report import update_section

        runs = [json.loads((d if d.suffix == ".json" else d / "gpu_execute.json").read_text()) for d in args.record]
        data = dict(machine=runs[0]["machine"], rows=[r for run in runs for r in run["rows"]])
        update_section(args.section, args.title,
                       markdown(data["rows"], data["machine"]), machine=data["machine"])


if __name__ == "__main__":
    main()
