"""fp32 and tf32 GEMMs on the fitted H100: their speed relative to bf16's as soap calibrate measured it on a lent
H100, written into the fitted profile (and, through `benchmarks.borrow_fitted`, the H200's and every profile that
borrows the fitted H100's kernel factors).

    python -m benchmarks.fp32_gemm        # after each refit of dgx-h100 (benchmarks.published_runs calls it)

The fitted H100 (`h100-sxm-fitted`) is fitted on bf16 and fp8 runs: its GEMM multiplier (`matmul/bf16`) says how
far below the datasheet peak x the matmul curve real bf16 GEMMs run, and its tf32 and fp32 GEMMs, which no published
run has, kept the datasheet's rates. There a tf32 GEMM was priced 1.25x a bf16 one of the same FLOPs. soap calibrate
on a lent H100 (2026-11-26, `h100-x1-measured`) timed the same square GEMMs in every precision: tf32 1.9x (at 1e12
FLOPs) to 2.6x (at 1e9) bf16's time, fp32 (no TF32: SIMT) 13-16x. A profiled tf32 step of Llama 3.2 1B on a lent
H200 (benchmarks/data/h200-2026-11-28b) ran its GEMMs 3.2x as long as its bf16 twin's.

The factor written at each of the measured profile's points x (FLOPs) is

    k_p(x) = k_bf16(x) * r_p(x) * P_p / P_bf16,    r_p(x) = t_p(x) / t_bf16(x) on h100-x1-measured

so the fitted profile prices a precision-p GEMM at its own bf16 price times the measured ratio (P: the fitted
profile's datasheet peaks; t: the measured profile's priced times, its own peaks, curve and factors).
"""

from __future__ import annotations

import json
from pathlib import Path

PROFILES = Path(__file__).resolve().parents[1] / "profiles" / "devices"
MEASURED = "h100-x1-measured"
PRECISIONS = ("tf32", "fp32")
POINTS = (1e9, 1e10, 1e11, 1e12, 1e13)
SOURCE = ("matmul/tf32, matmul/fp32: this profile's bf16 GEMM price times the tf32 and fp32 GEMMs' time over bf16's "
          f"as soap calibrate measured them on a lent H100 ({MEASURED}, 2026-11-26; benchmarks/fp32_gemm.py)")
DEVICES = ("h100-sxm-fitted",)


def gemm_time(device, precision: str, flops: float) -> float:
    """A GEMM of `flops` at `precision` as `device` prices it, launch aside (`costmodel.opcost.kernel_time`)."""
    curve = device.kernel_factors.get(f"matmul/{precision}")
    factor = curve.at(flops) if curve is not None else 1.0
    return factor * flops / (device.peak_flops[precision] * device.matmul_efficiency.at(flops))


def factors(device_json: dict) -> dict[str, list[list[float]]]:
    """The `matmul/tf32` and `matmul/fp32` factor curves of `device_json` (module docstring)."""
    from costmodel.profiles import load_device
    from costmodel.profiles_json import device_from_json

    measured = load_device(MEASURED)
    fitted = device_from_json(device_json, "fitted")
    bf16 = fitted.kernel_factors.get("matmul/bf16")
    out = {}
    for p in PRECISIONS:
        points = []
        for x in POINTS:
            ratio = gemm_time(measured, p, x) / gemm_time(measured, "bf16", x)
            k = (bf16.at(x) if bf16 is not None else 1.0) * ratio * fitted.peak_flops[p] / fitted.peak_flops["bf16"]
            points.append([x, float(f"{k:.4g}")])
        out[f"matmul/{p}"] = points
    return out


def with_fp32_gemms(device_json: dict) -> dict:
    """`device_json` with the `matmul/tf32` and `matmul/fp32` factors in its `kernel_factors`, the source named."""
    from costmodel.profiles import with_measured_factors

    table = with_measured_factors(device_json.get("kernel_factors"), factors(device_json), SOURCE)
    return {**device_json, "kernel_factors": table}


def main() -> None:
    for name in DEVICES:
        path = PROFILES / f"{name}.json"
        data = with_fp32_gemms(json.loads(path.read_text()))
        path.write_text(json.dumps(data, indent=2) + "\n")
        for p in PRECISIONS:
            print(f"{name}: matmul/{p} {data['kernel_factors']['factors'][f'matmul/{p}']}")


if __name__ == "__main__":
    main()
