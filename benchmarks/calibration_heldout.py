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
        lines = [f"**{title}**", "", "| family | held-out points | median abs err % | max abs err % |", "|---|---:|---:|---:|"]
        for s in summarize(errors):
            name = f"**{s.family}**" if s.family == "all" else s.family
            lines.append(f"| {name} | {s.points} | {s.median_abs_pct:.1f} | {s.max_abs_pct:.1f} |")
        parts.append("\n".join(lines))
    residual_mm = result.device_json["matmul_efficiency"]["fit"]["residual_by_family"]
    residual_mem = result.device_json["memory_efficiency"]["fit"]["residual_by_family"]
    residual_comm = result.cluster_json["links"]["intra_node"]["efficiency"]["fit"]
    notes = (
        "Median measured/predicted on the fit set, per family (what one shared curve cannot express): "
        f"kernels {dict(**residual_mm, **residual_mem)}; collectives {residual_comm['residual_by_collective']}, "
        f"by group size {residual_comm['residual_by_group_size']}."
    )
    body = (
        "Every third point of each sweep (shapes, message sizes) is held out; the profile is fitted on the rest "
        "(one torch thread per rank; collectives on gloo, 2 and 4 ranks). Target: median ≤ 15%.\n\n"
        + "\n\n".join(parts) + "\n\n" + notes
    )
    update_section("calibration_heldout", "Calibration: held-out microbenchmark error (local-cpu)", body)
    for s in summarize(result.kernel_errors) + summarize(result.comm_errors):
        print(s)


if __name__ == "__main__":
    main()
