"""`SimResult`: the simulated step, its time breakdown, memory over time and the timeline.

Time breakdown of one rank (it sums to the step time):
- compute: busy time of its compute stream on forward, backward and recomputation;
- optimizer: the optimizer step on the compute stream;
- exposed_comm: idle compute-stream time whose cause is communication of this rank — a gap before
  a compute task whose latest-finishing dependency is a collective, and the part of a gap covered by
  the pipeline transfer it waits for — plus the host shares of collectives that run on the compute
  stream (`costmodel.simulator_step`);
- bubble: idle time waiting for another stage's compute (the part of a gap before the awaited
  transfer started), and idle time at the end of the step after the rank's last work;
- other: idle time with no dependency to blame (0 in the current model).
The result's `breakdown` is that of the critical rank: the one with the most compute plus optimizer
time (the bottleneck stage), lowest rank on ties.

Memory of a rank over time: constant weights, gradients, optimizer state, buffers and overhead, plus
activations and gathered parameters that follow the `MemoryEvent`s; its peak and the breakdown at
the peak are reported per pipeline rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from costmodel.memory import MemoryBreakdown, rank_breakdown
from costmodel.memory_schedule import rank_activation_peaks, stage_activations
from costmodel.simulator_costs import StepCosts
from costmodel.simulator_engine import Task
from costmodel.simulator_step import MemoryEvent

COMM_CATEGORIES = frozenset({"tp", "cp", "ep", "dp", "fsdp", "pp"})
GIB = 2**30


@dataclass(frozen=True)
class TimeBreakdown:
    compute: float
    exposed_comm: float
    bubble: float
    optimizer: float
    other: float

    def as_dict(self) -> dict[str, float]:
        return {
            "compute": self.compute, "exposed_comm": self.exposed_comm, "bubble": self.bubble,
            "optimizer": self.optimizer, "other": self.other,
        }


@dataclass(frozen=True)
class RankMemory:
    rank: int
    """Pipeline rank (it stands for every DP/TP/CP rank of its stages)."""
    stages: tuple[int, ...]
    at_peak: MemoryBreakdown
    timeline: tuple[tuple[float, int], ...]
    """(time, total bytes) after each change, starting at (0, the constant part)."""

    @property
    def peak_bytes(self) -> int:
        return self.at_peak.total


class TimelineEvent(NamedTuple):
    """One task of the simulated step (a NamedTuple: thousands are made per simulation)."""

    rank: int
    stream: str
    name: str
    category: str
    start: float
    end: float
    flow: int | None = None
    """Links a pipeline send (on `rank`) to its receive (on `peer`)."""
    peer: int | None = None


class TimelineEvents(Sequence):
    """The step's `TimelineEvent`s (tasks of positive duration, in issue order), made on first use: the
    search simulates dozens of candidates and draws the timeline of one."""

    def __init__(self, tasks: Sequence[Any]) -> None:
        self._tasks: Sequence[Any] | None = tasks
        self._events: tuple[TimelineEvent, ...] = ()

    def _made(self) -> tuple[TimelineEvent, ...]:
        if self._tasks is not None:
            self._events = tuple(
                TimelineEvent(t.rank, t.stream, t.name, t.category, t.start, t.end, t.flow, t.peer)
                for t in self._tasks if t.duration > 0
            )
            self._tasks = None
        return self._events

    def __getitem__(self, index):
        return self._made()[index]

    def __len__(self) -> int:
        return len(self._made())

    def __iter__(self):
        return iter(self._made())

    def __eq__(self, other: object) -> bool:
        return self._made() == (other._made() if isinstance(other, TimelineEvents) else other)

    def __hash__(self) -> int:
        return hash(self._made())

    def __repr__(self) -> str:
        return f"TimelineEvents({len(self)} events)"


@dataclass(frozen=True)
class StepFacts:
    """Model-level facts the pricing phase knows and the metrics need (zeros in hand-made tests)."""

    model_flops: float = 0.0
    """Per step, all ranks: forward + backward FLOPs of the model (attention included), no recompute."""
    hardware_flops: float = 0.0
    """Per step, all ranks: model FLOPs plus recomputed forward FLOPs."""
    world_size: int = 1
    global_batch: int = 1
    seq_len: int = 1
    peak_flops_per_gpu: float = 0.0
    """The device's dense peak at the plan's precision."""
    parallelism: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SimResult:
    step_time_s: float
    breakdown: TimeBreakdown
    rank_breakdowns: tuple[TimeBreakdown, ...]
    critical_rank: int
    memory: tuple[RankMemory, ...]
    events: Sequence[TimelineEvent]
    """A `TimelineEvents`, made on first use."""
    facts: StepFacts

    @property
    def peak_memory_bytes(self) -> int:
        return max(m.peak_bytes for m in self.memory)

    @property
    def tokens_per_s(self) -> float:
        return self.facts.global_batch * self.facts.seq_len / self.step_time_s if self.step_time_s else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.facts.global_batch / self.step_time_s if self.step_time_s else 0.0

    def _per_gpu_tflops(self, flops: float) -> float:
        if not self.step_time_s:
            return 0.0
        return flops / self.step_time_s / self.facts.world_size / 1e12

    def to_contract(self) -> dict[str, Any]:
        """The DESIGN contract's JSON keys for `soap plan/simulate --json`."""
        model_tf = self._per_gpu_tflops(self.facts.model_flops)
        hw_tf = self._per_gpu_tflops(self.facts.hardware_flops)
        peak_tf = self.facts.peak_flops_per_gpu / 1e12
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "samples_per_s": self.samples_per_s,
            "model_tflops_per_gpu": model_tf,
            "hardware_tflops_per_gpu": hw_tf,
            "mfu": model_tf / peak_tf if peak_tf else 0.0,
            "hfu": hw_tf / peak_tf if peak_tf else 0.0,
            "peak_memory_gib": self.peak_memory_bytes / GIB,
            "parallelism": dict(self.facts.parallelism),
            "breakdown_s": self.breakdown.as_dict(),
            "peak_memory_per_stage_gib": [m.peak_bytes / GIB for m in self.memory],
            "memory_breakdown_gib": [
                {"rank": m.rank, "stages": list(m.stages), **m.at_peak.as_gib()} for m in self.memory
            ],
        }


def analyse(costs: StepCosts, tasks: Sequence[Task], memory_events: Sequence[MemoryEvent], facts: StepFacts) -> SimResult:
    step = max((t.end for t in tasks), default=0.0)
    pp = costs.schedule.pp
    by_rank: list[list[Task]] = [[] for _ in range(pp)]
    for t in tasks:
        by_rank[t.rank].append(t)
    breakdowns = tuple(_rank_breakdown(rank, by_rank[rank], tasks, step) for rank in range(pp))
    critical = max(range(pp), key=lambda r: (breakdowns[r].compute + breakdowns[r].optimizer, -r))
    events = TimelineEvents(tasks)
    return SimResult(
        step_time_s=step, breakdown=breakdowns[critical], rank_breakdowns=breakdowns, critical_rank=critical,
        memory=_memory(costs, tasks, memory_events), events=events, facts=facts,
    )


def _rank_breakdown(rank: int, own: Sequence[Task], tasks: Sequence[Task], step: float) -> TimeBreakdown:
    """`own`: this rank's tasks in issue order; `tasks`: all of them, indexed by id (dependencies)."""
    compute = optimizer = exposed = bubble = other = 0.0
    prev_end = 0.0
    last_own_comm_end = 0.0
    for t in own:
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
        elif t.category in COMM_CATEGORIES:  # a collective's host share (`costmodel.simulator_step`)
            exposed += t.duration
        else:
            compute += t.duration
        prev_end = max(prev_end, t.end)
    tail = step - prev_end
    if tail > 0:
        comm_tail = min(tail, max(0.0, last_own_comm_end - prev_end))
        exposed += comm_tail
        bubble += tail - comm_tail
    return TimeBreakdown(compute, exposed, bubble, optimizer, other)


def _memory(costs: StepCosts, tasks: Sequence[Task], events: Sequence[MemoryEvent]) -> tuple[RankMemory, ...]:
    """Per pipeline rank: the constant terms, the activation peak of `memory_schedule.rank_activation_peaks`
    (the estimator's rule) and the activation timeline the events draw."""
    sched = costs.schedule
    chunks = [c for s in costs.stages for c in s.chunks]
    bounds = [0]
    for s in costs.stages:
        bounds.append(bounds[-1] + len(s.chunks))
    stage_acts = stage_activations([c.activation_bytes for c in chunks], [c.recompute_bytes for c in chunks], bounds)
    peaks = rank_activation_peaks(sched, stage_acts)
    per_rank: list[list[tuple[float, int]]] = [[] for _ in range(sched.pp)]
    for e in events:
        if e.delta:
            t = tasks[e.task]
            per_rank[t.rank].append((t.end if e.at_end else t.start, e.delta))
    out = []
    for rank in range(sched.pp):
        stages = sched.stages_of(rank)
        weights = sum(costs.stages[s].weights_bytes for s in stages)
        grads = sum(costs.stages[s].grads_bytes for s in stages)
        opt = sum(costs.stages[s].optimizer_bytes for s in stages)
        host = sum(costs.stages[s].host_bytes for s in stages)
        buffers = costs.rank_buffer_bytes[rank] if costs.rank_buffer_bytes else 0
        constant = weights + grads + opt + buffers + costs.workspace_bytes
        live = 0
        timeline = [(0.0, constant)]
        for time, delta in sorted(per_rank[rank]):
            live += delta
            timeline.append((time, constant + live))
        out.append(
            RankMemory(
                rank=rank, stages=stages, timeline=tuple(timeline),
                at_peak=rank_breakdown(
                    weights=weights, grads=grads, optimizer=opt, activations=int(peaks[rank]), buffers=buffers,
                    host=host, workspace=costs.workspace_bytes, reserve_fraction=costs.allocator_reserve_fraction,
                ),
            )
        )
    return tuple(out)
