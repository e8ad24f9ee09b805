"""The simulator that times tasks as it issues them gives the results of the task-graph simulator it
replaced (issue 17), bit for bit: step time, every rank's breakdown, the timeline events (names, order,
flows) and the memory timelines.

The reference below is that simulator, kept here only as a test oracle: `_Reference` expanded the
schedule into a task graph (deps named by keys), `_heap_times` timed it with a heap ordered by earliest
start (the engine before the work list), and `_reference_breakdown` / `_reference_memory` read the
breakdown and the memory timeline off the timed tasks.
"""

from __future__ import annotations

import heapq
import itertools
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from costmodel.profiles import load_cluster
from costmodel.schedule import B, F, I, SEND_B, SEND_F, W, build_schedule
from costmodel.simulator import simulate, simulate_costs
from costmodel.simulator.costs import ChunkCost, StageCost, StepCosts
from costmodel.simulator.engine import COMM_CATEGORIES, CRITICAL_STREAMS, Deadlock
from costmodel.simulator.pricing import price_step
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig

sys.path.insert(0, str(Path(__file__).parent))
from test_sim_graphs import tiny_decoder  # noqa: E402


@dataclass
class _Task:
    rank: int
    stream: str
    name: str
    category: str
    duration: float
    deps: list = field(default_factory=list)
    link: str | None = None
    flow: int | None = None
    peer: int | None = None
    start: float = 0.0
    end: float = 0.0


class _Reference:
    """The task-graph builder before issue 17 (costmodel/simulator/step.py's `_Builder`)."""

    def __init__(self, costs: StepCosts) -> None:
        self.costs, self.sched = costs, costs.schedule
        self.tasks: list[_Task] = []
        self.keys: dict = {}
        self.memory: list[tuple[int, bool, int]] = []
        self.flows = 0
        self.last_comm: dict = {}
        self.last_tp_comm: dict = {}
        for rank, actions in enumerate(self.sched.actions):
            final = {}
            for index, a in enumerate(actions):
                if a.kind in (B, W):
                    final[a.stage] = index
            for p in range(costs.grad_accum):
                for index, a in enumerate(actions):
                    last = p == costs.grad_accum - 1 and final.get(a.stage) == index
                    self.action(rank, a, p * self.sched.num_microbatches + a.microbatch, last)
            self.optimizer(rank)

    def add(self, rank, stream, name, category, duration, deps, key=None):
        tasks = self.tasks
        if stream == "compute":
            blocking = self.last_tp_comm.get(rank)
            deps = list(deps) if blocking is None else [*deps, blocking]
            tasks.append(_Task(rank, stream, name, category, duration, deps))
        else:
            link = self.costs.links.get(stream)
            deps = list(deps)
            share = self.costs.comm_compute_share * duration
            if share > 0:
                tasks.append(_Task(rank, "compute", f"{name} (host share)", category, share, deps))
                deps, duration = [len(tasks) - 1], duration - share
            tasks.append(_Task(rank, stream, name, category, duration, deps, link))
            self.last_comm[(rank, stream)] = len(tasks) - 1
            if stream == "tp-comm":
                self.last_tp_comm[rank] = len(tasks) - 1
        tid = len(tasks) - 1
        if key is not None:
            self.keys[key] = tid
        return tid

    def input_dep(self, stage, kind, mb):
        s2r = self.sched.stage_to_rank
        if kind is F:
            if stage == 0:
                return []
            return [("xfer", F, stage - 1, mb) if s2r[stage - 1] != s2r[stage] else (F, stage - 1, mb)]
        if stage == self.sched.num_stages - 1:
            return []
        return [("xfer", B, stage + 1, mb) if s2r[stage + 1] != s2r[stage] else (B, stage + 1, mb)]

    def action(self, rank, a, mb, last_of_step):
        sync = last_of_step or self.costs.grad_sync_every_microbatch
        if a.kind is F:
            self.forward(rank, a.stage, mb)
        elif a.kind in (B, I):
            self.backward(rank, a.stage, mb, full=a.kind is B, sync=sync)
        elif a.kind is W:
            self.weight(rank, a.stage, mb, sync=sync)
        elif a.kind in (SEND_F, SEND_B):
            self.send(rank, a.stage, a.kind, mb)

    def gather(self, rank, chunk, label, compute_ids):
        if chunk.param_gather_s <= 0:
            return []
        bound = [compute_ids[-2]] if len(compute_ids) >= 2 else []
        return [self.add(rank, "dp-comm", f"all-gather {label}", "fsdp", chunk.param_gather_s, bound)]

    def forward(self, rank, stage, mb):
        deps = self.input_dep(stage, F, mb)
        compute_ids, last = [], None
        for chunk in self.costs.stages[stage].chunks:
            label = f"{stage}F{mb} {chunk.name}"
            ag = self.gather(rank, chunk, label, compute_ids)
            comp = self.add(rank, "compute", label, "compute", chunk.fwd_s, deps + ag)
            compute_ids.append(comp)
            self.memory.append((comp, True, chunk.activation_bytes))
            last = comp
            if chunk.fwd_comm_s > 0:
                last = self.add(rank, "tp-comm", f"{label} collectives", "tp", chunk.fwd_comm_s, [comp])
            deps = [last]
        self.keys[(F, stage, mb)] = last

    def backward(self, rank, stage, mb, *, full, sync):
        deps = self.input_dep(stage, B, mb) + [(F, stage, mb)]
        compute_ids, last = [], None
        chunks = tuple(reversed(self.costs.stages[stage].chunks))
        labels = [f"{stage}{'B' if full else 'I'}{mb} {c.name}" for c in chunks]
        gathers = {}

        def gather(i):
            if i < len(chunks) and i not in gathers:
                gathers[i] = self.gather(rank, chunks[i], labels[i], compute_ids) if self.costs.gather_in_backward else []
            return gathers.get(i, [])

        for i, chunk in enumerate(chunks):
            ag = gather(i)
            duration = chunk.recompute_s + chunk.bwd_input_s + (chunk.bwd_weight_s if full else 0.0)
            comp = self.add(rank, "compute", labels[i], "compute", duration, deps + ag)
            compute_ids.append(comp)
            gather(i + 1)
            if chunk.recompute_bytes:
                self.memory.append((comp, False, chunk.recompute_bytes))
                self.memory.append((comp, True, -chunk.recompute_bytes))
            if full:
                self.memory.append((comp, True, -chunk.activation_bytes))
            last = comp
            if chunk.bwd_comm_s > 0:
                last = self.add(rank, "tp-comm", f"{labels[i]} collectives", "tp", chunk.bwd_comm_s, [comp])
            if full and sync and chunk.grad_sync_s > 0:
                self.add(rank, "dp-comm", f"grad sync {stage}:{chunk.name}", "dp", chunk.grad_sync_s, [comp])
            deps = [last]
        self.keys[(B, stage, mb)] = last

    def weight(self, rank, stage, mb, *, sync):
        for chunk in reversed(self.costs.stages[stage].chunks):
            comp = self.add(rank, "compute", f"{stage}W{mb} {chunk.name}", "compute", chunk.bwd_weight_s, [])
            self.memory.append((comp, True, -chunk.activation_bytes))
            if sync and chunk.grad_sync_s > 0:
                self.add(rank, "dp-comm", f"grad sync {stage}:{chunk.name}", "dp", chunk.grad_sync_s, [comp])

    def send(self, rank, stage, kind, mb):
        fwd = kind is SEND_F
        cost = self.costs.stages[stage]
        peer = stage + 1 if fwd else stage - 1
        self.flows += 1
        tid = self.add(rank, "pp-p2p", f"{'send activation' if fwd else 'send gradient'} {stage}->{peer} mb{mb}", "pp",
                       cost.send_activation_s if fwd else cost.send_gradient_s, [(F if fwd else B, stage, mb)],
                       key=("xfer", F if fwd else B, stage, mb))
        self.tasks[tid].flow, self.tasks[tid].peer = self.flows, self.sched.stage_to_rank[peer]

    def optimizer(self, rank):
        stages = [self.costs.stages[s] for s in self.sched.stages_of(rank)]
        deps = [self.last_comm[(rank, s)] for s in ("tp-comm", "dp-comm") if (rank, s) in self.last_comm]
        opt_s = sum(s.optimizer_s for s in stages)
        if opt_s > 0:
            opt = self.add(rank, "compute", "optimizer step", "optimizer", opt_s, deps)
            gather_s = sum(s.post_step_gather_s for s in stages)
            if gather_s > 0:
                self.add(rank, "dp-comm", "all-gather updated shards", "dp", gather_s, [opt])


def _heap_times(ref: _Reference) -> list[_Task]:
    """The engine before issue 17: a heap of ready tasks ordered by earliest start."""
    tasks = ref.tasks
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
        t.deps = [key if isinstance(key, int) else ref.keys[key] for key in t.deps]
        for dep in t.deps:
            succ[dep].append(tid)
            waiting[tid] += 1
    ready_at = [0.0] * n
    heap = [(0.0, tid) for tid in range(n) if waiting[tid] == 0]
    heapq.heapify(heap)
    finished = 0
    while heap:
        start, tid = heapq.heappop(heap)
        t = tasks[tid]
        t.start, t.end = start, start + t.duration
        finished += 1
        for s in succ[tid]:
            ready_at[s] = max(ready_at[s], t.end)
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(heap, (ready_at[s], s))
    if finished != n:
        raise Deadlock("cycle")
    return tasks


def _reference_breakdown(rank, tasks, step):
    compute = optimizer = exposed = bubble = other = 0.0
    prev_end = last_own_comm_end = 0.0
    for t in (t for t in tasks if t.rank == rank):
        if t.stream != "compute":
            last_own_comm_end = max(last_own_comm_end, t.end)
            continue
        gap = t.start - prev_end
        if gap > 1e-15:
            binding = max((tasks[d] for d in t.deps), key=lambda d: d.end, default=None)
            if binding is None or binding.end < t.start - 1e-12:
                other += gap
            elif binding.category == "pp":
                covered = max(0.0, binding.end - max(prev_end, binding.start))
                exposed += min(gap, covered)
                bubble += gap - min(gap, covered)
            elif binding.category in COMM_CATEGORIES and binding.rank == rank:
                exposed += gap
            else:
                bubble += gap
        if t.category == "optimizer":
            optimizer += t.duration
        elif t.category in COMM_CATEGORIES:
            exposed += t.duration
        else:
            compute += t.duration
        prev_end = max(prev_end, t.end)
    tail = step - prev_end
    if tail > 0:
        comm_tail = min(tail, max(0.0, last_own_comm_end - prev_end))
        exposed += comm_tail
        bubble += tail - comm_tail
    return compute, exposed, bubble, optimizer, other


def _reference_timelines(ref: _Reference, tasks, constants):
    per_rank = [[] for _ in constants]
    for task, at_end, delta in ref.memory:
        if delta:
            t = tasks[task]
            per_rank[t.rank].append((t.end if at_end else t.start, delta))
    out = []
    for constant, changes in zip(constants, per_rank):
        live, timeline = 0, [(0.0, constant)]
        for time, delta in sorted(changes):
            live += delta
            timeline.append((time, constant + live))
        out.append(tuple(timeline))
    return out


def assert_same_as_reference(costs: StepCosts, result) -> None:
    ref = _Reference(costs)
    tasks = _heap_times(ref)
    step = max((t.end for t in tasks), default=0.0)
    assert result.step_time_s == step
    for rank, b in enumerate(result.rank_breakdowns):
        assert (b.compute, b.exposed_comm, b.bubble, b.optimizer, b.other) == _reference_breakdown(rank, tasks, step)
    events = [(t.rank, t.stream, t.name, t.category, t.start, t.end, t.flow, t.peer) for t in tasks if t.duration > 0]
    assert [tuple(e) for e in result.events] == events
    constants = [m.timeline[0][1] for m in result.memory]
    assert [tuple(m.timeline) for m in result.memory] == _reference_timelines(ref, tasks, constants)


def _costs(name, pp, m, v, ga, seed, *, chains=False):
    """Random cost tables; `chains`: no FSDP gathers and no host shares, so most actions are chains."""
    rng = random.Random(seed)

    def chunk(i):
        return ChunkCost(name=f"c{i}", fwd_s=rng.uniform(1, 3), bwd_input_s=rng.uniform(1, 3),
                         bwd_weight_s=rng.choice([0.0, rng.uniform(0.5, 2)]), fwd_comm_s=rng.choice([0.0, rng.uniform(0, 1)]),
                         bwd_comm_s=rng.choice([0.0, rng.uniform(0, 1)]), grad_sync_s=rng.uniform(0, 2),
                         param_gather_s=0.0 if chains else rng.choice([0.0, rng.uniform(0, 1)]),
                         activation_bytes=rng.randint(0, 9), recompute_s=rng.choice([0.0, 0.5]),
                         recompute_bytes=rng.choice([0, 3]))

    stages = tuple(StageCost(chunks=tuple(chunk(i) for i in range(rng.randint(1, 3))), send_activation_s=rng.uniform(0, 1),
                             send_gradient_s=rng.uniform(0, 1), optimizer_s=rng.uniform(0, 2),
                             post_step_gather_s=rng.choice([0.0, rng.uniform(0, 1)]), weights_bytes=rng.randint(0, 99))
                   for _ in range(pp * v))
    links = rng.choice([{"tp-comm": "intra_node", "pp-p2p": "inter_node", "dp-comm": "inter_node"},
                        {"tp-comm": "intra_node", "pp-p2p": "intra_node", "dp-comm": "intra_node"},
                        {"tp-comm": "inter_node", "pp-p2p": "intra_node", "dp-comm": "inter_node"}])
    return StepCosts(schedule=build_schedule(name, pp, m, v), stages=stages, grad_accum=ga, links=links,
                     comm_compute_share=0.0 if chains else rng.choice([0.0, 0.0, 0.5]),
                     grad_sync_every_microbatch=rng.random() < 0.3,
                     gather_in_backward=rng.random() < 0.5, rank_buffer_bytes=tuple(rng.randint(0, 9) for _ in range(pp)))


SCHEDULES = [("1F1B", 1, 4, 1), ("1F1B", 4, 8, 1), ("1F1B", 3, 2, 1), ("GPipe", 2, 4, 1), ("Interleaved1F1B", 2, 4, 2),
             ("Interleaved1F1B", 4, 8, 2), ("InterleavedZeroBubble", 2, 4, 2), ("ZBVZeroBubble", 2, 4, 2),
             ("ZBVZeroBubble", 3, 7, 2), ("LoopedBFS", 2, 2, 2)]


@pytest.mark.parametrize("seed,schedule,ga", list(itertools.product(range(4), SCHEDULES, (1, 2))))
@pytest.mark.parametrize("chains", [False, True])
def test_simulation_equals_the_task_graph_reference_on_random_costs(seed, schedule, ga, chains):
    costs = _costs(*schedule, ga=ga, seed=seed, chains=chains)
    assert_same_as_reference(costs, simulate_costs(costs))


@pytest.mark.parametrize("dims,train", [
    (dict(dp=4), dict(zero=3)),
    (dict(tp=2, dp=2), dict(zero=1, recompute="selective")),
    (dict(pp=2, dp=2), dict(zero=2, schedule="1F1B")),
    (dict(tp=2, pp=2), dict(schedule="ZBVZeroBubble", virtual_stages=2, recompute="full")),
    (dict(pp=2, cp=2, dp=2), dict(schedule="Interleaved1F1B", virtual_stages=2, zero=1)),
])
@pytest.mark.parametrize("cluster", ["dgx-h100", "local-cpu"])
def test_simulation_equals_the_task_graph_reference_on_priced_strategies(dims, train, cluster):
    graph = tiny_decoder()
    cluster = load_cluster(cluster)
    dp, pp, mb = dims.get("dp", 1), dims.get("pp", 1), 4
    d = ParallelDims(tp=dims.get("tp", 1), pp=pp, cp=dims.get("cp", 1), dp_shard=dp)
    strategy = Strategy(dims=d, train=TrainingConfig(global_batch=dp * mb, seq_len=graph.seq_len, num_microbatches=mb,
                                                     grad_accum=mb if pp == 1 else 1, **train))
    costs, _ = price_step(graph, strategy, cluster)
    assert_same_as_reference(costs, simulate(graph, strategy, cluster))
