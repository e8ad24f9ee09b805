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

Memory events ride along (`MemoryEvent`): activations are saved at a chunk's forward end and freed
at its backward end (at W's end when the backward is split, since W still reads them); recomputed
activations live during the chunk's backward. They draw the memory timeline; the peak itself is
`costmodel.memory_schedule.rank_activation_peaks`, the estimator's rule, and a test holds the two equal.
Buffers (FSDP's gathered units among them) are a constant per rank (`costmodel.memory.buffer_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.schedule import B, F, I, SEND_B, SEND_F, W, ActionKind
from costmodel.simulator_costs import StepCosts
from costmodel.simulator_engine import Task, TaskGraph


@dataclass(frozen=True, slots=True)
class MemoryEvent:
    task: int
    at_end: bool
    """Applied at the task's end (else at its start)."""
    delta: int
    """Activation bytes saved (+) or freed (-)."""


@dataclass
class StepGraph:
    graph: TaskGraph
    memory: list[MemoryEvent]


def build_step(costs: StepCosts) -> StepGraph:
    sched = costs.schedule
    graph = TaskGraph()
    memory: list[MemoryEvent] = []
    builder = _Builder(costs, graph, memory)
    for rank, actions in enumerate(sched.actions):
        final_bwd = _final_backward_per_stage(actions)
        for p in range(costs.grad_accum):
            for index, action in enumerate(actions):
                last_of_step = p == costs.grad_accum - 1 and final_bwd.get(action.stage) == index
                builder.action(rank, action, p * sched.num_microbatches + action.microbatch, last_of_step)
        builder.optimizer(rank)
    return StepGraph(graph, memory)


def _final_backward_per_stage(actions) -> dict[int, int]:
    final: dict[int, int] = {}
    for index, a in enumerate(actions):
        if a.kind in (B, W):
            final[a.stage] = index
    return final


class _Builder:
    def __init__(self, costs: StepCosts, graph: TaskGraph, memory: list[MemoryEvent]) -> None:
        self.costs, self.graph, self.memory = costs, graph, memory
        self.sched = costs.schedule
        self.last_stage = self.sched.num_stages - 1
        self.flows = 0
        self.last_comm: dict[tuple[int, str], int] = {}
        self.last_tp_comm: dict[int, int] = {}
        """Per rank, the last activation collective issued: the rank's next compute waits for it."""
        self.tasks, self.links, self.share = graph.tasks, costs.links, costs.comm_compute_share

    def _add(self, rank: int, stream: str, name: str, category: str, duration: float, deps, key=None) -> int:
        tasks = self.tasks
        if stream == "compute":
            blocking = self.last_tp_comm.get(rank)
            deps = list(deps) if blocking is None else [*deps, blocking]  # activation collectives block compute
            tasks.append(Task(rank, stream, name, category, duration, deps))
            tid = len(tasks) - 1
        else:
            link = self.links.get(stream)
            deps = list(deps)
            share = self.share * duration
            if share > 0:
                # the collective's host share runs on the compute stream, in issue order, then the rest on its own
                tasks.append(Task(rank, "compute", f"{name} (host share)", category, share, deps))
                deps, duration = [len(tasks) - 1], duration - share
            tasks.append(Task(rank, stream, name, category, duration, deps, link))
            tid = len(tasks) - 1
            self.last_comm[(rank, stream)] = tid
            if stream == "tp-comm":
                self.last_tp_comm[rank] = tid
        if key is not None:
            self.graph.key(key, tid)
        return tid

    def _input_dep(self, stage: int, kind: ActionKind, mb: int):
        """What the first chunk of F/B waits for: a transfer from another rank, or a local stage."""
        s2r = self.sched.stage_to_rank
        if kind is F:
            if stage == 0:
                return []
            remote = s2r[stage - 1] != s2r[stage]
            return [("xfer", F, stage - 1, mb) if remote else (F, stage - 1, mb)]
        if stage == self.last_stage:
            return []
        remote = s2r[stage + 1] != s2r[stage]
        return [("xfer", B, stage + 1, mb) if remote else (B, stage + 1, mb)]

    def action(self, rank: int, a, mb: int, last_of_step: bool) -> None:
        if a.kind is F:
            self._forward(rank, a.stage, mb)
        elif a.kind in (B, I):
            self._backward(rank, a.stage, mb, full=a.kind is B, sync=last_of_step or self.costs.grad_sync_every_microbatch)
        elif a.kind is W:
            self._weight(rank, a.stage, mb, sync=last_of_step or self.costs.grad_sync_every_microbatch)
        elif a.kind in (SEND_F, SEND_B):
            self._send(rank, a.stage, a.kind, mb)

    def _gather(self, rank: int, chunk, label: str, compute_ids: list[int]) -> list[int]:
        if chunk.param_gather_s <= 0:
            return []
        bound = [compute_ids[-2]] if len(compute_ids) >= 2 else []
        return [self._add(rank, "dp-comm", f"all-gather {label}", "fsdp", chunk.param_gather_s, bound)]

    def _forward(self, rank: int, stage: int, mb: int) -> None:
        deps = self._input_dep(stage, F, mb)
        compute_ids: list[int] = []
        last = None
        for chunk in self.costs.stages[stage].chunks:
            label = f"{stage}F{mb} {chunk.name}"
            ag = self._gather(rank, chunk, label, compute_ids)
            comp = self._add(rank, "compute", label, "compute", chunk.fwd_s, deps + ag)
            compute_ids.append(comp)
            self.memory.append(MemoryEvent(comp, True, chunk.activation_bytes))
            last = comp
            if chunk.fwd_comm_s > 0:
                last = self._add(rank, "tp-comm", f"{label} collectives", "tp", chunk.fwd_comm_s, [comp])
            deps = [last]
        self.graph.key((F, stage, mb), last)

    def _backward(self, rank: int, stage: int, mb: int, *, full: bool, sync: bool) -> None:
        deps = self._input_dep(stage, B, mb) + [(F, stage, mb)]
        compute_ids: list[int] = []
        last = None
        tag = "B" if full else "I"
        chunks = tuple(reversed(self.costs.stages[stage].chunks))
        labels = [f"{stage}{tag}{mb} {chunk.name}" for chunk in chunks]
        gathers: dict[int, list[int]] = {}

        def gather(i: int) -> list[int]:
            if i < len(chunks) and i not in gathers:
                gathers[i] = self._gather(rank, chunks[i], labels[i], compute_ids) if self.costs.gather_in_backward else []
            return gathers.get(i, [])

        for i, chunk in enumerate(chunks):
            label = labels[i]
            ag = gather(i)
            duration = chunk.recompute_s + chunk.bwd_input_s + (chunk.bwd_weight_s if full else 0.0)
            comp = self._add(rank, "compute", label, "compute", duration, deps + ag)
            compute_ids.append(comp)
            gather(i + 1)  # FSDP2's backward prefetch: the next unit's gather is issued before this one's reduce-scatter
            if chunk.recompute_bytes:
                self.memory.append(MemoryEvent(comp, False, chunk.recompute_bytes))
                self.memory.append(MemoryEvent(comp, True, -chunk.recompute_bytes))
            if full:
                self.memory.append(MemoryEvent(comp, True, -chunk.activation_bytes))
            last = comp
            if chunk.bwd_comm_s > 0:
                last = self._add(rank, "tp-comm", f"{label} collectives", "tp", chunk.bwd_comm_s, [comp])
            if full and sync and chunk.grad_sync_s > 0:
                self._add(rank, "dp-comm", f"grad sync {stage}:{chunk.name}", "dp", chunk.grad_sync_s, [comp])
            deps = [last]
        self.graph.key((B, stage, mb), last)

    def _weight(self, rank: int, stage: int, mb: int, *, sync: bool) -> None:
        deps: list = []
        last = None
        for chunk in reversed(self.costs.stages[stage].chunks):
            comp = self._add(rank, "compute", f"{stage}W{mb} {chunk.name}", "compute", chunk.bwd_weight_s, deps)
            self.memory.append(MemoryEvent(comp, True, -chunk.activation_bytes))
            if sync and chunk.grad_sync_s > 0:
                self._add(rank, "dp-comm", f"grad sync {stage}:{chunk.name}", "dp", chunk.grad_sync_s, [comp])
            last = comp
        self.graph.key((W, stage, mb), last)

    def _send(self, rank: int, stage: int, kind: ActionKind, mb: int) -> None:
        fwd = kind is SEND_F
        cost = self.costs.stages[stage]
        duration = cost.send_activation_s if fwd else cost.send_gradient_s
        peer_stage = stage + 1 if fwd else stage - 1
        self.flows += 1
        tid = self._add(
            rank, "pp-p2p", f"{'send activation' if fwd else 'send gradient'} {stage}->{peer_stage} mb{mb}", "pp",
            duration, [(F if fwd else B, stage, mb)], key=("xfer", F if fwd else B, stage, mb),
        )
        task = self.graph.tasks[tid]
        task.flow, task.peer = self.flows, self.sched.stage_to_rank[peer_stage]

    def optimizer(self, rank: int) -> None:
        stages = [self.costs.stages[s] for s in self.sched.stages_of(rank)]
        deps = [self.last_comm[(rank, s)] for s in ("tp-comm", "dp-comm") if (rank, s) in self.last_comm]
        opt_s = sum(s.optimizer_s for s in stages)
        if opt_s > 0:
            opt = self._add(rank, "compute", "optimizer step", "optimizer", opt_s, deps)
            gather_s = sum(s.post_step_gather_s for s in stages)
            if gather_s > 0:
                self._add(rank, "dp-comm", "all-gather updated shards", "dp", gather_s, [opt])
