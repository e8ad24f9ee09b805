"""The pipeline schedule IR shared by the simulator and the executor.

A schedule is data: for every pipeline rank, the ordered list of `Action`s it runs in one pass over
`num_microbatches` micro-batches. An action is torch.distributed.pipelining's `_Action` without the
torch dependency, and prints the same way (`2F0` = stage 2 forward of micro-batch 0, `1SEND_B3`):

    F        forward of one micro-batch on one stage
    B        full backward (input and weight gradients)
    I / W    backward split into input gradient (I, on the critical path) and weight gradient (W,
             deferrable): zero-bubble schedules
    SEND_F / RECV_F   activation to / from the next / previous stage (on another rank)
    SEND_B / RECV_B   gradient to / from the previous / next stage (on another rank)

`PipelineSchedule.to_torch()` turns it into `{rank: [torch _Action, ...]}` for
`_PipelineScheduleRuntime`, so the executor runs exactly the order the simulator priced.

Compute orders are torch's own (GPipe, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
ZBVZeroBubble), ported to `costmodel.schedule_orders` so that planning never imports
torch.distributed.pipelining; tests/test_schedule.py checks them against torch's generators. 1F1B is
generated here in the order torch's `Schedule1F1B` runtime executes (warm-up of `pp - rank` forwards,
then backward/forward pairs): torch's `Schedule1F1B._get_pipeline_order` is a display helper that is
off by one.

Communication is inserted by `_with_comms`: a RECV right before the compute that consumes it, a SEND
right after the compute that produces it, and none between two stages on the same rank (the turn of
the V in ZBV). `dry_run` executes the actions with torch's runtime semantics: sends are posted
asynchronously (isend), a receive blocks until its matching send was posted, every rank runs its list
in order, and a compute action may only run once its inputs exist on the rank. If no rank can make
progress before all are done, it raises `ScheduleDeadlock` naming the blocked actions.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from tracer.errors import SoapError


class ActionKind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


F, B, I, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
COMPUTE_KINDS = frozenset({F, B, I, W})
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class Action(NamedTuple):
    """One action of one rank (immutable; a named tuple, since the generators make hundreds of thousands)."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @staticmethod
    def from_str(text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise SoapError(f"bad pipeline action {text!r}; expected e.g. 2F0, 1B3 or 0SEND_F1")
        return Action(int(match[1]), ActionKind(match[2]), int(match[3]))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


action = functools.lru_cache(maxsize=1 << 18)(Action)
"""`Action(stage, kind, microbatch)`, one shared instance per value: the generators make hundreds of
thousands of actions, mostly the same ones again (actions are frozen, so sharing is safe), and a frozen
dataclass costs far more to build than a cache look-up."""

_RUNS: dict[tuple[int, ActionKind], list[Action]] = {}


def action_run(stage: int, kind: ActionKind, count: int) -> list[Action]:
    """`[Action(stage, kind, mb) for mb in range(count)]`, kept per (stage, kind) and grown on demand (never
    trimmed: as large as the largest schedule seen): a generator slices (or indexes) runs of micro-batches
    instead of making or looking up every action."""
    run = _RUNS.setdefault((stage, kind), [])
    if len(run) < count:
        n = len(run)
        run.extend(map(Action, [stage] * (count - n), [kind] * (count - n), range(n, count)))
    return run[:count]


class ScheduleDeadlock(SoapError):
    """The schedule cannot finish: some rank waits forever."""


@dataclass(frozen=True)
class PipelineSchedule:
    name: str
    pp: int
    stages_per_rank: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    """Pipeline rank of each stage (looped `s % pp`, or V-shaped for ZBVZeroBubble)."""
    actions: tuple[tuple[Action, ...], ...]
    """Per pipeline rank, compute and communication in execution order."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def splits_backward(self) -> bool:
        return any(a.kind is I for acts in self.actions for a in acts)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def to_strings(self) -> dict[int, list[str]]:
        return {rank: [str(a) for a in acts] for rank, acts in enumerate(self.actions)}

    def to_torch(self) -> dict[int, list]:
        """`{rank: [torch _Action]}` for torch.distributed.pipelining's `_PipelineScheduleRuntime`."""
        from torch.distributed.pipelining.schedules import _Action

        return {rank: [_Action.from_str(s) for s in acts] for rank, acts in self.to_strings().items()}


# --- generators ----------------------------------------------------------------------------------


def _one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    """Per rank: `pp - rank` warm-up forwards, then backward/forward pairs, then the last backwards."""
    ranks = []
    for rank in range(pp):
        warmup = min(m, pp - rank)
        forwards, backwards = action_run(rank, F, m), action_run(rank, B, m)
        steady = [forwards[0]] * (2 * (m - warmup))
        steady[0::2], steady[1::2] = backwards[:m - warmup], forwards[warmup:]
        ranks.append(forwards[:warmup] + steady + backwards[m - warmup:])
    return ranks


def stage_to_rank(name: str, pp: int, v: int) -> tuple[int, ...]:
    """The pipeline rank of each of the pp*v stages: looped (s % pp), or V-shaped for ZBVZeroBubble."""
    if name == "ZBVZeroBubble":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(2 * pp))
    return tuple(s % pp for s in range(pp * v))


def _with_comms(compute, stage_to_rank: tuple[int, ...]) -> tuple[tuple[Action, ...], ...]:
    last = len(stage_to_rank) - 1
    ranks = []
    for acts in compute:
        full: list[Action] = []
        for a in acts:
            s, mb = a.stage, a.microbatch
            if a.kind is F and s > 0 and stage_to_rank[s - 1] != stage_to_rank[s]:
                full.append(action(s, RECV_F, mb))
            if a.kind in (B, I) and s < last and stage_to_rank[s + 1] != stage_to_rank[s]:
                full.append(action(s, RECV_B, mb))
            full.append(a)
            if a.kind is F and s < last and stage_to_rank[s + 1] != stage_to_rank[s]:
                full.append(action(s, SEND_F, mb))
            if a.kind in (B, I) and s > 0 and stage_to_rank[s - 1] != stage_to_rank[s]:
                full.append(action(s, SEND_B, mb))
        ranks.append(tuple(full))
    return tuple(ranks)


@functools.lru_cache(maxsize=256)
def compute_order(name: str, pp: int, num_microbatches: int, stages_per_rank: int = 1
                  ) -> tuple[tuple[Action, ...], ...]:
    """Per rank, the compute actions (F, B, I, W) of schedule `name` in execution order: `build_schedule`
    without the communication. The activation peaks (`costmodel.memory_schedule`) read only this, so the
    planner's memory estimate never pays for the communication pass."""
    m, v = num_microbatches, stages_per_rank
    if pp < 1 or m < 1 or v < 1:
        raise SoapError(f"pipeline needs pp, micro-batches and stages per rank >= 1 (got {pp}, {m}, {v})")
    from costmodel import schedule_orders  # imports this module's Action

    if name in ("GPipe", "1F1B"):
        if v != 1:
            raise SoapError(f"{name} runs one stage per rank; use Interleaved1F1B for {v} virtual stages")
        compute = schedule_orders.gpipe(pp, m) if name == "GPipe" else _one_f_one_b(pp, m)
    elif name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        compute = schedule_orders.interleaved(name, pp, m, v)
    elif name == "LoopedBFS":
        compute = schedule_orders.looped_bfs(pp, m, v)
    elif name == "ZBVZeroBubble":
        if v != 2:
            raise SoapError(f"ZBVZeroBubble needs exactly 2 stages per rank (got {v})")
        compute = schedule_orders.zbv(pp, m)
    else:
        raise SoapError(
            f"unknown schedule {name!r}; choose GPipe, 1F1B, Interleaved1F1B, LoopedBFS, "
            "InterleavedZeroBubble or ZBVZeroBubble"
        )
    return tuple(tuple(acts) for acts in compute)


@functools.lru_cache(maxsize=256)
def build_schedule(name: str, pp: int, num_microbatches: int, stages_per_rank: int = 1) -> PipelineSchedule:
    """The schedule `name` (torch.distributed.pipelining's names) for `pp` ranks and `num_microbatches`."""
    compute = compute_order(name, pp, num_microbatches, stages_per_rank)
    ranks = stage_to_rank(name, pp, stages_per_rank)
    return PipelineSchedule(name, pp, stages_per_rank, num_microbatches, ranks, _with_comms(compute, ranks))


def step_shape(name: str, pp: int, num_microbatches: int, grad_accum: int, stages_per_rank: int = 1
               ) -> tuple[str, int, int, int, int]:
    """(schedule, pp, micro-batches per pass, stages per rank, passes) of a training step: without a
    pipeline one 1F1B "stage" runs all `num_microbatches` in one pass; a pipeline runs `name` over
    num_microbatches // grad_accum, `grad_accum` times."""
    if pp == 1:
        return "1F1B", 1, num_microbatches, 1, 1
    return name, pp, num_microbatches // grad_accum, stages_per_rank, grad_accum


def step_schedule(name: str, pp: int, num_microbatches: int, grad_accum: int, stages_per_rank: int = 1
                  ) -> tuple[PipelineSchedule, int]:
    """(the schedule of one pass, passes per step) for a training step (`step_shape`). The simulator takes
    the step from here; the planner's memory estimate takes `step_shape` and never builds the schedule."""
    sched_name, sched_pp, m, v, passes = step_shape(name, pp, num_microbatches, grad_accum, stages_per_rank)
    return build_schedule(sched_name, sched_pp, m, v), passes


# --- dry run -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DryRun:
    rounds: int
    """Lock-step rounds until every rank finished (one action per rank per round at most)."""
    actions_run: int


def dry_run(schedule: PipelineSchedule) -> DryRun:
    """Execute `schedule` with isend / blocking-recv semantics; raise ScheduleDeadlock if it hangs.

    Also checks completeness: every stage runs F and (B, or I then W) exactly once per micro-batch.
    """
    _check_complete(schedule)
    last = schedule.num_stages - 1
    posted: set[tuple[int, ActionKind, int]] = set()  # (stage, SEND kind, mb) messages in flight or received
    done: list[set[Action]] = [set() for _ in range(schedule.pp)]
    pointer = [0] * schedule.pp
    rounds = total = 0
    while any(pointer[r] < len(schedule.actions[r]) for r in range(schedule.pp)):
        progressed = []
        for rank, acts in enumerate(schedule.actions):
            if pointer[rank] < len(acts) and _ready(acts[pointer[rank]], done[rank], posted, last):
                progressed.append((rank, acts[pointer[rank]]))
        if not progressed:
            blocked = ", ".join(
                f"rank {r} at {schedule.actions[r][pointer[r]]}"
                for r in range(schedule.pp) if pointer[r] < len(schedule.actions[r])
            )
            raise ScheduleDeadlock(f"{schedule.name} deadlocks: {blocked}")
        for rank, action in progressed:  # lock-step: sends of this round are seen in the next
            done[rank].add(action)
            if action.kind in (SEND_F, SEND_B):
                posted.add((action.stage, action.kind, action.microbatch))
            pointer[rank] += 1
        rounds += 1
        total += len(progressed)
    return DryRun(rounds=rounds, actions_run=total)


def _ready(a: Action, done: set[Action], posted: set, last: int) -> bool:
    s, mb = a.stage, a.microbatch
    if a.kind is RECV_F:
        return (s - 1, SEND_F, mb) in posted
    if a.kind is RECV_B:
        return (s + 1, SEND_B, mb) in posted
    if a.kind in (SEND_F, SEND_B):
        return Action(s, F if a.kind is SEND_F else B, mb) in done or Action(s, I, mb) in done
    if a.kind is F:
        return s == 0 or Action(s, RECV_F, mb) in done or Action(s - 1, F, mb) in done
    if a.kind is W:
        return Action(s, I, mb) in done
    grad_ready = (
        s == last
        or Action(s, RECV_B, mb) in done
        or Action(s + 1, B, mb) in done
        or Action(s + 1, I, mb) in done
    )
    return Action(s, F, mb) in done and grad_ready


def _check_complete(schedule: PipelineSchedule) -> None:
    seen: dict[tuple[int, int], list[ActionKind]] = {}
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            if a.is_compute:
                if schedule.stage_to_rank[a.stage] != rank:
                    raise ScheduleDeadlock(f"{schedule.name}: {a} runs on rank {rank}, not its stage's rank")
                seen.setdefault((a.stage, a.microbatch), []).append(a.kind)
    for stage in range(schedule.num_stages):
        for mb in range(schedule.num_microbatches):
            kinds = sorted(k.value for k in seen.get((stage, mb), []))
            if kinds not in (["B", "F"], ["F", "I", "W"]):
                raise ScheduleDeadlock(
                    f"{schedule.name}: stage {stage} micro-batch {mb} runs {kinds or 'nothing'}, expected F and B (or F, I, W)"
                )
