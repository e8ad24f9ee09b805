"""Profile factor tables: `kernel_factors` (device) and `collective_factors` (link) validate strictly,
scale the predicted time by exactly the stored factor, and change nothing where absent."""

import dataclasses
import json

import pytest

from costmodel import profiles
from costmodel.collectives import CommGroup, collective_time
from costmodel.opcost import kernel_class, op_time
from costmodel.profiles import FactorCurve, cluster_to_dict, load_cluster, load_device
from costmodel.profiles_json import cluster_from_json, device_from_json
from tracer.errors import SoapError
from tracer.ir import DimRole, OpKind, OpNode, TensorMeta

S, P = DimRole.SAMPLE, DimRole.PARAMETER


def unary_op(target: str, kind: OpKind = OpKind.ELEMENTWISE, rows: int = 4096, cols: int = 1024) -> OpNode:
    x = TensorMeta((rows, cols), "float32", (S, P))
    return OpNode(f"act:{target}", kind, target, "act", "layers", (x,), (x,), (), 0, 0, 2 * x.nbytes, (x,))


def _h100_json() -> dict:
    return json.loads((profiles.PROFILES_DIR / "devices" / "h100-sxm.json").read_text())


@pytest.mark.parametrize(
    "table, field",
    [
        ({"factors": {"softmax/fp32": [[1, 2.0]]}}, "kernel_factors: missing key(s) source"),
        ({"source": "x", "factors": {"softmax/fp32": [[1, 0.0]]}}, "kernel_factors.factors.softmax/fp32[0]"),
        ({"source": "x", "factors": {"softmax/fp32": [[1, -3]]}}, "kernel_factors.factors.softmax/fp32[0]"),
        ({"source": "x", "factors": {"softmax/fp32": [[10, 2], [5, 2]]}}, "x must increase"),
        ({"source": "x", "factors": {"sofmax/fp32": [[1, 2]]}}, "kernel_factors.factors.sofmax/fp32: key must be"),
        ({"source": "x", "factors": {"softmax/fp64": [[1, 2]]}}, "kernel_factors.factors.softmax/fp64: key must be"),
        ({"source": "x", "factors": {"softmax/fp32": []}}, "non-empty list"),
    ],
)
def test_bad_kernel_factors_are_refused_naming_the_field(table, field):
    data = {**_h100_json(), "kernel_factors": table}
    with pytest.raises(SoapError) as err:
        device_from_json(data, "probe.json")
    assert field in str(err.value) and "probe.json" in str(err.value)


def test_bad_collective_factors_are_refused_naming_the_field():
    data = cluster_to_dict(load_cluster("dgx-h100"))
    data["links"]["intra_node"]["collective_factors"] = {"source": "x", "factors": {"all_reduce/1": [[1, 2]]}}
    with pytest.raises(SoapError, match=r"links\.intra_node\.collective_factors\.factors\.all_reduce/1: key must be"):
        cluster_from_json(data, "probe.json", load_device)
    data["links"]["intra_node"]["collective_factors"] = {"source": "x", "factors": {"all_reduce/4": [[1, 1e9]]}}
    with pytest.raises(SoapError, match=r"collective_factors\.factors\.all_reduce/4\[0\]"):
        cluster_from_json(data, "probe.json", load_device)


def test_factor_tables_round_trip_with_their_source():
    data = {**_h100_json(), "kernel_factors": {"source": "measured here", "factors": {"norm/bf16": [[1e3, 3.0], [1e6, 2.0]]}}}
    device = device_from_json(data, "probe.json")
    assert device.kernel_factors["norm/bf16"].at(1e3) == 3.0
    assert device.sources["kernel_factors"] == "measured here"
    cluster = dataclasses.replace(load_cluster("dgx-h100"), device=device)
    again = cluster_from_json(json.loads(json.dumps(cluster_to_dict(cluster))), "again", load_device)
    assert again.device.kernel_factors == device.kernel_factors


def test_ops_map_to_kernel_classes_by_kind_and_target():
    assert kernel_class(unary_op("aten.tanh.default")) == "tanh"
    assert kernel_class(unary_op("aten.gelu.default")) == "transcendental"
    assert kernel_class(unary_op("aten.add.Tensor")) == "arithmetic"
    assert kernel_class(unary_op("aten.native_dropout.default")) == "dropout"
    assert kernel_class(unary_op("aten._softmax.default", OpKind.SOFTMAX)) == "softmax"
    assert kernel_class(unary_op("aten.layer_norm.default", OpKind.NORM)) == "norm"


def test_a_kernel_factor_scales_the_kernel_time_by_exactly_that_factor():
    base = dataclasses.replace(load_device("h100-sxm"), kernel_overhead_s=0.0)
    tanh, add = unary_op("aten.gelu.default"), unary_op("aten.add.Tensor")
    scaled = dataclasses.replace(base, kernel_factors={"transcendental/fp32": FactorCurve(((1.0, 3.5),))})

    def times(op, device):
        cost = op_time(op, device=device, precision="fp32", micro_batch=1, batch_traced=1)
        return cost.fwd_s, cost.bwd_s

    assert times(tanh, scaled) == pytest.approx(tuple(3.5 * t for t in times(tanh, base)), rel=1e-12)
    assert times(add, scaled) == times(add, base)  # other classes keep factor 1
    # bf16 has no entry: unchanged
    assert op_time(tanh, device=scaled, precision="bf16", micro_batch=1, batch_traced=1) == \
        op_time(tanh, device=base, precision="bf16", micro_batch=1, batch_traced=1)


def test_a_collective_factor_scales_that_collective_at_and_above_its_group_size():
    base = load_cluster("dgx-h100")
    curve = FactorCurve(((1e3, 2.0), (1e9, 4.0)))
    intra = dataclasses.replace(base.intra_node, collective_factors={"reduce_scatter/4": curve})
    scaled = dataclasses.replace(base, intra_node=intra)
    nbytes = 1e6  # halfway between the knots in log space: factor 3
    for n, factor in ((4, 3.0), (8, 3.0), (2, 1.0)):
        group = CommGroup(n, n)
        assert collective_time("reduce_scatter", nbytes, group, scaled) == pytest.approx(
            factor * collective_time("reduce_scatter", nbytes, group, base), rel=1e-12)
    assert collective_time("all_reduce", nbytes, CommGroup(8, 8), scaled) == \
        collective_time("all_reduce", nbytes, CommGroup(8, 8), base)


def test_datasheet_gpu_profiles_carry_no_factors():
    """Datasheet profiles carry no kernel factors; a fitted one (dgx-h100, dgx-a100-80g-vtrain) carries them with the runs
    they came from."""
    for name in ("dgx-h100-datasheet", "dgx-a100-80g-datasheet", "l40s-pcie"):
        cluster = load_cluster(name)
        assert not cluster.device.kernel_factors
        assert not cluster.intra_node.collective_factors and not cluster.inter_node.collective_factors
    for name in ("dgx-h100", "dgx-a100-80g-vtrain"):
        fitted = load_cluster(name)
        assert fitted.device.kernel_factors and "refit by soap calibrate --from-runs" in fitted.device.sources["kernel_factors"]
