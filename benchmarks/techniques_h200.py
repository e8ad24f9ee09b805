"""The single-GPU techniques no GPU had run, on one H200: measured against their prices.

    python -m benchmarks.techniques_h200

A lent H200 (2026-11-28, `benchmarks/gpu_session_techniques.sh`, two calls) ran Llama 3.2 1B at 16 x 2,048 tokens a
step, every plan pinned alike on the default `dgx-h200` (micro-batch 4, 4 micro-batches, no recompute, eager, chunked
loss) with one pin changed: the bf16 AdamW baseline, fp16 (GradScaler), tf32 (fp32 weights and activations, TF32
GEMMs), bitsandbytes' 8-bit AdamW, Adafactor, SGD, and the optimizer offloaded to the CPU. Until then the GPU runs
(`benchmarks/data/h1*-runs-*.jsonl`) had all been bf16 or fp8 AdamW on the device. The plans are in
`benchmarks/data/h200-2026-11-28/plans`, the runs (the plan as run beside the report) in its `runs.jsonl`; each plan is
re-priced with the current cost model on the default `dgx-h200` and the measured `h200-x1-measured` (as
`benchmarks.gpu_repredict` does), beside what `dgx-h200` priced when the plan was made. The measured step is the
median of the steps after the first (`executor.train.steady_step_s`).
"""

from __future__ import annotations

import os
from pathlib import Path

RUNS = Path(__file__).resolve().parent / "data" / "h200-2026-11-28"
BASELINE = "1b-adamw"
CLUSTERS = ("dgx-h200", "h200-x1-measured")


def records() -> list[dict]:
    from executor.runs_log import read_runs

    return [dict(record, name=record["name"].removesuffix(".plan")) for record in read_runs(str(RUNS / "runs.jsonl"))]


def rows() -> list[dict]:
    from benchmarks.gpu_repredict import priced
    from executor.train import steady_step_s
    from planner.plan import plan_from_dict

    out = []
    for record in records():
        p = plan_from_dict(record["plan"]).parallelism
        out.append(dict(name=record["name"], precision=p.precision, optimizer=p.optimizer,
                        measured_s=steady_step_s(record["step_times_s"]), measured_gib=record["peak_memory_gib"],
                        reserved_gib=record.get("peak_memory_reserved_gib"), then_s=record["predicted_step_time_s"])
                   | priced(record, {name: name for name in CLUSTERS}))
    return out


UNFUSED = ("adamw8bit", "adafactor", "sgd")
"""The optimizers soap's executor steps with more than one pass (`executor.data_parallel._optimizer_class`)."""


def optimizer_factors() -> dict[str, list[list[float]]]:
    """The measured factor k of each unfused optimizer (`costmodel.optimizer_step`): its step's time, the fused
    AdamW's priced on `h200-x1-measured` (measured there, 2026-11-26) plus what the run measured over the AdamW run
    of the same plan, over its one-pass estimate on that profile, at its bytes. Everything else in the two steps is
    the same (the GEMMs, attention, activations), as the repricing shows (0.995-0.997x)."""
    from costmodel.optimizer_step import memory_pass_time, optimizer_step_bytes, optimizer_step_time
    from costmodel.profiles import load_device
    from executor.model import build_meta_model
    from executor.train import steady_step_s
    from planner.plan import plan_from_dict

    device = load_device(CLUSTERS[1])
    runs = {r["name"]: r for r in records()}
    base = runs[BASELINE]
    model = plan_from_dict(base["plan"]).model
    n = sum(p.numel() for p in build_meta_model(model.config, model.task).parameters())  # tied embeddings once
    adamw = optimizer_step_time(device, n, precision="bf16", optimizer="adamw")
    out = {}
    for name in UNFUSED:
        run = runs[f"1b-{name}"]
        extra = steady_step_s(run["step_times_s"]) - steady_step_s(base["step_times_s"])
        nbytes = optimizer_step_bytes(n, precision="bf16", optimizer=name)
        factor = (adamw + extra) / memory_pass_time(device, nbytes)
        out[f"{name}/bf16"] = [[float(f"{nbytes:.4g}"), float(f"{factor:.3g}")]]
    return out


OPTIMIZER_SOURCE = ("measured on a lent H200, 2026-11-28, for adamw8bit, adafactor and sgd: each step over the AdamW "
                    "run of the same Llama 3.2 1B plan (benchmarks/techniques_h200.py), the fused AdamW's own time "
                    "as h200-x1-measured prices it, over the one-pass estimate")


def with_optimizers(device_json: dict) -> dict:
    """`device_json` with the unfused optimizers' measured factors (`optimizer_factors`) added to its own."""
    from costmodel.profiles import with_measured_factors

    table = with_measured_factors(device_json.get("optimizer_factors"), optimizer_factors(), OPTIMIZER_SOURCE)
    return {**device_json, "optimizer_factors": table}


def pct(p: float, m: float) -> str:
    return f"{100 * (p - m) / m:+.0f}%"


def markdown(table: list[dict]) -> str:
    lines = ["| run | precision | optimizer | measured step | dgx-h200 when planned | dgx-h200 now | "
             "h200-x1-measured | measured memory (reserved) | dgx-h200 now |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        (ds, dg), (hs, _) = r[CLUSTERS[0]], r[CLUSTERS[1]]
        m = r["measured_s"]
        lines.append(f"| {r['name']} | {r['precision']} | {r['optimizer']} | {m * 1e3:.0f} ms | "
                     f"{r['then_s'] * 1e3:.0f} ({pct(r['then_s'], m)}) | {ds * 1e3:.0f} ({pct(ds, m)}) | "
                     f"{hs * 1e3:.0f} ({pct(hs, m)}) | {r['measured_gib']:.1f} ({r['reserved_gib']:.1f}) GiB | "
                     f"{dg:.1f} ({pct(dg, r['measured_gib'])}) |")
    base = next(r for r in table if r["name"] == BASELINE)
    lines += ["", f"Each run over the bf16 AdamW baseline ({BASELINE}), step time:", "",
              "| run | measured | dgx-h200 now | h200-x1-measured |", "|---|---:|---:|---:|"]
    for r in table:
        if r is not base:
            lines.append(f"| {r['name']} | {r['measured_s'] / base['measured_s']:.3f} | "
                         + " | ".join(f"{r[c][0] / base[c][0]:.3f}" for c in CLUSTERS) + " |")
    lines += ["", READING]
    return "\n".join(lines)


READING = """Reading it:
- **fp16 was priced 29% fast** when planned (523 ms against 741 measured; bf16 706 / 725): the default's GEMM
  multiplier (x1.6) was fitted on bf16 runs only, and fp16's GEMMs kept the datasheet's efficiency. bf16 and fp16 run
  on the same tensor cores at one peak, so a fit on one now writes the other's too
  (`executor.validation.external.half_twin`); fp16 is priced within 5% of its run, and 1.003x its bf16 twin against
  1.022x measured (the loss scaler's unscale and inf check).
- **tf32 (fp32 weights and activations): its memory was priced 39% low, its step is priced 2x fast.** The
  plan printed 52.9 GiB with its workspace; the step allocated 85.0. The 32 GiB missing were, to the byte, one fp32
  [4, 32, 2,048, 2,048] matrix for each of the 16 layers: with fp32 queries torch's SDPA has neither FlashAttention
  nor cuDNN, HF's Llama passes a boolean mask (K/V repeated to the query heads) in this regime, and either the math
  path (its softmax probabilities) or the memory-efficient kernel (its bias expanded to every head) keeps such a
  matrix for backward. A later call traced it (benchmarks/data/h200-2026-11-28b): one profiled tf32 step of this
  plan (`benchmarks/gpu_step_profile.py --precision tf32`: 1.89 s, against 0.73 s in bf16) ran no attention kernel
  at all, but the math path: TF32 GEMMs over the whole square, `where` for the mask, softmax forward and backward
  over [4, 32, 2,048, 2,048] fp32 (GEMMs 1.00 s and memory-bound kernels 0.85 s of the step, against 0.32 and 0.33
  in bf16). Alone, SDPA at the same shape with the causal boolean mask and K/V already repeated picks the
  memory-efficient kernel (`benchmarks/sdpa_fp32.py`: 15.9 ms forward and backward, 15 TFLOP/s of causal work; the
  math path 12.5 ms, `is_causal` 7.9, bf16's cuDNN kernel 0.84), so the model's call differs (likely HF's
  `enable_gqa`, which the memory-efficient kernel lacks; not verified). The memory model now counts eager's saves
  for SDPA at 4-byte precision on a GPU (`costmodel.memory_activations.sdpa_attention`; the CPU's flash kernel keeps
  none), and prices the step's allocated peak 2% low (83.4 GiB; 1.6 short, about one more such matrix, a transient
  not modelled); such a plan no longer fits an 80 GB card at this micro-batch without recompute
  (tests/test_memory.py). Its time: the attention core was priced as one fused kernel (1.17 ms a core, the step
  1.28x bf16's where 2.56x was measured); it is now priced as the math path the profile shows
  (`costmodel.math_attention`: six batched GEMMs and the passes over the score matrix, 8.8 ms a core; the passes
  priced 5.29 ms against 5.41 measured), and the default's tf32 and fp32 GEMMs, which had kept the datasheet's rates
  (a tf32 GEMM priced 1.25x a bf16 one; the profiled step's ran 3.2x), now take its fitted bf16 price times the
  tf32/bf16 time ratio soap calibrate measured on a lent H100 (`benchmarks/fp32_gemm.py`: 1.9-2.6x). The tf32 step
  is now priced 2.62x bf16's on `dgx-h200` (-0%) and 2.28x on `h200-x1-measured` (-17%). The planner picks tf32 or
  fp32 only where pinned.
- **8-bit AdamW, Adafactor and SGD** ran 5.9%, 6.3% and 2.1% slower than AdamW, priced 0.995-0.997x when planned:
  the fused AdamW is one kernel over every parameter; bitsandbytes' 8-bit step, Adafactor's foreach factored step
  and SGD's foreach momentum step are several passes each, 15-45 ms a step here that one memory-bound pass does
  not carry. So `soap plan --optimizer auto` picked 8-bit AdamW for this 1B on one H200 where AdamW fits and runs
  faster. Their steps, as measured here (`optimizer_factors`: x9.3, x8.1 and x3.7 over one pass), are now the
  `optimizer_factors` of `h200-x1-measured`, of the default H100 (`benchmarks.published_runs` writes them beside
  the fit, which has no such run) and of `dgx-h200`; the ratios above are in sample (one run each, one size:
  1.24e9 parameters), and the same 1B now picks AdamW on `dgx-h100` and `dgx-h200`. Their allocated peaks are
  priced within 0.5% (34.7, 32.4 and 37.0 GiB against AdamW's 41.6), as bf16's and fp16's are.
- **Offload failed on the GPU** (the first call): FSDP2's CPUOffloadPolicy refuses parameters allocated on the
  device, and soap's executor materialized them there. Fixed (`executor.api.parameter_device`: the host for the
  parameters, the GPU for the buffers), with a GPU-marked test, which passes on the H200. A later call measured the
  offload step: 12.8 s at these 4 micro-batches, priced 2.83 (section "The optimizer offloaded to the host, on one
  H200", `benchmarks/offload_h200.py`)."""


def main() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from benchmarks.report import update_section

    body = markdown(rows())
    print(body)
    update_section("techniques-h200", "The single-GPU techniques on one H200: measured against their prices", body,
                   machine="runs measured on NVIDIA H200 (torch 2.11.0+cu130, transformers 5.24.0, bitsandbytes "
                           "0.50.2), re-priced on this CPU")


if __name__ == "__main__":
    main()
