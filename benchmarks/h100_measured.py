"""The measured H100 profile (`h100-x1-measured`), built from what a lent H100 measured on 2026-11-26.

    python -m benchmarks.h100_measured [--dry-run]   # writes profiles/devices/h100-x1-measured.json and its docs section

Everything comes from `benchmarks/data/h100-2026-11-26/` (the device call: `benchmarks/gpu_session_h100_8b.sh`):

- `calibrate-output.json`: `soap calibrate --device cuda --nproc 1` (222 s): matmul, attention (SDPA up to 32k
  tokens at head size 128), memory curve, per-class kernel factors, compile chains at training sizes.
- `adamw-fused.json` (`adamw_fused.py`): fused AdamW over fp32 parameters. The optimizer factor is taken from the
  4M-element tensors (a model's weights); calibrate's own sweep of that day timed 32K-element bf16 tensors, 18x
  slower at 2^28 elements than the same step over a model's tensors (`costmodel.calibration.node` now sweeps
  those sizes on CUDA).
- `step-profile-8b4l.json` (`step_profile_8b4l.py`): torch.profiler over one eager bf16-autocast step of four
  Llama-3-8B layers at 1 x 8,192 tokens, every CUDA kernel summed by group (`kernel_groups`).
- the six `*.run.json` / `../h100-runs-8b-shapes.jsonl`: `soap execute` runs (reserved and allocated memory).

The step factor on memory-bound kernels (`costmodel.calibration.step_factor`, which `soap calibrate --device cuda`
now runs on a reference step of its own). In the profiled step the GEMMs ran at 789 TFLOP/s (68.7 TFLOP in
87.1 ms; calibrate prices them at 85.9 ms), attention took 15.2 ms (priced 13.0), the optimizer 21.6 ms
(priced 22.2). The rest, the memory-bound kernels (elementwise, autocast's casts and copies, the loss's
log-softmax: 634 kernels), took 62.2 ms where calibrate's microbenchmarks price the same ops at 27.9 ms. So a
step's memory-bound kernels run at 1/k of the microbenchmarks' rate, k solved from

    T_priced(memory-bound; k) = T_measured(memory-bound):  k = 2.31 (2.23 as a plain ratio; launches are not scaled)

 (contiguous, vectorized kernels at one size; a step's are broadcast and strided,
fp32 under autocast, and share the GPU with its GEMMs). `k` multiplies every memory-bound class's kernel factor
(`costmodel.calibration.step_factor.MEMORY_BOUND`), so the effective bandwidth of such a kernel is about 1.4 TB/s
of the H100's 3.35, inside the physical bound. One step fits `k`; the checks are the other runs (`benchmarks.gpu_repredict`: GPT-2, BERT-large,
Llama 3.2 1B and small Llamas, eager and compiled, none of which set it) and `leave_model_out`: `k` fitted on the
step times of every other model's runs, model by model (2.29-2.48 where the profiled step gives 2.31).

The host floor of soap's executor (`benchmarks.gpu_repredict.host_floor`, 40.2 us per eager kernel) is a
property of the executor on this machine, so this profile carries it too.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "h100-2026-11-26"
COMPILED_DATA = ROOT / "benchmarks" / "data" / "h100-2026-11-26b"
"""The second lent H100 of that day (`benchmarks/gpu_session_h100_compile.sh`): the compiled
step's profile and the 16k run's memory snapshots."""
PROFILE = ROOT / "profiles" / "devices" / "h100-x1-measured.json"
PROFILED_RUN = "8b4l-eager"
"""The `soap execute` run whose model, sequence and micro-batch the profiled step ran (one micro-batch of it)."""
COLLECTIVE_CALL_OVERHEAD = {
    "value": 7,
    "source": "assumed equal to the per-kernel launch and framework overhead: a collective is one NCCL kernel launched "
              "through c10d, so its host cost is at least a kernel's, about 5-10 us per kernel on GPU (autoparallel's "
              "7 us floor) (shared/reference/hardware.md); no published per-collective host figure exists in the "
              "reference (its 'small-message floor of about 123 us' for a 2-node H100 all-reduce is a whole collective, "
              "latency steps included, on a cloud cluster, not used here)"}


def kernel_groups(profile: dict) -> dict[str, float]:
    """Seconds of the profiled step per kernel group (`costmodel.calibration.step_factor.kernel_groups`)."""
    from costmodel.calibration.step_factor import kernel_groups as groups

    return groups((name, us * 1e-6) for name, us, _calls in profile["kernels_us"])


def profiled_graph(device_json: dict) -> object:
    """`PROFILED_RUN`'s plan traced as it ran (on `device_json`'s regime; the graph does not depend on its rates)."""
    from costmodel.profiles import cluster_from_dict
    from executor.runs_log import read_runs
    from executor.validation.refit import trace_plan_model
    from planner.plan import plan_from_dict

    record = next(r for r in read_runs(str(DATA.parent / "h100-runs-8b-shapes.jsonl"))
                  if r["name"].removesuffix(".plan") == PROFILED_RUN)
    return trace_plan_model(plan_from_dict(record["plan"]), cluster_from_dict({**_cluster_json(), "device": device_json}))


def priced_groups(device_json: dict, graph: object = None) -> dict[str, float]:
    """What `device_json` prices one micro-batch of `PROFILED_RUN` at, per group (forward and backward)."""
    from costmodel.calibration.step_factor import priced_groups as priced
    from costmodel.profiles_json import device_from_json

    graph = profiled_graph(device_json) if graph is None else graph
    return priced(graph, device_from_json(device_json, PROFILE.stem), micro_batch=1)


def _cluster_json() -> dict:
    return json.loads((ROOT / "profiles" / "clusters" / "h100-x1-measured.json").read_text())


def unstepped() -> dict:
    """The profile before its step factor: calibrate's output with the fused AdamW, the allocator reserve and the
    host floor measured on the same GPU."""
    from benchmarks.allocator_reserve import H100_LOGS, reserve_entry
    from benchmarks.gpu_repredict import HOST_SOURCE, host_floor
    from costmodel.calibration.node import OptimizerSample, optimizer_factor_points

    device = json.loads((DATA / "calibrate-output.json").read_text())
    adamw = [r for r in json.loads((DATA / "adamw-fused.json").read_text())
             if r["dtype"] == "torch.float32" and r["tensor"] == 2**22]
    samples = [OptimizerSample("adamw", "bf16", r["total"], r["seconds"]) for r in adamw]
    device["optimizer_factors"] = {
        "source": "measured on this H100, 2026-11-26: fused AdamW over fp32 parameters in 4M-element tensors ("
                  + ", ".join(f"2^{r['total'].bit_length() - 1} elements {r['seconds'] * 1e3:.3f} ms" for r in adamw)
                  + ") (benchmarks/data/h100-2026-11-26/adamw-fused.json), over the one-pass "
                  "estimate at this profile's memory curve",
        "factors": optimizer_factor_points(samples, device)}
    device["allocator_reserve_fraction"] = reserve_entry(
        H100_LOGS, "on this H100 (Llama 3.2 1B and four Llama-3-8B layers, eager and compiled, recompute none/selective/full, "
        "8k and 16k tokens, upcast and chunked loss)")
    device["collective_call_overhead_us"] = COLLECTIVE_CALL_OVERHEAD
    device["host_dispatch_us"] = {"value": round(host_floor()[0] * 1e6, 1), "source": HOST_SOURCE}
    device["description"] = (
        "NVIDIA H100 80GB HBM3 (one GPU of a Firecracker VM, driver 580.159.04, torch 2.11.0+cu130), measured by "
        "`soap calibrate --device cuda --nproc 1` on 2026-11-26 (held-out kernels median |error| 7.3% over 179 points), "
        "with its fused AdamW, a step's memory-bound kernels and soap's executor's host floor measured on the same GPU "
        "(benchmarks/h100_measured.py). memory_bandwidth_gbps is the fastest copy of the sweep, an L2-resident size "
        "(6-25 MB; the L2 is 50 MB); at 400 MB copies bandwidth x efficiency is 3.10 TB/s, under the 3.35 TB/s datasheet")
    return device


def build(base: dict | None = None) -> tuple[dict, dict[str, float], dict[str, float], float]:
    """The profile (`base`, default `unstepped()`, with the profiled step's factor and the compiled step's compile
    factor), the profiled step's measured groups, their price before the step factor, and the step factor."""
    device, measured, priced, k, _ = build_compiled(base)
    return device, measured, priced, k


def build_compiled(base: dict | None = None) -> tuple[dict, dict[str, float], dict[str, float], float, dict]:
    """`build`'s four, and what the compiled step says: its measured groups, their price with the step factor
    and the calibrated compile chains (`priced_before`), with the compile factor (`priced_after`), and `k_c`."""
    from costmodel.calibration.step_factor import apply_compile_factor, apply_step_factor
    from costmodel.calibration.step_factor import priced_groups as priced
    from costmodel.profiles_json import device_from_json

    base = unstepped() if base is None else base
    graph = profiled_graph(base)
    measured = kernel_groups(json.loads((DATA / "step-profile-8b4l.json").read_text()))
    stepped, k = apply_step_factor(
        base, measured, graph=graph, micro_batch=1,
        step="one eager step of four Llama-3-8B layers at 1 x 8,192 tokens, "
             "benchmarks/data/h100-2026-11-26/step-profile-8b4l.json",
        source="measured by torch.profiler on this H100, 2026-11-26 (benchmarks/h100_measured.py)")
    compiled = kernel_groups(json.loads((COMPILED_DATA / "step-profile-compile.json").read_text()))
    device, k_c = apply_compile_factor(
        stepped, compiled, graph=graph, micro_batch=1,
        step="the same step with each block torch.compiled, benchmarks/data/h100-2026-11-26b/step-profile-compile.json",
        source="measured by torch.profiler on a lent H100 80GB HBM3, 2026-11-26 (benchmarks/h100_measured.py)")
    check = {"measured": compiled, "k_c": k_c,
             "priced_before": priced(graph, device_from_json(stepped, PROFILE.stem), 1, compile=True),
             "priced_after": priced(graph, device_from_json(device, PROFILE.stem), 1, compile=True)}
    from costmodel.context_attention import with_lower_right

    device["kernel_factors"] = with_lower_right(device.get("kernel_factors"))  # measured apart: cp_attention.py
    return device, measured, priced_groups(base, graph), k, check


STEP_FACTOR_RANGE = (1.0, 3.3)
"""Where `leave_model_out` searches the step factor: inside `costmodel.calibration.step_factor.BOUNDS`, and no
faster than the microbenchmarks' kernels."""


def leave_model_out(base: dict | None = None, compile_k: float = 1.0) -> list[tuple[str, str, float, float, float]]:
    """Soap's own H100 runs, each model predicted with the step factor fitted on the other models' runs (their step
    times, golden-section on the squared log error) instead of the profiled 8B step: (run, model, measured step,
    the factor fitted without the model, predicted step). The host floor stays the one fitted on every run (it
    binds only on the small Llama's runs); the compile factor is `compile_k`, the profiled compiled step's."""
    import math

    from benchmarks.gpu_repredict import model_of, runs
    from costmodel.calibration.fit import golden_section
    from costmodel.calibration.step_factor import with_compile_factor, with_step_factor
    from costmodel.profiles import cluster_from_dict
    from executor.validation.refit import simulate_on, trace_plan_model
    from planner.plan import plan_from_dict

    base = unstepped() if base is None else base
    cluster_json = _cluster_json()
    records = runs()
    names = [r["name"].removesuffix(".plan") for r in records]
    models = [model_of(r) for r in records]
    plans = [plan_from_dict(r["plan"]) for r in records]
    graphs = [trace_plan_model(p, cluster_from_dict({**cluster_json, "device": base})) for p in plans]
    cache: dict[float, list[float]] = {}

    def steps(x: float) -> list[float]:
        if x not in cache:
            device = with_compile_factor(with_step_factor(base, math.exp(x), "fitted"), compile_k, "profiled")
            cluster = cluster_from_dict({**cluster_json, "device": device})
            cache[x] = [simulate_on(p, g, cluster).step_time_s for p, g in zip(plans, graphs)]
        return cache[x]

    out = []
    for model in dict.fromkeys(models):
        others = [i for i, m in enumerate(models) if m != model]

        def loss(x: float) -> float:
            return sum(math.log(steps(x)[i] / records[i]["step_time_s"]) ** 2 for i in others)

        x = golden_section(loss, *(math.log(k) for k in STEP_FACTOR_RANGE), 16)
        out += [(names[i], model, records[i]["step_time_s"], math.exp(x), steps(x)[i])
                for i, m in enumerate(models) if m == model]
    return out


def main() -> None:
    import argparse
    import os

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print, but write neither the profile nor docs")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    base = unstepped()
    device, measured, priced, k, compiled = build_compiled(base)
    if not args.dry_run:
        PROFILE.write_text(json.dumps(device, indent=2) + "\n")
    held = leave_model_out(base, compiled["k_c"])
    lines = ["`benchmarks/h100_measured.py` builds `h100-x1-measured` from the lent H100's measurements of 2026-11-26 "
             "(module docstring). One eager micro-batch of four Llama-3-8B layers at 1 x 8,192 tokens, torch.profiler "
             "against calibrate's price of the same ops:", "",
             "| kernels | measured | priced by calibrate's microbenchmarks |", "|---|---:|---:|"]
    lines += [f"| {g} | {measured[g] * 1e3:.1f} ms | {priced[g] * 1e3:.1f} ms |" for g in ("gemm", "attention", "memory-bound")]
    lines += [f"| optimizer (fused AdamW) | {measured['optimizer'] * 1e3:.1f} ms | (from the AdamW sweep) |", "",
              "The same step with each block compiled (`executor.api.compile_blocks`; the embedding, LM head and loss "
              "eager), torch.profiler on the second lent H100 of the day, against the price with the step factor and "
              "calibrate's compile chains, then with the compile factor k_c solved on it "
              "(`costmodel.calibration.step_factor.apply_compile_factor`):", "",
              "| kernels | measured | priced, chains | priced, k_c |", "|---|---:|---:|---:|"]
    lines += [f"| {g} | {compiled['measured'][g] * 1e3:.1f} ms | {compiled['priced_before'][g] * 1e3:.1f} ms | "
              f"{compiled['priced_after'][g] * 1e3:.1f} ms |" for g in ("gemm", "attention", "memory-bound")]
    lines += ["", f"k_c = {compiled['k_c']:.2f}: in a block Inductor fuses across classes, so a step's compiled "
              "kernels beat the one-class chains. Outside the blocks nothing is compiled and nothing is discounted.", "",
              f"Step factor on the memory-bound classes: k = {k:.2f}. Leave one model out: each model's runs predicted "
              "with k fitted on the other models' step times instead (host floor as fitted on every run):", "",
              "| run | model | measured step | k without the model | predicted | error |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {n} | {m} | {t * 1e3:.0f} ms | {kk:.2f} | {p * 1e3:.0f} ms | {100 * (p / t - 1):+.1f}% |"
              for n, m, t, kk, p in held]
    mape = sum(abs(p / t - 1) for *_, t, _, p in held) / len(held)
    lines += ["", f"Leave-one-model-out step-time MAPE {100 * mape:.1f}% over {len(held)} runs of "
              f"{len({m for _, m, *_ in held})} models."]
    body = "\n".join(lines)
    print(body)
    if not args.dry_run:
        from benchmarks.report import update_section

        update_section("h100-measured", "The measured H100 profile: its step factor, left out model by model", body)


if __name__ == "__main__":
    main()
