"""What published runs reached, per GPU and model class: the bounds a believable profile stays inside.

    python -m benchmarks.believable_mfu          # writes profiles/published-mfu.json and a docs section

For every row of ../shared/published-runs/ with a measured throughput, its MFU counted as soap counts it:

    MFU = tokens/s per GPU x (F_fwd + F_bwd) / (batch x seq) / datasheet bf16 (fp16 on V100) dense peak

F: the traced graph's model FLOPs (`costmodel.simulator.pricing._facts`: no recompute counted), so the bound
and soap's predicted MFU count the same FLOPs. The peak is the datasheet's (989 TFLOP/s for H100 SXM, 312 for
A100), never a measured or fitted rate. A class whose runs all state one recompute mode records it
(`recompute`): recompute costs FLOPs MFU does not count (full recompute a third more), so the test prices its
reference plans under the same mode, like with like. Rows are grouped by torch.compile (a compiled run is bounded by
compiled runs), GPU, model class (`1b`: under 3B parameters;
`8b`: 3-20B; `70b`: over 20B), scale (`one node`: up to 8 GPUs; `multi-node`) and stack family:
`eager` (torch-native and nanotron: soap's executor runs this kind of stack) and `fused` (Transformer Engine,
Megatron's fused kernels), which a soap prediction of its own executor must not be held to. fp8 rows are left
out (their MFU is counted against the bf16 peak by convention, which makes them incomparable).

tests/test_believable_profiles.py holds every default GPU profile's predicted MFU for reference plans at or
below the best `eager` run of its class, where the corpus has one, else below its best `fused` run (small GPT on
one A100 node: vTrain's Megatron-DeepSpeed grid).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "published-runs"
OUT = ROOT / "profiles" / "published-mfu.json"
FILES = {  # file: (gpu, stack family, datasheet dense 16-bit peak FLOP/s)
    "torchtitan-llama3-8b-h100.json": ("h100", "eager", 989e12),
    "nanotron-playbook-1b-h100.json": ("h100", "eager", 989e12),
    "nvidia-dgxc-8b-15b-h100.json": ("h100", "fused", 989e12),
    "vtrain-megatron-ds-a100-1node.json": ("a100", "fused", 312e12),
}
STACK_NOTE = {"eager": "torch-native / nanotron (no fused kernels beyond torch.compile)",
              "fused": "Transformer Engine or Megatron fused kernels"}


def model_class(params: float) -> str:
    return "1b" if params < 3e9 else "8b" if params < 20e9 else "70b"


def scale_class(gpus: int) -> str:
    return "one node" if gpus <= 8 else "multi-node"


def flops_per_token(record, cache: dict) -> tuple[float, float]:
    """Model FLOPs per token (forward + backward) and parameter count of the record's model at its sequence."""
    import tracer

    key = (json.dumps(record.model, sort_keys=True, default=str), record.seq)
    if key not in cache:
        graph = tracer.trace(record.model_spec(), batch=1, seq_len=record.seq)
        cache[key] = ((graph.fwd_flops + graph.bwd_flops) / graph.batch / record.seq, graph.params_total)
    return cache[key]


def records(path: Path) -> list:
    """The file's run records: a grid with one file-level `model` (the Playbook) through the grid loader, which
    gives every row that model; otherwise the rows as run records."""
    from executor.validation.grid import load_grid
    from executor.validation.run_records import RunRecord, read_records

    data = json.loads(path.read_text())
    if isinstance(data.get("model"), dict):
        return load_grid(path)[0]
    if data.get("memory_kind") in ("reserved", "allocated"):
        return list(read_records(path).records)
    keep = set(RunRecord.model_fields) - {"memory_gib", "memory_kind"}  # a memory of unknown kind is not needed here
    return [RunRecord.model_validate({k: v for k, v in row.items() if k in keep and v is not None})
            for row in data["rows"]]


def measure() -> list[dict]:
    rows, cache = [], {}
    for name, (gpu, family, peak) in FILES.items():
        for record in records(CORPUS / name):
            if record.precision == "fp8":
                continue
            tokens = record.measured_tokens_per_s_per_gpu
            if not tokens:
                continue
            per_token, params = flops_per_token(record, cache)
            rows.append(dict(file=name, run=record.name, gpu=gpu, family=family, gpus=record.gpus,
                             compile=bool(record.torch_compile), recompute=record.recompute,
                             model=model_class(params), params=params, scale=scale_class(record.gpus),
                             mfu=tokens * per_token / peak))
    return rows


def classes(rows: list[dict]) -> list[dict]:
    groups = defaultdict(list)
    for r in rows:
        groups[(r["gpu"], r["model"], r["scale"], r["family"], r["compile"])].append(r)
    out = []
    for (gpu, model, scale, family, compiled), members in sorted(groups.items()):
        best = max(members, key=lambda r: r["mfu"])
        worst = min(members, key=lambda r: r["mfu"])
        modes = {r["recompute"] for r in members}
        out.append(dict(gpu=gpu, model=model, scale=scale, family=family, compile=compiled, runs=len(members),
                        mfu_max=round(best["mfu"], 4), best_run=best["run"], mfu_min=round(worst["mfu"], 4),
                        worst_run=worst["run"], recompute=modes.pop() if len(modes) == 1 else None,
                        source=sorted({r["file"] for r in members})))
    return out


def markdown(table: list[dict]) -> str:
    lines = ["MFU of every non-fp8 row of `../shared/published-runs/`, counted as soap counts it (the traced model "
             "FLOPs, no recompute, over the datasheet dense 16-bit peak), per GPU, model class, scale and stack "
             "family (`benchmarks/believable_mfu.py`; written to `profiles/published-mfu.json`, which "
             "`tests/test_believable_profiles.py` reads).", "",
             "| GPU | model | scale | stack | torch.compile | recompute | runs | best MFU (run) | worst MFU |",
             "|---|---|---|---|---|---|---:|---|---:|"]
    for c in table:
        lines.append(f"| {c['gpu']} | {c['model']} | {c['scale']} | {c['family']} | "
                     f"{'yes' if c['compile'] else 'no'} | {c['recompute'] or 'mixed'} | {c['runs']} | "
                     f"{100 * c['mfu_max']:.1f}% ({c['best_run']}) | {100 * c['mfu_min']:.1f}% |")
    lines += ["", "Stacks: " + "; ".join(f"`{k}`: {v}" for k, v in STACK_NOTE.items()) + ". No published 70B run, "
              "and no H200, A100 40 GB, V100 or multi-node A100 run, is in the corpus: those classes have no bound."]
    return "\n".join(lines)


def main() -> None:
    from benchmarks.report import update_section

    rows = measure()
    table = classes(rows)
    assert all(math.isfinite(c["mfu_max"]) for c in table)
    OUT.write_text(json.dumps({"about": "written by benchmarks/believable_mfu.py: the best and worst MFU published "
                                        "runs of each class reached (its docstring says how they are counted)",
                               "classes": table}, indent=1) + "\n")
    update_section("believable-mfu", "What published runs reached: MFU per GPU and model class", markdown(table))
    print(markdown(table))


if __name__ == "__main__":
    main()
