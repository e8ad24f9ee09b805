"""Collective microbenchmarks: torch.distributed collectives over message sizes and group sizes.

`run_collectives` spawns `group_size` processes that rendezvous over TCP on 127.0.0.1 (gloo on CPU,
NCCL with one GPU per rank on CUDA) and time every `CommCase`. Sizes follow nccl-tests' "size", the
same convention as `costmodel.collectives.collective_time`: the full buffer per rank (all-reduce: the
tensor; all-gather: the gathered output; reduce-scatter: the input; all-to-all: the send buffer;
send_recv: the message).

Timing, per case, on every rank: two warm-up calls; a probe call whose slowest-rank time fixes a repeat
count `r` (identical on every rank, so no rank waits on a collective the others skip); then
`samples · r` calls back to back, each timed on its own. A rank's figure is the median call (gloo on
a loaded CPU stalls now and then for milliseconds: the median keeps the typical call, the stalls would
swamp a mean), and the case's figure is the slowest rank's (an all-reduce MAX outside the timed
region). send_recv is a ping-pong between rank pairs (0↔1, 2↔3, ...) at the same time, reported as
half the round trip.
"""

from __future__ import annotations

import datetime as _dt
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class CommCase:
    kind: str
    nbytes: int
    group_size: int

    @property
    def label(self) -> str:
        return f"{self.kind} {self.nbytes} B x{self.group_size}"


@dataclass(frozen=True)
class CommSample:
    case: CommCase
    seconds: float


@dataclass(frozen=True)
class RankMemory:
    """Memory one rank holds once torch and its process group are up: the per-process context overhead
    (CPU: resident set size; CUDA: device memory in use before any tensor is allocated)."""

    nbytes: int


@dataclass(frozen=True, kw_only=True)
class CommTimingConfig:
    """How each collective is timed (see the module docstring)."""

    samples: int = 9
    """Timed samples per case (each of `r` calls); the median call is kept."""
    sample_s: float = 0.03
    """Minimum length of one sample: small messages repeat back to back to reach it."""
    max_case_s: float = 1.5
    """Soft cap on one case's time: fewer samples for slow cases, never fewer than 3."""
    timeout_s: float = 300.0
    """Give up on a process group that does not finish in this time."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_call(kind: str, nbytes: int, rank: int, world: int, device: str) -> Callable[[], None]:
    import torch
    import torch.distributed as dist

    elems = max(world, nbytes // 4 // world * world)
    full = torch.ones(elems, dtype=torch.float32, device=device)
    part = torch.ones(elems // world, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full)
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)
    peer = rank ^ 1
    if peer >= world:
        return lambda: None

    def ping_pong() -> None:
        if rank % 2 == 0:
            dist.send(full, peer)
            dist.recv(full, peer)
        else:
            dist.recv(full, peer)
            dist.send(full, peer)

    return ping_pong


def _worker(rank: int, world: int, port: int, device: str, cases: list[CommCase], timing: CommTimingConfig,
            threads: int, queue: mp.Queue) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename notice
    torch.set_num_threads(threads)
    backend = "nccl" if device == "cuda" else "gloo"
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=_dt.timedelta(seconds=timing.timeout_s))
    try:
        dist.barrier()
        if rank == 0:
            queue.put(RankMemory(_context_bytes(device)))
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        slowest = torch.zeros(1, dtype=torch.float64, device=dev)

        def max_over_ranks(seconds: float) -> float:
            slowest.fill_(seconds)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            return float(slowest.item())

        for case in cases:
            call = _collective_call(case.kind, case.nbytes, rank, world, dev)
            for _ in range(2):
                call()
            sync()
            dist.barrier()
            start = time.perf_counter()
            call()
            sync()
            probe = max(max_over_ranks(time.perf_counter() - start), 1e-7)
            repeat = max(1, int(timing.sample_s / probe))
            samples = max(3, min(timing.samples, int(timing.max_case_s / (probe * repeat))))
            per_call = []
            dist.barrier()
            for _ in range(samples * repeat):
                start = time.perf_counter()
                call()
                sync()
                per_call.append(time.perf_counter() - start)
            seconds = max_over_ranks(statistics.median(per_call))
            if case.kind == "send_recv":
                seconds /= 2
            if rank == 0:
                queue.put(CommSample(case, seconds))
            del call
    finally:
        dist.destroy_process_group()


def _context_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return total - free
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run_collectives(cases: list[CommCase], *, group_size: int, device: str, timing: CommTimingConfig,
                    threads: int = 1) -> Iterator[CommSample | RankMemory]:
    """Spawn `group_size` ranks, time `cases` (all of that group size), and yield rank 0's context memory,
    then the samples as they finish."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    env_backup = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        procs = [ctx.Process(target=_worker, args=(r, group_size, port, device, cases, timing, threads, queue))
                 for r in range(group_size)]
        for p in procs:
            p.start()
    finally:
        if env_backup is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_backup
    try:
        received = 0
        deadline = time.monotonic() + timing.timeout_s
        while received < len(cases):
            if time.monotonic() > deadline:
                raise TimeoutError(f"collective benchmark on {group_size} ranks did not finish in {timing.timeout_s} s")
            try:
                sample = queue.get(timeout=1.0)
            except Exception:  # queue.Empty: check the workers are still alive
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a collective benchmark rank exited with code {dead[0].exitcode}") from None
                continue
            received += isinstance(sample, CommSample)
            yield sample
    finally:
        killed = stop_workers(procs)
    check_workers(procs, f"the collective benchmark on {group_size} ranks", killed=killed)


def stop_workers(procs: list, timeout_s: float = 30.0) -> set[int]:
    """Join the workers; kill the ones still running after `timeout_s` (a teardown that hangs once every result
    is in) and return their indices."""
    killed = set()
    for rank, p in enumerate(procs):
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
            p.join()
            killed.add(rank)
    return killed


def check_workers(procs: list, what: str, *, killed: set[int] = frozenset()) -> None:
    """Raise if a worker process failed on its own, even after sending its results: a rank that aborts (a C++
    `terminate`, a signal) is a crash of the calibration, not a measurement. The ones `stop_workers` killed
    had delivered everything and only hung at exit."""
    import signal

    for rank, p in enumerate(procs):
        code = p.exitcode
        if code and rank not in killed:
            how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
                else f"exit code {code}"
            raise RuntimeError(f"{what}: rank {rank} ended with {how}; nothing was written")
