"""One training step as a task graph: the pipeline schedule expanded into compute and communication.

For each pipeline rank (one representative of all DP/TP/CP ranks of its stages), the schedule's
actions run `grad_accum` times (micro-batch indices offset per pass). Each action expands per chunk
(block instance) of its stage:

    F(s, mb):  [fsdp all-gather] -> forward compute -> [activation collectives]  for chunk 0..n-1
    B(s, mb):  [fsdp all-gather] -> recompute + backward compute -> [collectives] -> [grad bucket]
               for chunk n-1..0
    I / W:     B's input-gradient part (with recompute and collectives) and weight-gradient part;
               the grad bucket follows W
    SEND_F/B:  one transfer on the sender's pp-p2p stream; the receiver's first chunk waits for it
    RECV_F/B:  nothing to run: the dependency is the transfer

Activation collectives (tp-comm) are synchronous, as in Megatron/DTensor TP: the next compute task
of the rank waits for the last one issued. FSDP all-gathers are prefetched one chunk ahead: the
gather for chunk c waits only for the compute of chunk c-2 (two chunks' parameters alive at once); in
backward it is issued as chunk c-1's compute starts, before chunk c-1's gradient reduce-scatter, as
FSDP2's backward prefetch issues it (all of a process group's collectives share one NCCL stream, so
the issue order is the order they run in: per chunk the dp link carries one gather and one
reduce-scatter while the chunk computes, instead of serializing gather, compute and sync).
Gradient buckets are one per chunk (a block instance's gradients; DDP's 25 MB buckets are finer, so
this slightly delays the first bucket and exposes the last one the same way). They are
synchronized after the stage's last backward of the step, or after every backward with
`grad_sync_every_microbatch` (zero 3). After its last action a rank steps the optimizer on the
compute stream once its dp-comm stream is drained, then all-gathers the updated shards (zero 1).

Where communication needs the compute resources (`StepCosts.comm_compute_share` s > 0: gloo on the CPU
cores the ranks compute on), each communication task of duration d becomes a host share of s * d on
the rank's compute stream, in issue order, followed by the remaining (1 - s) * d on its own stream:
with s = 1 a collective and the rank's compute take turns, however the schedule overlaps them.

Memory events ride along, per rank as (time, bytes) changes: activations are saved at a chunk's forward
end and freed at its backward end (at W's end when the backward is split, since W still reads them);
recomputed activations live during the chunk's backward. They draw the memory timeline; the peak itself
is `costmodel.memory_schedule.rank_activation_peaks`, the estimator's rule, and a test holds the two equal.
Buffers (FSDP's gathered units among them) are a constant per rank (`costmodel.memory.buffer_bytes`).

Order of evaluation (`run_step`): each rank's tasks are timed as they are issued
(`costmodel.simulator.engine.RankLanes`), the rank's actions in schedule order; where an action's input is
a transfer the sending rank has not issued yet, the rank waits and the next rank goes on (as `dry_run`
runs a schedule), so every dependency is timed before the task that reads it. Without host shares (GPU
profiles) an action is one chain (`RankLanes.compute_chain`: its chunks' computes, collectives, gathers
and buckets in one loop, the times the task-by-task path gives), recorded, when asked for, as one `Chain`
that makes its timeline and memory events when they are read; with host shares the action is issued task
by task (`_Rank._forward`, `_backward`, `_weight`). Task names are made only when the timeline is read
(`name` is a template and its arguments until then).
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.schedule import B, F, I, SEND_B, SEND_F, W
from costmodel.simulator.costs import StepCosts
from costmodel.simulator.engine import Deadlock, Done, RankLanes

_FORWARD, _BACKWARD, _XFER_FORWARD, _XFER_BACKWARD = range(4)
"""Kinds of the keys other tasks wait on: (kind, stage, micro-batch) -> the action's (or transfer's) last task."""
_RUN_NOTHING, _RUN_CHAIN, _RUN_SEND, _RUN_SLOW = "nothing", "chain", "send", "tasks"
"""What an action issues (`_Rank._program`): nothing (a receive), one chain, one transfer, or task by task."""


@dataclass
class StepRun:
    """One simulated step: every rank's timed streams, and its activation changes over time."""

    lanes: tuple[RankLanes, ...]
    memory: tuple[list, ...] | None
    """Per pipeline rank, (time, activation bytes saved (+) or freed (-)) or a `Chain` that makes them, in
    issue order (`memory_changes`); None unless recorded."""

    @property
    def step_time_s(self) -> float:
        return max((lanes.end for lanes in self.lanes), default=0.0)


class Chain:
    """One action's chunks timed in one loop (`RankLanes.compute_chain`): its timeline records and memory
    events, made when read."""

    __slots__ = ("kind", "stage", "mb", "chunks", "times", "prefetch")

    def __init__(self, kind, stage: int, mb: int, chunks, times: list[tuple], prefetch: bool) -> None:
        self.kind, self.stage, self.mb, self.chunks, self.times = kind, stage, mb, chunks, times
        self.prefetch = prefetch

    def records(self) -> list[tuple]:
        """(stream, name, category, start, end, flow, peer) of its tasks of positive duration, in issue order."""
        out: list[tuple] = []
        tag, kind, times = self.kind.value, self.kind, self.times
        labels = [(self.stage, tag, self.mb, chunk.name) for chunk in self.chunks]

        def gather(k: int) -> None:
            if k < len(times) and times[k][6] is not None:
                out.append(("dp-comm", ("all-gather {}{}{} {}", *labels[k]), "fsdp", times[k][6], times[k][7], None, None))

        if self.prefetch:
            gather(0)
        for k, (chunk, (start, end, comm_start, comm_end, sync_start, sync_end, _, _)) in enumerate(zip(self.chunks, times)):
            if not self.prefetch:
                gather(k)
            if kind is F:
                duration = chunk.fwd_s
            elif kind is W:
                duration = chunk.bwd_weight_s
            else:
                duration = chunk.recompute_s + chunk.bwd_input_s + (chunk.bwd_weight_s if kind is B else 0.0)
            if duration > 0:
                out.append(("compute", ("{}{}{} {}", *labels[k]), "compute", start, end, None, None))
            if self.prefetch:
                gather(k + 1)
            if comm_start is not None:
                out.append(("tp-comm", ("{}{}{} {} collectives", *labels[k]), "tp", comm_start, comm_end, None, None))
            if sync_start is not None:
                out.append(("dp-comm", ("grad sync {}:{}", self.stage, chunk.name), "dp", sync_start, sync_end, None, None))
        return out

    def memory(self) -> list[tuple[float, int]]:
        """Its (time, activation bytes) changes, as `_Rank` would have appended them."""
        out = []
        kind = self.kind
        for chunk, (start, end, *_) in zip(self.chunks, self.times):
            if kind is F:
                if chunk.activation_bytes:
                    out.append((end, chunk.activation_bytes))
                continue
            if kind is not W and chunk.recompute_bytes:
                out.append((start, chunk.recompute_bytes))
                out.append((end, -chunk.recompute_bytes))
            if kind is not I and chunk.activation_bytes:
                out.append((end, -chunk.activation_bytes))
        return out


def memory_changes(entries) -> list[tuple[float, int]]:
    """A rank's (time, bytes) activation changes from `StepRun.memory`'s entries."""
    out: list[tuple[float, int]] = []
    for e in entries:
        if type(e) is tuple:
            out.append(e)
        else:
            out.extend(e.memory())
    return out


def run_step(costs: StepCosts, *, record: bool = False) -> StepRun:
    """Time every task of the step (see the module docstring's order of evaluation); `record` keeps the
    timeline records and memory events (the same run again, for the timeline of a result)."""
    sched = costs.schedule
    done: dict[tuple[int, int, int], Done] = {}
    ranks: list[_Rank] = []
    flows = 0
    plans = _ChainPlans(costs)
    for rank, actions in enumerate(sched.actions):
        ranks.append(_Rank(rank, actions, costs, done, flows, plans, record))
        flows += costs.grad_accum * sum(1 for a in actions if a.kind is SEND_F or a.kind is SEND_B)
    waiting = ranks
    while waiting:
        progressed = [r.advance() for r in waiting]
        if not any(progressed):
            names = ", ".join(f"rank {r.rank} at {r.actions[r.index]}" for r in waiting[:3])
            raise Deadlock(f"{len(waiting)} ranks wait forever on a transfer (a dependency cycle), e.g. {names}")
        waiting = [r for r in waiting if not r.finished]
    return StepRun(lanes=tuple(r.lanes for r in ranks), memory=tuple(r.memory for r in ranks) if record else None)


class _ChainPlans:
    """Per stage and action kind, the action as one chain (module docstring): (chunks in issue order, and
    per chunk its compute, collective, gather and bucket durations (`RankLanes.compute_chain`'s lists, None
    where all are 0), and whether gathers are prefetched); None with host shares, which take the task by
    task path."""

    def __init__(self, costs: StepCosts) -> None:
        self.costs = costs
        self.plain = not costs.comm_compute_share > 0  # no host shares
        self._forward: dict[int, tuple | None] = {}
        self._backward: dict[tuple[int, bool, bool], tuple | None] = {}
        self._weight: dict[tuple[int, bool], tuple | None] = {}

    def forward(self, stage: int):
        if stage not in self._forward:
            chunks = self.costs.stages[stage].chunks
            self._forward[stage] = (chunks, [c.fwd_s for c in chunks], _nonzero([c.fwd_comm_s for c in chunks]),
                                    _nonzero([c.param_gather_s for c in chunks]), None, False
                                    ) if self.plain and chunks else None
        return self._forward[stage]

    def backward(self, stage: int, full: bool, sync: bool):
        key = (stage, full, sync)
        if key not in self._backward:
            chunks = tuple(reversed(self.costs.stages[stage].chunks))
            self._backward[key] = (
                chunks, [c.recompute_s + c.bwd_input_s + (c.bwd_weight_s if full else 0.0) for c in chunks],
                _nonzero([c.bwd_comm_s for c in chunks]),
                _nonzero([c.param_gather_s for c in chunks]) if self.costs.gather_in_backward else None,
                _nonzero([c.grad_sync_s for c in chunks]) if full and sync else None, True,
            ) if self.plain and chunks else None
        return self._backward[key]

    def weight(self, stage: int, sync: bool):
        key = (stage, sync)
        if key not in self._weight:
            chunks = tuple(reversed(self.costs.stages[stage].chunks))
            self._weight[key] = (chunks, [c.bwd_weight_s for c in chunks], None, None,
                                 _nonzero([c.grad_sync_s for c in chunks]) if sync else None, False
                                 ) if self.plain and chunks else None
        return self._weight[key]


def _nonzero(durations: list[float]) -> list[float] | None:
    return durations if any(d > 0 for d in durations) else None


def _final_backward_per_stage(actions) -> dict[int, int]:
    final: dict[int, int] = {}
    for index, a in enumerate(actions):
        if a.kind in (B, W):
            final[a.stage] = index
    return final


class _Rank:
    """One pipeline rank's actions, issued in order as their inputs become available."""

    def __init__(self, rank: int, actions, costs: StepCosts, done: dict, first_flow: int, plans: _ChainPlans,
                 record: bool) -> None:
        self.rank, self.actions, self.costs, self.done = rank, actions, costs, done
        self.sched = sched = costs.schedule
        self.stage_to_rank = sched.stage_to_rank
        self.last_stage = sched.num_stages - 1
        self.lanes = RankLanes(rank, costs.links, record=record)
        self.memory: list | None = [] if record else None
        self.share = costs.comm_compute_share
        self.flows = first_flow
        self.last_tp_comm: Done | None = None
        """The last activation collective issued: the rank's next compute waits for it."""
        self.final_bwd = _final_backward_per_stage(actions)
        self.passes, self.pass_index, self.index = costs.grad_accum, 0, 0
        self.finished = False
        self.plans = plans
        self.program: list[tuple] | None = None
        self.last_program: list[tuple] | None = None

    # --- issuing tasks ----------------------------------------------------------------------------
    def _compute(self, name, category: str, duration: float, deps: list) -> Done:
        if self.last_tp_comm is not None:  # activation collectives block compute
            deps.append(self.last_tp_comm)
        return self.lanes.compute_task(name, category, duration, deps)

    def _comm(self, stream: str, name, category: str, duration: float, deps: list, flow=None, peer=None) -> Done:
        share = self.share * duration
        if share > 0:
            # the collective's host share runs on the compute stream, in issue order, then the rest on its own
            host = self.lanes.compute_task(("{} (host share)", name), category, share, deps)
            deps, duration = [host], duration - share
        done = self.lanes.comm_task(stream, name, category, duration, deps, flow, peer)
        if stream == "tp-comm":
            self.last_tp_comm = done
        return done

    # --- the schedule -----------------------------------------------------------------------------
    def _program(self, last_pass: bool) -> list[tuple]:
        """Per action of a pass: (its micro-batch in the pass, (what it does, stage, key kind and stage of its
        input (None: none), whether it waits for its own stage's forward, key kind of its last task (None: no
        key), its chain or its handler's flags)), the second shared by the actions of one stage and kind."""
        s2r, out = self.stage_to_rank, []
        every = self.costs.grad_sync_every_microbatch
        heads: dict[tuple, tuple] = {}
        for index, a in enumerate(self.actions):
            kind, stage = a.kind, a.stage
            sync = every or (last_pass and self.final_bwd.get(stage) == index)
            head = heads.get((kind, stage, sync))
            if head is None:
                head = heads[(kind, stage, sync)] = self._head(kind, stage, sync, s2r)
            out.append((a.microbatch, head))
        return out

    def _head(self, kind, stage: int, sync: bool, s2r) -> tuple:
        if kind is F:
            inputs = (None, 0) if stage == 0 else (_XFER_FORWARD if s2r[stage - 1] != s2r[stage] else _FORWARD, stage - 1)
            plan = self.plans.forward(stage)
            return (_RUN_CHAIN if plan else _RUN_SLOW, stage, *inputs, False, _FORWARD,
                    (kind, *plan) if plan else (kind, sync))
        if kind is B or kind is I:
            inputs = (None, 0) if stage == self.last_stage else (
                _XFER_BACKWARD if s2r[stage + 1] != s2r[stage] else _BACKWARD, stage + 1)
            plan = self.plans.backward(stage, kind is B, sync)
            return (_RUN_CHAIN if plan else _RUN_SLOW, stage, *inputs, True, _BACKWARD,
                    (kind, *plan) if plan else (kind, sync))
        if kind is W:
            plan = self.plans.weight(stage, sync)
            return (_RUN_CHAIN if plan else _RUN_SLOW, stage, None, 0, False, None, (kind, *plan) if plan else (kind, sync))
        if kind is SEND_F or kind is SEND_B:
            fwd = kind is SEND_F
            cost = self.costs.stages[stage]
            peer = stage + 1 if fwd else stage - 1
            return (_RUN_SEND, stage, _FORWARD if fwd else _BACKWARD, stage, False, _XFER_FORWARD if fwd else _XFER_BACKWARD,
                    (cost.send_activation_s if fwd else cost.send_gradient_s, peer, s2r[peer],
                     "send activation" if fwd else "send gradient"))
        return (_RUN_NOTHING, stage, None, 0, False, None, None)

    def advance(self) -> bool:
        """Issue actions until one waits for a transfer not issued yet (or all ran: then the optimizer).
        Whether any action ran."""
        ran, done, lanes = False, self.done, self.lanes
        m, passes = self.sched.num_microbatches, self.passes
        recording = self.memory is not None
        while self.pass_index < passes:
            last_pass = self.pass_index == passes - 1
            if last_pass:
                program = self.last_program if self.last_program is not None else self._program(True)
                self.last_program = program
            else:
                program = self.program if self.program is not None else self._program(False)
                self.program = program
            base = self.pass_index * m
            i, n = self.index, len(program)
            while i < n:
                mb, (what, stage, in_kind, in_stage, own, out_kind, data) = program[i]
                mb += base
                if in_kind is None:
                    deps = []
                else:
                    dep = done.get((in_kind, in_stage, mb))
                    if dep is None:
                        self.index = i
                        return ran
                    deps = [dep]
                if own:
                    dep = done.get((_FORWARD, stage, mb))
                    if dep is None:
                        self.index = i
                        return ran
                    deps.append(dep)
                if what is _RUN_CHAIN:
                    kind, chunks, durations, collectives, gathers, syncs, prefetch = data
                    # activation collectives block compute (`blocking`)
                    last, collective, times = lanes.compute_chain(durations, collectives, deps, self.last_tp_comm,
                                                                  gathers, syncs, prefetch)
                    if collective is not None:
                        self.last_tp_comm = collective
                    if recording:
                        chain = Chain(kind, stage, mb, chunks, times, prefetch)
                        lanes.records.append(chain)
                        self.memory.append(chain)
                    if out_kind is not None:
                        done[(out_kind, stage, mb)] = last
                elif what is _RUN_SEND:
                    duration, peer, peer_rank, what_name = data
                    self.flows += 1
                    done[(out_kind, stage, mb)] = self._comm(
                        "pp-p2p", ("{} {}->{} mb{}", what_name, stage, peer, mb), "pp", duration, deps,
                        flow=self.flows, peer=peer_rank)
                elif what is _RUN_SLOW:
                    kind, sync = data
                    if kind is F:
                        self._forward(stage, mb, deps)
                    elif kind is W:
                        self._weight(stage, mb, sync=sync)
                    else:
                        self._backward(stage, mb, deps, full=kind is B, sync=sync)
                i += 1
                ran = True
            self.pass_index += 1
            self.index = 0
        self._optimizer()
        self.finished = True
        return True

    def _gather(self, chunk, label: tuple, compute: list[Done]) -> list[Done]:
        if chunk.param_gather_s <= 0:
            return []
        bound = [compute[-2]] if len(compute) >= 2 else []
        return [self._comm("dp-comm", ("all-gather {}{}{} {}", *label), "fsdp", chunk.param_gather_s, bound)]

    def _forward(self, stage: int, mb: int, deps: list[Done]) -> None:
        compute: list[Done] = []
        memory = self.memory
        last = None
        for chunk in self.costs.stages[stage].chunks:
            label = (stage, "F", mb, chunk.name)
            ag = self._gather(chunk, label, compute) if chunk.param_gather_s > 0 else []
            comp = self._compute(("{}{}{} {}", *label), "compute", chunk.fwd_s, deps + ag)
            compute.append(comp)
            if memory is not None and chunk.activation_bytes:
                memory.append((comp[0], chunk.activation_bytes))
            last = comp
            if chunk.fwd_comm_s > 0:
                last = self._comm("tp-comm", ("{}{}{} {} collectives", *label), "tp", chunk.fwd_comm_s, [comp])
            deps = [last]
        self.done[(_FORWARD, stage, mb)] = last

    def _backward(self, stage: int, mb: int, deps: list[Done], *, full: bool, sync: bool) -> None:
        compute: list[Done] = []
        memory = self.memory
        last = None
        tag = "B" if full else "I"
        chunks = tuple(reversed(self.costs.stages[stage].chunks))
        labels = [(stage, tag, mb, chunk.name) for chunk in chunks]
        gathering = self.costs.gather_in_backward and any(c.param_gather_s > 0 for c in chunks)
        gathers: dict[int, list[Done]] = {}

        def gather(i: int) -> list[Done]:
            if i < len(chunks) and i not in gathers:
                gathers[i] = self._gather(chunks[i], labels[i], compute)
            return gathers.get(i, [])

        for i, chunk in enumerate(chunks):
            label = labels[i]
            ag = gather(i) if gathering else []
            duration = chunk.recompute_s + chunk.bwd_input_s + (chunk.bwd_weight_s if full else 0.0)
            comp = self._compute(("{}{}{} {}", *label), "compute", duration, deps + ag)
            compute.append(comp)
            if gathering:
                gather(i + 1)  # FSDP2's backward prefetch: the next unit's gather is issued before this one's reduce-scatter
            if memory is not None:
                if chunk.recompute_bytes:
                    memory.append((comp[1], chunk.recompute_bytes))
                    memory.append((comp[0], -chunk.recompute_bytes))
                if full and chunk.activation_bytes:
                    memory.append((comp[0], -chunk.activation_bytes))
            last = comp
            if chunk.bwd_comm_s > 0:
                last = self._comm("tp-comm", ("{}{}{} {} collectives", *label), "tp", chunk.bwd_comm_s, [comp])
            if full and sync and chunk.grad_sync_s > 0:
                self._comm("dp-comm", ("grad sync {}:{}", stage, chunk.name), "dp", chunk.grad_sync_s, [comp])
            deps = [last]
        self.done[(_BACKWARD, stage, mb)] = last

    def _weight(self, stage: int, mb: int, *, sync: bool) -> None:
        deps: list[Done] = []
        memory = self.memory
        for chunk in reversed(self.costs.stages[stage].chunks):
            comp = self._compute(("{}W{} {}", stage, mb, chunk.name), "compute", chunk.bwd_weight_s, deps)
            if memory is not None and chunk.activation_bytes:
                memory.append((comp[0], -chunk.activation_bytes))
            if sync and chunk.grad_sync_s > 0:
                self._comm("dp-comm", ("grad sync {}:{}", stage, chunk.name), "dp", chunk.grad_sync_s, [comp])
            deps = []

    def _optimizer(self) -> None:
        stages = [self.costs.stages[s] for s in self.sched.stages_of(self.rank)]
        last_comm = self.lanes.last_comm
        deps = [last_comm[s] for s in ("tp-comm", "dp-comm") if s in last_comm]
        opt_s = sum(s.optimizer_s for s in stages)
        if opt_s > 0:
            opt = self._compute("optimizer step", "optimizer", opt_s, deps)
            gather_s = sum(s.post_step_gather_s for s in stages)
            if gather_s > 0:
                self._comm("dp-comm", "all-gather updated shards", "dp", gather_s, [opt])
