"""The measured H200 profile is what its measurements give (benchmarks/h200_measured.py): the H100's compute (the
same die and clocks, which the two profiled steps confirm), the H200's memory, and factors solved on its own steps."""

import json

import pytest

from benchmarks.h200_measured import DATA, PROFILE, build, runs


@pytest.fixture(scope="module")
def built():
    return build()


def test_the_shipped_measured_h200_is_what_its_data_give(built):
    device, _ = built
    assert json.loads(PROFILE.read_text()) == json.loads(json.dumps(device))


def test_its_steps_are_priced_as_measured_and_its_factors_stay_physical(built):
    device, steps = built
    assert 1 < steps["k"] < 3.3 and 0.05 < steps["k_c"] < 1
    assert steps["eager_after"]["memory-bound"] == pytest.approx(steps["eager"]["memory-bound"], rel=0.01)
    assert steps["compiled_after"]["memory-bound"] == pytest.approx(steps["compiled"]["memory-bound"], rel=0.01)
    for group in ("gemm", "attention"):  # the H100's calibrated compute, unfitted, prices the H200's step
        assert steps["eager_after"][group] == pytest.approx(steps["eager"][group], rel=0.2)
    assert all(0 < v <= 1 for curve in device["compile_factors"]["factors"].values() for _, v in curve)
    assert device["memory_gib"]["value"] > 130 and device["optimizer_factors"]["factors"]["adamw/bf16"]


def test_every_h200_run_counts_once_and_reports_both_peaks():
    records = runs()
    keys = {(r["plan"]["model"]["config_hash"], json.dumps(r["parallelism"], sort_keys=True)) for r in records}
    assert len(keys) == len(records) >= 9
    assert all(r["peak_memory_reserved_gib"] >= r["peak_memory_allocated_gib"] > 0 for r in records)
    assert (DATA / "step-profile-eager.json").exists() and (DATA / "step-profile-compile.json").exists()
