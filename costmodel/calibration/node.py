"""`soap calibrate`: how a rank behaves inside a training step, beside the kernel and collective sweeps.

The kernel sweeps time one kernel at a time on one process while the rest of the machine idles; a
training step differs in three ways this module measures, each written to an optional device field
(`costmodel.profiles`):

- `optimizer_factors` (`measure_optimizer`, `optimizer_factor_points`): torch's optimizer as the
  executor builds it (AdamW, foreach on CPU, fused on CUDA, over fp32 parameters: the executor keeps fp32
  masters at every precision) stepping over parameter sets of 2^17 to 2^23 elements on CPU, 2^23 to 2^27
  on CUDA (tensors of `OPTIMIZER_TENSOR_ELEMENTS`: a model's weight matrices, 4M elements on CUDA), each
  time divided by the cost model's one-pass estimate at the fitted memory curve (`costmodel.optimizer_step`):
  the factor per byte size. The tensor size matters: on an H100 (2026-11-26,
  benchmarks/data/h100-2026-11-26/adamw-fused.json) fused AdamW over 2^28 fp32 elements took 57 ms in
  32K-element tensors and 3.1 ms in 4M-element ones (2.4 TB/s); the 32K sweep had priced a 1.9B-parameter
  step at 177 ms where the run's whole step was 359 ms.
- `concurrency_efficiency` (`measure_concurrency`): a kernel mix (`_kernel_mix`: a matmul, an add over
  4 MiB, a tanh) timed on 1 process, then on n = 2, 4, ... up to `nproc` processes at once (started
  together); the efficiency at n is the time alone over the mean time at n, each the fastest of two
  rounds. Ranks of one node share
  caches, memory bandwidth and, on a VM, whatever the host gives its vCPUs.
- `communication_overlap` (`measure_overlap`): on 2 ranks, a compute loop alone (c), an all-reduce
  alone (m), and the all-reduce started asynchronously with the loop run beside it (b); the overlap is
  (c + m - b) / min(c, m), clamped to [0, 1]: 1 when the two run side by side, 0 when they take turns;
  `soap calibrate` keeps the median of three process groups (it varies with how the host schedules the
  ranks' compute and gloo threads).
  The all-reduce is `OVERLAP_MESSAGE_BYTES` and the loop is sized to take about as long.
- `collective_call_overhead_us` (same 2 ranks, `_framework_overhead`): what a training framework
  spends per collective it issues beyond the collective itself — FSDP2's copy-in/out, hooks and stream
  bookkeeping, DTensor's redistribution — measured on `CALL_OVERHEAD_UNITS` tiny `fully_shard` units
  (64x64 linears, so each collective is latency only): (step time sharded - step time plain) / calls,
  less one bare all-gather of a unit's shard. A slow host pays this per call; on a GPU it hides behind
  asynchronous kernel launches, so GPU profiles leave it out (0).
On CUDA the three are measured the same way (fused AdamW; GPUs do not share SMs, and NCCL runs on its
own), so a GPU profile gets near-neutral values.
"""

from __future__ import annotations

import datetime as _dt
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass

from costmodel.calibration.microbench_comm import check_workers, stop_workers

OPTIMIZER_TENSOR_ELEMENTS = {"cpu": 2**15, "cuda": 2**22}
"""Elements per parameter tensor of the optimizer sweep: on CPU the validate suite's tiny models (32-64K
average), on a GPU a model's weight matrices (Llama's are 4M-59M elements)."""
OPTIMIZER_SWEEP_ELEMENTS = {"cpu": tuple(2**k for k in range(17, 24, 2)), "cuda": (2**23, 2**25, 2**27)}
OPTIMIZER_QUICK_ELEMENTS = (2**17,)
OVERLAP_MESSAGE_BYTES = 8 * 2**20
CALL_OVERHEAD_UNITS = 6
MIX_SECONDS = 1.0
"""How long each process of the concurrency measurement repeats the kernel mix."""


@dataclass(frozen=True)
class OptimizerSample:
    optimizer: str
    precision: str
    elements: int
    seconds: float


@dataclass(frozen=True)
class NodeMeasurements:
    """What this module measured (each may be empty / None when not measured)."""

    optimizer: tuple[OptimizerSample, ...] = ()
    concurrency: tuple[tuple[int, float], ...] = ()
    """(ranks at once, efficiency), starting at (1, 1.0)."""
    overlap: float | None = None
    call_overhead_s: float | None = None


def _sync(device: str):
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def measure_optimizer(device: str, *, precision: str, quick: bool, repeats: int = 5) -> list[OptimizerSample]:
    """Median step time of AdamW over parameter sets of each size (see the module docstring)."""
    import torch

    kind = "cuda" if device == "cuda" else "cpu"
    size = OPTIMIZER_TENSOR_ELEMENTS[kind]
    sync = _sync(device)
    samples = []
    for elements in OPTIMIZER_QUICK_ELEMENTS if quick else OPTIMIZER_SWEEP_ELEMENTS[kind]:
        tensor = min(size, elements)
        count = max(1, elements // tensor)
        params = [torch.nn.Parameter(torch.randn(tensor, device=device, dtype=torch.float32)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        kwargs = {"fused": True} if device == "cuda" else {"foreach": True}
        opt = torch.optim.AdamW(params, lr=1e-4, **kwargs)
        opt.step()  # creates the state
        times = []
        for _ in range(repeats + 1):
            sync()
            start = time.perf_counter()
            opt.step()
            sync()
            times.append(time.perf_counter() - start)
        samples.append(OptimizerSample("adamw", precision, count * tensor, statistics.median(times[1:])))
        del opt, params
    return samples


def optimizer_factor_points(samples: list[OptimizerSample], device_json: dict) -> dict[str, list[list[float]]]:
    """`optimizer_factors.factors` of the fitted device: measured over estimated, against the bytes."""
    from costmodel.optimizer_step import memory_pass_time, optimizer_step_bytes
    from costmodel.profiles_json import MAX_FACTOR, device_from_json

    device = device_from_json(device_json, "fitted device")
    table: dict[str, list[list[float]]] = {}
    for s in sorted(samples, key=lambda s: s.elements):
        nbytes = optimizer_step_bytes(s.elements, precision=s.precision, optimizer=s.optimizer)
        # A step small enough to be all launch overhead can exceed the loader's bound; it saturates there
        # rather than making calibrate write a profile its own loader refuses.
        factor = min(s.seconds / memory_pass_time(device, nbytes), MAX_FACTOR)
        table.setdefault(f"{s.optimizer}/{s.precision}", []).append([float(f"{nbytes:.4g}"), float(f"{factor:.4g}")])
    return table


def _kernel_mix(device: str):
    import torch

    a, b = torch.randn(512, 256, device=device), torch.randn(256, 512, device=device)
    x, y = torch.randn(2**20, device=device), torch.randn(2**20, device=device)
    z = torch.randn(2**16, device=device)

    def mix() -> None:
        torch.mm(a, b)
        torch.add(x, y)
        torch.tanh(z)

    return mix


def _mix_worker(rank: int, device: str, threads: int, barrier, queue) -> None:
    import torch

    torch.set_num_threads(threads)
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    mix, sync = _kernel_mix(dev), _sync(device)
    for _ in range(20):
        mix()
    sync()
    barrier.wait()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < MIX_SECONDS:
        mix()
        calls += 1
    sync()
    queue.put((time.perf_counter() - start) / calls)


def _start(ctx, target, arglists: list[tuple], threads: int) -> list:
    """Start one spawned process per argument tuple, each with OMP_NUM_THREADS=`threads` (the parent's
    environment is restored)."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        procs = [ctx.Process(target=target, args=args) for args in arglists]
        for p in procs:
            p.start()
        return procs
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def _mix_time(processes: int, device: str, threads: int) -> float:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(processes), ctx.Queue()
    procs = _start(ctx, _mix_worker, [(r, device, threads, barrier, queue) for r in range(processes)], threads)
    try:
        times = [queue.get(timeout=120) for _ in procs]
    finally:
        killed = stop_workers(procs)
    check_workers(procs, f"the concurrency benchmark on {processes} processes", killed=killed)
    return statistics.mean(times)


def measure_concurrency(nproc: int, device: str, threads: int, rounds: int = 2) -> list[tuple[int, float]]:
    """(n, efficiency) for n = 1, 2, 4, ... up to `nproc` (CUDA: up to the visible GPUs); each count keeps
    its fastest of `rounds` rounds (another program on the machine only ever slows a round down)."""
    counts = [1]
    while counts[-1] * 2 <= nproc:
        counts.append(counts[-1] * 2)
    best = {n: min(_mix_time(n, device, threads) for _ in range(rounds)) for n in counts}
    return [(n, min(1.0, best[1] / best[n])) for n in counts]


def _overlap_worker(rank: int, port: int, device: str, threads: int, queue) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename notice
    torch.set_num_threads(threads)
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2, timeout=_dt.timedelta(seconds=120))
    try:
        sync = _sync(device)
        message = torch.ones(OVERLAP_MESSAGE_BYTES // 4, device=dev)
        a, b = torch.randn(512, 512, device=dev), torch.randn(512, 512, device=dev)

        def timed(fn) -> float:
            sync()
            dist.barrier()
            start = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - start

        def reduce() -> None:
            dist.all_reduce(message)

        for _ in range(3):
            reduce()
        comm = statistics.median(timed(reduce) for _ in range(5))
        one = statistics.median(timed(lambda: torch.mm(a, b)) for _ in range(5))
        repeats = max(1, int(comm / max(one, 1e-9)))

        def compute() -> None:
            for _ in range(repeats):
                torch.mm(a, b)

        def both() -> None:
            work = dist.all_reduce(message, async_op=True)
            compute()
            work.wait()

        rounds = [(timed(compute), timed(reduce), timed(both)) for _ in range(5)]
        c, m, t = (statistics.median(r[i] for r in rounds) for i in range(3))
        call = _framework_overhead(dev, timed)
        if rank == 0:
            queue.put((max(0.0, min(1.0, (c + m - t) / min(c, m))), call))
    finally:
        dist.destroy_process_group()


def _framework_overhead(dev: str, timed) -> float:
    """Seconds per collective FSDP2 issues beyond the collective (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(CALL_OVERHEAD_UNITS)]).to(dev)

    plain, sharded = model(), model()
    mesh = init_device_mesh(dev.split(":")[0], (2,))
    for unit in sharded:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=False)
    x = torch.randn(8, 64, device=dev)
    shard = torch.ones((64 * 64 + 64) // 2, device=dev)
    gathered = torch.empty(2 * shard.numel(), device=dev)

    def step(m: torch.nn.Module):
        return lambda: m(x).sum().backward()

    def gather() -> None:
        dist.all_gather_into_tensor(gathered, shard)

    times = {}
    for name, fn in (("plain", step(plain)), ("sharded", step(sharded)), ("gather", gather)):
        for _ in range(3):
            fn()
        times[name] = statistics.median(timed(fn) for _ in range(15))
    calls = 3 * CALL_OVERHEAD_UNITS - 1  # all-gathers: forward, backward (all but the last unit); reduce-scatters
    return max(0.0, (times["sharded"] - times["plain"]) / calls - times["gather"])


def measure_overlap(device: str, threads: int) -> tuple[float, float]:
    """`communication_overlap` and the per-call framework overhead (seconds) from 2 ranks (see the module
    docstring)."""
    from costmodel.calibration.microbench_comm import _free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = _start(ctx, _overlap_worker, [(r, port, device, threads, queue) for r in range(2)], threads)
    try:
        overlap, call = queue.get(timeout=300)
    finally:
        killed = stop_workers(procs)
    check_workers(procs, "the overlap benchmark on 2 ranks", killed=killed)
    return float(overlap), float(call)


def node_fields(meas: NodeMeasurements, device_json: dict, source: str) -> dict:
    """The optional device fields for what was measured, each with `source`."""
    out: dict = {}
    if meas.optimizer:
        out["optimizer_factors"] = {"source": source, "factors": optimizer_factor_points(list(meas.optimizer), device_json)}
    if len(meas.concurrency) > 1:
        out["concurrency_efficiency"] = {"points": [[float(n), float(f"{max(e, 1e-3):.4g}")] for n, e in meas.concurrency],
                                         "source": source}
    if meas.overlap is not None:
        out["communication_overlap"] = {"value": float(f"{meas.overlap:.3g}"), "source": source}
    if meas.call_overhead_s is not None:
        out["collective_call_overhead_us"] = {"value": float(f"{meas.call_overhead_s * 1e6:.4g}"), "source": source}
    return out
