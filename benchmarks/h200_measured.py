"""The measured H200 profile (`h200-x1-measured`), rebuilt from what lent H200s and H100s measured on 2026-11-26.

    python -m benchmarks.h200_measured [--dry-run]   # writes profiles/devices/h200-x1-measured.json and its docs section

The first lent H200's `soap calibrate --device cuda` (the profile shipped until now) timed its kernel classes badly:
factors of 0.001-0.009 on memory-bound classes (a kernel a thousand times faster than its bytes allow), attention
priced 2x slower than the step below ran it, and an optimizer sweep on the wrong tensors (dropped). The second lent
H200 (`benchmarks/gpu_session.sh h200-x1-measured dgx-h200`, `benchmarks/data/h200-2026-11-26/`) ran out of time in
the full calibrate, but profiled a training step of four Llama-3-8B layers eager and compiled and ran soap's
executor on three plans. Those steps say what the H200 shares with the H100 and what it does not:

- The same GH100 die at the same clocks (1,980 MHz, 700 W): the profiled steps' GEMMs took 89.4 ms on the H200 and
  87.1 ms on the H100, attention 15.2 ms on both. So the compute terms (peak rates, matmul efficiency by size,
  attention and matmul kernel factors, launch overhead) are `h100-x1-measured`'s calibrate output
  (`benchmarks.h100_measured.unstepped`), measured on the H100.
- Its own memory: 139.8 GiB, and the copy sweep of the first H200 calibrate (4.26 TB/s at 1.5-400 MB, of the
  4.8 TB/s datasheet; `data/h200-2026-11-26/first-calibrate-profile.json` is that profile as it was shipped; the second
  H200's quick calibrate, `calibrate-quick.json`, is kept but not used: 19% held-out error). The memory-bound kernels of the step took 50.5 ms against the H100's 62.2.
- What the H200's steps measured, solved as for the H100 (`costmodel.calibration.step_factor`): the step factor on
  the memory-bound classes from the eager step, the compile factor from the compiled one, the fused AdamW's
  factor from the optimizer kernels of the same step (1.92e9 fp32 parameters), the allocator reserve from its runs.
- The host floor of soap's executor is the H100 VM's (`benchmarks.gpu_repredict.host_floor`): both are lent VMs of
  16 cores; no H200 run is host-bound enough to fit its own.

The check: every soap run on an H200 (`benchmarks/data/h200-runs-*.jsonl`: GPT-2, GPT-2 XL, BERT-large, Llama 3.2 1B
and the 8B's layers, eager and compiled, bf16 and fp8), each plan once, predicted by this profile, by the one it
replaces and by the default `dgx-h200`. The 8b4l eager and compiled runs are in sample (their steps set the two
factors); the rest are not.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "h200-2026-11-26"
PROFILE = ROOT / "profiles" / "devices" / "h200-x1-measured.json"
LOGS = ("h200-runs-execute.jsonl", "h200-runs-8b-shapes.jsonl")
PROFILED_RUN = "8b4l-eager"
MEMORY_FROM = ("memory_gib", "memory_bandwidth_gbps", "memory_efficiency", "context_overhead_gib", "host_link_gbps")
"""The fields kept from the first H200's calibrate: its memory and its copy sweep."""
GIB = 2**30
SOURCE = "measured by torch.profiler on a lent H200, 2026-11-26 (benchmarks/h200_measured.py)"


def runs() -> list[dict]:
    """soap's runs on an H200, each plan once."""
    from benchmarks.gpu_repredict import runs as logged

    return logged(LOGS)


def _cluster_json() -> dict:
    return json.loads((ROOT / "profiles" / "clusters" / "h200-x1-measured.json").read_text())


def _profile(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def base() -> dict:
    """The H100's calibrated compute with the H200's memory, optimizer, reserve and (the H100 VM's) host floor."""
    from benchmarks.allocator_reserve import reserve_entry
    from benchmarks.gpu_repredict import HOST_SOURCE, host_floor
    from benchmarks.h100_measured import kernel_groups, unstepped
    from costmodel.calibration.node import OptimizerSample, optimizer_factor_points

    first = json.loads((DATA / "first-calibrate-profile.json").read_text())  # as shipped before this rebuild
    device = unstepped()
    for field in MEMORY_FROM:
        device[field] = first[field]
    device["name"] = "h200-x1-measured"
    eager = _profile("step-profile-eager.json")
    params = profiled_graph(device).params_total  # fp32 parameters under AdamW, all trainable
    optimizer = kernel_groups(eager)["optimizer"]
    device["optimizer_factors"] = {
        "source": f"measured on this H200, 2026-11-26: the fused AdamW kernels of one profiled step over "
                  f"{params / 1e9:.2f}e9 fp32 parameters took {optimizer * 1e3:.1f} ms "
                  "(benchmarks/data/h200-2026-11-26/step-profile-eager.json), over the one-pass estimate at this "
                  "profile's memory curve",
        "factors": optimizer_factor_points([OptimizerSample("adamw", "bf16", params, optimizer)], device)}
    device["allocator_reserve_fraction"] = reserve_entry(LOGS, "on H200s (benchmarks/data/h200-runs-*.jsonl)")
    device["host_dispatch_us"] = {"value": round(host_floor()[0] * 1e6, 1),
                                  "source": "the H100 VM's, assumed for the H200's (both lent VMs of 16 cores): "
                                            + HOST_SOURCE}
    device["description"] = (
        "NVIDIA H200 (one GPU of a lent Firecracker VM, driver 580.159.04, 700 W, torch 2.11.0+cu130): the compute "
        "terms of h100-x1-measured (the same GH100 die and clocks: the profiled 8B-layer steps' GEMMs took 89.4 ms "
        "here, 87.1 on the H100, attention 15.2 ms on both), the H200's own memory and copy sweep (its first soap "
        "calibrate), and a step factor, compile factor, fused AdamW and allocator reserve measured in soap's steps "
        "on H200s (benchmarks/h200_measured.py)")
    return device


def profiled_graph(device_json: dict) -> object:
    from costmodel.profiles import cluster_from_dict
    from executor.validation.refit import trace_plan_model
    from planner.plan import plan_from_dict

    record = next(r for r in runs() if r["name"].removesuffix(".plan") == PROFILED_RUN)
    return trace_plan_model(plan_from_dict(record["plan"]), cluster_from_dict({**_cluster_json(), "device": device_json}))


def build() -> tuple[dict, dict]:
    """The profile and what its two profiled steps say (measured groups, factors, prices before and after)."""
    from benchmarks.h100_measured import kernel_groups
    from benchmarks.techniques_h200 import with_optimizers
    from costmodel.calibration.step_factor import apply_compile_factor, apply_step_factor, priced_groups
    from costmodel.context_attention import with_lower_right
    from costmodel.profiles_json import device_from_json

    start = base()
    graph = profiled_graph(start)
    eager, compiled = kernel_groups(_profile("step-profile-eager.json")), kernel_groups(_profile("step-profile-compile.json"))
    stepped, k = apply_step_factor(start, eager, graph=graph, micro_batch=1, source=SOURCE,
                                   step="one eager step of four Llama-3-8B layers at 1 x 8,192 tokens, "
                                        "benchmarks/data/h200-2026-11-26/step-profile-eager.json")
    device, k_c = apply_compile_factor(stepped, compiled, graph=graph, micro_batch=1, source=SOURCE,
                                       step="the same step with each block compiled, "
                                            "benchmarks/data/h200-2026-11-26/step-profile-compile.json")

    def price(d: dict, compile: bool) -> dict[str, float]:
        return priced_groups(graph, device_from_json(d, PROFILE.stem), 1, compile=compile)

    device["kernel_factors"] = with_lower_right(device.get("kernel_factors"))  # measured apart: cp_attention.py
    device = with_optimizers(device)  # measured apart: techniques_h200.py
    return device, {"eager": eager, "compiled": compiled, "k": k, "k_c": k_c,
                    "eager_before": price(start, False), "eager_after": price(device, False),
                    "compiled_before": price(stepped, True), "compiled_after": price(device, True)}


def repredict(device: dict) -> list[tuple[str, float, dict[str, float], float, dict[str, float]]]:
    """(run, measured step, predicted step per profile, measured allocated GiB, predicted allocated GiB per profile)."""
    from costmodel.profiles import cluster_from_dict, load_cluster
    from executor.validation.refit import simulate_on, trace_plan_model
    from executor.validation.validate import predicted_memory_bytes
    from planner.plan import plan_from_dict

    first = json.loads((DATA / "first-calibrate-profile.json").read_text())
    clusters = {"dgx-h200": load_cluster("dgx-h200"),
                "h200-x1-measured (before)": cluster_from_dict({**_cluster_json(), "device": first}),
                "h200-x1-measured": cluster_from_dict({**_cluster_json(), "device": device})}
    out = []
    for record in runs():
        plan = plan_from_dict(record["plan"])
        steps, memory = {}, {}
        for label, cluster in clusters.items():
            result = simulate_on(plan, trace_plan_model(plan, cluster), cluster)
            steps[label] = result.step_time_s
            memory[label] = predicted_memory_bytes(result, cluster.device.runtime_workspace_bytes) / GIB
        name = record["name"].removesuffix(".plan")
        if plan.parallelism.compile and "compile" not in name:
            name += " (compiled)"
        out.append((name, record["step_time_s"], steps,
                    record.get("peak_memory_allocated_gib") or record["peak_memory_gib"], memory))
    return out


def main() -> None:
    import argparse
    import os

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print, but write neither the profile nor docs")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    device, steps = build()
    rows = repredict(device)
    if not args.dry_run:
        PROFILE.write_text(json.dumps(device, indent=2) + "\n")
    lines = ["`benchmarks/h200_measured.py` rebuilds `h200-x1-measured` (module docstring). The profiled step of four "
             "Llama-3-8B layers at 1 x 8,192 tokens on the H200, torch.profiler against this profile's price before "
             f"and after its step factor (k = {steps['k']:.2f}) and, compiled, its compile factor (k_c = {steps['k_c']:.2f}):",
             "", "| kernels | eager measured | priced before | after | compiled measured | priced before | after |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {g} | {steps['eager'][g] * 1e3:.1f} ms | {steps['eager_before'][g] * 1e3:.1f} | "
              f"{steps['eager_after'][g] * 1e3:.1f} | {steps['compiled'][g] * 1e3:.1f} ms | "
              f"{steps['compiled_before'][g] * 1e3:.1f} | {steps['compiled_after'][g] * 1e3:.1f} |"
              for g in ("gemm", "attention", "memory-bound")]
    labels = list(rows[0][2])
    lines += ["", "soap's runs on H200s (one rank; the 8b4l eager and compiled runs set the two factors, the others are "
              "held out), step time and allocated peak, predicted over measured:", "",
              "| run | measured step | " + " | ".join(f"`{l}`" for l in labels) + " | measured GiB | " +
              " | ".join(f"`{l}`" for l in labels) + " |", "|---|" + "---:|" * (2 * len(labels) + 2)]
    for name, t, pred, m, mem in rows:
        lines.append(f"| {name} | {t * 1e3:.0f} ms | " + " | ".join(f"{pred[l] * 1e3:.0f} ({100 * (pred[l] / t - 1):+.0f}%)"
                                                                   for l in labels)
                     + f" | {m:.1f} | " + " | ".join(f"{mem[l]:.1f} ({100 * (mem[l] / m - 1):+.0f}%)" for l in labels) + " |")
    held = [r for r in rows if not r[0].startswith("8b4l")]
    lines += ["", "The fp8 run without torch.compile (torchao's float8 Linears eagerly: their amax, scale and cast kernels "
              "unfused, each dispatched from Python) ran 3.4x slower than the same plan in bf16; every profile prices "
              "it near bf16. `soap plan gpt2 --precision fp8` on `dgx-h200` now picks compile (it prices eager fp8 "
              "1.24x slower, not 3.4x).", ""]
    for l in labels:
        mape = sum(abs(p[l] / t - 1) for _, t, p, _, _ in rows) / len(rows)
        out = sum(abs(p[l] / t - 1) for _, t, p, _, _ in held) / len(held)
        mem = sum(abs(mm[l] / m - 1) for *_, m, mm in rows) / len(rows)
        lines.append(f"`{l}`: step-time MAPE {100 * mape:.1f}% over {len(rows)} runs ({100 * out:.1f}% over the "
                     f"{len(held)} held out), allocated-memory MAPE {100 * mem:.1f}%.")
        lines.append("")
    body = "\n".join(lines).rstrip()
    print(body)
    if not args.dry_run:
        from benchmarks.report import update_section

        update_section("h200-measured", "The measured H200 profile, rebuilt from its steps", body)


if __name__ == "__main__":
    main()
