"""Device fields about a rank inside a training step: `optimizer_factors`, `concurrency_efficiency` and
`communication_overlap` load strictly, round-trip with their sources, are neutral where absent (every
GPU profile), and price what they say: the optimizer step times its factor, every kernel slower by
1 / efficiency when the node's ranks compute at once, and a collective's host share on the compute
stream."""

from __future__ import annotations

import dataclasses
import json

import pytest

from costmodel.calibration.node import NodeMeasurements, OptimizerSample, node_fields
from costmodel.optimizer_step import memory_pass_time, optimizer_step_bytes, optimizer_step_time
from costmodel.profiles import EfficiencyCurve, FactorCurve, list_devices, load_cluster, load_device
from costmodel.profiles_json import device_from_json, device_to_dict
from costmodel.schedule import build_schedule
from costmodel.simulator import simulate, simulate_costs
from costmodel.simulator.costs import ChunkCost, StageCost, StepCosts
from costmodel.simulator.pricing import ProfilePricer
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
from tracer.errors import SoapError

SOURCE = "measured by soap calibrate on a test machine, 2026-01-01"


def _device_json(**fields) -> dict:
    return {**device_to_dict(load_device("h100-sxm")), **fields}


@pytest.mark.parametrize("name", [n for n in list_devices() if n != "local-cpu"])
def test_gpu_profiles_leave_the_step_fields_neutral(name):
    """...but for the per-collective host time, which every GPU profile carries from the reference's
    per-kernel launch figure (issue 16, tests/test_physics.py)."""
    device = load_device(name)
    written = device_to_dict(device)
    if device.optimizer_factors:  # a GPU profile's optimizer step, where it has one, was timed on that GPU or its die
        source = written["optimizer_factors"]["source"]
        assert source.startswith("measured") or source.startswith("borrowed from h100-sxm-fitted (measured"), source
    assert device.concurrency_efficiency is None
    assert device.communication_overlap == 1.0 and device.collective_call_overhead_s > 0
    assert not {"concurrency_efficiency", "communication_overlap"} & set(written)


def test_step_fields_load_and_round_trip_with_their_sources():
    data = _device_json(optimizer_factors={"source": SOURCE, "factors": {"adamw/fp32": [[1e6, 3.0], [1e8, 2.5]]}},
                        concurrency_efficiency={"points": [[1, 1.0], [2, 0.5]], "source": SOURCE},
                        communication_overlap={"value": 0.0, "source": SOURCE},
                        collective_call_overhead_us={"value": 1500.0, "source": SOURCE})
    device = device_from_json(data, "test")
    assert device.optimizer_factors["adamw/fp32"] == FactorCurve(((1e6, 3.0), (1e8, 2.5)))
    assert device.concurrency_efficiency.at(2) == 0.5 and device.communication_overlap == 0.0
    assert device.collective_call_overhead_s == pytest.approx(1.5e-3)
    again = device_to_dict(device)
    assert again["collective_call_overhead_us"] == {"value": pytest.approx(1500.0), "source": SOURCE}
    assert again["communication_overlap"] == {"value": 0.0, "source": SOURCE}
    assert again["optimizer_factors"]["source"] == SOURCE and again["concurrency_efficiency"]["source"] == SOURCE
    assert device_from_json(json.loads(json.dumps(again)), "again").optimizer_factors == device.optimizer_factors


@pytest.mark.parametrize("field,value,message", [
    ("communication_overlap", {"value": 1.5, "source": SOURCE}, "communication_overlap.value: must be in [0, 1]"),
    ("communication_overlap", {"value": -0.1, "source": SOURCE}, "must be non-negative"),
    ("communication_overlap", {"value": 0.5}, "missing key(s) source"),
    ("collective_call_overhead_us", {"value": -1, "source": SOURCE}, "must be non-negative"),
    ("concurrency_efficiency", {"points": [[1, 1.0], [2, 1.5]], "source": SOURCE}, "efficiency must be in (0, 1]"),
    ("concurrency_efficiency", {"points": [[2, 0.5], [1, 1.0]], "source": SOURCE}, "x must increase"),
    ("optimizer_factors", {"source": SOURCE, "factors": {"adam/fp32": [[1, 2.0]]}}, "key must be"),
    ("optimizer_factors", {"source": SOURCE, "factors": {"adamw/fp32": [[1, 0.0]]}}, "optimizer_factors.factors.adamw/fp32[0]"),
])
def test_bad_step_fields_are_refused_naming_the_field(field, value, message):
    with pytest.raises(SoapError, match="field " + field) as err:
        device_from_json(_device_json(**{field: value}), "bad.json")
    assert message in str(err.value)


def test_the_optimizer_step_is_its_one_pass_estimate_times_the_measured_factor():
    plain = load_device("h100-sxm")
    elements = 3e6
    nbytes = optimizer_step_bytes(elements, precision="fp32", optimizer="adamw")
    assert nbytes == elements * (2 * 4 + 4 + 2 * 8)
    assert optimizer_step_time(plain, elements, precision="fp32", optimizer="adamw") == memory_pass_time(plain, nbytes)
    slow = dataclasses.replace(plain, optimizer_factors={"adamw/fp32": FactorCurve(((1.0, 4.0),))})
    assert optimizer_step_time(slow, elements, precision="fp32", optimizer="adamw") == \
        pytest.approx(4 * memory_pass_time(plain, nbytes))
    assert optimizer_step_time(slow, elements, precision="bf16", optimizer="adamw") == \
        optimizer_step_time(plain, elements, precision="bf16", optimizer="adamw")  # no bf16 factor measured


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16", "fp8"])
def test_fp16_alone_pays_the_grad_scalers_unscale_pass(precision):
    """The executor runs fp16 with a GradScaler (`executor.precision`), whose unscale reads and writes
    every fp32 gradient once before the step; no other precision has one."""
    device = load_device("v100-sxm2-16g" if precision in ("fp32", "fp16") else "h100-sxm")
    elements = 3e8
    step = memory_pass_time(device, optimizer_step_bytes(elements, precision=precision, optimizer="adamw"))
    unscale = memory_pass_time(device, 2 * elements * 4) if precision == "fp16" else 0.0
    assert optimizer_step_time(device, elements, precision=precision, optimizer="adamw") == pytest.approx(step + unscale)


def test_kernels_slow_down_by_the_concurrency_efficiency_of_the_ranks_on_a_node():
    from tracer.ir import OpKind

    cluster = load_cluster("dgx-h100")
    # without the host-bound floor, which sets this tiny model's pace on dgx-h100 whatever its kernels cost
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, host_dispatch_s=0.0))
    shared = dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, concurrency_efficiency=EfficiencyCurve(((1.0, 1.0), (2.0, 0.5), (4.0, 0.25)))))
    import tracer
    from transformers import AutoConfig

    graph = tracer.trace(AutoConfig.for_model("gpt2", n_embd=64, n_layer=1, n_head=2, vocab_size=128, n_positions=32),
                         task="causal-lm", seq_len=32)
    op = next(o for o in graph.ops if o.kind is OpKind.MATMUL)
    alone = ProfilePricer(shared, "fp32", node_ranks=1).op(op, {}, 1, graph.batch)
    for n, k in ((2, 2.0), (4, 4.0)):
        assert ProfilePricer(shared, "fp32", node_ranks=n).op(op, {}, 1, graph.batch) == pytest.approx(
            tuple(k * t for t in alone))
    assert ProfilePricer(cluster, "fp32", node_ranks=8).op(op, {}, 1, graph.batch) == \
        ProfilePricer(cluster, "fp32", node_ranks=1).op(op, {}, 1, graph.batch)  # GPU: neutral

    strategy = Strategy(dims=ParallelDims(dp_replicate=2), train=TrainingConfig(global_batch=2, seq_len=32))
    gpu, cpu_like = simulate(graph, strategy, cluster), simulate(graph, strategy, shared)
    assert cpu_like.breakdown.compute == pytest.approx(2 * gpu.breakdown.compute)
    assert cpu_like.breakdown.optimizer == pytest.approx(2 * gpu.breakdown.optimizer)


def _ddp_step(share: float):
    first = ChunkCost(name="first", fwd_s=1.0, bwd_input_s=3.0, bwd_weight_s=0.0)
    last = ChunkCost(name="last", fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=1.0, grad_sync_s=2.5)
    stage = StageCost(chunks=(first, last), optimizer_s=0.5)
    return simulate_costs(StepCosts(stages=(stage,), schedule=build_schedule("1F1B", 1, 1), comm_compute_share=share))


def test_collectives_without_overlap_take_turns_with_compute():
    hidden = _ddp_step(0.0)  # the bucket hides behind the first layer's backward (test_sim_hand)
    assert hidden.step_time_s == pytest.approx(7.5) and hidden.breakdown.exposed_comm == 0
    serial = _ddp_step(1.0)
    assert serial.step_time_s == pytest.approx(7.5 + 2.5)
    assert serial.breakdown.exposed_comm == pytest.approx(2.5)
    assert serial.breakdown.compute == pytest.approx(7.0)
    half = _ddp_step(0.5)  # 1.25 s on the compute stream, the other 1.25 s hidden behind the first layer
    assert half.step_time_s == pytest.approx(7.5 + 1.25)
    assert [e.stream for e in half.events if e.category == "dp"] == ["compute", "dp-comm"]


def test_communication_overlap_of_the_device_sets_the_host_share():
    from costmodel.simulator.pricing import price_step
    import tracer
    from transformers import AutoConfig

    graph = tracer.trace(AutoConfig.for_model("gpt2", n_embd=64, n_layer=1, n_head=2, vocab_size=128, n_positions=32),
                         task="causal-lm", seq_len=32)
    strategy = Strategy(dims=ParallelDims(dp_replicate=2), train=TrainingConfig(global_batch=2, seq_len=32))
    cluster = load_cluster("dgx-h100")
    assert price_step(graph, strategy, cluster)[0].comm_compute_share == 0.0
    gloo_like = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, communication_overlap=0.25))
    assert price_step(graph, strategy, gloo_like)[0].comm_compute_share == pytest.approx(0.75)


def test_calibrated_step_fields_are_profile_json_with_the_measurement_source():
    device_json = device_to_dict(load_device("h100-sxm"))
    meas = NodeMeasurements(optimizer=(OptimizerSample("adamw", "fp32", 2**20, 0.004),),
                            concurrency=((1, 1.0), (2, 0.52)), overlap=0.1, call_overhead_s=2e-3)
    fields = node_fields(meas, device_json, SOURCE)
    device = device_from_json({**device_json, **fields}, "calibrated")
    nbytes = optimizer_step_bytes(2**20, precision="fp32", optimizer="adamw")
    assert device.optimizer_factors["adamw/fp32"].at(nbytes) == pytest.approx(
        0.004 / memory_pass_time(device, nbytes), rel=1e-3)
    assert device.concurrency_efficiency.at(2) == 0.52 and device.communication_overlap == 0.1
    assert device.collective_call_overhead_s == pytest.approx(2e-3)
    assert {device.sources[k] for k in ("optimizer_factors", "communication_overlap",
                                        "collective_call_overhead_us")} == {SOURCE}
    assert device.concurrency_efficiency.source == SOURCE


def test_an_overhead_bound_optimizer_step_saturates_at_the_loaders_bound_instead_of_breaking_the_profile():
    from costmodel.profiles_json import MAX_FACTOR

    device_json = device_to_dict(load_device("h100-sxm"))
    meas = NodeMeasurements(optimizer=(OptimizerSample("adamw", "fp32", 16, 0.5),), concurrency=((1, 1.0),),
                            overlap=0.1, call_overhead_s=2e-3)
    device = device_from_json({**device_json, **node_fields(meas, device_json, SOURCE)}, "calibrated")
    assert device.optimizer_factors["adamw/fp32"].at(1.0) == MAX_FACTOR


def test_every_collective_the_step_issues_pays_the_framework_overhead_and_free_links_drop_it():
    from costmodel.collectives import CommGroup, collective_time
    from executor.validation.refit import free_links

    cluster = load_cluster("dgx-h100")
    slow_host = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, collective_call_overhead_s=1e-3))
    group = CommGroup(size=8, ranks_per_node=8)
    base = collective_time("all_reduce", 2**20, group, cluster)
    assert ProfilePricer(slow_host, "bf16").collective("all_reduce", 2**20, group) == pytest.approx(base + 1e-3)
    assert ProfilePricer(slow_host, "bf16").collective("all_reduce", 2**20, CommGroup(size=1, ranks_per_node=1)) == 0
    assert ProfilePricer(cluster, "bf16").collective("all_reduce", 2**20, group) == pytest.approx(
        base + cluster.device.collective_call_overhead_s)
    assert free_links(slow_host).device.collective_call_overhead_s == 0.0
