"""Each per-layer TP/CP collective waits for the slowest host of its group (costmodel.host_sync): the order
statistic by hand, the wait in the simulator, and the fast estimator never above it; in a pipelined run, for its
ring's hosts (chain_wait): n delta per collective, only where the plan has a pipeline."""

import dataclasses
import math
import sys
from pathlib import Path

import pytest

from costmodel.host_sync import chain_wait, expected_max_normal, sync_wait
from costmodel.profiles import cluster_from_dict, cluster_to_dict, load_cluster
from costmodel.simulator import simulate
from costmodel.simulator.pricing import price_step
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
from planner.estimate import Estimator
from planner.space import MeshChoice
from planner.units import model_units

sys.path.insert(0, str(Path(__file__).parent))
from test_sim_graphs import tiny_decoder  # noqa: E402


def _strategy(*, tp: int, seq: int) -> Strategy:
    return Strategy(dims=ParallelDims(tp=tp), train=TrainingConfig(
        global_batch=4, seq_len=seq, micro_batch=1, num_microbatches=4, grad_accum=4, precision="bf16",
        recompute="full"))


def _jittery(cluster, jitter_s: float):
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, host_jitter_s=jitter_s))


def test_the_expected_maximum_of_normal_draws_matches_its_closed_forms():
    """e_2 = 1/sqrt(pi), e_3 = 3/(2 sqrt(pi)) (the closed forms for two and three draws); more hosts, longer wait."""
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(8) == pytest.approx(1.4236, abs=1e-4)
    values = [expected_max_normal(n) for n in range(1, 17)]
    assert values == sorted(values) and len(set(values)) == len(values)


def test_each_collective_adds_sigma_times_the_expected_maximum():
    assert sync_wait(6, 4, 10e-6) == pytest.approx(6 * 10e-6 * expected_max_normal(4))
    assert sync_wait(6, 1, 10e-6) == 0.0 and sync_wait(6, 8, 0.0) == 0.0 and sync_wait(0, 8, 1.0) == 0.0
    with pytest.raises(ValueError):
        sync_wait(1, 2, -1e-6)


def test_a_tp_chunk_pays_its_collectives_wait_and_tp1_pays_none():
    """A block's forward waits sigma e_tp per all-reduce (a whole number of them, at least one), its backward under
    full recompute twice that (its own and the recompute's); at tp1 nothing waits."""
    graph = tiny_decoder(layers=2)
    base = load_cluster("dgx-h100")
    sigma = 50e-6
    for tp in (1, 4):
        strategy = _strategy(tp=tp, seq=graph.seq_len)
        plain = price_step(graph, strategy, base)[0].stages[0].chunks
        waited = price_step(graph, strategy, _jittery(base, sigma))[0].stages[0].chunks
        blocks = 0
        for p, w in zip(plain, waited):
            extra_fwd, extra_bwd = w.fwd_comm_s - p.fwd_comm_s, w.bwd_comm_s - p.bwd_comm_s
            if tp == 1:
                assert extra_fwd == pytest.approx(0, abs=1e-15) and extra_bwd == pytest.approx(0, abs=1e-15)
                continue
            if p.name.startswith("<"):  # the embedding and the head: their own collectives, no recompute
                continue
            blocks += 1
            waits = extra_fwd / (sigma * expected_max_normal(tp))
            assert waits >= 1 and waits == pytest.approx(round(waits))
            assert extra_bwd == pytest.approx(2 * extra_fwd)
        assert blocks > 0 or tp == 1
    one = [simulate(graph, _strategy(tp=1, seq=graph.seq_len), c).step_time_s for c in (base, _jittery(base, sigma))]
    four = [simulate(graph, _strategy(tp=4, seq=graph.seq_len), c).step_time_s for c in (base, _jittery(base, sigma))]
    assert one[1] == pytest.approx(one[0])
    assert four[1] > four[0]


def test_the_estimator_stays_at_or_below_the_simulator_with_host_jitter():
    graph = tiny_decoder(layers=2)
    cluster = _jittery(load_cluster("dgx-h100"), 200e-6)
    for tp in (2, 4):
        strategy = _strategy(tp=tp, seq=graph.seq_len)
        simulated = simulate(graph, strategy, cluster).step_time_s
        estimated = Estimator(graph, cluster, model_units(graph)).estimate(MeshChoice(strategy.dims, 0),
                                                                           strategy.train).step_time_s
        assert estimated <= simulated * (1 + 1e-9)


@pytest.mark.parametrize("field, key", [("host_jitter_s", "host_jitter_us"),
                                        ("pipelined_sync_s", "pipelined_sync_us")])
def test_the_stack_waits_round_trip_through_the_profile_json_and_ship_as_zero(field, key):
    cluster = load_cluster("dgx-h100")
    assert getattr(cluster.device, field) == 0.0
    data = cluster_to_dict(dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, **{field: 12e-6})))
    assert data["device"][key]["value"] == pytest.approx(12)
    assert getattr(cluster_from_dict(data).device, field) == pytest.approx(12e-6)


def _pipelined(*, tp: int, pp: int, seq: int) -> Strategy:
    return Strategy(dims=ParallelDims(tp=tp, pp=pp), train=TrainingConfig(
        global_batch=4, seq_len=seq, micro_batch=1, num_microbatches=4, grad_accum=4, precision="bf16",
        recompute="none", schedule="1F1B"))


def _synced(cluster, delta_s: float):
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, pipelined_sync_s=delta_s))


def test_a_pipelined_collective_waits_delta_per_rank_of_its_group():
    assert chain_wait(3, 8, 250e-6) == pytest.approx(3 * 8 * 250e-6)
    assert chain_wait(3, 1, 250e-6) == 0.0 and chain_wait(0, 8, 1.0) == 0.0 and chain_wait(3, 8, 0.0) == 0.0
    with pytest.raises(ValueError):
        chain_wait(1, 2, -1e-6)


def test_only_a_pipelined_plan_with_tp_pays_the_chain_wait():
    """The Playbook grid's law (costmodel.host_sync): pipelined TP runs waited per TP collective in proportion to
    the group, TP runs without a pipeline did not. In the simulator: a pp2 x tp4 block chunk's forward grows by
    a whole number of 4 delta waits (its backward by as many again, no recompute), pp1 x tp4 and pp2 x tp1 do not
    move, and the step of the pipelined TP plan grows."""
    graph = tiny_decoder(layers=2)
    base = load_cluster("dgx-h100")
    delta = 100e-6
    for tp, pp, pays in ((4, 2, True), (4, 1, False), (1, 2, False)):
        strategy = _pipelined(tp=tp, pp=pp, seq=graph.seq_len)
        plain = [c for s in price_step(graph, strategy, base)[0].stages for c in s.chunks]
        waited = [c for s in price_step(graph, strategy, _synced(base, delta))[0].stages for c in s.chunks]
        blocks = 0
        for p, w in zip(plain, waited):
            extra_fwd, extra_bwd = w.fwd_comm_s - p.fwd_comm_s, w.bwd_comm_s - p.bwd_comm_s
            if not pays:
                assert extra_fwd == pytest.approx(0, abs=1e-15) and extra_bwd == pytest.approx(0, abs=1e-15)
                continue
            if p.name.startswith("<"):
                continue
            blocks += 1
            waits = extra_fwd / (tp * delta)
            assert waits >= 1 and waits == pytest.approx(round(waits))
            assert extra_bwd == pytest.approx(extra_fwd)
        assert blocks > 0 or not pays
        steps = [simulate(graph, strategy, c).step_time_s for c in (base, _synced(base, delta))]
        assert (steps[1] > steps[0]) if pays else steps[1] == pytest.approx(steps[0])


def test_the_default_h100_carries_its_executors_host_floor_and_only_eager_chunks_feel_it():
    """dgx-h100 ships the host-bound floor fitted on soap's own H100 runs (benchmarks/gpu_repredict.py); a tiny
    model's eager step is host-bound under it, and a compiled step (Inductor's generated code, no per-op Python)
    is priced as without it."""
    graph = tiny_decoder(layers=2)
    shipped = load_cluster("dgx-h100")
    assert 20e-6 < shipped.device.host_dispatch_s < 80e-6
    bare = dataclasses.replace(shipped, device=dataclasses.replace(shipped.device, host_dispatch_s=0.0))
    for compiled in (False, True):
        strategy = dataclasses.replace(_strategy(tp=1, seq=graph.seq_len), train=dataclasses.replace(
            _strategy(tp=1, seq=graph.seq_len).train, compile=compiled))
        floored, free = (simulate(graph, strategy, c).step_time_s for c in (shipped, bare))
        assert (floored > 1.5 * free) if not compiled else floored == pytest.approx(free)
