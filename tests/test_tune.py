"""`soap tune` (issue 29): candidates that differ in mesh or schedule, trials through `soap execute`'s path,
a refit from the trials, the measured-best plan, out-of-memory trials, and resuming without re-running.

The multi-process tests tune tiny Llamas on gloo ranks with compile pinned off: 4 ranks with the local-cpu
profile's link bandwidth misstated 10x (benchmarks/tune_cpu.py's example), and 2 ranks with a vocabulary
large enough that a replicated plan measurably outweighs a sharded one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.tune_cpu import misstated_cluster, tune_args, write_model
from executor.trials import classify_failure, finished_trials, trial_id
from soap.cli import main
from soap.tuning import _learned_memory_limit, log_error_pct

ROOT = Path(__file__).resolve().parents[1]


def soap_tune(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "soap", "tune", *args, "--json"], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def wrong_profile(tmp_path_factory) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("tune")
    return write_model(work / "model"), misstated_cluster(work / "cluster.json")


def test_candidates_differ_in_mesh_or_schedule(wrong_profile):
    from planner.api import plan_report
    from planner.candidates import distinct_candidates, layout_key, plan_pins, ranked_pool, schedule_key
    from planner.report import parallelism_of

    model, cluster = wrong_profile
    report = plan_report(str(model), gpus=4, cluster=str(cluster), seq_len=32, global_batch=8, compile=False)
    pool = ranked_pool(report)
    picked = [parallelism_of(p) for p in distinct_candidates(pool, 3)]
    assert len(picked) == 3 and len({schedule_key(p) for p in picked}) == 3
    layouts = {layout_key(parallelism_of(p)) for p in pool}
    assert len({layout_key(p) for p in picked}) == min(3, len(layouts)), "one plan per mesh comes first"
    assert parallelism_of(report.chosen) == picked[0]
    pinned = plan_report(str(model), gpus=4, cluster=str(cluster), seq_len=32, global_batch=8,
                         **plan_pins(picked[1])).plan
    assert {k: v for k, v in pinned.parallelism.model_dump().items() if k in picked[1]} == \
        {k: v for k, v in picked[1].items() if k in pinned.parallelism.model_dump()}


def test_a_trial_is_named_by_its_configuration_not_its_profile(wrong_profile):
    import soap

    model, cluster = wrong_profile
    pins = dict(seq_len=32, global_batch=8, compile=False, pp=1, tp=1, zero=0, micro_batch=2, grad_accum=1)
    right = soap.plan(str(model), gpus=4, cluster="local-cpu", **pins)
    wrong = soap.plan(str(model), gpus=4, cluster=str(cluster), **pins)
    assert right.predicted["step_time_s"] != wrong.predicted["step_time_s"]
    assert trial_id(right) == trial_id(wrong)


def test_failures_are_classified():
    assert classify_failure("a worker failed (rank 1): OutOfMemoryError: CUDA out of memory. Tried ...") == "oom"
    assert classify_failure("a worker failed (rank 0, exit code -9) without a Python exception (killed, ...)") == "oom"
    assert classify_failure("rank 1 waited 61 s on all_reduce (no progress within the 60 s limit; ...)") == "hung"
    assert classify_failure("a worker failed (rank 0): ValueError: bad") == "failed"


def test_an_out_of_memory_trial_lowers_the_replans_memory_limit():
    from executor.trials import Trial

    def trial(status: str, predicted: float) -> Trial:
        return Trial(id=status + str(predicted), plan="p", status=status, predicted_step_time_s=1.0,
                     measured_step_time_s=1.0, predicted_peak_memory_gib=predicted, measured_peak_memory_gib=9.0)

    assert _learned_memory_limit([trial("ok", 5.0)], None) is None
    assert _learned_memory_limit([trial("ok", 5.0), trial("oom", 8.0), trial("oom", 6.0)], None) == pytest.approx(5.94)
    assert _learned_memory_limit([trial("oom", 6.0)], 4.0) == 4.0


def test_the_log_error_is_symmetric_in_factors():
    assert log_error_pct([2.0, 0.5], [1.0, 1.0]) == pytest.approx(100.0)
    assert log_error_pct([1.0], [1.0]) == 0.0


@pytest.mark.parametrize("flags, words", [
    (["--top", "0"], "--top 0"),
    (["--mem-cap", "-1"], "--mem-cap -1"),
    (["--budget", "0"], "--budget 0"),
    (["--tp", "3"], "tp"),
])
def test_bad_input_is_one_error_line(wrong_profile, tmp_path, capsys, flags, words):
    model, cluster = wrong_profile
    code = main(["tune", str(model), "--gpus", "4", "--cluster", str(cluster), "--seq-len", "32",
                 "--dir", str(tmp_path / "t"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and words in err[-1]
    assert not (tmp_path / "t" / "runs.jsonl").exists()


def test_python_api_tunes_and_refuses_bad_input_before_planning():
    import soap
    from tracer.errors import SoapError

    assert callable(soap.tune)
    with pytest.raises(SoapError, match="--top 0"):
        soap.tune("gpt2", gpus=4, cluster="local-cpu", top=0)


def test_a_plan_predicted_over_the_memory_cap_is_out_of_memory_without_running(wrong_profile, tmp_path):
    import soap
    from executor.launch import LaunchOptions
    from executor.trials import run_trial

    model, _ = wrong_profile
    plan = soap.plan(str(model), gpus=4, cluster="local-cpu", seq_len=32, global_batch=8, compile=False)
    cap = plan.predicted["peak_memory_gib"] / 2
    trial = run_trial(plan, log=tmp_path / "runs.jsonl", steps=1, warmup=0, launch=LaunchOptions(), mem_cap_gib=cap)
    assert trial.status == "oom" and trial.measured_step_time_s is None and "not run" in trial.message
    assert finished_trials(tmp_path / "runs.jsonl") == {trial.id: trial}


@pytest.fixture(scope="module")
def tuned(wrong_profile, tmp_path_factory) -> tuple[dict, Path, list[str]]:
    model, cluster = wrong_profile
    directory = tmp_path_factory.mktemp("tuned") / "tune"
    args = [*tune_args(model, cluster, directory, top=3, steps=2), "-o", str(directory.parent / "plan.json")]
    proc = soap_tune(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), directory, args


@pytest.mark.slow
def test_tune_hands_back_the_plan_measured_fastest_and_the_refit_learns(tuned):
    from planner.plan import load_plan

    report, directory, _ = tuned
    ok = [t for t in report["trials"] if t["status"] == "ok"]
    assert len({t["id"] for t in report["trials"]}) == len(report["trials"]) >= 3
    fastest = min(ok, key=lambda t: t["measured_step_time_s"])
    assert report["best"] == fastest["id"] and fastest["rank"] == 1
    # the wrong profile (links 10x too slow) puts a pipeline first; 4 CPU ranks run data parallelism faster
    assert report["first_predicted"] == report["trials"][0]["id"] and not report["best_is_first_predicted"]
    assert report["refit"]["log_error_after_pct"] < report["refit"]["log_error_before_pct"]
    plan = load_plan(directory.parent / "plan.json")
    assert trial_id(plan) == report["best"]
    assert plan.predicted["measured_step_time_s"] == report["measured_step_time_s"]
    assert plan.predicted["step_time_s"] == report["repredicted_step_time_s"] > 0
    assert plan.cluster.profile["name"].endswith("-tuned")
    assert len(finished_trials(directory / "runs.jsonl")) == len(report["trials"])


@pytest.mark.slow
def test_resuming_after_an_interrupt_reruns_no_finished_trial(tuned):
    report, directory, args = tuned
    log = directory / "runs.jsonl"
    lines = log.read_text().splitlines()
    lost = json.loads(lines[-1])["tune"]["trial"]["id"]
    log.write_text("\n".join(lines[:-1]) + "\n")  # the last trial never finished: interrupted
    proc = soap_tune(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = [json.loads(line)["tune"]["trial"]["id"] for line in log.read_text().splitlines()]
    assert ids[len(lines) - 1] == lost, "the interrupted trial runs again, first"
    assert len(set(ids)) == len(ids), "no trial that finished runs again"
    # a re-plan on a profile refitted from new measurements may add a trial, never repeat one
    resumed = json.loads(proc.stdout)
    assert {t["id"] for t in report["trials"]} <= {t["id"] for t in resumed["trials"]}


@pytest.mark.slow
def test_a_trial_over_the_memory_cap_is_out_of_memory_and_excluded(tmp_path):
    # a 131072-token vocabulary: the top two plans are zero0 and zero1 (the latter shards AdamW's ~270 MB of
    # moments over 2 ranks); at 65536 their measured RSS peaks came 18-48 MB apart, too close for a cap between.
    # fp32: the same peaks 0.18 GiB apart, at a tenth of bf16's step time on a CPU (1 s against 11 s here)
    model = write_model(tmp_path / "model", vocab_size=131072, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2)
    common = [str(model), "--gpus", "2", "--cluster", "local-cpu", "--seq-len", "32", "--global-batch", "4",
              "--pp", "1", "--tp", "1", "--no-compile", "--precision", "fp32", "--top", "2", "--steps", "1",
              "--warmup", "1"]
    free = soap_tune(*common, "--dir", str(tmp_path / "free"))
    assert free.returncode == 0, free.stderr[-3000:]
    peaks = sorted(t["measured_peak_memory_gib"] for t in json.loads(free.stdout)["trials"][:2])
    assert peaks[1] - peaks[0] > 0.02, f"the two plans' peaks are too close to put a cap between: {peaks}"
    cap = (peaks[0] + peaks[1]) / 2
    capped = soap_tune(*common, "--dir", str(tmp_path / "capped"), "--mem-cap", f"{cap:.4f}")
    assert capped.returncode == 0, capped.stderr[-3000:]
    report = json.loads(capped.stdout)
    initial = [t for t in report["trials"] if t["round"] == "initial"]
    oom = [t for t in initial if t["status"] == "oom"]
    assert len(initial) == 2 and len(oom) == 1
    assert oom[0]["measured_peak_memory_gib"] > cap and "over the" in oom[0]["message"] and oom[0]["rank"] is None
    assert report["best"] != oom[0]["id"] and all(t["status"] == "ok" for t in initial if t is not oom[0])
    assert report["replanned"]["mem_limit_gib"] < oom[0]["predicted_peak_memory_gib"]
    statuses = [json.loads(line)["tune"]["trial"]["status"] for line in
                (tmp_path / "capped" / "runs.jsonl").read_text().splitlines()]
    assert "oom" in statuses


def test_tune_takes_a_plan_file_and_a_spent_budget_runs_no_trial(wrong_profile, tmp_path, capsys):
    import soap

    model, cluster = wrong_profile
    plan = soap.plan(str(model), gpus=4, cluster=str(cluster), seq_len=32, global_batch=8, compile=False, pp=1)
    plan.save(tmp_path / "plan.json")
    code = main(["tune", str(tmp_path / "plan.json"), "--budget", "1e-9", "--top", "2", "--dir", str(tmp_path / "t")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == "error: every trial failed: no trial ran within the budget"
    assert "dp4 zero0" in "\n".join(err) and "not run (budget)" in "\n".join(err)
    assert not (tmp_path / "t" / "runs.jsonl").exists()


def test_a_plan_file_refuses_another_cluster_or_gpu_count(wrong_profile, tmp_path, capsys):
    """A plan.json brings its cluster and GPU count: naming others is an error, not silently ignored."""
    import soap

    model, cluster = wrong_profile
    plan = soap.plan(str(model), gpus=4, cluster=str(cluster), seq_len=32, global_batch=8, compile=False, pp=1)
    plan.save(tmp_path / "plan.json")
    for flags in (["--cluster", "local-cpu"], ["--gpus", "2"]):
        assert main(["tune", str(tmp_path / "plan.json"), *flags, "--dir", str(tmp_path / "t")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "brings its own cluster" in err[0]
    assert not (tmp_path / "t" / "runs.jsonl").exists()
