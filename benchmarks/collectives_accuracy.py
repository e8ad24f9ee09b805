"""Predicted vs measured collectives on 2 and 4 gloo ranks, with the shipped local-cpu cluster profile.

Message sizes (6 KiB · 4^k) sit between the calibration's (4 KiB · 2^k), so no point here was used in the fit. The
prediction is `costmodel.collectives.collective_time` on a one-node group of the measured size.

    flock -x /tmp/soap-cpu.lock python -m benchmarks.collectives_accuracy
"""

from __future__ import annotations

import statistics

from benchmarks.report import update_section
from costmodel.calibration.predict import predict_comm
from costmodel.calibration.microbench_comm import COMM_KINDS, CommCase, CommSample, CommTimingConfig, run_collectives
from costmodel.profiles import load_cluster

SIZES = [6144 * 4**k for k in range(7)]  # 6 KiB ... 24 MiB


def main() -> None:
    cluster = load_cluster("local-cpu")
    rows = []
    for n in (2, 4):
        cases = [CommCase(kind, size, n) for kind in COMM_KINDS for size in SIZES]
        for sample in run_collectives(cases, group_size=n, device="cpu", timing=CommTimingConfig()):
            if isinstance(sample, CommSample):
                predicted = predict_comm(sample.case, cluster)
                rows.append((sample.case, sample.seconds, predicted, abs(predicted - sample.seconds) / sample.seconds * 100))
    table = ["| collective | ranks | bytes | measured µs | predicted µs | abs err % |",
             "|---|---:|---:|---:|---:|---:|"]
    for case, measured, predicted, err in rows:
        table.append(f"| {case.kind} | {case.group_size} | {case.nbytes} | {measured * 1e6:.0f} | {predicted * 1e6:.0f} "
                     f"| {err:.1f} |")
    summary = ["| group | points | median abs err % |", "|---|---:|---:|"]
    for label, sel in [(f"{k}", [r for r in rows if r[0].kind == k]) for k in COMM_KINDS] + [
        (f"{n} ranks", [r for r in rows if r[0].group_size == n]) for n in (2, 4)
    ]:
        summary.append(f"| {label} | {len(sel)} | {statistics.median(r[3] for r in sel):.1f} |")
    overall = statistics.median(r[3] for r in rows)
    summary.append(f"| **all** | {len(rows)} | **{overall:.1f}** |")
    body = (
        "gloo over 127.0.0.1, one torch thread per rank, median call (see `costmodel/calibration/microbench_comm.py`), "
        "against `collective_time` with `profiles/clusters/local-cpu.json`, whose `collective_factors` (per "
        "collective and group size, fitted by `soap calibrate` on its own message sizes) `collective_time` "
        "applies. Target: median ≤ 25%.\n\n"
        + "\n".join(summary) + "\n\n" + "\n".join(table)
    )
    update_section("collectives_accuracy", "Collectives: predicted vs measured on 2 and 4 gloo ranks", body)
    print(f"collectives: {len(rows)} points, median abs err {overall:.1f}%")


if __name__ == "__main__":
    main()
