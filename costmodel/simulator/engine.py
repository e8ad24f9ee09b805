"""Discrete-event simulation of one rank's tasks over its streams and shared links.

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
profile says collectives need the compute resources, `costmodel.simulator.step` puts their host share
on the compute stream as tasks of its own.

Evaluation (`RankLanes.compute_task`, `comm_task`; `compute_chain` for one action's chunks). Every edge
points to a task issued before it: its stream and link predecessors by definition, its dependencies
because a rank issues its actions in the schedule's order (a local input comes from an earlier action) or
waits for another rank's pipeline transfer, which `costmodel.simulator.step` issues first (it switches
ranks where an action's transfer is not issued yet, as `costmodel.schedule.dry_run` does, and raises
`Deadlock` where no rank can go on). So each task is timed the moment it is issued, from ends already
known: no task graph, no queue, O(1) per edge. A finished task is a `Done` (end, start, category, rank), all that a later task or the breakdown reads.

Time breakdown of the rank (reported by `costmodel.simulator.result`), accumulated as its compute-stream
tasks are issued: a gap before a compute-stream task is blamed on its binding dependency (the first of
its latest-ending dependencies): none, or one that ended before the gap closed -> other; a pipeline
transfer -> exposed communication for the part of the gap the transfer covers, bubble for the rest; a
collective of this rank -> exposed communication; anything else (another stage's compute) -> bubble.
A compute-stream task counts as optimizer, exposed communication (a collective's host share) or compute
by its category. The idle tail after the rank's last compute is added by `RankLanes.breakdown`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

STREAMS: tuple[str, ...] = ("compute", "tp-comm", "dp-comm", "pp-p2p")
CRITICAL_STREAMS = frozenset({"tp-comm", "pp-p2p"})
"""Streams whose transfers take a shared link before bulk (`dp-comm`) traffic."""
COMM_CATEGORIES = frozenset({"tp", "cp", "ep", "dp", "fsdp", "pp"})


Done = tuple
"""A timed task as a dependency and the breakdown see it: (end, start, category, rank), a plain tuple (a
step issues tens of thousands); category is what its time counts as (compute, recompute, optimizer, tp,
cp, ep, dp, fsdp, pp)."""


class Deadlock(RuntimeError):
    """The tasks have a cycle through stream order and dependencies."""


class RankLanes:
    """One rank's streams and links while its tasks are issued in order (see the module docstring).

    `records` (None unless asked for: a search reads only the step time, breakdown and peaks) keeps every
    task of positive duration for the timeline, in issue order, as (stream, name, category, start, end,
    flow, peer), `name` a string or a template and its arguments (names are only read when the timeline
    is drawn), or as one record of a chain of them (`costmodel.simulator.step`'s chains, expanded when
    read)."""

    __slots__ = ("rank", "links", "lane_end", "critical_end", "last_comm", "records", "compute", "optimizer",
                 "exposed", "bubble", "other", "compute_end", "comm_end")

    def __init__(self, rank: int, links: Mapping[str, str], *, record: bool = False) -> None:
        self.rank, self.links = rank, links
        self.lane_end: dict[str, float] = {}
        """End of the last task issued on each communication stream."""
        self.critical_end: dict[str, float] = {}
        """End of the last critical transfer issued on each link."""
        self.last_comm: dict[str, Done] = {}
        """The last task issued on each communication stream."""
        self.records: list | None = [] if record else None
        self.compute = self.optimizer = self.exposed = self.bubble = self.other = 0.0
        self.compute_end = 0.0
        """End of the last compute-stream task (the stream is FIFO: the latest end so far)."""
        self.comm_end = 0.0
        """Latest end of this rank's communication tasks."""

    def compute_task(self, name, category: str, duration: float, deps: Sequence[Done]) -> Done:
        """Issue a task on the compute stream; `deps` in the order whose first latest end binds a gap."""
        binding = None
        for d in deps:
            if binding is None or d[0] > binding[0]:
                binding = d
        prev_end = self.compute_end
        start = prev_end if binding is None or binding[0] <= prev_end else binding[0]
        gap = start - prev_end
        if gap > 1e-15:
            if binding is None or binding[0] < start - 1e-12:
                self.other += gap
            elif binding[2] == "pp":
                covered = max(0.0, binding[0] - max(prev_end, binding[1]))
                self.exposed += min(gap, covered)
                self.bubble += gap - min(gap, covered)
            elif binding[2] in COMM_CATEGORIES and binding[3] == self.rank:
                self.exposed += gap
            else:
                self.bubble += gap
        if category == "optimizer":
            self.optimizer += duration
        elif category in COMM_CATEGORIES:  # a collective's host share (`costmodel.simulator.step`)
            self.exposed += duration
        else:
            self.compute += duration
        end = self.compute_end = start + duration
        if duration > 0 and name is not None and self.records is not None:  # name None: the caller records it
            self.records.append(("compute", name, category, start, end, None, None))
        return (end, start, category, self.rank)

    def compute_chain(self, durations: Sequence[float], collectives: Sequence[float] | None, deps: list[Done],
                      blocking: Done | None = None, gathers: Sequence[float] | None = None,
                      syncs: Sequence[float] | None = None, prefetch: bool = False
                      ) -> tuple[Done, Done | None, list[tuple] | None]:
        """Issue one action's chunks, as `compute_task` and `comm_task` would one by one with nothing else
        issued between them and no host share, timed the same in one loop. Chunk i is its compute
        (`durations[i]`), then where the lists say so (None: nowhere): its activation collective on the
        tp-comm stream (`collectives[i] > 0`; the rank's next compute waits for it) and its gradient bucket
        on the dp-comm stream (`syncs[i] > 0`, after the compute); and before it, the all-gather of its
        parameters on the dp-comm stream (`gathers[i] > 0`), which waits for the compute two chunks back:
        issued just before the compute, or with `prefetch` (FSDP2's backward) just after the previous
        compute (the first before the first compute). The first compute waits for `deps`, its gather and
        `blocking` (the rank's last collective), in that order; each later one for the chunk before it
        (its collective, or its compute) and its gather, and starts at the later end: a gap is this rank's
        exposed communication (the rank's last collective ended before the chunk before it). A transfer
        starts at the latest of what it waits for, its stream's last end and its link's last critical
        transfer (collectives are critical, gathers and buckets not).

        Records nothing (the caller records the chain). Returns (the last chunk's last task, its collective
        or the compute; the last collective or None; when recording, per chunk (compute start, compute end,
        collective start, end, bucket start, end, gather start, end), None where absent; else None)."""
        rank = self.rank
        record = self.records is not None
        if collectives is None and gathers is None and syncs is None:  # each compute starts at the last one's end
            first = self.compute_task(None, "compute", durations[0], deps + [blocking] if blocking is not None else deps)
            start, end = first[1], first[0]
            times = [(start, end, None, None, None, None, None, None)] if record else None
            compute = self.compute
            for duration in durations[1:]:
                compute += duration
                start, end = end, end + duration
                if times is not None:
                    times.append((start, end, None, None, None, None, None, None))
            self.compute, self.compute_end = compute, end
            return (end, start, "compute", rank), None, times

        links, critical_end, lane_end = self.links, self.critical_end, self.lane_end
        tp_link, dp_link = links.get("tp-comm"), links.get("dp-comm")
        tp_critical = critical_end.get(tp_link, 0.0) if tp_link is not None else 0.0
        dp_critical = critical_end.get(dp_link, 0.0) if dp_link is not None else 0.0
        shared_link = tp_link is not None and tp_link == dp_link
        tp_end, dp_end = lane_end.get("tp-comm", 0.0), lane_end.get("dp-comm", 0.0)
        comm_end = self.comm_end
        last_tp = last_dp = None  # (start, end[, category]) of the last collective / dp-comm transfer issued here
        n = len(durations)
        gathered: list = [None] * n  # (start, end) of each chunk's gather

        def gather(i: int, bound: float) -> None:
            nonlocal dp_end, comm_end, last_dp
            start = dp_end if dp_end >= dp_critical else dp_critical
            if bound > start:
                start = bound
            end = dp_end = start + gathers[i]
            if end > comm_end:
                comm_end = end
            gathered[i] = (start, end)
            last_dp = (start, end, "fsdp")

        if gathers is not None and gathers[0] > 0:
            gather(0, 0.0)
        first_deps = list(deps)
        if gathered[0] is not None:
            first_deps.append((gathered[0][1], gathered[0][0], "fsdp", rank))
        if blocking is not None:
            first_deps.append(blocking)
        first = self.compute_task(None, "compute", durations[0], first_deps)
        compute, exposed = self.compute, self.exposed
        start, end = first[1], first[0]
        before = before2 = -1.0  # ends of the computes one and two chunks back (-1: none)
        rows: list | None = [] if record else None
        i = 0
        while True:
            if prefetch and gathers is not None and i + 1 < n and gathers[i + 1] > 0:
                gather(i + 1, before if i >= 1 else 0.0)
            comm_start = comm_end_i = None
            if collectives is not None and collectives[i] > 0:
                comm_start = tp_end if tp_end >= tp_critical else tp_critical
                if end > comm_start:
                    comm_start = end
                comm_end_i = tp_end = tp_critical = comm_start + collectives[i]
                if shared_link:
                    dp_critical = comm_end_i
                if comm_end_i > comm_end:
                    comm_end = comm_end_i
                last_tp = (comm_start, comm_end_i)
                ready = comm_end_i
            else:
                ready = end
            sync_start = sync_end = None
            if syncs is not None and syncs[i] > 0:
                sync_start = dp_end if dp_end >= dp_critical else dp_critical
                if end > sync_start:
                    sync_start = end
                sync_end = dp_end = sync_start + syncs[i]
                if sync_end > comm_end:
                    comm_end = sync_end
                last_dp = (sync_start, sync_end, "dp")
            if rows is not None:
                rows.append([start, end, comm_start, comm_end_i, sync_start, sync_end])
            i += 1
            if i == n:
                break
            before2, before = before, end
            if not prefetch and gathers is not None and gathers[i] > 0:
                gather(i, before2 if i >= 2 else 0.0)
            next_start = ready
            if gathered[i] is not None and gathered[i][1] > next_start:
                next_start = gathered[i][1]
            gap = next_start - end
            if gap > 1e-15:  # bound by this rank's collective or gather, which ended at `next_start`
                exposed += gap
            duration = durations[i]
            compute += duration
            start, end = next_start, next_start + duration
        self.compute, self.exposed, self.compute_end, self.comm_end = compute, exposed, end, comm_end
        last_collective = None
        if last_tp is not None:
            lane_end["tp-comm"] = tp_end
            if tp_link is not None:
                critical_end[tp_link] = tp_critical
            last_collective = self.last_comm["tp-comm"] = (last_tp[1], last_tp[0], "tp", rank)
        if last_dp is not None:
            lane_end["dp-comm"] = dp_end
            self.last_comm["dp-comm"] = (last_dp[1], last_dp[0], last_dp[2], rank)
        times = None
        if rows is not None:
            times = [(*row, *(gathered[k] or (None, None))) for k, row in enumerate(rows)]
        last = last_collective if collectives is not None and collectives[n - 1] > 0 else (end, start, "compute", rank)
        return last, last_collective, times

    def comm_task(self, stream: str, name, category: str, duration: float, deps: Sequence[Done],
                  flow: int | None = None, peer: int | None = None) -> Done:
        """Issue a task on a communication stream, behind the critical transfers issued before it on its link."""
        start = self.lane_end.get(stream, 0.0)
        link = self.links.get(stream)
        if link is not None:
            start = max(start, self.critical_end.get(link, 0.0))
        for d in deps:
            if d[0] > start:
                start = d[0]
        end = start + duration
        self.lane_end[stream] = end
        if link is not None and stream in CRITICAL_STREAMS:
            self.critical_end[link] = end
        if end > self.comm_end:
            self.comm_end = end
        if duration > 0 and self.records is not None:
            self.records.append((stream, name, category, start, end, flow, peer))
        done = self.last_comm[stream] = (end, start, category, self.rank)
        return done

    @property
    def end(self) -> float:
        """The rank's last task end."""
        return max(self.compute_end, self.comm_end)

    def breakdown(self, step: float) -> tuple[float, float, float, float, float]:
        """The rank's (compute, exposed_comm, bubble, optimizer, other) once the step (the last end over all
        ranks) is known: the idle tail after its last compute is exposed communication while its own
        transfers run, bubble after."""
        exposed, bubble = self.exposed, self.bubble
        tail = step - self.compute_end
        if tail > 0:
            comm_tail = min(tail, max(0.0, self.comm_end - self.compute_end))
            exposed += comm_tail
            bubble += tail - comm_tail
        return self.compute, exposed, bubble, self.optimizer, self.other
