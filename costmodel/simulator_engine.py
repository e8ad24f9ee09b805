"""Discrete-event simulation of a task graph over per-rank streams and shared links.

Model. A task has a duration, runs on one in-order stream of one rank (`compute`, `tp-comm`,
`dp-comm`, `pp-p2p`), depends on other tasks, and may occupy a link. It starts at

    start = max(end of its stream predecessor, end of its link predecessor, max end of its dependencies)

Streams are FIFO: a task never overtakes an earlier task of its stream (as on a CUDA stream or an
NCCL communicator). Link contention: every communication task names the link level it crosses on its
rank (`intra_node` for NVLink, `inter_node` for the NIC), and streams crossing one link of one rank
contend for it by priority class:
- latency-critical transfers (`tp-comm` activation collectives, `pp-p2p` pipeline sends) go first:
  they are serialized among themselves in issue order and never wait for bulk traffic (NCCL
  interleaves a small send with a running bucket rather than queueing it behind the whole sync);
- bulk transfers (`dp-comm`: gradient buckets, FSDP gathers) wait for every critical transfer issued
  before them on the link, and for each other through their own FIFO stream.
Every wait is a fixed edge in issue order, so the simulation is a max-plus system: making any task
shorter (more bandwidth, faster compute, fewer bytes) never delays another, and the predicted step is
monotone in every cost, which the planner's ranking relies on. (A first-ready-first-served link is
not: hypothesis found a case where shrinking every collective reordered a link and slowed the step.)
Compute never contends with communication here (NCCL's SM use is folded into its bandwidth numbers); where a
profile says collectives need the compute resources, `costmodel.simulator_step` puts their host share
on the compute stream as tasks of its own.

`run_tasks` takes the tasks in any dependency order (every edge is fixed, so the order does not change a
start time). Cost: O(T + E) for T tasks and E edges.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

STREAMS: tuple[str, ...] = ("compute", "tp-comm", "dp-comm", "pp-p2p")
CRITICAL_STREAMS = frozenset({"tp-comm", "pp-p2p"})
"""Streams whose transfers take a shared link before bulk (`dp-comm`) traffic."""


@dataclass(slots=True)
class Task:
    rank: int
    stream: str
    name: str
    category: str
    """compute, recompute, optimizer, tp, cp, ep, dp, fsdp, pp: what the time counts as."""
    duration: float
    deps: list[Hashable] = field(default_factory=list)
    """Ids or keys of the tasks this one waits for (see `TaskGraph.add`); ids after `run_tasks`."""
    link: str | None = None
    flow: int | None = None
    """Shared by a send and its receive, for the trace's flow arrows."""
    peer: int | None = None
    """For a pipeline transfer: the receiving rank."""
    start: float = 0.0
    end: float = 0.0


class TaskGraph:
    """Tasks in issue order per (rank, stream), with dependencies named by arbitrary keys."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self._key_to_id: dict[Hashable, int] = {}

    def add(self, task: Task, key: Hashable | None = None) -> int:
        tid = len(self.tasks)
        self.tasks.append(task)
        if key is not None:
            self._key_to_id[key] = tid
        return tid

    def key(self, key: Hashable, tid: int) -> None:
        """Name an existing task so later (or earlier) tasks can depend on it."""
        self._key_to_id[key] = tid

    def id_of(self, key: Hashable) -> int:
        return self._key_to_id[key]

    def has(self, key: Hashable) -> bool:
        return key in self._key_to_id


class Deadlock(RuntimeError):
    """The task graph has a cycle through stream order and dependencies."""


def run_tasks(graph: TaskGraph) -> list[Task]:
    """Assign start/end times to every task (in place) and return the tasks.

    Every wait is a fixed edge, so a task's start is the latest end among its predecessors whatever order
    the ready tasks are taken in: a plain work list (Kahn's order) gives the same times as a heap ordered
    by start, in O(T) rather than O(T log T)."""
    tasks = graph.tasks
    n = len(tasks)
    succ: list[list[int]] = [[] for _ in range(n)]
    waiting = [0] * n
    last_on_stream: dict[tuple[int, str], int] = {}
    last_critical: dict[tuple[int, str], int] = {}
    key_to_id = graph._key_to_id
    for tid, t in enumerate(tasks):
        lane = (t.rank, t.stream)
        prev = last_on_stream.get(lane)
        last_on_stream[lane] = tid
        if prev is not None:
            succ[prev].append(tid)
            waiting[tid] += 1
        if t.link is not None:
            link = (t.rank, t.link)
            prev = last_critical.get(link)
            if t.stream in CRITICAL_STREAMS:
                last_critical[link] = tid
            if prev is not None:
                succ[prev].append(tid)
                waiting[tid] += 1
        if t.deps:
            deps = t.deps = [key if isinstance(key, int) else key_to_id[key] for key in t.deps]
            for dep in deps:
                succ[dep].append(tid)
            waiting[tid] += len(deps)
    ready_at = [0.0] * n
    todo = [tid for tid in range(n - 1, -1, -1) if waiting[tid] == 0]
    finished = 0
    while todo:
        tid = todo.pop()
        t = tasks[tid]
        start = ready_at[tid]
        end = t.end = start + t.duration
        t.start = start
        finished += 1
        for s in succ[tid]:
            if end > ready_at[s]:
                ready_at[s] = end
            waiting[s] -= 1
            if waiting[s] == 0:
                todo.append(s)
    if finished != n:
        stuck = [tasks[i] for i in range(n) if waiting[i] > 0][:3]
        names = ", ".join(f"rank {t.rank} {t.stream} {t.name}" for t in stuck)
        raise Deadlock(f"{n - finished} tasks never became ready (a dependency cycle), e.g. {names}")
    return tasks
