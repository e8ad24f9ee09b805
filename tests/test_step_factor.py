"""The step factor (costmodel/calibration/step_factor.py): a profiled training step's memory-bound kernels over the
calibrated price of the same ops multiply the memory-bound classes, and `soap calibrate` writes it on a GPU."""

import dataclasses

import pytest

from costmodel.calibration.step_factor import (BOUNDS, MEMORY_BOUND, REFERENCE_BATCH, apply_step_factor, kernel_groups,
                                               priced_groups, reference_graph)
from costmodel.profiles import device_to_dict, load_device
from costmodel.profiles_json import device_from_json


@pytest.fixture(scope="module")
def graph():
    return reference_graph()


@pytest.fixture(scope="module")
def quick_cpu():
    """One quick CPU calibration's measurements (a minute of microbenchmarks on 2 cores), shared by the tests that fit
    a step onto them: a quick calibration never profiles the step (`calibrate.measure`), so no test's patches reach
    it."""
    from costmodel.calibration.calibrate import CalibrationConfig, measure

    config = CalibrationConfig(quick=True, nproc=1, rounds=1)
    return config, measure(config)


def test_kernels_are_grouped_by_name_and_none_is_lost():
    kernels = [("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 3.0), ("sm90_xmma_gemm_bf16bf16", 1.0),
               ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma", 2.0),
               ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>", 0.5),
               ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", 0.25),
               ("void at::native::cunn_SoftMaxForward<4, float>", 0.125), ("Memcpy DtoD (Device -> Device)", 0.125)]
    groups = kernel_groups(kernels)
    assert groups == {"gemm": 4.0, "attention": 2.0, "optimizer": 0.5, "memory-bound": 0.5}


def test_the_reference_step_is_priced_in_every_group(graph):
    priced = priced_groups(graph, load_device("h100-x1-measured"), REFERENCE_BATCH)
    assert all(v > 0 for v in priced.values()) and priced["gemm"] > priced["attention"]


def test_the_factor_makes_the_profile_price_the_step_as_measured_and_leaves_gemms_alone(graph):
    """A step whose memory-bound kernels took twice the price: the memory-bound ops then cost twice
    (the factor solved for it, launches unscaled), GEMMs and attention as before; a wild measurement is held to the bounds."""
    device_json = device_to_dict(load_device("h100-sxm"))
    before = priced_groups(graph, device_from_json(device_json, "x"), REFERENCE_BATCH)
    measured = {"gemm": 1.0, "attention": 1.0, "optimizer": 1.0, "memory-bound": 2 * before["memory-bound"]}
    after_json, k = apply_step_factor(device_json, measured, source="a test", graph=graph)
    after = priced_groups(graph, device_from_json(after_json, "x"), REFERENCE_BATCH)
    assert k > 2  # launches are not scaled, so the data time grows by more than 2x
    assert after["memory-bound"] == pytest.approx(2 * before["memory-bound"], rel=0.01)
    assert after["gemm"] == pytest.approx(before["gemm"]) and after["attention"] == pytest.approx(before["attention"])
    assert all(f"{kind}/bf16" in after_json["kernel_factors"]["factors"] for kind in MEMORY_BOUND)
    assert "a test" in after_json["kernel_factors"]["source"]
    _, wild = apply_step_factor(device_json, {**measured, "memory-bound": 100 * before["memory-bound"]}, source="",
                                graph=graph)
    assert wild == BOUNDS[1]


def test_calibrate_writes_the_factor_of_a_measured_step(monkeypatch, graph, quick_cpu):
    """`fit` applies a measured step (GPU calibrations measure one; here a quick CPU measurement carries a stub)."""
    from costmodel.calibration import step_factor
    from costmodel.calibration.calibrate import fit

    monkeypatch.setattr(step_factor, "reference_graph", lambda: graph)
    config, meas = quick_cpu
    assert meas.step == ()  # a CPU calibration profiles no step
    plain = fit(meas, config).device_json
    stepped = fit(dataclasses.replace(meas, step=(("gemm", 1.0), ("memory-bound", 1.0))), config).device_json
    assert "training step" in stepped["kernel_factors"]["source"]
    assert stepped["kernel_factors"]["factors"] != plain.get("kernel_factors", {}).get("factors")
    # with the same step compiled, the memory-bound classes' compile factors are solved on it too
    compiled = fit(dataclasses.replace(meas, step=(("gemm", 1.0), ("memory-bound", 1.0)),
                                       compiled_step=(("gemm", 1.0), ("memory-bound", 0.5))), config).device_json
    assert "its layers compiled" in compiled["compile_factors"]["source"]
    assert compiled["kernel_factors"] == stepped["kernel_factors"]
    assert all(0 < v <= 1 for curve in compiled["compile_factors"]["factors"].values() for _, v in curve)


@pytest.mark.gpu
def test_a_training_step_is_profiled_on_the_gpu():
    from costmodel.calibration.step_factor import measure_step

    groups = measure_step(warmup=1)
    assert all(groups[g] > 0 for g in ("gemm", "attention", "optimizer", "memory-bound"))
    compiled = measure_step(warmup=1, compile=True)  # Inductor fuses the layers' memory-bound kernels, not the GEMMs
    assert compiled["memory-bound"] < groups["memory-bound"]
    assert compiled["gemm"] == pytest.approx(groups["gemm"], rel=0.2)


def test_a_step_that_cannot_run_or_be_priced_loses_no_calibration(monkeypatch, capsys, graph, quick_cpu):
    """A GPU calibration spends minutes on kernels before the step: a failing step or pricing only warns."""
    from costmodel.calibration import calibrate, step_factor
    from costmodel.calibration.calibrate import fit

    def broken():
        raise RuntimeError("no CUDA kernels here")

    monkeypatch.setattr(calibrate, "measure_step", broken)
    assert calibrate._measured_step() == ()
    monkeypatch.setattr(step_factor, "reference_graph", broken)
    config, meas = quick_cpu
    meas = dataclasses.replace(meas, step=(("memory-bound", 1.0),))
    device_json = fit(meas, config).device_json
    assert "training step" not in device_json.get("kernel_factors", {}).get("source", "")
    assert capsys.readouterr().err.count("warning:") == 2
