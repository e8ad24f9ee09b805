"""The pipeline schedule IR: generation, torch agreement, and deadlock dry-runs."""

import subprocess
import sys
from pathlib import Path

import pytest

from costmodel.schedule import (
    B, F, I, W, Action, ActionKind, PipelineSchedule, ScheduleDeadlock, build_schedule, dry_run,
)
from tracer.errors import SoapError

CASES = [
    ("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 3), ("LoopedBFS", 2),
    ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2),
]


@pytest.mark.parametrize("name,v", CASES)
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 6), (8, 16), (4, 3)])
def test_every_schedule_runs_to_completion_without_deadlock(name, v, pp, m):
    if name in ("Interleaved1F1B", "InterleavedZeroBubble") and m % max(1, m // pp):
        with pytest.raises(SoapError, match="divisible"):
            build_schedule(name, pp, m, v)
        return
    schedule = build_schedule(name, pp, m, v)
    result = dry_run(schedule)
    assert result.actions_run == sum(len(a) for a in schedule.actions)


def _torch_compute_order(name: str, pp: int, m: int, v: int) -> list[list[str]]:
    """torch's own generator for `name`, run on a plain namespace (no process group)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    cls = schedules.get_schedule_class(name)
    rounds = max(1, m // pp)
    ns = SimpleNamespace(
        pp_group_size=pp, n_local_stages=v, _n_microbatches=m, num_stages=pp * v, _num_stages=pp * v,
        _stages=[None] * v, number_of_rounds=rounds, microbatches_per_round=m // rounds,
    )
    if name == "GPipe":
        ns.pipeline_order = cls._get_pipeline_order(ns)
    else:
        ns.pipeline_order = {rank: cls._calculate_single_rank_operations(ns, rank) for rank in range(pp)}
    if name == "InterleavedZeroBubble":
        ns.pipeline_order = cls._add_bubbles_to_actions(ns, pp * v)
    return [
        [str(a) for a in ns.pipeline_order[rank] if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
        for rank in range(pp)
    ]


GRID = [(pp, m) for pp in range(1, 7) for m in range(1, 15)] + [(8, 8), (8, 16), (8, 24), (16, 32), (16, 40)]


@pytest.mark.parametrize("name,vs", [
    ("GPipe", (1,)), ("LoopedBFS", (1, 2, 3, 4)), ("Interleaved1F1B", (1, 2, 3, 4)),
    ("InterleavedZeroBubble", (1, 2, 3, 4)), ("ZBVZeroBubble", (2,)),
])
def test_native_compute_orders_equal_torch_generators(name, vs):
    """The ported generators (costmodel.schedule_orders) give torch's orders exactly, bubbles aside."""
    for pp, m in GRID:
        for v in vs:
            if name in ("Interleaved1F1B", "InterleavedZeroBubble") and m % max(1, m // pp):
                with pytest.raises(SoapError, match="divisible"):
                    build_schedule(name, pp, m, v)
                continue
            ours = [[str(a) for a in acts if a.is_compute] for acts in build_schedule(name, pp, m, v).actions]
            assert ours == _torch_compute_order(name, pp, m, v), (name, pp, m, v)


def test_planning_schedules_do_not_import_torch_pipelining():
    code = (
        "import sys\n"
        "from costmodel.schedule import build_schedule\n"
        "for name, v in [('GPipe', 1), ('1F1B', 1), ('Interleaved1F1B', 2), ('LoopedBFS', 2),\n"
        "                ('InterleavedZeroBubble', 2), ('ZBVZeroBubble', 2)]:\n"
        "    build_schedule(name, 4, 8, v)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_1f1b_follows_torch_runtime_order_warmup_then_alternation():
    ranks = build_schedule("1F1B", 4, 6).actions
    compute = [[str(a) for a in acts if a.is_compute] for acts in ranks]
    assert compute[0][:6] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4"]
    assert compute[3][:4] == ["3F0", "3B0", "3F1", "3B1"]


def test_1f1b_keeps_at_most_pp_minus_rank_microbatches_in_flight():
    schedule = build_schedule("1F1B", 4, 8)
    for rank, acts in enumerate(schedule.actions):
        in_flight = peak = 0
        for a in acts:
            in_flight += (a.kind is F) - (a.kind is B)
            peak = max(peak, in_flight)
        assert peak == 4 - rank


def test_torch_round_trip_of_the_ir():
    schedule = build_schedule("Interleaved1F1B", 2, 4, 2)
    torch_actions = schedule.to_torch()
    assert [str(a) for a in torch_actions[1]] == schedule.to_strings()[1]
    assert Action.from_str("3SEND_B12") == Action(3, ActionKind.SEND_B, 12)


def test_zbv_places_stages_in_a_v_and_splits_backward():
    schedule = build_schedule("ZBVZeroBubble", 4, 8, 2)
    assert schedule.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.splits_backward
    kinds = {a.kind for acts in schedule.actions for a in acts}
    assert {I, W} <= kinds and B not in kinds


def test_swapped_receive_order_is_reported_as_deadlock():
    good = build_schedule("GPipe", 2, 2)
    rank1 = list(good.actions[1])
    # rank 1 waits for micro-batch 1's activation before micro-batch 0's: still fine with buffered sends,
    # but asking for a gradient that is never sent hangs.
    rank1.insert(0, Action(1, ActionKind.RECV_B, 0))
    bad = PipelineSchedule("GPipe", 2, 1, 2, good.stage_to_rank, (good.actions[0], tuple(rank1)))
    with pytest.raises(ScheduleDeadlock, match="rank 1 at 1RECV_B0"):
        dry_run(bad)


def test_backward_before_forward_deadlocks():
    good = build_schedule("1F1B", 2, 2)
    rank0 = [a for a in good.actions[0]]
    first_b = next(i for i, a in enumerate(rank0) if a.kind is B)
    rank0.insert(0, rank0.pop(first_b))
    bad = PipelineSchedule("1F1B", 2, 1, 2, good.stage_to_rank, (tuple(rank0), good.actions[1]))
    with pytest.raises(ScheduleDeadlock):
        dry_run(bad)


def test_missing_backward_is_reported():
    good = build_schedule("GPipe", 2, 2)
    rank0 = tuple(a for a in good.actions[0] if str(a) != "0B1")
    bad = PipelineSchedule("GPipe", 2, 1, 2, good.stage_to_rank, (rank0, good.actions[1]))
    with pytest.raises(ScheduleDeadlock, match="stage 0 micro-batch 1"):
        dry_run(bad)


def test_bad_schedule_requests_are_soap_errors():
    with pytest.raises(SoapError, match="unknown schedule"):
        build_schedule("Bogus", 2, 2)
    with pytest.raises(SoapError, match="exactly 2 stages"):
        build_schedule("ZBVZeroBubble", 2, 4, 3)
    with pytest.raises(SoapError, match="one stage per rank"):
        build_schedule("1F1B", 2, 4, 2)


@pytest.mark.parametrize("name,v", CASES)
def test_torch_own_dry_run_accepts_our_actions(name, v):
    from torch.distributed.pipelining.schedules import _simulate_comms_compute

    schedule = build_schedule(name, 4, 8, v)
    simulated = _simulate_comms_compute(schedule.to_torch(), lambda s: schedule.stage_to_rank[s], schedule.num_stages)
    ran = sum(1 for acts in simulated.values() for a in acts if a is not None)
    assert ran == sum(len(a) for a in schedule.actions)
