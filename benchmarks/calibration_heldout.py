"""Held-out validation of `soap calibrate` on this machine: fit on two thirds of every sweep, predict the
rest through `op_time` / `collective_time`, report the median absolute % error per family.

Measures afresh (the same sweeps as `soap calibrate`, about a minute) and writes no profile.

    flock -x /tmp/soap-cpu.lock python -m benchmarks.calibration_heldout
"""

from __future__ import annotations

from benchmarks.report import update_section
from costmodel.calibration.calibrate import CalibrationConfig, calibrate
from costmodel.calibration.predict import summarize


def main() -> None:
    result = calibrate(CalibrationConfig())
    parts = []
    for title, errors in (("Kernels (op_time)", result.kernel_errors), ("Collectives (collective_time)", result.comm_errors)):
        lines = [f"**{title}**", "",
                 "| family | held-out points | median abs err % | max abs err % |",
                 "|---|---:|---:|---:|"]
        for s in summarize(errors):
            name = f"**{s.family}**" if s.family == "all" else s.family
            lines.append(f"| {name} | {s.points} | {s.median_abs_pct:.1f} | {s.max_abs_pct:.1f} |")
        parts.append("\n".join(lines))
    kernel_keys = sorted(result.device_json.get("kernel_factors", {}).get("factors", {}))
    comm_keys = sorted(result.cluster_json["links"]["intra_node"].get("collective_factors", {}).get("factors", {}))
    body = (
        "Every third point of each sweep (shapes, message sizes) is held out; the profile is fitted on the rest "
        "(one torch thread per rank, each case the faster of two rounds; curves shaped by fp32 matmuls and fp32 "
        "add/mul; memory-bound kernels at 1 to 4096 rows of 1024 and collectives at 4 KiB to 64 MiB, each a factor 2 "
        "apart; collectives on gloo, 2 and 4 ranks, send/recv on one pair, one link level). Predictions go through the simulator's "
        "`op_time` and `collective_time`. Target: median ≤ 15%.\n\n"
        "Besides the shared curves, the profile carries factor curves fitted on the fit split only and read by "
        "the cost model: `kernel_factors` per kernel class and precision (device) and `collective_factors` per "
        "collective and group size (link); each is a time multiplier against size (see `costmodel/opcost.py`, "
        "`costmodel/collectives.py`).\n\n"
        + "\n\n".join(parts)
        + f"\n\nFitted factor curves: kernels {', '.join(f'`{k}`' for k in kernel_keys) or 'none'}; "
        f"collectives {', '.join(f'`{k}`' for k in comm_keys) or 'none'}."
        + "\n\n" + step_fields(result.device_json)
    )
    update_section("calibration_heldout", "Calibration: held-out microbenchmark error (local-cpu)", body)
    for s in summarize(result.kernel_errors) + summarize(result.comm_errors):
        print(s)


def step_fields(device: dict) -> str:
    """The device fields about a rank inside a training step (`costmodel.calibration.node`; measured whole,
    nothing held out)."""
    opt = device.get("optimizer_factors", {}).get("factors", {})
    conc = device.get("concurrency_efficiency", {}).get("points", [])
    overlap = device.get("communication_overlap", {}).get("value")
    parts = [f"`optimizer_factors` {k}: " + ", ".join(f"x{f:g} at {b / 2**20:.1f} MiB" for b, f in pts)
             for k, pts in sorted(opt.items())]
    if conc:
        parts.append("`concurrency_efficiency`: " + ", ".join(f"{e:g} at {n:g} ranks" for n, e in conc))
    if overlap is not None:
        parts.append(f"`communication_overlap`: {overlap:g}")
    call = device.get("collective_call_overhead_us", {}).get("value")
    if call is not None:
        parts.append(f"`collective_call_overhead_us`: {call:g}")
    return ("Step fields (`costmodel/calibration/node.py`, measured whole): " + "; ".join(parts) + ".") if parts else ""


if __name__ == "__main__":
    main()
