"""`SimResult`: the simulated step, its time breakdown, memory over time and the timeline.

Time breakdown of one rank (it sums to the step time):
- compute: busy time of its compute stream on forward, backward and recomputation;
- optimizer: the optimizer step on the compute stream;
- exposed_comm: idle compute-stream time whose cause is communication of this rank — a gap before
  a compute task whose latest-finishing dependency is a collective, and the part of a gap covered by
  the pipeline transfer it waits for — plus the host shares of collectives that run on the compute
  stream (`costmodel.simulator.step`);
- bubble: idle time waiting for another stage's compute (the part of a gap before the awaited
  transfer started), and idle time at the end of the step after the rank's last work;
- other: idle time with no dependency to blame (0 in the current model).
The result's `breakdown` is that of the critical rank: the one with the most compute plus optimizer
time (the bottleneck stage), lowest rank on ties. It is accumulated while the step is simulated
(`costmodel.simulator.engine.RankLanes`, which states the gap rule).

Memory of a rank over time: constant weights, gradients, optimizer state, buffers and overhead, plus
activations and gathered parameters that follow the step's memory events (`costmodel.simulator.step`);
its peak and the breakdown at the peak are reported per pipeline rank. The timeline and the timeline
events are made when first read, by running the step again with its records
(`costmodel.simulator.step.run_step(costs, record=True)`, the same times): the search simulates dozens of
candidates and draws one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from costmodel.memory import MemoryBreakdown, rank_breakdown
from costmodel.memory_schedule import rank_activation_peaks, stage_activations
from costmodel.simulator.costs import StepCosts
from costmodel.simulator.step import StepRun, memory_changes, run_step

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
    timeline: Sequence[tuple[float, int]]
    """(time, total bytes) after each change, starting at (0, the constant part): a `MemoryTimeline`, made
    on first use, in a simulated result."""
    grads_bytes: int = 0
    """The rank's gradients once the backward is done (model state); `at_peak.grads` is what of them is live at
    the peak (`costmodel.memory.rank_breakdown`)."""

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


def _name(spec) -> str:
    """A task's name from its template and arguments (`costmodel.simulator.step`), or the name itself."""
    if isinstance(spec, str):
        return spec
    return spec[0].format(*(_name(a) if isinstance(a, tuple) else a for a in spec[1:]))


class _Lazy(Sequence):
    """A tuple made on first use (equal to, and hashing as, that tuple)."""

    def __init__(self) -> None:
        self._items: tuple | None = None

    def _make(self) -> tuple:
        raise NotImplementedError

    def _made(self) -> tuple:
        if self._items is None:
            self._items = self._make()
        return self._items

    def __getitem__(self, index):
        return self._made()[index]

    def __len__(self) -> int:
        return len(self._made())

    def __iter__(self):
        return iter(self._made())

    def __eq__(self, other: object) -> bool:
        return self._made() == (other._made() if isinstance(other, _Lazy) else other)

    def __hash__(self) -> int:
        return hash(self._made())


class _Recorded:
    """A step's run with its timeline records and memory events, made once, when first asked for."""

    def __init__(self, costs: StepCosts, run: StepRun) -> None:
        self._costs: StepCosts | None = costs
        self._run = run if run.memory is not None else None

    def run(self) -> StepRun:
        if self._run is None:
            assert self._costs is not None
            self._run = run_step(self._costs, record=True)
            self._costs = None
        return self._run


class TimelineEvents(_Lazy):
    """The step's `TimelineEvent`s (tasks of positive duration; rank by rank, each in issue order), made on
    first use."""

    def __init__(self, recorded: _Recorded) -> None:
        super().__init__()
        self._recorded: _Recorded | None = recorded

    def _make(self) -> tuple[TimelineEvent, ...]:
        assert self._recorded is not None
        events = []
        for lanes in self._recorded.run().lanes:
            for record in lanes.records:
                for stream, name, category, start, end, flow, peer in (
                        (record,) if type(record) is tuple else record.records()):
                    events.append(TimelineEvent(lanes.rank, stream, _name(name), category, start, end, flow, peer))
        self._recorded = None
        return tuple(events)

    def __repr__(self) -> str:
        return f"TimelineEvents({len(self)} events)"


class MemoryTimeline(_Lazy):
    """A rank's (time, total bytes) after each activation change, from (0, constant), made on first use."""

    def __init__(self, constant: int, recorded: _Recorded, rank: int) -> None:
        super().__init__()
        self._constant, self._recorded, self._rank = constant, recorded, rank

    def _make(self) -> tuple[tuple[float, int], ...]:
        assert self._recorded is not None
        memory = self._recorded.run().memory
        assert memory is not None
        constant, live = self._constant, 0
        timeline = [(0.0, constant)]
        for time, delta in sorted(memory_changes(memory[self._rank])):
            live += delta
            timeline.append((time, constant + live))
        self._recorded = None
        return tuple(timeline)

    def __repr__(self) -> str:
        return f"MemoryTimeline({len(self)} points)"


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


def analyse(costs: StepCosts, run: StepRun, facts: StepFacts) -> SimResult:
    """The result of `run` (`run_step(costs)`, recorded or not: the timelines replay it when read)."""
    step = run.step_time_s
    breakdowns = tuple(TimeBreakdown(*lanes.breakdown(step)) for lanes in run.lanes)
    critical = max(range(len(breakdowns)), key=lambda r: (breakdowns[r].compute + breakdowns[r].optimizer, -r))
    recorded = _Recorded(costs, run)
    return SimResult(
        step_time_s=step, breakdown=breakdowns[critical], rank_breakdowns=breakdowns, critical_rank=critical,
        memory=_memory(costs, recorded), events=TimelineEvents(recorded), facts=facts,
    )


def _memory(costs: StepCosts, recorded: _Recorded) -> tuple[RankMemory, ...]:
    """Per pipeline rank: the constant terms, the activation peak of `memory_schedule.rank_activation_peaks`
    (the estimator's rule) and the activation timeline the memory events draw."""
    sched = costs.schedule
    chunks = [c for s in costs.stages for c in s.chunks]
    bounds = [0]
    for s in costs.stages:
        bounds.append(bounds[-1] + len(s.chunks))
    stage_acts = stage_activations([c.activation_bytes for c in chunks], [c.recompute_bytes for c in chunks], bounds)
    peaks = rank_activation_peaks(sched, stage_acts)
    out = []
    for rank in range(sched.pp):
        stages = sched.stages_of(rank)
        weights = sum(costs.stages[s].weights_bytes for s in stages)
        grads = sum(costs.stages[s].grads_bytes for s in stages)
        opt = sum(costs.stages[s].optimizer_bytes for s in stages)
        host = sum(costs.stages[s].host_bytes for s in stages)
        buffers = costs.rank_buffer_bytes[rank] if costs.rank_buffer_bytes else 0
        at_peak = rank_breakdown(
            weights=weights, grads=grads, optimizer=opt, activations=int(peaks[rank]), buffers=buffers,
            host=host, workspace=costs.workspace_bytes, reserve_fraction=costs.allocator_reserve_fraction,
            grads_held=costs.grads_held,
            loss_transient=max((c.loss_transient_bytes for s in stages for c in costs.stages[s].chunks), default=0),
        )
        # the timeline draws the activations over what stays: the gradients as live at the peak
        constant = weights + int(at_peak.grads) + opt + buffers + costs.workspace_bytes
        out.append(RankMemory(rank=rank, stages=stages, timeline=MemoryTimeline(constant, recorded, rank),
                              at_peak=at_peak, grads_bytes=grads))
    return tuple(out)
