"""Trials of `soap tune`: one plan run for a few steps through `soap execute`'s path, and its record.

A trial is `executor.launch.run_plan` with `RunConfig(steps=warmup + steps)`: the first `warmup` steps
(building the process groups' buffers, the allocator's first pass, lazy inits) are run but not timed; the
measured step time is the median of the remaining `steps`. The watchdog (`RunConfig.timeout_s`, `--timeout`)
ends a hung trial. What a trial ends as (`Trial.status`):
- `ok`: it ran, and its measured peak memory (max over ranks) is within the memory cap, if any;
- `oom`: out of memory: the plan's predicted peak is over the cap (`mem_cap_gib`, per rank; then it is not
  run), a rank's measured peak memory went over it (on the CPU the process's peak RSS, on CUDA the
  allocator's peak), or a rank raised torch's out-of-memory error (CUDA's
  `OutOfMemoryError`, the CPU allocator's "can't allocate memory") or was killed without an exception;
- `hung`: the watchdog ended it (no progress within its limit);
- `failed`: any other error (the launcher's one line is kept).
Only `ok` trials compete for the measured best; an `oom` trial that ran still has a measured step time.

Every trial is appended to the tune's runs log (`executor.runs_log.append_run`, the record `soap calibrate
--from-runs` reads, with the plan inline) with a `tune` field: the trial's id, status, warm-up and message.
Its `step_time_s` is the timed median (warm-up excluded). The id (`trial_id`) names the configuration, not
the profile it was priced on: the model's hash, batch, sequence length, world size and the parallelism, so
a plan re-planned on a refitted profile that equals a tried one is not run again, and a tune that is run
again with the same log (`finished_trials`) skips every trial that has a record: resuming re-runs nothing
that finished.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from executor.launch import LaunchOptions, run_plan
from executor.runs_log import append_run, read_runs
from planner.plan import Plan
from tracer.errors import SoapError

STATUSES = ("ok", "oom", "hung", "failed")
OOM_MARKERS = ("out of memory", "outofmemoryerror", "can't allocate memory", "cannot allocate memory",
               "without a python exception")
"""Words of a failed worker group's line that mean a rank ran out of memory (a killed rank: the OOM killer)."""
HUNG_MARKERS = ("no progress within",)


@dataclass(frozen=True)
class Trial:
    """One tried plan: what was predicted and what was measured."""

    id: str
    plan: str
    """A one-line name of the plan (`describe_plan`)."""
    status: str
    predicted_step_time_s: float | None
    measured_step_time_s: float | None
    predicted_peak_memory_gib: float | None
    measured_peak_memory_gib: float | None
    message: str = ""
    round: str = "initial"
    """`initial` (a candidate of the first search) or `replanned` (the best after the refit)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def trial_id(plan: Plan) -> str:
    """The configuration's identity, independent of the profile it was priced on."""
    key = {"model": plan.model.config_hash, "task": plan.model.task, "seq_len": plan.seq_len,
           "global_batch": plan.global_batch, "gpus": plan.world_size,
           "parallelism": plan.parallelism.model_dump(mode="json"),
           "stages": [s.layers for s in plan.stages]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def describe_plan(plan: Plan) -> str:
    """e.g. `pp2 dp2 zero0 mb2x2 1F1B bf16` (the planner's `describe`, from a plan.json)."""
    p = plan.parallelism
    parts = [f"{n}{d}" for n, d in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp), ("ep", p.ep)) if d > 1]
    parts.append(f"dp{p.dp}")
    if p.dp > 1:
        parts.append("hsdp" if p.zero == 3 and p.dp_replicate > 1 else f"zero{p.zero}")
    parts.append(f"mb{p.micro_batch}x{p.num_microbatches}")
    if p.pp > 1:
        parts.append(p.schedule + (f"(v{p.virtual_stages})" if p.virtual_stages > 1 else ""))
    if p.recompute != "none":
        parts.append(f"rc={p.recompute}")
    parts.extend(name for name, on in (("offload", p.offload_optimizer), ("compile", p.compile)) if on)
    parts.append(p.precision)
    return " ".join(parts)


def finished_trials(log: Path) -> dict[str, Trial]:
    """The trials recorded in the runs log `log` by id (the last record of an id wins); {} without a log."""
    if not log.is_file():
        return {}
    trials = {}
    for record in read_runs(log):
        tune = record.get("tune")
        if isinstance(tune, dict) and isinstance(tune.get("trial"), dict):
            trial = Trial(**tune["trial"])
            trials[trial.id] = trial
    return trials


def classify_failure(message: str) -> str:
    lowered = message.lower()
    if any(m in lowered for m in HUNG_MARKERS):
        return "hung"
    if any(m in lowered for m in OOM_MARKERS):
        return "oom"
    return "failed"


def run_trial(plan: Plan, *, log: Path, steps: int, warmup: int, launch: LaunchOptions,
              timeout_s: float | None = None, mem_cap_gib: float | None = None, seed: int = 0,
              round: str = "initial") -> Trial:
    """Run `plan` for `warmup + steps` steps, classify the outcome, append it to `log`; never raises for a
    failed trial (a bad launch flag, found before any worker starts, does raise)."""
    from executor.train import RunConfig

    config = RunConfig(steps=warmup + steps, seed=seed, progress=False, timeout_s=timeout_s)
    base = dict(id=trial_id(plan), plan=describe_plan(plan), round=round,
                predicted_step_time_s=plan.predicted.get("step_time_s"),
                predicted_peak_memory_gib=plan.predicted.get("peak_memory_gib"))
    predicted_peak = base["predicted_peak_memory_gib"]
    if mem_cap_gib is not None and predicted_peak is not None and predicted_peak > mem_cap_gib:
        trial = Trial(**base, status="oom", measured_step_time_s=None, measured_peak_memory_gib=None,
                      message=f"predicted peak {predicted_peak:.3f} GiB per rank is over the {mem_cap_gib:g} GiB cap; "
                              "not run")
        append_run({}, log, plan=plan, name=trial.plan, extra={"tune": {"trial": trial.to_json()}})
        return trial
    try:
        result = run_plan(plan, config, launch)
    except SoapError as exc:
        trial = Trial(**base, status=classify_failure(str(exc)), measured_step_time_s=None,
                      measured_peak_memory_gib=None, message=str(exc))
        append_run({}, log, plan=plan, name=trial.plan, extra={"tune": {"trial": trial.to_json()}})
        return trial
    if result is None:  # not rank 0 of a multi-node launch: rank 0's node records the trial
        return Trial(**base, status="ok", measured_step_time_s=None, measured_peak_memory_gib=None,
                     message="recorded on the node of rank 0")
    timed = result["step_times_s"][warmup:] or result["step_times_s"]
    measured = statistics.median(timed)
    peak = result.get("peak_memory_gib")
    over = mem_cap_gib is not None and peak is not None and peak > mem_cap_gib
    message = (f"measured peak {peak:.3f} GiB per rank ({result.get('peak_memory_source')}) is over the "
               f"{mem_cap_gib:g} GiB cap") if over else ""
    trial = Trial(**base, status="oom" if over else "ok", measured_step_time_s=measured,
                  measured_peak_memory_gib=peak, message=message)
    record = {**result, "step_time_s": measured, "step_times_s": timed}
    append_run(record, log, plan=plan, name=trial.plan,
               extra={"tune": {"trial": trial.to_json(), "warmup_steps": warmup}})
    return trial
