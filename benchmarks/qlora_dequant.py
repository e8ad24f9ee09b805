"""QLoRA's dequantization timed alone, weight by weight, against its price.

    python -m benchmarks.qlora_dequant [--out FILE] [--cluster dgx-h100]
    python -m benchmarks.qlora_dequant --smoke        # small weights on any machine (bitsandbytes' CPU kernels)

On the lent H100 of 2026-11-27 (`benchmarks/peft_h100.py`) QLoRA's step outran its LoRA twin's by 0.69-0.94 ms a
layer and micro-batch where soap prices the dequantization of a Llama-3-8B layer at 0.43 ms, as a copy at the
device's streaming rate (`costmodel.peft.dequantize_time`): two runs, 0.5% and 3% of their steps, so nothing was
fitted. This script times the kernel itself: `bitsandbytes.functional.dequantize_4bit` of each Llama-3-8B
projection's weight shape (nf4, blocksize 64, double quantization, as `executor.peft` quantizes) into bf16, and
prices one dequantization of the same weight (`costmodel.peft.dequantize_seconds`) on a cluster's device: the
measured and priced times, and the bytes a second the kernel moved (the packed weight, its constants and the
bf16 copy: `nf4_bytes` + 2 bytes an element). Nothing here is fitted; run on a lent GPU it says whether the
missing half is the kernel's rate (a factor on `dequantize_seconds`) or something around it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WEIGHTS = (("q_proj, o_proj", 4096, 4096), ("k_proj, v_proj", 1024, 4096), ("gate_proj, up_proj", 14336, 4096),
           ("down_proj", 4096, 14336))
"""Llama-3-8B's projections, (out, in) features."""
SMOKE_WEIGHTS = (("smoke", 256, 512),)


def measure(weights: Sequence[tuple[str, int, int]], *, cluster: str, samples: int = 7, tokens: int = 4096) -> dict:
    """Each weight quantized once and its dequantization timed (module docstring)."""
    import bitsandbytes
    import bitsandbytes.functional as bnb
    import torch

    from costmodel.calibration.microbench import TimingConfig, time_kernel
    from costmodel.peft import dequantize_seconds, nf4_bytes
    from costmodel.profiles import load_cluster

    device = load_cluster(cluster).device
    on = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name, out_features, in_features in weights:
        weight = torch.randn(out_features, in_features, device=on, dtype=torch.bfloat16)
        packed, state = bnb.quantize_4bit(weight, quant_type="nf4", blocksize=64, compress_statistics=True)
        call = (lambda p=packed, s=state: bnb.dequantize_4bit(p, s))
        seconds = time_kernel(call, on, TimingConfig(samples=samples))
        kernels, kernel_s = device_time(call, on)
        in_step = step_delta(weight, packed, state, on, tokens=tokens)
        numel = out_features * in_features
        moved = nf4_bytes(numel) + 2 * numel
        priced = dequantize_seconds(numel, device=device, precision="bf16")
        rows.append({"weight": name, "shape": [out_features, in_features], "seconds": seconds, "priced_s": priced,
                     "bytes": moved, "tb_per_s": moved / seconds / 1e12, "kernel_s": kernel_s, "kernels": kernels,
                     "in_step_s": in_step})
        del weight, packed, state
    name = torch.cuda.get_device_name() if on == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "bitsandbytes": bitsandbytes.__version__,
            "cluster": cluster, "rows": rows}


def device_time(call, on: str, calls: int = 50) -> tuple[dict[str, float], float | None]:
    """The GPU's own time of one call, host overhead excluded: `torch.profiler` over `calls` calls, each CUDA
    kernel's device time summed by name and divided by `calls` (kernels a call, seconds a call). ({}, None) on a
    machine without CUDA, whose profiler records no device kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if on != "cuda":
        return {}, None
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0.0)
        if device_us > 0:
            per_kernel[event.key[:60]] = device_us / 1e6 / calls
    return per_kernel, sum(per_kernel.values())


def step_delta(weight, packed, state, on: str, *, tokens: int) -> float | None:
    """GPU seconds a forward and backward of `tokens` tokens through the 4-bit weight (`bitsandbytes.matmul_4bit`,
    what peft's Linear4bit runs: a dequantization in each pass) take beyond the same through the frozen bf16 weight:
    the dequantizations as a training step runs them, among its GEMMs. None without CUDA."""
    import bitsandbytes
    import torch

    if on != "cuda":
        return None
    x = torch.randn(tokens, weight.shape[1], device=on, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, weight.shape[0], device=on, dtype=torch.bfloat16)

    def through(matmul):
        def call():
            matmul(x).backward(grad)
            x.grad = None
        return call

    _, quantized = device_time(through(lambda a: bitsandbytes.matmul_4bit(a, packed.t(), quant_state=state)), on)
    _, frozen = device_time(through(lambda a: torch.nn.functional.linear(a, weight)), on)
    return quantized - frozen


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f} us"


def table(result: dict) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, bitsandbytes {result['bitsandbytes']}; priced on "
             f"`{result['cluster']}` (soap's microbenchmark timer: median seconds a call, launch included, as priced):",
             "", "| weight | shape | measured | priced | measured / priced | TB/s moved | GPU kernels a call | "
             "GPU time a call | TB/s at GPU time | in a step, forward + backward |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        gpu = r.get("kernel_s")
        kernels = len(r.get("kernels") or {})
        at_gpu = f"{gpu * 1e6:.1f} us | {r['bytes'] / gpu / 1e12:.3g}" if gpu else "- | -"
        lines.append(f"| {r['weight']} | {r['shape'][0]} x {r['shape'][1]} | {r['seconds'] * 1e6:.1f} us | "
                     f"{r['priced_s'] * 1e6:.1f} us | {r['seconds'] / r['priced_s']:.2f} | {r['tb_per_s']:.3g} | "
                     f"{kernels} | {at_gpu} | {_us(r.get('in_step_s'))} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="dgx-h100", help="cluster profile whose device prices the weights")
    parser.add_argument("--out", help="write the measurements as JSON here")
    parser.add_argument("--smoke", action="store_true", help="a small weight, any machine")
    args = parser.parse_args(argv)
    from benchmarks.report import emit

    result = measure(SMOKE_WEIGHTS if args.smoke else WEIGHTS, cluster=args.cluster, samples=3 if args.smoke else 7)
    return emit(result, table(result), args.out)


if __name__ == "__main__":
    main()
