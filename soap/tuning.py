"""`soap tune`: try the best few plans on the real cluster, refit the profile from them, re-plan, and hand
back the plan measured fastest.

Method:
1. Plan (`planner.api.plan_report`) and take the K best plans that differ in mesh or schedule
   (`planner.candidates.distinct_candidates`: one per mesh first, then one per mesh and schedule; never two
   that differ only in micro-batching). Each is built as a full plan.json by re-planning with its
   configuration pinned (`planner.candidates.plan_pins`). `soap tune plan.json` tries that plan first.
2. Run each as a trial (`executor.trials.run_trial`): `soap execute`'s launcher and training loop for
   `warmup + steps` steps, the warm-up untimed, the watchdog's `timeout_s` ending a hung trial, a rank whose
   peak memory passes `mem_cap_gib` (or that raises torch's out-of-memory error) recorded as `oom`. A failed
   trial is recorded and the tune goes on; only when every trial fails does it end, as one `error:` line.
3. Every trial is appended to the tune's runs log (`DIR/runs.jsonl`). The cluster profile is refitted from
   the trials that measured a step time with `soap calibrate --from-runs`'s machinery
   (`executor.validation.refit.refit_cluster`: compute, kernel launch, communication and activation
   collective multipliers) and written to `DIR/cluster-refit.json`. Its step-time error on the trials is
   reported before (each trial simulated on the profile as given) and after (re-simulated on the refitted
   profile), as the geometric mean error factor (`log_error_pct`, the fit's own terms: it minimizes squared
   log ratios) and as the mean absolute percentage error.
4. Memory learns from out-of-memory trials: the re-plan's memory limit is lowered below the smallest
   predicted peak of a trial that ran out of memory, so that plan and any predicted as heavy are excluded.
5. Re-plan on the refitted profile; if the new best was not tried, try it.
6. The measured-best `ok` trial is the answer: its plan, with the refitted profile inline and its
   `predicted` block re-simulated on it plus `measured_step_time_s` and `measured_peak_memory_gib`, goes to
   `-o`; `DIR/tune.json` holds the report: every trial with its plan, status, predicted and measured step time
   and memory, and its rank by measured time.
Multi-node: every node runs this with the same arguments; the search is deterministic, so all nodes try the
same plans in the same order. Only rank 0's node measures (`run_plan` returns rank 0's result), so only it
records, refits and re-plans; the other nodes return after the initial trials (`follower` in the report), and a
re-planned trial that is new needs them started on it with `soap execute`.
Resume: the trial ids (`executor.trials.trial_id`) name configurations; a tune run again with the same
directory searches the same candidates, finds their records in the runs log and re-runs none that finished.

Why here and not in the executor: the tune calls the search (plan, re-plan), and the executor imports the
`Plan` type, never the search (DESIGN.md); it also reads `executor.validation` (the refit), which the rest
of the executor must not import. So the trials live in `executor.trials`, the choice of candidates in
`planner.candidates`, and this module only wires the two, as `soap.api` wires plan and parallelize.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracer.errors import SoapError

OOM_MARGIN = 0.99
"""The re-plan's memory limit, as a share of the smallest predicted peak that ran out of memory."""
RowsCallback = Callable[[list[dict[str, Any]]], None]


def default_directory(output: str | None) -> Path:
    """The tune's directory: `-o plan.json` gives `plan.tune/`; without -o, `soap-tune/`."""
    return Path(output).with_suffix(".tune") if output else Path("soap-tune")


def plan_input(model: Any) -> Any:
    """The Plan when MODEL is a plan.json, else None."""
    from planner.plan import load_plan

    if isinstance(model, (str, Path)) and str(model).endswith(".json") and Path(model).is_file():
        try:
            data = json.loads(Path(model).read_text())
        except (OSError, ValueError):
            return None
        if isinstance(data, dict) and "schema_version" in data and "parallelism" in data:
            return load_plan(model)
    return None


def tune(model: Any, *, gpus: int | None = None, cluster: Any = None, top: int = 3, steps: int = 3,
         warmup: int = 1, budget_min: float | None = None, output: str | None = None, directory: str | None = None,
         launch: Any = None, timeout_s: float | None = None, mem_cap_gib: float | None = None, seed: int = 0,
         on_update: RowsCallback | None = None, **plan_kwargs: Any) -> dict[str, Any]:
    """Tune `model` (anything `soap plan` takes, or a plan.json) on `gpus` ranks of `cluster` (default
    dgx-h100; a plan.json brings its own GPU count and cluster, and naming others is refused); returns the
    report (`--json`'s object). `plan_kwargs`: the planner's pins and options (tp=, pp=, seq_len=, ...)."""
    from costmodel.profiles import ClusterSpec, cluster_from_dict, load_cluster
    from executor.launch import LaunchOptions, preflight
    from executor.trials import finished_trials, trial_id
    from planner.api import plan_report
    from planner.candidates import distinct_candidates, plan_pins, ranked_pool
    from planner.report import parallelism_of

    if top < 1 or steps < 1 or warmup < 0:
        raise SoapError(f"--top {top}, --steps {steps}, --warmup {warmup}: need top >= 1, steps >= 1, warmup >= 0")
    if budget_min is not None and not budget_min > 0:
        raise SoapError(f"--budget {budget_min:g}: need a positive number of minutes")
    if mem_cap_gib is not None and not mem_cap_gib > 0:
        raise SoapError(f"--mem-cap {mem_cap_gib:g}: need a positive number of GiB")
    launch = launch or LaunchOptions()
    given = plan_input(model)
    if given is not None:
        from transformers import AutoConfig

        if cluster is not None or gpus not in (None, given.world_size):
            raise SoapError(f"{model} brings its own cluster ({given.cluster.name}) and GPU count ({given.world_size}); "
                            "drop --cluster/--gpus, or tune the model itself: soap tune MODEL --gpus N --cluster C")
        fields = dict(given.model.config)
        model = AutoConfig.for_model(fields.pop("model_type"), **fields)
        gpus = given.world_size
        cluster = cluster_from_dict(given.cluster.profile)
        plan_kwargs = {"task": given.model.task, "seq_len": given.seq_len, "global_batch": given.global_batch,
                       **({"peft": given.model.peft_spec()} if given.model.peft else {}), **plan_kwargs}
    if gpus is None:
        raise SoapError("--gpus N is needed with a MODEL (a plan.json brings its own)")
    spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster or "dgx-h100")
    start = time.monotonic()
    directory_path = Path(directory) if directory else default_directory(output)
    log = directory_path / "runs.jsonl"

    def search(on: Any, **extra: Any) -> Any:
        return plan_report(model, gpus=gpus, cluster=on, **{**plan_kwargs, **extra})

    report = search(spec)
    directory_path.mkdir(parents=True, exist_ok=True)
    pool = ranked_pool(report)
    plans = [given] if given is not None else []
    for priced in distinct_candidates(pool, top):
        if len(plans) >= top:
            break
        plan = report.plan if priced is report.chosen else search(spec, **plan_pins(parallelism_of(priced))).plan
        if all(trial_id(plan) != trial_id(p) for p in plans):
            plans.append(plan)
    for plan in plans:
        preflight(plan, launch)  # a bad launch flag fails now, as one line, not as K failed trials
    rows = _Rows([(p, "initial") for p in plans], finished_trials(log), on_update)
    runner = _Runner(log=log, rows=rows, steps=steps, warmup=warmup, launch=launch, timeout_s=timeout_s,
                     mem_cap_gib=mem_cap_gib, seed=seed, deadline=None if budget_min is None else start + 60 * budget_min)
    for plan in plans:
        runner.try_plan(plan, "initial")
    if rows.trials() and all(t.status == "ok" and t.measured_step_time_s is None for t in rows.trials()):
        # another node of a multi-node launch: rank 0's node measured, records, refits and re-plans
        return {"model": report.model, "cluster": spec.name, "gpus": gpus, "directory": str(directory_path),
                "trials": [t.to_json() for t in rows.trials()], "follower": True,
                "elapsed_s": round(time.monotonic() - start, 1)}
    if not any(t.status == "ok" for t in rows.trials()):
        failures = "; ".join(f"{t.plan}: {t.status} {t.message}".strip() for t in rows.trials())
        raise SoapError(f"every trial failed: {failures or 'no trial ran within the budget'}")

    refit = _refit(log, spec, directory_path)
    refitted = cluster_from_dict(refit["profile_inline"])
    memory = _learned_memory_limit(rows.trials(), plan_kwargs.get("mem_limit_gib"))
    extra = {"mem_limit_gib": memory} if memory is not None else {}
    try:
        replanned, replan_error = search(refitted, **extra).plan, None
    except SoapError as exc:  # e.g. nothing fits under the learned memory limit: the trials still stand
        replanned, replan_error = None, str(exc)
    if replanned is not None:
        rows.add(replanned, "replanned")
        runner.try_plan(replanned, "replanned")

    best = min((t for t in rows.trials() if t.status == "ok" and t.measured_step_time_s is not None),
               key=lambda t: t.measured_step_time_s)
    best_plan = _best_plan(log, best, refitted, refit["profile_inline"])
    if output:
        best_plan.save(output)
    ranked = sorted((t for t in rows.trials() if t.status == "ok" and t.measured_step_time_s is not None),
                    key=lambda t: t.measured_step_time_s)
    rank = {t.id: i + 1 for i, t in enumerate(ranked)}
    first = trial_id(plans[0])
    result = {
        "model": report.model, "cluster": spec.name, "gpus": gpus, "directory": str(directory_path),
        "runs_log": str(log), "steps": steps, "warmup_steps": warmup, "mem_cap_gib": mem_cap_gib,
        "trials": [{**t.to_json(), "rank": rank.get(t.id)} for t in rows.trials()],
        "not_run": rows.not_run(),
        "first_predicted": first, "best": best.id, "best_plan": best.plan,
        "best_is_first_predicted": best.id == first,
        "measured_step_time_s": best.measured_step_time_s,
        "measured_peak_memory_gib": best.measured_peak_memory_gib,
        "repredicted_step_time_s": best_plan.predicted.get("step_time_s"),
        "repredicted_peak_memory_gib": best_plan.predicted.get("peak_memory_gib"),
        "replanned": {"trial": trial_id(replanned), "plan": rows.name(replanned),
                      "new": trial_id(replanned) not in {trial_id(p) for p in plans},
                      "mem_limit_gib": memory} if replanned is not None else
                     {"trial": None, "plan": None, "new": False, "mem_limit_gib": memory, "error": replan_error},
        "refit": {k: v for k, v in refit.items() if k != "profile_inline"},
        "output": output, "elapsed_s": round(time.monotonic() - start, 1),
    }
    (directory_path / "tune.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result


class _Rows:
    """The trials in the order they are tried, for the live table: `pending`, `running`, then a status."""

    def __init__(self, plans: list[tuple[Any, str]], finished: dict, on_update: RowsCallback | None) -> None:
        from executor.trials import describe_plan, trial_id

        self._id, self._describe = trial_id, describe_plan
        self.finished = finished
        self._rows: dict[str, dict[str, Any]] = {}
        self._on_update = on_update
        for plan, round in plans:
            self.add(plan, round, notify=False)
        self.notify()

    def name(self, plan: Any) -> str:
        return self._describe(plan)

    def add(self, plan: Any, round: str, *, notify: bool = True) -> None:
        key = self._id(plan)
        if key in self._rows:
            return
        done = self.finished.get(key)
        self._rows[key] = {"id": key, "plan": self._describe(plan), "round": round,
                           "status": f"{done.status} (resumed)" if done else "pending", "trial": done,
                           "predicted_step_time_s": plan.predicted.get("step_time_s"),
                           "measured_step_time_s": done.measured_step_time_s if done else None,
                           "predicted_peak_memory_gib": plan.predicted.get("peak_memory_gib"),
                           "measured_peak_memory_gib": done.measured_peak_memory_gib if done else None}
        if notify:
            self.notify()

    def set(self, key: str, status: str, trial: Any = None) -> None:
        row = self._rows[key]
        row["status"] = status
        if trial is not None:
            row.update(trial=trial, measured_step_time_s=trial.measured_step_time_s,
                       measured_peak_memory_gib=trial.measured_peak_memory_gib)
        self.notify()

    def notify(self) -> None:
        if self._on_update:
            self._on_update([{k: v for k, v in r.items() if k != "trial"} for r in self._rows.values()])

    def trials(self) -> list[Any]:
        return [r["trial"] for r in self._rows.values() if r["trial"] is not None]

    def not_run(self) -> list[dict[str, Any]]:
        return [{"id": r["id"], "plan": r["plan"], "status": r["status"]} for r in self._rows.values()
                if r["trial"] is None]


class _Runner:
    def __init__(self, *, log: Path, rows: _Rows, deadline: float | None, **trial_options: Any) -> None:
        self.log, self.rows, self.deadline, self.options = log, rows, deadline, trial_options

    def try_plan(self, plan: Any, round: str) -> None:
        from executor.trials import run_trial, trial_id

        key = trial_id(plan)
        if key in self.rows.finished:
            return
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.rows.set(key, "not run (budget)")
            return
        self.rows.set(key, "running")
        trial = run_trial(plan, log=self.log, round=round, **self.options)
        self.rows.finished[key] = trial
        self.rows.set(key, trial.status, trial)


def _learned_memory_limit(trials: list[Any], given: float | None) -> float | None:
    """Below the smallest predicted peak of a trial that ran out of memory (None: no trial did)."""
    peaks = [t.predicted_peak_memory_gib for t in trials if t.status == "oom" and t.predicted_peak_memory_gib]
    if not peaks:
        return given
    learned = OOM_MARGIN * min(peaks)
    return learned if given is None else min(given, learned)


def _tune_records(log: Path) -> list[dict[str, Any]]:
    from executor.runs_log import read_runs

    return [r for r in read_runs(log) if isinstance(r.get("tune"), dict) and r.get("step_time_s", 0) > 0
            and isinstance(r.get("plan"), dict)]


def _refit(log: Path, spec: Any, directory: Path) -> dict[str, Any]:
    """Refit `spec` from the trials in `log` (`soap calibrate --from-runs`'s fit), write it, and measure its
    step-time error on those trials before and after."""
    from costmodel.profiles import cluster_from_dict
    from executor.validation.metrics import mape
    from executor.validation.refit import refit_cluster, simulate_on, trace_plan_model
    from planner.plan import plan_from_dict

    records = _tune_records(log)
    multipliers, refitted, _ = refit_cluster(records, spec)
    refitted["name"] = f"{spec.name}-tuned"
    refitted["description"] = f"{spec.name} refitted by soap tune from {len(records)} trials"
    path = directory / "cluster-refit.json"
    path.write_text(json.dumps(refitted, indent=2) + "\n")
    after_spec = cluster_from_dict(refitted)
    graphs: dict[tuple, Any] = {}
    measured, before, after = [], [], []
    for record in records:
        plan = plan_from_dict(record["plan"], origin=str(log))
        key = (plan.model.config_hash, plan.model.task, plan.seq_len)
        if key not in graphs:
            graphs[key] = trace_plan_model(plan, spec)
        measured.append(record["step_time_s"])
        before.append(simulate_on(plan, graphs[key], spec).step_time_s)
        after.append(simulate_on(plan, graphs[key], after_spec).step_time_s)
    return {"profile": str(path), "profile_inline": refitted, "trials": len(records),
            "multipliers": multipliers.as_dict(), "mape_before_pct": round(mape(before, measured), 2),
            "mape_after_pct": round(mape(after, measured), 2),
            "log_error_before_pct": round(log_error_pct(before, measured), 2),
            "log_error_after_pct": round(log_error_pct(after, measured), 2)}


def log_error_pct(predicted: list[float], measured: list[float]) -> float:
    """The geometric mean error factor, as a percentage: exp(mean |ln(predicted / measured)|) - 1. The refit
    minimizes squared log ratios, so this is its error in its own terms; MAPE, reported beside it, weighs an
    over-prediction more than an under-prediction of the same factor."""
    logs = [abs(math.log(p / m)) for p, m in zip(predicted, measured)]
    return 100 * (math.exp(sum(logs) / len(logs)) - 1)


def _best_plan(log: Path, best: Any, refitted: Any, refitted_inline: dict) -> Any:
    """The measured-best trial's plan as it ran, with the refitted profile inline and its `predicted` block
    re-simulated on it, plus what was measured."""
    from executor.validation.refit import simulate_on, trace_plan_model
    from planner.plan import plan_from_dict

    record = next(r for r in reversed(_tune_records(log)) if r["tune"]["trial"]["id"] == best.id)
    plan = plan_from_dict(record["plan"], origin=str(log))
    result = simulate_on(plan, trace_plan_model(plan, refitted), refitted)
    predicted = json.loads(json.dumps(result.to_contract(), sort_keys=True))
    predicted.update(measured_step_time_s=best.measured_step_time_s,
                     measured_peak_memory_gib=best.measured_peak_memory_gib,
                     first_predicted_step_time_s=best.predicted_step_time_s,
                     first_predicted_peak_memory_gib=best.predicted_peak_memory_gib)
    cluster = plan.cluster.model_copy(update={"name": refitted.name, "profile": refitted_inline})
    return plan.model_copy(update={"cluster": cluster, "predicted": predicted})
