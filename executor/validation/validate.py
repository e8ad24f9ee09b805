"""`soap validate`: simulate and execute a suite of plans on this machine, and compare.

Steps (`run_validation`):
1. the cluster profile (`local-cpu` by default; `soap calibrate` runs first if it is missing);
2. every suite case (`executor.validation.suite`) traced, simulated and turned into a Plan: the
   parallel suite at 2 or 4 ranks, or the single-device suite at `--nproc 1`; with `--suite
   calibration` the calibration plans instead (other models, for `soap calibrate --from-runs`);
3. all plans executed on `nproc` spawned ranks (`executor.validation.run`: gloo on CPU, NCCL on CUDA),
   after one unmeasured warm-up run of the first plan (it pays one-time costs: lazy imports, gloo
   pairs, allocator arenas); the 2-D plan runs on its own 4 ranks the same way;
4. each run appended to the runs log (`executor.runs_log`, with its plan, for `soap calibrate --from-runs`);
5. predicted against measured (`executor.validation.metrics`): per-plan errors, step-time and memory
   MAPE, Kendall's tau of the step-time ranking.

Memory is compared like with like: the simulator's peak without its per-process context overhead, plus
the device profile's runtime workspace (allocations beyond the counted tensors), against the measured
peak growth during the plan (see `executor.validation.run`).

`compare_runs(built, measurements)` is the comparison alone: tests feed it recorded measurements and
plans simulated on a deliberately wrong profile, without executing anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from executor.validation.metrics import Comparison, Summary, summarize
from executor.validation.run import Measurement, execute_plans
from executor.validation.suite import (BuiltCase, SuiteCase, build_case, calibration_cases, quick_cases,
                                       quick_single_device_cases, single_device_cases, suite_cases, two_d_cases)
from tracer.errors import SoapError

SUITE_WORLD = 2
SUITES = ("validation", "calibration")


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    """What `soap validate` runs."""

    device: str = "cpu"
    """cpu (gloo) or cuda (NCCL)."""
    nproc: int = SUITE_WORLD
    """Ranks per plan: 1 runs the single-device suite; 2 or 4 the parallel suite (its degree-2
    dimension becomes this degree)."""
    steps: int = 6
    """Optimizer steps per plan; the first is not timed."""
    quick: bool = False
    """Run the 4-plan subset."""
    suite: str = "validation"
    """validation (the suite) or calibration (`calibration_cases`: other plans on other models, whose runs
    `soap calibrate --from-runs` refits the profile from while the suite stays held out)."""
    cluster: str = "local-cpu"
    """Cluster profile name or JSON file the predictions use."""
    runs_log: str | None = None
    """Runs log to append to (None: $SOAP_RUNS_LOG or ~/.cache/soap/runs.jsonl)."""
    cases: tuple[SuiteCase, ...] | None = None
    """Explicit cases (tests, benchmarks); None: the suite or its quick subset."""


@dataclass(frozen=True)
class ValidationReport:
    rows: tuple[Comparison, ...]
    summary: Summary
    failed: tuple[tuple[str, str], ...]
    """(plan, error) of plans that did not run."""
    built: tuple[BuiltCase, ...]
    measurements: tuple[Measurement, ...]
    """Of the plans that ran, in the order of `rows`."""

    def to_json(self) -> dict[str, Any]:
        # the per-plan rows replace the summary's plan count under "plans"
        return {**self.summary.to_json(),
                "plans": [{**r.to_json(), **m.allocator_peaks_gib()} for r, m in zip(self.rows, self.measurements)],
                "failed": [{"name": n, "error": e} for n, e in self.failed]}


def check_config(config: ValidationConfig) -> None:
    if config.device not in ("cpu", "cuda"):
        raise SoapError(f"--device {config.device!r}: choose cpu or cuda")
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SoapError("--device cuda: CUDA is not available on this machine; run on a GPU machine or use --device cpu")
        if torch.cuda.device_count() < config.nproc:
            raise SoapError(f"--nproc {config.nproc}: only {torch.cuda.device_count()} GPUs; pass --nproc "
                            f"{torch.cuda.device_count()}")
    if config.suite not in SUITES:
        raise SoapError(f"--suite {config.suite!r}: choose {' or '.join(SUITES)}")
    if config.suite == "calibration" and config.nproc == 1:
        raise SoapError("--suite calibration runs at 2 or 4 ranks; drop --nproc 1")
    if config.nproc not in (1, 2, 4):
        raise SoapError(f"--nproc {config.nproc}: the suite runs at 1 rank (single-device plans) or at 2 or 4 ranks")
    if config.steps < 2:
        raise SoapError(f"--steps {config.steps}: need at least 2 (the first step is not timed)")


def load_or_calibrate(cluster: str, device: str, nproc: int, log: Callable[[str], None]) -> Any:
    """The cluster profile; a missing local profile is measured first with `soap calibrate`'s defaults."""
    from costmodel.profiles import list_clusters, load_cluster

    local = f"local-{device}"
    if cluster == local and local not in list_clusters():
        from costmodel.calibration.calibrate import CalibrationConfig, calibrate, write_profiles

        log(f"no {local} profile yet: running soap calibrate (a few minutes)")
        write_profiles(calibrate(CalibrationConfig(device=device, nproc=4 if device == "cpu" else nproc,
                                                   name=local, reference_precision="fp32" if device == "cpu" else "bf16"),
                                 lambda label: None), None)
    return load_cluster(cluster)


def default_cases(config: ValidationConfig) -> list[SuiteCase]:
    if config.suite == "calibration":
        cases = calibration_cases()
        return cases[::3] if config.quick else cases
    if config.nproc == 1:
        return (quick_single_device_cases if config.quick else single_device_cases)(config.device)
    if config.quick:
        return quick_cases()
    return suite_cases() + (two_d_cases() if config.nproc == SUITE_WORLD and _ranks_for_2d(config.device) else [])


def _ranks_for_2d(device: str) -> bool:
    """The 2-D plan's 4 ranks: processes on a CPU (sharing its cores), GPUs only where there are 4."""
    if device == "cpu":
        return True
    import torch

    return torch.cuda.device_count() >= 4


def scaled_case(case: SuiteCase, nproc: int) -> SuiteCase:
    """The case with its degree-2 dimension at `nproc` ranks (a case of another world size, the 2-D one,
    stays as it is)."""
    if case_world(case) != SUITE_WORLD:
        return case
    return replace(case, dims={k: (nproc if v == SUITE_WORLD else v) for k, v in case.dims.items()})


def case_world(case: SuiteCase) -> int:
    return math.prod(case.dims.values())


def execute_by_world(texts: Sequence[str], worlds: Sequence[int], *, steps: int, device: str) -> list[Measurement | str]:
    """Every plan executed on its world size's ranks: one spawn per world size, each after an unmeasured
    warm-up run of its first plan; results in the order of `texts`."""
    results: list[Measurement | str] = [""] * len(texts)
    for world in dict.fromkeys(worlds):
        index = [i for i, w in enumerate(worlds) if w == world]
        group = [texts[i] for i in index]
        for i, result in zip(index, execute_plans(group[:1] + group, world=world, steps=steps, device=device)[1:]):
            results[i] = result
    return results


def run_validation(config: ValidationConfig, log: Callable[[str], None] = lambda message: None) -> ValidationReport:
    check_config(config)
    cluster = load_or_calibrate(config.cluster, config.device, config.nproc, log)
    cases = tuple(scaled_case(c, config.nproc) for c in config.cases or default_cases(config))
    graphs: dict = {}
    built = []
    for case in cases:
        log(f"simulate {case.name}")
        built.append(build_case(case, cluster, graphs))
    worlds = [case_world(c) for c in cases]
    sizes = " and ".join(str(w) for w in dict.fromkeys(worlds))
    log(f"execute {len(built)} plans on {sizes} ranks ({config.device}), {config.steps} steps each")
    results = execute_by_world([b.plan.to_json() for b in built], worlds, steps=config.steps, device=config.device)
    _log_runs(built, results, config.runs_log)
    return compare_runs(built, results)


def compare_runs(built: Sequence[BuiltCase], results: Sequence[Measurement | str]) -> ValidationReport:
    """Predicted (each case's SimResult) against measured; a string result is a failed plan."""
    rows, failed, ran, measured = [], [], [], []
    for b, m in zip(built, results):
        if isinstance(m, str):
            failed.append((b.case.name, m))
            continue
        rows.append(Comparison(name=b.case.name, predicted_step_s=b.result.step_time_s, measured_step_s=m.step_time_s,
                               predicted_memory_bytes=predicted_memory_bytes(b.result, b.workspace_bytes),
                               measured_memory_bytes=m.peak_memory_bytes))
        ran.append(b)
        measured.append(m)
    if not rows:
        raise SoapError("no plan of the suite ran; see the errors above")
    return ValidationReport(rows=tuple(rows), summary=summarize(rows), failed=tuple(failed), built=tuple(ran),
                            measurements=tuple(measured))


def predicted_memory_bytes(result: Any, workspace_bytes: int = 0) -> int:
    """The simulator's peak over ranks without the per-process context overhead, plus the runtime
    workspace (comparable to the measured growth)."""
    return max(m.at_peak.total - m.at_peak.workspace for m in result.memory) + workspace_bytes


def _log_runs(built: Sequence[BuiltCase], results: Sequence[Measurement | str], path: str | None) -> None:
    from executor.runs_log import append_run

    for b, m in zip(built, results):
        if isinstance(m, str):
            continue
        report = {"step_time_s": m.step_time_s, "step_times_s": list(m.step_times_s), "losses": list(m.losses),
                  "peak_memory_gib": m.peak_memory_bytes / 2**30, "peak_memory_source": m.memory_source,
                  "predicted_step_time_s": b.result.step_time_s,
                  "predicted_peak_memory_gib": predicted_memory_bytes(b.result, b.workspace_bytes) / 2**30,
                  "parallelism": b.plan.parallelism.model_dump(), **m.allocator_peaks_gib()}
        append_run(report, path, plan=b.plan, name=b.case.name,
                   extra={"source": "soap validate", "timed_steps": "median of steps after the first"})
