"""Held-out validation of `soap calibrate` on this machine: fit on two thirds of every sweep, predict the
rest through `op_time` / `collective_time`, report the median absolute % error per family.

Measures afresh (the same sweeps as `soap calibrate`, about a minute) and writes no profile.

    flock -x /tmp/soap-cpu.lock python -m benchmarks.calibration_heldout
"""

from __future__ import annotations

from benchmarks.report import update_section
from costmodel.calibrate import CalibrationConfig, calibrate
from costmodel.calibrate_predict import summarize


def main() -> None:
    result = calibrate(CalibrationConfig())
    parts = []
    for title, errors in (("Kernels (op_time)", result.kernel_errors), ("Collectives (collective_time)", result.comm_errors)):
        lines = [f"**{title}**", "",
                 "| family | held-out points | median abs err % | max abs err % | median with recorded residual % |",
                 "|---|---:|---:|---:|---:|"]
        for s, c in zip(summarize(errors), summarize(errors, corrected=True)):
            name = f"**{s.family}**" if s.family == "all" else s.family
            lines.append(f"| {name} | {s.points} | {s.median_abs_pct:.1f} | {s.max_abs_pct:.1f} | {c.median_abs_pct:.1f} |")
        parts.append("\n".join(lines))
    residual_mm = result.device_json["matmul_efficiency"]["fit"]["residual_by_family"]
    residual_mem = result.device_json["memory_efficiency"]["fit"]["residual_by_family"]
    residual_comm = result.cluster_json["links"]["intra_node"]["efficiency"]["fit"]["residual_by_collective"]
    body = (
        "Every third point of each sweep (shapes, message sizes) is held out; the profile is fitted on the rest "
        "(one torch thread per rank, each case the faster of two rounds; curves shaped by fp32 matmuls and fp32 "
        "add/mul; collectives on gloo, 2 and 4 ranks, one link level). Predictions go through the simulator's "
        "`op_time` and `collective_time`. Target: median ≤ 15%.\n\n"
        "The last column multiplies each prediction by the median measured/predicted ratio of its family "
        "(kernels: family/precision; collectives: kind/ranks) on the fit set, which the profile records under "
        "`fit.residual_by_family` / `fit.residual_by_collective`; the cost model does not read them (yet), so "
        "this column is what such a per-family factor would give, not what soap predicts today.\n\n"
        + "\n\n".join(parts)
        + f"\n\nRecorded residuals (measured/predicted): kernels {dict(**residual_mm, **residual_mem)}; "
        f"collectives {residual_comm}."
    )
    update_section("calibration_heldout", "Calibration: held-out microbenchmark error (local-cpu)", body)
    for s in summarize(result.kernel_errors) + summarize(result.comm_errors):
        print(s)


if __name__ == "__main__":
    main()
