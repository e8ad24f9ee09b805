"""Executing the validation suite: every plan, one after another, in one group of spawned ranks.

All the suite's plans share a world size, so the ranks are spawned once (torch.multiprocessing, a
file store) and each rank runs every plan with `executor.train.train`, as `soap execute` would.

Measured step time: the median of the steps after the first (the first pays lazy initialization:
allocator growth, gloo connections, autograd graph caches).

Time and memory come from two runs of each plan, because measuring memory on the CPU slows the step:
the memory run allocates every tensor above 64 KiB as its own mmap (below), so each step page-faults
its activations in afresh (the tiny suite's steps took 40-60% longer that way, and two ranks faulting
at once more still). So each rank first runs every plan for
`MEMORY_STEPS` steps (enough for the optimizer state to exist) with the 64 KiB threshold, measuring
memory; then sets glibc's thresholds to where its dynamic defaults settle once a training step has
freed its tensors (`HEAP_MMAP_THRESHOLD`, `HEAP_TRIM_THRESHOLD`), as in a plain `soap execute`, and
runs every plan again for the timed steps. (Timing first would leave heap chunks that later memory
runs reuse without returning them, inflating their peaks.)

Measured peak memory, per rank, max over ranks (the simulator's `peak_memory_gib` is a max over ranks):
- CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, i.e. what the caching
  allocator handed out (the simulator's context overhead is excluded on both sides). The window's
  absolute peaks of `max_memory_allocated` and `max_memory_reserved` (what the allocator took from the
  device: live tensors plus fragmentation and per-stream pools) are recorded beside it
  (`Measurement.allocator_peaks_gib`), for `soap calibrate --from-runs` to fit the device's
  `allocator_reserve_fraction` from their ratio.
- CPU: peak resident-set growth of the rank's process during the plan: VmHWM from /proc/self/status
  after resetting it (`echo 5 > /proc/self/clear_refs`) at the plan's start, minus VmRSS at that
  moment. The ranks run with `MALLOC_MMAP_THRESHOLD_=65536`, so every tensor storage above 64 KiB is
  its own mmap and goes back to the OS when freed, and `malloc_trim(0)` runs between plans: the RSS
  then follows the live tensors instead of glibc's retained heap. What this includes that tensors do
  not: gloo's and autograd's own buffers and page granularity. The comparable prediction is the
  simulator's peak bytes without the per-process context overhead (`overhead`), which on CPU is the
  interpreter and libraries already resident before the plan starts.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

MEASURE_MMAP_THRESHOLD = "65536"
HEAP_MMAP_THRESHOLD = 32 * 2**20
"""glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: its dynamic threshold grows to the largest freed chunk, up to this."""
HEAP_TRIM_THRESHOLD = 2 * HEAP_MMAP_THRESHOLD
"""glibc keeps its trim threshold at twice the dynamic mmap threshold."""
MEMORY_STEPS = 3
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""mallopt(3) parameters."""


@dataclass(frozen=True)
class Measurement:
    """What one plan's run measured (rank 0's report, memory as max over ranks)."""

    step_time_s: float
    """Median step time over the steps after the first."""
    step_times_s: tuple[float, ...]
    peak_memory_bytes: int
    memory_source: str
    losses: tuple[float, ...]
    peak_allocated_bytes: int | None = None
    """CUDA's `max_memory_allocated` over the memory run, max over ranks (None off CUDA)."""
    peak_reserved_bytes: int | None = None
    """CUDA's `max_memory_reserved` over the memory run, max over ranks (None off CUDA)."""

    def allocator_peaks_gib(self) -> dict[str, float]:
        """`peak_memory_allocated_gib` and `peak_memory_reserved_gib` (the runs-log keys) where measured."""
        if self.peak_allocated_bytes is None or self.peak_reserved_bytes is None:
            return {}
        return {"peak_memory_allocated_gib": self.peak_allocated_bytes / 2**30,
                "peak_memory_reserved_gib": self.peak_reserved_bytes / 2**30}

    def to_json(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "step_times_s": list(self.step_times_s),
                "peak_memory_bytes": self.peak_memory_bytes, "peak_memory_source": self.memory_source,
                "losses": list(self.losses), **self.allocator_peaks_gib()}


def execute_plans(plan_jsons: list[str], *, world: int, steps: int, device: str) -> list[Measurement | str]:
    """Run every plan (JSON text) on `world` spawned ranks; a failed plan gives its error text."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="soap-validate-") as tmp:
        out = os.path.join(tmp, "results.json")
        env = {"MALLOC_MMAP_THRESHOLD_": MEASURE_MMAP_THRESHOLD, "OMP_NUM_THREADS": "1"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            mp.spawn(_rank_main, args=(world, os.path.join(tmp, "store"), plan_jsons, steps, device, out),
                     nprocs=world, join=True)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        with open(out) as f:
            raw = json.load(f)
    return [Measurement(step_time_s=r["step_time_s"], step_times_s=tuple(r["step_times_s"]),
                        peak_memory_bytes=r["peak_memory_bytes"], memory_source=r["peak_memory_source"],
                        losses=tuple(r["losses"]), peak_allocated_bytes=r.get("peak_allocated_bytes"),
                        peak_reserved_bytes=r.get("peak_reserved_bytes")) if isinstance(r, dict) else r for r in raw]


def _rank_main(rank: int, world: int, store: str, plan_jsons: list[str], steps: int, device: str, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    memory: list[Any] = []
    for text in plan_jsons:  # every plan's memory first, in a process whose heap the timed runs have not shaped
        try:
            memory.append(_peak_memory(text, steps, device))
        except Exception as exc:  # noqa: BLE001 - one failed plan is reported, the suite goes on
            memory.append(_failure(exc))
        dist.barrier()
    _set_malloc_thresholds(HEAP_MMAP_THRESHOLD, HEAP_TRIM_THRESHOLD)
    results: list[Any] = []
    for text, peak in zip(plan_jsons, memory):
        try:
            results.append(peak if isinstance(peak, str) else _timed_run(text, steps, device, peak))
        except Exception as exc:  # noqa: BLE001
            results.append(_failure(exc))
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _failure(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _peak_memory(plan_json: str, steps: int, device: str) -> dict[str, int]:
    """Peak memory growth of `MEMORY_STEPS` steps of the plan, max over ranks (`peak_memory_bytes`); on
    CUDA also the window's allocated and reserved peaks (`peak_allocated_bytes`, `peak_reserved_bytes`)."""
    import torch
    import torch.distributed as dist

    from executor.train import RunConfig, train
    from planner.plan import plan_from_dict

    plan = plan_from_dict(json.loads(plan_json))
    base = _start_memory_window(device)
    train(plan, RunConfig(steps=min(steps, MEMORY_STEPS), progress=False))
    values = {"peak_memory_bytes": _memory_window_peak(device) - base}
    if device == "cuda":
        values["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        values["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    peaks = torch.tensor([float(v) for v in values.values()], dtype=torch.float64,
                         device="cuda" if device == "cuda" else "cpu")
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return {k: int(v) for k, v in zip(values, peaks.tolist())}


def _timed_run(plan_json: str, steps: int, device: str, memory: dict[str, int]) -> dict[str, Any]:
    from executor.train import RunConfig, train
    from planner.plan import plan_from_dict

    result = train(plan_from_dict(json.loads(plan_json)), RunConfig(steps=steps, progress=False))
    return {"step_time_s": result.step_time_s, "step_times_s": list(result.step_times_s),
            **memory,
            "peak_memory_source": "cuda max_memory_allocated" if device == "cuda" else "peak RSS growth (VmHWM)",
            "losses": list(result.losses)}


def _start_memory_window(device: str) -> int:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    _malloc_trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _memory_window_peak(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated()
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def _set_malloc_thresholds(mmap_bytes: int, trim_bytes: int) -> None:
    """glibc's mmap and trim thresholds (no-op where libc has no mallopt)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, mmap_bytes)
        libc.mallopt(M_TRIM_THRESHOLD, trim_bytes)
    except (OSError, AttributeError):
        pass


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
