"""torch.compile priced from measurement: a device's `compile_factors` (per kernel class and pass) scale an
op's time when the strategy compiles, load strictly, and let the search choose compile only where it pays
(off on a tie, never on a device without factors)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from costmodel.calibration.microbench_compile import NOISE_BAND, CompileSample, class_factors, compile_factors_json
from costmodel.opcost import op_time
from costmodel.profiles import FactorCurve, cluster_from_dict, cluster_to_dict, load_cluster, load_device
from costmodel.profiles_json import device_from_json, device_to_dict
from costmodel.strategy import ParallelDims, TrainingConfig
from planner.api import plan_report
from planner.search import Candidate, Priced, SearchConfig, compile_variant, search
from planner.space import MeshChoice, Pins, SpaceRequest, compile_choices
from tracer.errors import SoapError
from tracer.ir import DimRole, ModelDims, OpKind, OpNode, TensorMeta

TINY_GPT2 = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 8,
    "vocab_size": 8192, "n_positions": 1024,
}
X = TensorMeta((4096, 1024), "float32", (DimRole.SAMPLE, DimRole.NONE))


def _op(kind: OpKind, target: str, flops: int = 0, block_id: str | None = "model.layers") -> OpNode:
    return OpNode(name="op", kind=kind, target=target, module_fqn="m", block_id=block_id, inputs=(X,), outputs=(X,),
                  params=(), fwd_flops=flops, bwd_flops=2 * flops, bytes_moved=2 * X.nbytes, saved=(X,), attrs={})


def _with_factors(device, table: dict[str, list[tuple[float, float]]]):
    return dataclasses.replace(device, compile_factors={k: FactorCurve(tuple(v)) for k, v in table.items()})


def _cost(op, device, *, compile: bool):
    return op_time(op, device=device, precision="fp32", micro_batch=1, batch_traced=1, compile=compile)


# --- opcost ------------------------------------------------------------------------------------


def test_compile_scales_each_pass_by_its_class_factor():
    device = load_device("h100-sxm")
    tanh = _op(OpKind.ELEMENTWISE, "aten.tanh.default")
    compiled = _with_factors(device, {"tanh/fwd": [(1.0, 0.5)], "tanh/bwd": [(1.0, 0.25)]})
    eager, fused = _cost(tanh, compiled, compile=False), _cost(tanh, compiled, compile=True)
    assert fused.fwd_s == pytest.approx(0.5 * eager.fwd_s)
    assert fused.bwd_s == pytest.approx(0.25 * eager.bwd_s)
    # another class keeps its eager time
    add = _op(OpKind.ELEMENTWISE, "aten.add.Tensor")
    assert _cost(add, compiled, compile=True) == _cost(add, compiled, compile=False)


def test_compile_prices_only_the_blocks_the_executor_compiles():
    # executor.api.compile_blocks compiles each block; the embedding, final norm, LM head and loss run eagerly
    compiled = _with_factors(load_device("h100-sxm"), {"softmax/fwd": [(1.0, 0.4)], "softmax/bwd": [(1.0, 0.4)]})
    in_block = _op(OpKind.SOFTMAX, "aten._softmax.default")
    loss = _op(OpKind.SOFTMAX, "aten._log_softmax.default", block_id=None)
    assert _cost(in_block, compiled, compile=True).fwd_s == pytest.approx(0.4 * _cost(in_block, compiled, compile=False).fwd_s)
    assert _cost(loss, compiled, compile=True) == _cost(loss, compiled, compile=False)


def test_compile_factor_solved_from_a_profiled_compiled_step():
    # the executor's compiled step: blocks at their compile factors times k_c, the rest eager; k_c is solved so
    # the priced memory-bound kernels match the profiled ones, and scales every memory-bound class alike
    from costmodel.calibration.step_factor import apply_compile_factor, priced_groups
    from transformers import AutoConfig

    from tracer import trace

    fields = dict(TINY_GPT2)
    fields.pop("architectures")
    graph = trace(AutoConfig.for_model(fields.pop("model_type"), **fields), task="causal-lm", seq_len=256, batch=2)
    base = device_to_dict(_with_factors(load_device("h100-sxm"), {"arithmetic/fwd": [(1.0, 0.6)],
                                                                  "norm/bwd": [(1.0, 0.8)]}))
    priced = priced_groups(graph, device_from_json(base, "t"), 2, compile=True)["memory-bound"]
    eager = priced_groups(graph, device_from_json(base, "t"), 2)["memory-bound"]
    target = 0.9 * priced
    device, k = apply_compile_factor(base, {"memory-bound": target}, graph=graph, micro_batch=2, source="s", step="t")
    assert 0.05 < k < 1
    assert priced_groups(graph, device_from_json(device, "t"), 2, compile=True)["memory-bound"] == pytest.approx(target, rel=0.02)
    assert priced_groups(graph, device_from_json(device, "t"), 2)["memory-bound"] == pytest.approx(eager)  # eager untouched
    factors = device["compile_factors"]["factors"]
    assert factors["arithmetic/fwd"][0][1] == pytest.approx(0.6 * k, abs=1e-4)
    assert factors["softmax/bwd"][0][1] == pytest.approx(k, abs=1e-4)  # a class without a chain factor gets k
    assert "matmul/fwd" not in factors  # library kernels keep their eager time
    assert all(0.02 <= v <= 1 for curve in factors.values() for _, v in curve)


def test_compile_without_factors_prices_as_eager():
    device = load_device("h100-sxm")
    assert not device.compile_factors and not device.compile_pays
    for op in (_op(OpKind.MATMUL, "aten.mm.default", 10**9), _op(OpKind.ELEMENTWISE, "aten.gelu.default")):
        assert _cost(op, device, compile=True) == _cost(op, device, compile=False)


def test_compile_factor_follows_the_size_axis():
    device = _with_factors(load_device("h100-sxm"), {"matmul/fwd": [(1e6, 0.5), (1e12, 1.0)]})
    small, big = _op(OpKind.MATMUL, "aten.mm.default", 10**6), _op(OpKind.MATMUL, "aten.mm.default", 10**12)
    assert _cost(small, device, compile=True).fwd_s == pytest.approx(0.5 * _cost(small, device, compile=False).fwd_s)
    assert _cost(big, device, compile=True).fwd_s == pytest.approx(_cost(big, device, compile=False).fwd_s)


# --- profile JSON ------------------------------------------------------------------------------


def _h100_json() -> dict:
    return device_to_dict(load_device("h100-sxm"))


def test_compile_factors_round_trip_with_source_and_notes():
    table = {"source": "measured here", "notes": {"method": "chains"},
             "factors": {"norm/fwd": [[1e3, 0.5], [1e6, 0.8]], "tanh/bwd": [[1e3, 1.3]]}}
    device = device_from_json({**_h100_json(), "compile_factors": table}, "test")
    assert device.compile_factors["norm/fwd"].at(1e3) == 0.5 and device.compile_pays
    assert device.sources["compile_factors"] == "measured here"
    again = device_from_json(json.loads(json.dumps(device_to_dict(device))), "again")
    assert again.compile_factors == device.compile_factors and again.compile_notes == {"method": "chains"}


@pytest.mark.parametrize("factors, field", [
    ({"norm/fwd": [[1, 0.001]]}, "compile_factors.factors.norm/fwd[0]"),
    ({"norm/fwd": [[1, 50.0]]}, "compile_factors.factors.norm/fwd[0]"),
    ({"norm/fp32": [[1, 0.5]]}, "compile_factors.factors.norm/fp32: key must be"),
    ({"nrom/fwd": [[1, 0.5]]}, "compile_factors.factors.nrom/fwd: key must be"),
])
def test_bad_compile_factors_are_refused_naming_the_field(factors, field):
    with pytest.raises(SoapError, match=field.replace("[", r"\[").replace("]", r"\]")):
        device_from_json({**_h100_json(), "compile_factors": {"source": "x", "factors": factors}}, "test")


def test_gpu_profiles_carry_no_compile_factors():
    for name in ("dgx-h100-datasheet", "dgx-a100-80g-datasheet", "dgx-h200-datasheet"):  # the defaults carry a compile fit
        assert not load_cluster(name).device.compile_factors


def test_local_cpu_profile_has_measured_compile_factors_with_provenance():
    device = load_cluster("local-cpu").device
    assert device.compile_factors, "soap calibrate's compile measurement is missing from local-cpu"
    assert "measured" in device.sources["compile_factors"]
    assert device.compile_notes and "method" in device.compile_notes


# --- the measurement's arithmetic --------------------------------------------------------------


def test_class_factor_is_the_chains_compiled_over_eager_ratio():
    samples = [
        CompileSample("tanh", (512, 1024), chain_eager=(4e-3, 8e-3), chain_compiled=(1e-3, 6e-3), compile_s=5.0),
        CompileSample("matmul", (256, 1024, 1024), chain_eager=(1e-3, 2e-3), chain_compiled=(1.01e-3, 2e-3),
                      compile_s=0.5),
    ]
    table = class_factors(samples)
    x = samples[0].case.op_node().bytes_moved
    assert table["tanh/fwd"] == [(x, 0.25)] and table["tanh/bwd"] == [(2 * x, 0.75)]
    assert table["matmul/fwd"][0][0] == samples[1].case.op_node().fwd_flops
    out = compile_factors_json(samples, source="measured by a test")
    # matmul within the noise band is left out (priced as 1), the raw numbers stay in the notes
    assert set(out["factors"]) == {"tanh/fwd", "tanh/bwd"} and NOISE_BAND >= 0.01
    assert "matmul 256x1024x1024" in out["notes"]["eager_ms_fwd_bwd"]
    device = device_from_json({**_h100_json(), "compile_factors": out}, "test")
    assert device.compile_factors["tanh/fwd"].at(x) == 0.25


# --- the search --------------------------------------------------------------------------------


def _space(compile_pin=None) -> SpaceRequest:
    dims = ModelDims(num_layers=4, hidden=256, heads=8, kv_heads=8, head_dim=32, vocab=1000, ffn=1024)
    return SpaceRequest(gpus=1, gpus_per_node=1, tp_across_nodes=False, dims=dims, seq_len=128, global_batch=8,
                        precisions=("fp32", "bf16"), pins=Pins(compile=compile_pin))


@pytest.mark.parametrize("pin, pays, expect", [
    (None, False, (False,)), (None, True, (False, True)), (True, False, (True,)), (False, True, (False,)),
])
def test_compile_is_searched_only_where_it_can_pay(pin, pays, expect):
    assert compile_choices(_space(pin), pays) == expect
    assert (compile_variant(_space(pin), pays) is not None) == (expect == (False, True))


def test_compile_loses_a_tie():
    """With compile priced at no gain, the plan without it is chosen (the key orders off first)."""
    train = TrainingConfig(global_batch=8, seq_len=128, micro_batch=1, num_microbatches=8, grad_accum=8)
    mesh = MeshChoice(dims=ParallelDims(), zero=0)
    base = Candidate(mesh, train, SimpleNamespace(step_time_s=1.0, memory_bytes=0))

    def price(c: Candidate) -> Priced:
        return Priced(candidate=c, step_time_s=1.0, peak_memory_bytes=0.0, result=None, fits=True)

    outcome = search([base], price, config=SearchConfig(), compile_variants=compile_variant(_space(), True))
    assert [p.candidate.train.compile for p in outcome.ranked] == [False, True]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    (path / "config.json").write_text(json.dumps(TINY_GPT2))
    return str(path)


def _cluster_with(factors: dict[str, list[tuple[float, float]]]):
    cluster = load_cluster("dgx-h100")
    return dataclasses.replace(cluster, device=_with_factors(cluster.device, factors))


def test_search_picks_compile_where_the_device_measures_a_gain(tiny):
    fast = {f"{k}/{p}": [(1.0, 0.5)] for k in ("arithmetic", "norm", "softmax", "tanh", "transcendental")
            for p in ("fwd", "bwd")}
    report = plan_report(tiny, gpus=8, global_batch=64, cluster=_cluster_with(fast))
    assert report.plan.parallelism.compile is True
    assert any("torch.compile" in line and "slower" in line for line in report.why)
    # the same request on a device where compile measured slower leaves it off
    slow = {k: [(1.0, 2.0)] for k in fast}
    assert plan_report(tiny, gpus=8, global_batch=64, cluster=_cluster_with(slow)).plan.parallelism.compile is False


def test_plan_on_a_gpu_profile_leaves_compile_off_unless_pinned(tiny):
    """On a GPU profile without compile factors (the datasheet H100) compile is priced as no gain; the fitted
    dgx-h100 carries the compile factor its runs gave (tests/test_believable_profiles.py)."""
    free = plan_report(tiny, gpus=8, global_batch=64, cluster="dgx-h100-datasheet")
    assert free.plan.parallelism.compile is False
    pinned = plan_report(tiny, gpus=8, global_batch=64, compile=True, cluster="dgx-h100-datasheet")
    assert pinned.plan.parallelism.compile is True
    # priced as no gain: the same step time as the free plan's
    assert pinned.chosen.step_time_s == pytest.approx(free.chosen.step_time_s)


def test_fp8_plans_compile_unless_pinned_off(tiny):
    """torchao's float8 Linears run eagerly op by op (1.6x slower than bf16 on an H100): an fp8 plan compiles
    even where the profile prices no compile gain; a pin keeps the user's choice."""
    fp8 = plan_report(tiny, gpus=8, global_batch=64, precision="fp8", cluster="dgx-h100-datasheet")
    assert fp8.plan.parallelism.compile is True and fp8.plan.parallelism.precision == "fp8"
    pinned = plan_report(tiny, gpus=8, global_batch=64, precision="fp8", compile=False, cluster="dgx-h100-datasheet")
    assert pinned.plan.parallelism.compile is False
    bf16 = plan_report(tiny, gpus=8, global_batch=64, cluster="dgx-h100-datasheet")
    assert bf16.plan.parallelism.compile is False
    # the plan says why a pinned eager fp8 costs what it does
    assert any("FP8" in line and "op by op" in line for line in pinned.why)
    assert not any("op by op" in line for line in fp8.why)


def test_inline_cluster_keeps_compile_factors():
    cluster = _cluster_with({"norm/fwd": [(1.0, 0.5)]})
    again = cluster_from_dict(json.loads(json.dumps(cluster_to_dict(cluster))))
    assert again.device.compile_factors == cluster.device.compile_factors
