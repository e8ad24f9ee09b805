"""The measured H100 profile is what its measurements give (benchmarks/h100_measured.py), and its step factor on
memory-bound kernels is the profiled step's own ratio, inside the physical bound."""

import json

import pytest

from benchmarks.h100_measured import DATA, PROFILE, build, kernel_groups
from costmodel.calibration.step_factor import MEMORY_BOUND


@pytest.fixture(scope="module")
def built():
    return build()


def test_the_shipped_measured_h100_is_what_its_data_give(built):
    device, *_ = built
    assert json.loads(PROFILE.read_text()) == json.loads(json.dumps(device))


def test_the_profiled_step_is_split_without_losing_a_kernel():
    profile = json.loads((DATA / "step-profile-8b4l.json").read_text())
    groups = kernel_groups(profile)
    assert sum(groups.values()) == pytest.approx(profile["kernel_total_us"] * 1e-6, rel=1e-3)
    assert groups["gemm"] > groups["memory-bound"] > groups["optimizer"] > 0


def test_the_step_factor_prices_the_profiled_step_as_measured_and_stays_physical(built):
    """After the factor, the memory-bound ops of the profiled micro-batch cost what torch.profiler measured; the
    GEMMs and attention are calibrate's own (within 20% of the profile, no factor); and the factor leaves the
    memory-bound kernels above 30% of the datasheet's 3.35 TB/s (k <= 1 / 0.3 of the microbenchmarks' rate)."""
    from benchmarks.h100_measured import priced_groups

    device, measured, priced, k = built
    assert 1 < k < 1 / 0.3 and measured["memory-bound"] > priced["memory-bound"]
    after = priced_groups(device)
    assert after["memory-bound"] == pytest.approx(measured["memory-bound"], rel=0.01)
    for group in ("gemm", "attention"):
        assert after[group] == pytest.approx(measured[group], rel=0.2)
    factors = device["kernel_factors"]["factors"]
    assert all(f"{kind}/bf16" in factors for kind in MEMORY_BOUND)


def test_the_compile_factor_prices_the_compiled_step_as_measured():
    """The compiled step (blocks compiled, the rest eager) priced with the step factor and calibrate's one-class
    chains is slower than measured; k_c, solved on it, makes its memory-bound kernels cost what torch.profiler
    measured, every compile factor stays a speed-up (<= 1), and the eager price does not move."""
    from benchmarks.h100_measured import COMPILED_DATA, build_compiled, priced_groups

    device, measured, _, _, compiled = build_compiled()
    profile = json.loads((COMPILED_DATA / "step-profile-compile.json").read_text())
    assert profile["compile"] and not any(n.startswith("Optimizer.step#") for n, *_ in profile["kernels_us"])
    assert sum(compiled["measured"].values()) == pytest.approx(profile["kernel_total_us"] * 1e-6, rel=1e-3)
    assert compiled["priced_before"]["memory-bound"] > compiled["measured"]["memory-bound"]
    assert compiled["priced_after"]["memory-bound"] == pytest.approx(compiled["measured"]["memory-bound"], rel=0.01)
    assert 0.05 < compiled["k_c"] < 1
    assert all(0 < v <= 1 for curve in device["compile_factors"]["factors"].values() for _, v in curve)
    assert priced_groups(device)["memory-bound"] == pytest.approx(measured["memory-bound"], rel=0.01)


def test_a_memory_snapshot_is_replayed_to_its_peak():
    """benchmarks/memory_snapshot_peak: the bytes live before the traced step come from the final state and the
    step's allocs and frees; the peak and what is held there, grouped by the frame that allocated it."""
    from benchmarks.memory_snapshot_peak import peak

    frames = lambda name: [{"filename": "/x/transformers/models/llama/modeling_llama.py", "line": 1, "name": name}]
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": frames("a")},
             {"action": "alloc", "addr": 2, "size": 50, "frames": frames("b")},
             {"action": "free_requested", "addr": 1, "size": 100, "frames": []},
             {"action": "free_completed", "addr": 1, "size": 100, "frames": []},
             {"action": "alloc", "addr": 3, "size": 30, "frames": frames("a")}]
    segments = [{"device": 0, "blocks": [{"size": 1000, "state": "active_allocated"},  # held since before
                                         {"size": 50, "state": "active_allocated"}, {"size": 30, "state": "active_allocated"},
                                         {"size": 100, "state": "inactive"}]}]
    out = peak({"segments": segments, "device_traces": [trace]})
    gib = 2**30
    assert out["held_from_before_step_gib"] * gib == pytest.approx(1000)
    assert out["peak_allocated_gib"] * gib == pytest.approx(1150) and out["peak_event"] == 1
    assert {r["site"]: r["gib"] * gib for r in out["held_by_site"]} == {"modeling_llama.py:1 a": 100,
                                                                        "modeling_llama.py:1 b": 50}


def test_a_runs_log_is_repredicted_with_either_devices_compute_and_the_profile_folder_restored(monkeypatch, tmp_path):
    """benchmarks/profile_choice: swapping a cluster's device for the one it already has changes no prediction,
    swapping the default's for the measured one changes them; the user's profile folder is left as it was."""
    import os

    from benchmarks.profile_choice import compare

    monkeypatch.setenv("SOAP_PROFILES_DIR", str(tmp_path))
    log = str(DATA.parent / "h100-runs-8b-shapes.jsonl")
    same = compare(log, "h100-x1-measured")
    assert len(same) == 7 and all(a == pytest.approx(b) for _, _, a, b in same)
    swapped = compare(log, "dgx-h100")
    assert all(a != pytest.approx(b) for _, _, a, b in swapped)
    assert os.environ["SOAP_PROFILES_DIR"] == str(tmp_path) and not any(tmp_path.iterdir())
