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


def measure(weights: Sequence[tuple[str, int, int]], *, cluster: str, samples: int = 7) -> dict:
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
        seconds = time_kernel(lambda p=packed, s=state: bnb.dequantize_4bit(p, s), on, TimingConfig(samples=samples))
        numel = out_features * in_features
        moved = nf4_bytes(numel) + 2 * numel
        priced = dequantize_seconds(numel, device=device, precision="bf16")
        rows.append({"weight": name, "shape": [out_features, in_features], "seconds": seconds, "priced_s": priced,
                     "bytes": moved, "tb_per_s": moved / seconds / 1e12})
        del weight, packed, state
    name = torch.cuda.get_device_name() if on == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "bitsandbytes": bitsandbytes.__version__,
            "cluster": cluster, "rows": rows}


def table(result: dict) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, bitsandbytes {result['bitsandbytes']}; priced on "
             f"`{result['cluster']}` (soap's microbenchmark timer: median seconds a call, launch included, as priced):",
             "", "| weight | shape | measured | priced | measured / priced | TB/s moved |",
             "|---|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['weight']} | {r['shape'][0]} x {r['shape'][1]} | {r['seconds'] * 1e6:.1f} us | "
                     f"{r['priced_s'] * 1e6:.1f} us | {r['seconds'] / r['priced_s']:.2f} | {r['tb_per_s']:.3g} |")
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
