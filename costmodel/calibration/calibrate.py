"""`soap calibrate`: measure this machine, fit a device and a cluster profile, validate on held-out points.

Pipeline (`calibrate`):
1. `measure`: run every kernel sweep (`suite.kernel_sweeps`) in this process, with
   `threads` torch threads (on CPU one rank is one core by default), and every collective sweep
   (`suite.comm_sweeps`) in spawned process groups of 2, 4, ... ranks.
2. Split each sweep: every third point is held out (`fit.held_out`); the rest is the fit set.
3. `device.fit_device` / `cluster.fit_cluster` turn the fit set into profile JSON:
   closed-form estimates refined through the cost model's own functions.
3b. `node`: how a rank behaves inside a training step rather than alone — the optimizer step
   against its one-pass estimate, kernels while every rank of the node computes, collectives beside
   compute and a framework's host time per collective — become the device's `optimizer_factors`,
   `concurrency_efficiency`, `communication_overlap` and `collective_call_overhead_us` (the last three
   need nproc >= 2 and are skipped by --quick).
3c. `microbench_compile`: each kernel class in its Hugging Face chain, eager against torch.compile,
   becomes the device's `compile_factors` (skipped by --quick: compiling the chains takes minutes).
3d. `step_factor` (GPU only, skipped by --quick): one profiled training step of a reference model; its
   memory-bound kernels over the fitted profile's price of the same ops multiply the memory-bound classes'
   kernel factors.
4. `validate` predicts the held-out points with the fitted profile through `costmodel.opcost.op_time`
   and `costmodel.collectives.collective_time` and reports the median absolute % error.

Every fitted number's source reads "measured by soap calibrate on <machine>, <date>".
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from costmodel.calibration.cluster import closed_form_link, cluster_json, refine_link
from costmodel.calibration.device import closed_form_device, family_key, refine_device
from costmodel.calibration.fit import held_out
from costmodel.calibration.node import (OPTIMIZER_QUICK_ELEMENTS, OPTIMIZER_SWEEP_ELEMENTS, NodeMeasurements,
                                      measure_concurrency, measure_optimizer, measure_overlap, node_fields)
from costmodel.calibration.predict import PointError, predict_comm, predict_kernel
from costmodel.calibration.suite import OVERHEAD_CASE, comm_sweeps, kernel_sweeps
from costmodel.calibration.microbench import KernelSample, TimingConfig, host_link_bandwidth, measure_case
from costmodel.calibration.microbench_compile import CompileSample, compile_cases, compile_factors_json, measure_compile
from costmodel.calibration.step_factor import apply_compile_factor, apply_step_factor, measure_step
from costmodel.calibration.microbench_comm import CommSample, CommTimingConfig, RankMemory, run_collectives
from costmodel.profiles import ClusterSpec, cluster_from_dict, user_profile_paths
from tracer.errors import SoapError
from tracer.files import write_atomic


@dataclass(frozen=True, kw_only=True)
class CalibrationConfig:
    """What to measure."""

    device: str = "cpu"
    """"cpu" or "cuda"."""
    nproc: int = 4
    """Largest collective group: groups of 2, 4, ... up to nproc ranks are measured (1: none)."""
    quick: bool = False
    """A reduced sweep (small shapes, 2 ranks, messages up to 1 MiB) for tests: seconds, not minutes."""
    threads: int = 1
    """Torch threads per rank on CPU: a local-cpu "device" is `threads` cores."""
    name: str = "local-cpu"
    """Profile name for the device and the cluster."""
    rounds: int = 2
    """Passes over every sweep; each case keeps its fastest pass."""
    compile: bool = True
    """Time torch.compile against eager per kernel class (`costmodel.calibration.microbench_compile`); never under
    `quick`."""
    reference_precision: str = "fp32"
    """The precision the device trains in, whose kernels shape the efficiency curves (`soap calibrate`
    uses fp32 on CPU, bf16 on CUDA)."""


@dataclass(frozen=True)
class Point:
    """One measurement, with its place in its sweep (which decides fit or held out)."""

    sweep: str
    index: int
    sample: KernelSample | CommSample

    @property
    def is_held_out(self) -> bool:
        return held_out(self.index)


@dataclass(frozen=True)
class Measurements:
    machine: str
    """The CPU model (and GPU name on CUDA)."""
    date: str
    threads: int
    kernels: tuple[Point, ...]
    comms: tuple[Point, ...]
    overhead_s: float
    memory_bytes: int
    """Device memory (CPU: physical RAM)."""
    rank_rss_bytes: int
    """Resident memory of a rank process after torch and the process group are up (context overhead)."""
    host_bandwidth: float | None = None
    """Bytes/s of a pinned host-to-device copy (CUDA only)."""
    node: NodeMeasurements = NodeMeasurements()
    """The optimizer step, concurrency and overlap measurements (`costmodel.calibration.node`)."""
    compile: tuple[CompileSample, ...] = ()
    """Eager against torch.compile per kernel class (`costmodel.calibration.microbench_compile`); empty: not measured."""
    step: tuple[tuple[str, float], ...] = ()
    """A profiled training step's kernel seconds by group (`costmodel.calibration.step_factor`; GPU only); empty: not
    measured."""
    compiled_step: tuple[tuple[str, float], ...] = ()
    """The same step with its layers compiled (`step_factor.apply_compile_factor`); empty: not measured."""

    @property
    def source(self) -> str:
        return f"measured by soap calibrate on {self.machine}, {self.date}"


def check_config(config: CalibrationConfig) -> None:
    if config.device not in ("cpu", "cuda"):
        raise SoapError(f"--device {config.device!r} is not supported; use cpu or cuda")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise SoapError("--device cuda but torch sees no CUDA device; run on a GPU machine or use --device cpu")
    if config.nproc < 1:
        raise SoapError(f"--nproc {config.nproc} must be at least 1 (1 measures the device only)")
    if config.device == "cuda" and config.nproc > torch.cuda.device_count():
        raise SoapError(f"--nproc {config.nproc} exceeds the {torch.cuda.device_count()} visible GPUs; lower it")
    if config.rounds < 1:
        raise SoapError(f"rounds={config.rounds} must be at least 1")
    if config.threads < 1:
        raise SoapError(f"threads={config.threads} must be at least 1")


def machine_name(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return torch.cuda.get_device_name(0) if device == "cuda" else cpu


def planned_points(config: CalibrationConfig) -> int:
    """How many measurements `measure` makes (for a progress bar)."""
    kernels = sum(len(s.cases) for s in kernel_sweeps(config.device, quick=config.quick))
    comms = sum(len(s.cases) for s in comm_sweeps(config.nproc, quick=config.quick))
    kind = "cuda" if config.device == "cuda" else "cpu"
    optimizer = len(OPTIMIZER_QUICK_ELEMENTS if config.quick else OPTIMIZER_SWEEP_ELEMENTS[kind])
    node = 0 if config.quick or config.nproc < 2 else 2
    compiled = 0 if config.quick or not config.compile else len(compile_cases(device=config.device))
    step = 0 if config.quick or kind != "cuda" else 1
    return (kernels + comms) * config.rounds + 1 + (optimizer > 0) + node + compiled + step


def measure(config: CalibrationConfig, progress: Callable[[str], None] = lambda _: None) -> Measurements:
    """Run every microbenchmark `rounds` times, keeping each case's fastest round (a shared machine slows
    some rounds down, never speeds one up); `progress(label)` is called after each measurement."""
    check_config(config)
    dev = "cuda" if config.device == "cuda" else "cpu"
    old_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    timing = TimingConfig(samples=5, max_case_s=0.5) if config.quick else TimingConfig()
    best: dict[tuple[str, int], KernelSample | CommSample] = {}

    def keep(key: tuple[str, int], sample: KernelSample | CommSample) -> None:
        if key not in best or sample.seconds < best[key].seconds:
            best[key] = sample

    try:
        overhead = measure_case(OVERHEAD_CASE, dev, timing).seconds
        host_bandwidth = host_link_bandwidth(dev, timing)
        progress("kernel overhead")
        for _ in range(config.rounds):
            for sweep in kernel_sweeps(config.device, quick=config.quick):
                for i, case in enumerate(sweep.cases):
                    keep((sweep.name, i), measure_case(case, dev, timing))
                    progress(case.label)
        optimizer = tuple(measure_optimizer(dev, precision=config.reference_precision, quick=config.quick))
        progress("optimizer step")
        compiled = () if config.quick or not config.compile else tuple(
            measure_compile(dev, threads=config.threads, rounds=config.rounds, timing=timing, progress=progress))
        step = () if config.quick or dev != "cuda" else _measured_step()
        if step:
            progress("training step")
        compiled_step = _measured_step(compile=True) if step and config.compile else ()
        if compiled_step:
            progress("training step, compiled")
    finally:
        torch.set_num_threads(old_threads)
    kernels = [Point(name, i, sample) for (name, i), sample in best.items()]
    best.clear()
    comm_timing = CommTimingConfig(samples=5, sample_s=0.01, max_case_s=0.3) if config.quick else CommTimingConfig()
    rss = 0
    for group in sorted({c.group_size for s in comm_sweeps(config.nproc, quick=config.quick) for c in s.cases}):
        sweeps = [s for s in comm_sweeps(config.nproc, quick=config.quick) if s.cases[0].group_size == group]
        place = {c: (s.name, i) for s in sweeps for i, c in enumerate(s.cases)}
        for item in run_collectives(list(place) * config.rounds, group_size=group, device=config.device,
                                    timing=comm_timing, threads=config.threads):
            if isinstance(item, RankMemory):
                rss = max(rss, item.nbytes)
                continue
            keep(place[item.case], item)
            progress(item.case.label)
    comms = [Point(name, i, sample) for (name, i), sample in best.items()]
    concurrency: list[tuple[int, float]] = []
    overlap = call_overhead = None
    if not config.quick and config.nproc >= 2:
        concurrency = measure_concurrency(config.nproc, config.device, config.threads, rounds=config.rounds)
        progress("ranks computing at once")
        # the overlap depends on how the host schedules 4 busy threads on the ranks' cores: the median of
        # rounds + 1 process groups
        runs = sorted(measure_overlap(config.device, config.threads) for _ in range(config.rounds + 1))
        overlap = statistics.median(r[0] for r in runs)
        call_overhead = statistics.median(r[1] for r in runs)
        progress("collective beside compute")
    return Measurements(
        machine=machine_name(config.device),
        date=_dt.date.today().isoformat(),
        threads=config.threads,
        kernels=tuple(kernels),
        comms=tuple(comms),
        overhead_s=overhead,
        memory_bytes=_device_memory(config.device),
        rank_rss_bytes=rss,
        host_bandwidth=host_bandwidth,
        node=NodeMeasurements(optimizer=optimizer, concurrency=tuple(concurrency), overlap=overlap,
                              call_overhead_s=call_overhead),
        compile=compiled,
        step=step,
        compiled_step=compiled_step,
    )


def _measured_step(compile: bool = False) -> tuple[tuple[str, float], ...]:
    """`step_factor.measure_step`'s groups; empty, with a warning, where the reference step cannot run (a failed
    step must not lose the minutes of kernels measured before it)."""
    try:
        return tuple(measure_step(compile=compile).items())
    except Exception as exc:
        what = "compiled training step" if compile else "training step"
        print(f"warning: the {what} was not profiled ({type(exc).__name__}: {exc})", file=sys.stderr)
        return ()


def _device_memory(device: str) -> int:
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def validate(meas: Measurements, cluster: ClusterSpec, with_comms: bool) -> tuple[list[PointError], list[PointError]]:
    """Held-out kernel and collective points against the profile's predictions."""
    kernels = []
    for p in meas.kernels:
        if p.is_held_out:
            case = p.sample.case
            kernels.append(PointError(family_key(case), case.label, p.sample.seconds, predict_kernel(case, cluster.device)))
    comms = []
    for p in meas.comms:
        if p.is_held_out and with_comms:
            case = p.sample.case
            comms.append(PointError(case.kind, case.label, p.sample.seconds, predict_comm(case, cluster)))
    return kernels, comms


def write_json_atomic(path: Path, data: dict) -> None:
    """Write `data` as indented JSON to `path` atomically (`tracer.files.write_atomic`)."""
    write_atomic(path, json.dumps(data, indent=2) + "\n", what="profile")


def load_inline(cluster_json: dict) -> ClusterSpec:
    """Validate a fitted cluster (device inline) with the profile loader."""
    return cluster_from_dict(cluster_json)


@dataclass(frozen=True)
class CalibrationResult:
    measurements: Measurements
    device_json: dict
    cluster_json: dict | None
    """None when no collective was measured (nproc 1)."""
    kernel_errors: tuple[PointError, ...]
    comm_errors: tuple[PointError, ...]


def fit(meas: Measurements, config: CalibrationConfig) -> CalibrationResult:
    """Fit the profiles on the fit set and validate them on the held-out set."""
    fit_kernels = [p.sample for p in meas.kernels if not p.is_held_out]
    fit_comms = [p.sample for p in meas.comms if not p.is_held_out]
    threads = f"{meas.threads} torch thread{'s' if meas.threads > 1 else ''} per rank"
    device_json = closed_form_device(
        fit_kernels,
        reference=config.reference_precision,
        name=config.name,
        description=f"{meas.machine} ({threads}), calibrated {meas.date}" if config.device == "cpu"
        else f"{meas.machine}, calibrated {meas.date}",
        source=meas.source,
        overhead_s=meas.overhead_s,
        memory_bytes=meas.memory_bytes,
        context_bytes=meas.rank_rss_bytes,
        host_bandwidth=meas.host_bandwidth,
    )
    device_json = refine_device(device_json, fit_kernels, reference=config.reference_precision)
    device_json.update(node_fields(meas.node, device_json, meas.source))
    if config.device == "cpu":
        device_json["kind"] = "cpu"  # ranks are host processes: `soap execute` runs them without a GPU
    if meas.compile:
        device_json["compile_factors"] = compile_factors_json(meas.compile, source=meas.source)
    if meas.step:
        try:
            device_json, _ = apply_step_factor(device_json, dict(meas.step), source=meas.source)
            if meas.compiled_step:
                from costmodel.calibration.step_factor import REFERENCE_BATCH, reference_graph

                device_json, _ = apply_compile_factor(
                    device_json, dict(meas.compiled_step), graph=reference_graph(), micro_batch=REFERENCE_BATCH,
                    source=meas.source, step="REFERENCE of costmodel.calibration.step_factor, its layers compiled")
        except Exception as exc:  # the reference model cannot be traced here: the kernels alone are still a profile
            print(f"warning: the training step's factor was not applied ({type(exc).__name__}: {exc})", file=sys.stderr)
    cluster: dict | None = None
    if fit_comms:
        group = max(p.sample.case.group_size for p in meas.comms)
        backend = "NCCL" if config.device == "cuda" else "gloo over 127.0.0.1"
        cluster = cluster_json(
            name=config.name,
            description=f"this machine: up to {group} ranks, collectives on {backend}, calibrated {meas.date}",
            device_json=device_json,
            gpus_per_node=group,
            link=closed_form_link(fit_comms, meas.source),
        )
        cluster = refine_link(cluster, fit_comms)
    spec = load_inline(cluster) if cluster else load_inline(cluster_json(
        name=config.name, description="device only", device_json=device_json, gpus_per_node=1,
        link=_placeholder_link()))
    kernel_errors, comm_errors = validate(meas, spec, cluster is not None)
    return CalibrationResult(meas, device_json, cluster, tuple(kernel_errors), tuple(comm_errors))


def _placeholder_link() -> dict:
    return {"bandwidth_gbps": {"value": 1, "source": "unused"}, "latency_us": {"value": 0, "source": "unused"},
            "efficiency": {"points": [[1, 1]], "source": "unused"}, "sharp": False}


def calibrate(config: CalibrationConfig, progress: Callable[[str], None] = lambda _: None) -> CalibrationResult:
    return fit(measure(config, progress), config)


def default_paths(name: str) -> tuple[Path, Path]:
    """Where `soap calibrate` writes by default: devices/NAME.json and clusters/NAME.json in the user's profile
    folder (`costmodel.profiles.user_profiles_dir`), never inside the installed package or the checkout."""
    return user_profile_paths(name, name)


KEPT_FROM_RUNS = ("runtime_workspace_mib", "allocator_reserve_fraction")
"""Device fields microbenchmarks do not measure but `soap calibrate --from-runs` fits from real training runs:
a recalibration keeps them from the profile it replaces."""


def _kept_from_runs(device_path: Path) -> dict:
    try:
        old = json.loads(device_path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: old[k] for k in KEPT_FROM_RUNS if isinstance(old, dict) and k in old}


def write_profiles(result: CalibrationResult, output: Path | None) -> list[Path]:
    """Write the fitted profiles atomically and return the paths written.

    Without `output`: the device and cluster files in the user's profile folder (`default_paths`; cluster's
    device by name), keeping the
    replaced device's `KEPT_FROM_RUNS` fields. With
    `output`: one self-contained file, the cluster with its device inline (device only for nproc 1).
    """
    name = result.device_json["name"]
    if output is not None:
        write_json_atomic(output, result.cluster_json or result.device_json)
        return [output]
    device_path, cluster_path = default_paths(name)
    write_json_atomic(device_path, {**result.device_json, **_kept_from_runs(device_path)})
    if result.cluster_json is None:
        return [device_path]
    write_json_atomic(cluster_path, {**result.cluster_json, "device": name})
    return [device_path, cluster_path]
