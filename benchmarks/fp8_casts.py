"""torchao's compiled float8 casts on one H100: the kernels' measured time against soap's two ways of pricing them.

    python -m benchmarks.fp8_casts

A lent H100 (2026-11-27, `benchmarks/gpu_session_fp8_casts.sh`) profiled one step of four Llama-3-8B layers
(8,192 tokens, micro-batch 1, bf16 autocast, every block compiled) with torchao's float8 Linears and without
(`benchmarks/gpu_step_profile.py --fp8`; `benchmarks/data/h100-2026-11-27-kernels/step-profile-compile-*.json`).
The memory-bound kernels the fp8 step runs beyond its bf16 twin's are its casts as Inductor emits them (fused into
their neighbours where it can: the RMSNorm's output cast to fp8 in one kernel). soap prices them
(`costmodel.opcost.fp8_cast_kernels`) as two fused kernels a cast, an amax and a scaled cast, and then multiplies
them by the device's compile factor (`_cast_time`), which stands for fusing an eager chain into such kernels.
This prices the same casts of the four layers both ways on `h100-x1-measured` (soap's measured H100) and the
shipped `dgx-h100`, beside the measured difference; nothing is fitted.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DATA = Path(__file__).resolve().parent / "data" / "h100-2026-11-27-kernels"
CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3-8b-4l.json"
CLUSTERS = ("h100-x1-measured", "dgx-h100")


def measured() -> dict[str, dict]:
    return {p: json.loads((DATA / f"step-profile-compile-{p}.json").read_text()) for p in ("fp8", "bf16")}


def priced(cluster: str, *, compile_factor: bool) -> float:
    """Seconds of the compiled float8 casts of the four layers' Linears, forward and backward, on `cluster`, with
    or without the compile factor on top of the fused kernels."""
    import tracer
    from costmodel import opcost
    from costmodel.profiles import load_cluster

    device = load_cluster(cluster).device
    graph = tracer.trace(str(CONFIG), batch=1, seq_len=8192)
    arithmetic = device.kernel_factors.get("arithmetic/bf16")
    fused = device.compile_factors.get("arithmetic/fwd")
    total = 0.0
    for op in graph.ops:
        if not op.attrs.get("fp8_linear"):
            continue
        repeat = next((b.count for b in graph.blocks if b.id == op.block_id), 1) if op.block_id else 1
        for direction in ("fwd", "bwd"):
            for nbytes in opcost.cast_kernels(op, op.fwd_flops, direction, compile=True):
                t, _ = opcost.kernel_time(0.0, nbytes, peak=device.effective_peak("fp32"), matmul=False,
                                          device=device, factor=arithmetic.at(nbytes) if arithmetic else 1.0)
                total += repeat * t * (fused.at(nbytes) if compile_factor and fused is not None else 1.0)
    return total


def body() -> str:
    runs = measured()
    fp8, bf16 = runs["fp8"], runs["bf16"]
    extra = fp8["groups_s"]["memory-bound"] - bf16["groups_s"]["memory-bound"]
    lines = [
        f"{fp8['device']}, torch {fp8['torch']}, torchao 0.18.0: one step of `{Path(fp8['model']).name}` (batch "
        f"{fp8['batch']} x {fp8['seq']} tokens, compiled blocks), kernel time by group (torch.profiler):", "",
        "| step | measured step | gemm | attention | memory-bound | optimizer |", "|---|---:|---:|---:|---:|---:|"]
    for name, run in (("bf16", bf16), ("fp8 (torchao float8 Linears)", fp8)):
        g = run["groups_s"]
        lines.append(f"| {name} | {run['step_s'] * 1e3:.1f} ms | {g['gemm'] * 1e3:.1f} | {g['attention'] * 1e3:.1f} | "
                     f"{g['memory-bound'] * 1e3:.1f} | {g['optimizer'] * 1e3:.1f} |")
    lines += ["", f"The fp8 step's memory-bound kernels outlast the bf16 step's by {extra * 1e3:.1f} ms; its GEMMs "
              f"take {bf16['groups_s']['gemm'] / fp8['groups_s']['gemm']:.2f}x less time, the step "
              f"{bf16['step_s'] / fp8['step_s']:.3f}x less. The same casts priced:", "",
              "| profile | with the compile factor (as priced today) | without | measured extra memory-bound |",
              "|---|---:|---:|---:|"]
    for cluster in CLUSTERS:
        lines.append(f"| `{cluster}` | {priced(cluster, compile_factor=True) * 1e3:.1f} ms | "
                     f"{priced(cluster, compile_factor=False) * 1e3:.1f} ms | {extra * 1e3:.1f} ms |")
    lines += ["", READING]
    return "\n".join(lines)


READING = """Reading it: on the measured H100 profile the casts priced without the compile factor land near what the
kernels took, and with it at a quarter of that: the factor discounts kernels already counted as fused. Inductor
does fuse the casts into neighbours (the RMSNorm and SiLU kernels write fp8 beside bf16), but what that saves is
inside the measured difference. The shipped `dgx-h100` prices memory-bound kernels faster still (its fit to the
published runs). Dropping the factor (tried 2026-11-27, session 25; `benchmarks/fp8_h100.py`'s reading) made the
corpus fit worse on every check and pushed the refitted default's 1B above the published runs' MFU: the fit, whose
casts share the memory-bound multiplier, pulled every memory-bound kernel faster to pay for the dearer casts on the
torchtitan fp8 rows. Not changed yet: the casts want a multiplier of their own in the fit (`fp8-casts`, with this
measurement as its prior) so that they stop moving the other memory-bound kernels."""


def main() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from benchmarks.report import update_section

    text = body()
    print(text)
    update_section("fp8-casts-h100", "torchao's compiled fp8 casts on one H100: measured against their price", text,
                   machine="one step profiled on a lent NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, torchao 0.18.0), "
                           "priced on this CPU")


if __name__ == "__main__":
    main()
