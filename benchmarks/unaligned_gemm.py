"""Unaligned GEMMs on an H100: the measured factor written into the H100 profiles (and, through
`benchmarks.borrow_fitted`, every profile that borrows the fitted H100's kernel factors).

    python -m benchmarks.unaligned_gemm        # after each refit of dgx-h100 (benchmarks.published_runs calls it)

A GEMM with a dimension that is not a multiple of 8 elements (`costmodel.opcost.unaligned_matmul`; GPT-2's
50,257-token and BERT's 30,522-token LM heads) leaves cuBLAS's aligned tensor-core kernels. On one H100 80GB
HBM3 (2026-11-22, torch 2.11.0+cu130, `benchmarks/gpu_step_profile.py`; docs/benchmarks.md
`gpu_step_profile`), torch.profiler timed GPT-2's LM head at batch 32 x 1,024 under bf16 autocast on
`cutlass_75_tensorop_bf16_s1688gemm` kernels: forward 26.434 ms, the two backward GEMMs 17.866 and
16.598 ms, each 2 x 32,768 x 768 x 50,257 = 2.53e12 FLOPs (96-152 TFLOP/s; an aligned GEMM of that size
runs near 780 on that GPU).

The factor a profile stores is over its own aligned price, `kernel_time` without a factor:

    k_unaligned = mean(t_measured) / (F / (P[bf16] * e_mm(F)))

so a profile whose curve is the datasheet's (989 TFLOP/s x 0.807) and one measured by soap calibrate (782.5
x 0.972) both price the same 20.3 ms per GEMM. One point (one shape was measured): a flat factor. fp16 takes
bf16's (the same sm75 kernel family; not measured). `soap calibrate --device cuda` now measures a curve
(`costmodel.calibration.suite`'s `mm unaligned` sweep), which replaces this where a GPU is calibrated: the
H100 calibrated on 2026-11-26 (`h100-x1-measured`) measured x6.4, x6.3 and x6.0 at 7.9e10, 1.3e12 and 5.1e12 FLOPs
over its own aligned price, the profiler's x6.1 within 5%; so this writes only the fitted default, which has no
GPU of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

from costmodel.profiles import UNALIGNED_MATMUL

PROFILES = Path(__file__).resolve().parents[1] / "profiles" / "devices"
FLOPS = 2 * 32768 * 768 * 50257
MEASURED_S = (26.434e-3, 17.866e-3, 16.598e-3)
SOURCE = ("matmul-unaligned/bf16, fp16: GPT-2's LM head GEMMs (vocabulary 50,257; forward 26.4, backward 17.9 "
          "and 16.6 ms at 2.53e12 FLOPs) measured by torch.profiler on one H100 80GB HBM3, 2026-11-22 "
          "(docs/benchmarks.md gpu_step_profile; benchmarks/unaligned_gemm.py), over this profile's aligned price")
DEVICES = ("h100-sxm-fitted",)


def factor(device_json: dict) -> float:
    """The measured unaligned GEMM time over `device_json`'s aligned price at the measured size."""
    peak = device_json["peak_tflops"]["bf16"]["value"] * 1e12
    points = device_json["matmul_efficiency"]["points"]
    efficiency = _interpolate(points, FLOPS)
    return sum(MEASURED_S) / len(MEASURED_S) / (FLOPS / (peak * efficiency))


def _interpolate(points: list, x: float) -> float:
    """The efficiency curve's value at x as `costmodel.profiles.EfficiencyCurve` reads it."""
    from costmodel.profiles import EfficiencyCurve

    return EfficiencyCurve(tuple((float(a), float(b)) for a, b in points)).at(x)


def with_unaligned(device_json: dict) -> dict:
    """`device_json` with the measured `matmul-unaligned` factors in its `kernel_factors`, the source named."""
    out = json.loads(json.dumps(device_json))
    table = out.setdefault("kernel_factors", {"source": "", "factors": {}})
    value = round(factor(device_json), 3)
    for precision in ("bf16", "fp16"):
        table["factors"][f"{UNALIGNED_MATMUL}/{precision}"] = [[float(FLOPS), value]]
    kept = [part for part in table.get("source", "").split("; ") if part and not part.startswith(f"{UNALIGNED_MATMUL}/")]
    table["source"] = "; ".join([*kept, f"{SOURCE}: x{value}"])
    return out


def main() -> None:
    for name in DEVICES:
        path = PROFILES / f"{name}.json"
        data = with_unaligned(json.loads(path.read_text()))
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"{name}: {UNALIGNED_MATMUL} x{data['kernel_factors']['factors'][f'{UNALIGNED_MATMUL}/bf16'][0][1]}")


if __name__ == "__main__":
    main()
