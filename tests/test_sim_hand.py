"""Hand-computable steps: textbook pipeline bubbles, DP overlap, TP collectives on the critical path."""

import pytest

from costmodel.schedule import build_schedule
from costmodel.simulator import simulate_costs
from costmodel.simulator.costs import ChunkCost, StageCost, StepCosts


def _uniform(name, pp, m, v=1, tf=1.0, tb=2.0, **chunk_extra):
    """Every stage: one chunk with forward tf and backward tb per micro-batch (split over v chunks)."""
    chunk = ChunkCost(name="layers", fwd_s=tf / v, bwd_input_s=tb / v / 2, bwd_weight_s=tb / v / 2, **chunk_extra)
    costs = StepCosts(stages=(StageCost(chunks=(chunk,)),) * (pp * v), schedule=build_schedule(name, pp, m, v))
    return simulate_costs(costs)


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize("pp,m", [(4, 4), (4, 8), (4, 16), (2, 3)])
def test_pipeline_bubble_is_textbook_fraction(name, pp, m):
    tf, tb = 1.0, 2.0
    r = _uniform(name, pp, m, tf=tf, tb=tb)
    assert r.step_time_s == pytest.approx((m + pp - 1) * (tf + tb))
    assert r.breakdown.bubble / r.step_time_s == pytest.approx((pp - 1) / (m + pp - 1))
    assert r.breakdown.compute == pytest.approx(m * (tf + tb))
    assert r.breakdown.exposed_comm == 0


@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_shrinks_bubble_to_p_minus_1_over_v_m(v):
    pp, m = 4, 8
    r = _uniform("Interleaved1F1B", pp, m, v=v)
    plain = _uniform("1F1B", pp, m)
    assert r.breakdown.compute == pytest.approx(plain.breakdown.compute)
    assert r.breakdown.bubble / r.breakdown.compute == pytest.approx((pp - 1) / (v * m))
    assert plain.breakdown.bubble / plain.breakdown.compute == pytest.approx((pp - 1) / m)


def test_zero_bubble_schedules_beat_1f1b():
    one_f_one_b = _uniform("1F1B", 4, 8).step_time_s
    assert _uniform("ZBVZeroBubble", 4, 8, v=2).step_time_s < one_f_one_b
    assert _uniform("InterleavedZeroBubble", 4, 8, v=2).step_time_s < one_f_one_b


def test_1f1b_holds_fewer_activations_than_gpipe():
    gpipe = _uniform("GPipe", 4, 8, activation_bytes=100)
    one_f_one_b = _uniform("1F1B", 4, 8, activation_bytes=100)
    assert [m.at_peak.activations for m in gpipe.memory] == [800] * 4
    assert [m.at_peak.activations for m in one_f_one_b.memory] == [400, 300, 200, 100]


def _dp_case(allreduce_s, first_layer_bwd_s=3.0):
    """One rank, one micro-batch: the last layer's gradient bucket overlaps the first layer's backward."""
    first = ChunkCost(name="first", fwd_s=1.0, bwd_input_s=first_layer_bwd_s, bwd_weight_s=0.0)
    last = ChunkCost(name="last", fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=1.0, grad_sync_s=allreduce_s)
    stage = StageCost(chunks=(first, last), optimizer_s=0.5)
    return simulate_costs(StepCosts(stages=(stage,), schedule=build_schedule("1F1B", 1, 1)))


def test_dp_allreduce_shorter_than_remaining_backward_is_hidden():
    r = _dp_case(allreduce_s=2.5)
    compute = 2.0 + 3.0 + 2.0
    assert r.step_time_s == pytest.approx(compute + 0.5)
    assert r.breakdown.exposed_comm == 0


def test_dp_allreduce_longer_than_remaining_backward_is_exposed_by_the_excess():
    r = _dp_case(allreduce_s=4.25)
    compute = 2.0 + 3.0 + 2.0
    assert r.breakdown.exposed_comm == pytest.approx(4.25 - 3.0)
    assert r.step_time_s == pytest.approx(compute + 0.5 + 1.25)
    assert r.breakdown.compute + r.breakdown.optimizer + r.breakdown.exposed_comm == pytest.approx(r.step_time_s)


def test_gradients_sync_once_per_step_not_per_microbatch():
    r = _uniform("1F1B", 2, 4, grad_sync_s=0.1)
    syncs = [e for e in r.events if e.category == "dp"]
    assert len(syncs) == 2  # one bucket per stage


def test_tp_collectives_sit_on_the_critical_path():
    r = _uniform("1F1B", 1, 2, fwd_comm_s=0.25, bwd_comm_s=0.5)
    assert r.step_time_s == pytest.approx(2 * (1 + 0.25 + 2 + 0.5))
    assert r.breakdown.exposed_comm == pytest.approx(2 * 0.75)


def test_pipeline_transfers_are_linked_by_flows_and_delay_the_receiver():
    schedule = build_schedule("GPipe", 2, 1)
    stage = StageCost(chunks=(ChunkCost(name="c", fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=1.0),),
                      send_activation_s=0.5, send_gradient_s=0.25)
    r = simulate_costs(StepCosts(stages=(stage, stage), schedule=schedule))
    assert r.step_time_s == pytest.approx(1 + 0.5 + 1 + 2 + 0.25 + 2)
    sends = [e for e in r.events if e.category == "pp"]
    assert {e.flow for e in sends} == {1, 2} and {e.peer for e in sends} == {0, 1}


def test_shared_link_delays_gradient_buckets_behind_pipeline_sends():
    # dp-comm and pp-p2p on one NIC: the last stage's final gradient bucket waits for the long send of
    # the previous micro-batch's gradient still on the wire; on separate links it would not.
    def step(links):
        chunk = ChunkCost(name="c", fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=1.0, grad_sync_s=1.0)
        stages = (StageCost(chunks=(chunk,)), StageCost(chunks=(chunk,), send_gradient_s=6.0))
        costs = StepCosts(stages=stages, schedule=build_schedule("1F1B", 2, 2), links=links)
        return simulate_costs(costs)

    shared = step({"dp-comm": "inter_node", "pp-p2p": "inter_node"})
    separate = step({"dp-comm": "inter_node", "pp-p2p": "intra_node"})
    sync = lambda r: next(e for e in r.events if e.category == "dp" and e.rank == 1)  # noqa: E731
    send = next(e for e in shared.events if e.category == "pp" and e.rank == 1)
    assert sync(shared).start == pytest.approx(send.end)
    assert sync(separate).start < send.end


def test_pipeline_sends_do_not_queue_behind_gradient_buckets():
    chunk = ChunkCost(name="c", fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=1.0, grad_sync_s=50.0)
    stages = (StageCost(chunks=(chunk,), send_activation_s=0.5, send_gradient_s=0.5),) * 2
    shared = simulate_costs(StepCosts(stages=stages, schedule=build_schedule("GPipe", 2, 2),
                                      links={"dp-comm": "inter_node", "pp-p2p": "inter_node"}))
    last_send = max(e.end for e in shared.events if e.category == "pp")
    assert last_send < 50.0
