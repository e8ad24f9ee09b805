"""The A100 and V100 defaults (benchmarks/native_profiles.py): each GPU's measured hardware with soap's executor's
terms measured on a lent H100 and H200. The shipped files are what the builder makes of the shipped inputs (a refit
of `a100-sxm-80g-fitted` or new step profiles must be carried through), and the carried terms are what the two
GPUs' profiled steps say."""

from __future__ import annotations

import json

import pytest

from benchmarks import native_profiles
from costmodel.calibration.step_factor import BOUNDS
from costmodel.profiles import load_cluster


@pytest.fixture(scope="module")
def terms():
    return native_profiles.executor_terms()


def test_the_shipped_defaults_are_what_the_builder_makes(terms):
    carry = native_profiles.carried(terms)
    built = {("devices", name): device for name, device in native_profiles.devices(terms, carry).items()}
    built |= {("clusters", name): cluster for name, cluster in native_profiles.clusters().items()}
    for (kind, name), data in built.items():
        shipped = json.loads((native_profiles.PROFILES / kind / f"{name}.json").read_text())
        assert shipped == json.loads(native_profiles.dumps(data)), f"{kind}/{name}.json is stale: run the builder"


def test_both_gpus_say_the_same_of_the_executor(terms):
    """The terms are carried as the software's, so the two GPUs' steps must agree on them: GEMMs priced within 2%,
    the memory-bound factors within 15% of each other, both inside the step factor's bounds, compiled blocks
    cheaper than eager ones."""
    h100, h200 = terms["H100"], terms["H200"]
    for t in (h100, h200):
        assert t["priced"]["gemm"] == pytest.approx(t["eager"]["gemm"], rel=0.02)
        assert BOUNDS[0] < t["k"] < BOUNDS[1] and 1 < t["k"]
        assert 0 < t["k_c"] < 1
    assert h200["k"] / h100["k"] == pytest.approx(1, abs=0.15)
    assert h200["k_c"] / h100["k_c"] == pytest.approx(1, abs=0.15)


def test_the_defaults_carry_the_executor_and_the_datasheets_do_not():
    for default, (datasheet, device) in native_profiles.NATIVE.items():
        native, plain = load_cluster(default).device, load_cluster(datasheet).device
        assert native.name == device
        assert native.kernel_factors["norm/bf16"].at(1e8) > 2 and native.compile_factors["norm/fwd"].at(1e8) < 1
        assert native.host_dispatch_s > 0 and "native_profiles" in native.sources["kernel_factors"]
        assert not plain.kernel_factors and not plain.compile_factors and plain.host_dispatch_s == 0
        assert native.peak_flops == plain.peak_flops and native.memory_bytes == plain.memory_bytes
