"""The A100 fitted to vTrain's Megatron-DeepSpeed grid (benchmarks/vtrain_a100.py) ships as `dgx-a100-80g-vtrain`;
the defaults `dgx-a100-80g` and `dgx-a100-40g` are its hardware terms with soap's executor's own terms measured on
Hopper (benchmarks/native_profiles.py), which pass the believability test where the fit alone does not
(tests/test_believable_profiles.py); the datasheet profiles stay beside them (issue 27, item 1)."""

from __future__ import annotations

from costmodel.profiles import load_cluster


def test_the_default_a100_clusters_are_native_and_the_fit_and_datasheet_ship_beside_them():
    assert load_cluster("dgx-a100-80g").device.name == "a100-sxm-80g-native"
    assert load_cluster("dgx-a100-40g").device.name == "a100-sxm-40g-native"
    assert load_cluster("dgx-a100-80g-vtrain").device.name == "a100-sxm-80g-fitted"
    assert load_cluster("dgx-a100-80g-datasheet").device.name == "a100-sxm-80g"
    assert load_cluster("dgx-a100-40g-datasheet").device.name == "a100-sxm-40g"


def test_every_fitted_a100_number_names_the_runs_it_came_from():
    device = load_cluster("dgx-a100-80g-vtrain").device
    for key in ("kernel_factors", "kernel_overhead_us", "activation_collective_factor"):
        assert "vTrain" in device.sources[key] and "runs (" in device.sources[key], key


def test_the_fit_keeps_the_stack_terms_out_of_the_device():
    """The host floor and jitter are Megatron-DeepSpeed's (printed by the benchmark, not written)."""
    device = load_cluster("dgx-a100-80g-vtrain").device
    assert device.host_dispatch_s == 0.0 and device.host_jitter_s == 0.0


def test_no_fitted_matmul_runs_faster_than_measured():
    """The datasheet peak is the ceiling, never the expected rate: at every size of the matmul curve the fitted
    efficiency (curve / factor) stays at or below the curve's measured top (MAMF, 85.9% of peak), in fp16 (the
    runs' precision) and bf16 (the same tensor-core rate); the defaults keep the fit's matmuls."""
    for name in ("dgx-a100-80g-vtrain", "dgx-a100-80g", "dgx-a100-40g"):
        device = load_cluster(name).device
        top = max(e for _, e in device.matmul_efficiency.points)
        for precision in ("fp16", "bf16"):
            factors = device.kernel_factors[f"matmul/{precision}"]
            for x, efficiency in device.matmul_efficiency.points:
                assert efficiency / factors.at(x) <= top * (1 + 1e-3), (name, precision, x)
            assert factors.at(1e7) < 1.0  # the fit did speed up the matmuls whose efficiency was assumed
