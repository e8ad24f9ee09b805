"""The planner's fast paths give the numbers of the slow ones they replaced (issue 17).

- activation peaks from the schedule's compute order alone (`memory_schedule.activation_peaks`, what the
  estimator calls without building the schedule) equal the walk over the full schedule, communication
  included, that `rank_activation_peaks` was;
- shared (interned) actions are plain equal `Action`s, and the compute order is the schedule's compute;
- `run_tasks`'s work-list order gives the start times of the heap ordered by earliest start it replaced;
- the estimator's memoized memory (activations and held parameters per partition) equals a fresh
  estimator's for the same candidates in any order.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random

import pytest

from costmodel.memory_schedule import StageActivations, activation_peaks, rank_activation_peaks
from costmodel.schedule import B, F, I, W, Action, action, build_schedule, compute_order
from costmodel.simulator_costs import ChunkCost, StageCost, StepCosts
from costmodel.simulator_engine import CRITICAL_STREAMS, run_tasks
from costmodel.simulator_step import build_step

SCHEDULES = (
    [("1F1B", 1, m, 1) for m in (1, 3, 8)]
    + [(name, pp, m, 1) for name in ("GPipe", "1F1B") for pp in (2, 3, 4) for m in (1, 2, 5, 8)]
    + [(name, pp, m, v) for name in ("Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS")
       for pp in (2, 4) for m in (pp, 2 * pp, 3 * pp) for v in (2, 3)]
    + [("ZBVZeroBubble", pp, m, 2) for pp in (2, 3) for m in (1, 4, 9)]
)


def _walked_peaks(name, pp, m, v, stages):
    """The module docstring's rule, walked action by action over the full schedule."""
    peaks = []
    for actions in build_schedule(name, pp, m, v).actions:
        live = peak = 0.0
        for a in actions:
            s = stages[a.stage]
            if a.kind is F:
                live += s.kept
                peak = max(peak, live)
            elif a.kind is B:
                peak = max(peak, live - s.kept + max(s.kept, s.backward_peak))
                live -= s.kept
            elif a.kind is I:
                peak = max(peak, live + s.window)
            elif a.kind is W:
                live -= s.kept
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("name,pp,m,v", SCHEDULES)
def test_peaks_from_compute_order_equal_the_walk_over_the_full_schedule(name, pp, m, v):
    rng = random.Random(hash((name, pp, m, v)) & 0xFFFF)
    stages = [StageActivations(kept=k, backward_peak=k + rng.uniform(0, 5e8), window=rng.uniform(0, 3e8))
              for k in (rng.uniform(1e8, 2e9) for _ in range(pp * v))]
    fast = activation_peaks(name, pp, m, v, stages)
    assert fast == rank_activation_peaks(build_schedule(name, pp, m, v), stages)
    assert fast == pytest.approx(_walked_peaks(name, pp, m, v, stages), rel=1e-12)


@pytest.mark.parametrize("name,pp,m,v", SCHEDULES)
def test_compute_order_is_the_schedules_compute(name, pp, m, v):
    schedule = build_schedule(name, pp, m, v)
    assert compute_order(name, pp, m, v) == tuple(tuple(a for a in acts if a.is_compute) for acts in schedule.actions)


def test_shared_actions_are_plain_equal_actions():
    assert action(3, F, 7) is action(3, F, 7)
    assert action(3, F, 7) == Action(3, F, 7) and hash(action(3, F, 7)) == hash(Action(3, F, 7))
    assert str(action(2, B, 0)) == "2B0"


def _heap_run(graph):
    """The engine before issue 17: a heap of ready tasks ordered by earliest start."""
    tasks = graph.tasks
    n = len(tasks)
    succ = [[] for _ in range(n)]
    waiting = [0] * n
    last_on_stream, last_critical = {}, {}
    for tid, t in enumerate(tasks):
        preds = [last_on_stream.get((t.rank, t.stream))]
        last_on_stream[(t.rank, t.stream)] = tid
        if t.link is not None:
            preds.append(last_critical.get((t.rank, t.link)))
            if t.stream in CRITICAL_STREAMS:
                last_critical[(t.rank, t.link)] = tid
        for prev in preds:
            if prev is not None:
                succ[prev].append(tid)
                waiting[tid] += 1
        deps = [key if isinstance(key, int) else graph.id_of(key) for key in t.deps]
        for dep in deps:
            succ[dep].append(tid)
            waiting[tid] += 1
    ready_at = [0.0] * n
    heap = [(0.0, tid) for tid in range(n) if waiting[tid] == 0]
    heapq.heapify(heap)
    times = [None] * n
    while heap:
        start, tid = heapq.heappop(heap)
        end = start + tasks[tid].duration
        times[tid] = (start, end)
        for s in succ[tid]:
            ready_at[s] = max(ready_at[s], end)
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(heap, (ready_at[s], s))
    return times


def _costs(name, pp, m, v, ga, seed):
    rng = random.Random(seed)

    def chunk(i):
        return ChunkCost(name=f"c{i}", fwd_s=rng.uniform(1, 3), bwd_input_s=rng.uniform(1, 3),
                         bwd_weight_s=rng.uniform(0.5, 2), fwd_comm_s=rng.choice([0.0, rng.uniform(0, 1)]),
                         bwd_comm_s=rng.choice([0.0, rng.uniform(0, 1)]), grad_sync_s=rng.uniform(0, 2),
                         param_gather_s=rng.choice([0.0, rng.uniform(0, 1)]), activation_bytes=rng.randint(1, 9),
                         recompute_s=rng.choice([0.0, 0.5]), recompute_bytes=rng.choice([0, 3]))

    stages = tuple(StageCost(chunks=tuple(chunk(i) for i in range(rng.randint(1, 3))), send_activation_s=rng.uniform(0, 1),
                             send_gradient_s=rng.uniform(0, 1), optimizer_s=rng.uniform(0, 2)) for _ in range(pp * v))
    return StepCosts(schedule=build_schedule(name, pp, m, v), stages=stages, grad_accum=ga,
                     links={"tp-comm": "intra_node", "pp-p2p": "inter_node", "dp-comm": "inter_node"},
                     comm_compute_share=rng.choice([0.0, 0.0, 0.5]), grad_sync_every_microbatch=rng.random() < 0.3,
                     gather_in_backward=rng.random() < 0.5)


@pytest.mark.parametrize("seed,schedule", list(itertools.product(range(3), [
    ("1F1B", 1, 4, 1), ("1F1B", 4, 8, 1), ("GPipe", 2, 4, 1), ("Interleaved1F1B", 2, 4, 2),
    ("InterleavedZeroBubble", 2, 4, 2), ("ZBVZeroBubble", 2, 4, 2), ("LoopedBFS", 2, 2, 2)])))
def test_work_list_engine_gives_the_heap_engines_times(seed, schedule):
    costs = _costs(*schedule, ga=2, seed=seed)
    reference = _heap_run(build_step(costs).graph)
    tasks = run_tasks(build_step(costs).graph)
    assert [(t.start, t.end) for t in tasks] == reference


def test_memoized_estimator_memory_equals_a_fresh_estimators(tmp_path):
    from costmodel.profiles import load_cluster
    from planner.api import make_request
    from planner.estimate import Estimator
    from planner.space import mesh_choices, training_choices
    from planner.units import model_units

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 256, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    req = make_request(str(tmp_path), gpus=8, global_batch=32, seq_len=64, mem_limit_gib=1e6, cluster="dgx-h100")
    graph = req.model.trace(task=None, seq_len=64)
    space = req.space
    cluster = load_cluster("dgx-h100")
    pairs = [(mesh, train) for mesh in mesh_choices(space) for train in training_choices(space, mesh)]
    pairs = random.Random(0).sample(pairs, min(120, len(pairs)))
    shared = Estimator(graph, cluster, model_units(graph))
    for mesh, train in pairs:
        fresh = Estimator(graph, cluster, model_units(graph))
        assert shared.estimate(mesh, train).memory == fresh.estimate(mesh, train).memory
