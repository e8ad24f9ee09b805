"""Keep a calibration's raw measurements, so that a device measured once can be refitted anywhere.

    python -m benchmarks.calibration_raw --device cuda --out FILE     # on the machine: measure, save
    python -m benchmarks.calibration_raw --refit FILE                 # anywhere: fit, print held-out errors

A GPU is lent rarely; its two minutes of microbenchmarks are worth keeping. The saved file is the
`Measurements` record as JSON (kernels only; collectives need several devices), and `--refit` runs the same
`costmodel.calibration.calibrate.fit` that `soap calibrate` runs, so fitting changes can be checked against a real
H100 sweep on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from costmodel.calibration.calibrate import CalibrationConfig, Measurements, Point, fit, measure
from costmodel.calibration.predict import summarize
from costmodel.calibration.microbench import KernelCase, KernelSample


def save(meas: Measurements, path: Path) -> None:
    path.write_text(json.dumps(dataclasses.asdict(meas), indent=1) + "\n")


def load(path: Path) -> Measurements:
    raw = json.loads(path.read_text())
    kernels = tuple(Point(p["sweep"], p["index"], KernelSample(KernelCase(
        p["sample"]["case"]["op"], tuple(p["sample"]["case"]["shape"]), p["sample"]["case"]["dtype"],
        p["sample"]["case"]["precision"]), p["sample"]["seconds"])) for p in raw["kernels"])
    return dataclasses.replace(Measurements(**{**raw, "kernels": (), "comms": ()}), kernels=kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, help="measure this machine's kernels and save them here")
    parser.add_argument("--quick", action="store_true", help="the reduced sweep (seconds)")
    parser.add_argument("--refit", type=Path, help="fit saved measurements and print the held-out errors")
    args = parser.parse_args()
    config = CalibrationConfig(device=args.device, nproc=1, name=f"local-{args.device}", quick=args.quick, rounds=1 if args.quick else 2,
                               reference_precision="bf16" if args.device == "cuda" else "fp32")
    if args.out:
        save(measure(config), args.out)
    if args.refit:
        result = fit(load(args.refit), config)
        for s in summarize(result.kernel_errors):
            print(f"{s.family:20s} median |error| {s.median_abs_pct:5.1f}%")


if __name__ == "__main__":
    main()
