"""soap validate's harness: metrics, the wrong-profile check, the runs log and the refit from runs."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
from dataclasses import replace

import numpy as np
import pytest

from costmodel.calibration.runs import PHYSICAL_BOUNDS, Multipliers, StepParts, fit_multipliers
from executor.validation.metrics import Comparison, kendall_tau, mape, summarize


def test_kendall_tau_counts_concordant_and_discordant_pairs():
    # pairs of [1,2,3,4] vs [1,3,2,4]: 5 concordant, 1 discordant (2,3 swapped) -> 4/6
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_kendall_tau_b_discounts_ties():
    # 4 concordant, 0 discordant, one tie in each ranking: 4 / sqrt((6-1)(6-1)) = 0.8
    assert kendall_tau([1, 2, 2, 3], [1, 2, 3, 3]) == pytest.approx(0.8)
    assert math.isnan(kendall_tau([1, 1, 1], [1, 2, 3]))


def test_mape_is_the_mean_absolute_relative_error():
    assert mape([110, 90, 200], [100, 100, 100]) == pytest.approx(40.0)
    rows = [Comparison("a", 0.11, 0.10, 90, 100), Comparison("b", 0.30, 0.20, 100, 100)]
    s = summarize(rows)
    assert (s.step_mape_pct, s.memory_mape_pct, s.step_kendall_tau) == pytest.approx((30.0, 5.0, 1.0))
    assert rows[0].step_error_pct == pytest.approx(10.0)


def test_refit_recovers_known_multipliers_from_synthetic_runs():
    rng = np.random.default_rng(0)
    truth = Multipliers(compute=2.5, kernel_overhead=1.6, communication=0.4, activation_communication=3.0)
    runs = []
    for i in range(16):
        c, k, m = rng.uniform(0.05, 0.3), rng.uniform(0.005, 0.05), rng.uniform(0.0, 0.1)
        a = rng.uniform(0.01, 0.1) if i % 2 else 0.0  # half the runs have TP
        parts = StepParts(compute_s=c, kernel_overhead_s=k, communication_s=m, activation_communication_s=a,
                          measured_s=0.0)
        runs.append(replace(parts, measured_s=truth.predict(parts)))
    fitted = fit_multipliers(runs)
    assert fitted.compute == pytest.approx(truth.compute, rel=0.02)
    assert fitted.kernel_overhead == pytest.approx(truth.kernel_overhead, rel=0.05)
    assert fitted.communication == pytest.approx(truth.communication, rel=0.05)
    assert fitted.activation_communication == pytest.approx(truth.activation_communication, rel=0.05)


def test_a_refit_never_writes_a_factor_beyond_its_physical_bound():
    """Issue 30: runs whose launch part needs x31.8 (the model misses time, the device is not 31.8x slower
    to launch) fit to the bound, and the fit says which term is there."""
    rng = np.random.default_rng(1)
    truth = Multipliers(compute=1.2, kernel_overhead=31.8)
    runs = []
    for _ in range(12):
        parts = StepParts(compute_s=rng.uniform(0.05, 0.3), kernel_overhead_s=rng.uniform(0.002, 0.02),
                          communication_s=0.0, measured_s=0.0)
        runs.append(replace(parts, measured_s=truth.predict(parts)))
    fitted = fit_multipliers(runs)
    assert fitted.kernel_overhead == pytest.approx(PHYSICAL_BOUNDS["kernel_overhead"][1])
    assert fitted.at_bound == ("kernel_overhead",)
    assert "kernel launch x10" in fitted.bound_note()
    plausible = replace(runs[0], measured_s=1.1 * runs[0].compute_s + runs[0].kernel_overhead_s)
    assert fit_multipliers([plausible]).at_bound == ()


def test_refit_keeps_an_unexercised_term_at_one():
    runs = [StepParts(compute_s=c, kernel_overhead_s=0.0, communication_s=0.0, measured_s=3 * c) for c in (0.1, 0.2)]
    fitted = fit_multipliers(runs)
    assert fitted.compute == pytest.approx(3.0, rel=0.01)
    assert fitted.communication == pytest.approx(1.0, abs=1e-6)
    assert fitted.activation_communication == pytest.approx(1.0, abs=1e-6)


def test_activation_collective_factor_scales_only_tp_collectives_and_applies_exactly():
    """The refit's fourth term: a profile with activation collectives 3x slower predicts a TP plan slower by
    exactly its activation part, leaves a DDP plan alone, and survives the JSON round trip."""
    from costmodel.calibration.runs import apply_multipliers
    from costmodel.profiles import cluster_from_dict, cluster_to_dict, load_cluster
    from executor.validation.refit import step_parts
    from executor.validation.suite import build_case, suite_cases

    cluster = load_cluster("local-cpu-kernels")
    refit = cluster_from_dict(apply_multipliers(cluster_to_dict(cluster), Multipliers(activation_communication=3.0),
                                                source="test"))
    assert refit.device.activation_collective_factor == pytest.approx(3.0)
    assert cluster_from_dict(cluster_to_dict(refit)).device.activation_collective_factor == pytest.approx(3.0)
    graphs: dict = {}
    cases = {c.name: c for c in suite_cases()}
    tp, ddp = build_case(cases["bert tp"], cluster, graphs), build_case(cases["gpt2 ddp"], cluster, graphs)
    graph = next(g for k, g in graphs.items() if k[0] == "bert")
    parts = step_parts(tp.plan, graph, cluster, 1.0)
    assert parts.activation_communication_s > 0
    assert build_case(cases["bert tp"], refit, graphs).result.step_time_s == pytest.approx(
        tp.result.step_time_s + 2 * parts.activation_communication_s, rel=0.02)
    assert build_case(cases["gpt2 ddp"], refit, graphs).result.step_time_s == pytest.approx(ddp.result.step_time_s)


def _append_many(path: str, worker: int) -> None:
    from executor.runs_log import append_run

    for i in range(40):
        append_run({"step_time_s": 0.1 + i, "losses": [1.0] * 200}, path, name=f"w{worker}-{i}")


def test_runs_log_appends_whole_lines_from_concurrent_writers(tmp_path, monkeypatch):
    from executor.runs_log import read_runs, runs_log_path

    log = tmp_path / "runs.jsonl"
    procs = [mp.get_context("fork").Process(target=_append_many, args=(str(log), w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    lines = log.read_text().splitlines()
    assert len(lines) == 160 and all(json.loads(line)["step_time_s"] > 0 for line in lines)
    monkeypatch.setenv("SOAP_RUNS_LOG", str(log))
    assert runs_log_path() == log and len(read_runs()) == 160


@pytest.fixture(scope="module")
def simulated():
    """Three suite plans (DDP, ZeRO-3, ZeRO-2) built on the shipped local-cpu profile."""
    from costmodel.profiles import load_cluster
    from executor.validation.suite import build_case, suite_cases

    cluster = load_cluster("local-cpu")
    graphs: dict = {}
    cases = [c for c in suite_cases() if c.name in ("gpt2 ddp", "llama fsdp zero3", "bert zero2")]
    return cluster, graphs, [build_case(c, cluster, graphs) for c in cases]


def _recorded(built):
    """Measurements as the right profile predicts them (a machine the profile describes exactly)."""
    from executor.validation.validate import predicted_memory_bytes
    from executor.validation.run import Measurement

    return [Measurement(step_time_s=b.result.step_time_s, step_times_s=(b.result.step_time_s,) * 3,
                        peak_memory_bytes=predicted_memory_bytes(b.result, b.workspace_bytes), memory_source="recorded",
                        losses=()) for b in built]


def test_harness_reports_a_large_error_for_a_profile_with_halved_bandwidth(simulated):
    from executor.validation.validate import compare_runs
    from executor.validation.suite import build_case

    cluster, graphs, built = simulated
    measured = _recorded(built)
    right = compare_runs(built, measured)
    assert right.summary.step_mape_pct == pytest.approx(0.0, abs=1e-9)

    def halve(link):
        return replace(link, bandwidth=link.bandwidth / 2)

    wrong = replace(cluster, intra_node=halve(cluster.intra_node), inter_node=halve(cluster.inter_node))
    report = compare_runs([build_case(b.case, wrong, graphs) for b in built], measured)
    errors = {r.name: r.step_error_pct for r in report.rows}
    assert all(e > 0 for e in errors.values())  # slower links predict slower steps
    # sharded data parallelism gathers and scatters every layer's parameters and gradients each step (on
    # local-cpu part of each collective is the framework's per-call host time, which bandwidth leaves alone)
    assert errors["llama fsdp zero3"] > 4.0 and errors["bert zero2"] > 10.0
    assert errors["bert zero2"] > errors["gpt2 ddp"]
    assert report.summary.step_mape_pct > 5.0


def test_harness_reports_a_large_error_for_a_profile_with_halved_compute(simulated):
    from executor.validation.validate import compare_runs
    from executor.validation.suite import build_case

    cluster, graphs, built = simulated
    device = cluster.device
    slow = replace(cluster, device=replace(device, peak_flops={k: v / 2 for k, v in device.peak_flops.items()},
                                           memory_bandwidth=device.memory_bandwidth / 2))
    report = compare_runs([build_case(b.case, slow, graphs) for b in built], _recorded(built))
    assert report.summary.step_mape_pct > 40.0
    assert report.summary.memory_mape_pct == pytest.approx(0.0, abs=1e-9)


def test_calibrate_from_runs_writes_a_profile_that_predicts_the_logged_runs(simulated, tmp_path, capsys):
    from costmodel.profiles import load_cluster
    from executor.runs_log import append_run
    from executor.validation.suite import build_case
    from soap.cli import main

    cluster, graphs, built = simulated
    log = tmp_path / "runs.jsonl"
    for b in built:  # this machine ran every plan 1.8x slower than predicted
        append_run({"step_time_s": 1.8 * b.result.step_time_s}, log, plan=b.plan, name=b.case.name)
    out = tmp_path / "refit.json"
    assert main(["calibrate", "--from-runs", str(log), "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["runs"] == 3 and summary["fit_mape_after_pct"] < 2.0 < summary["fit_mape_before_pct"]
    refit = load_cluster(str(out))
    for b in built:
        assert build_case(b.case, refit, graphs).result.step_time_s == pytest.approx(1.8 * b.result.step_time_s, rel=0.05)


def test_refit_from_runs_learns_the_runtime_workspace_from_measured_peaks(simulated, tmp_path):
    from costmodel.profiles import load_cluster
    from executor.runs_log import append_run
    from executor.validation.validate import compare_runs, predicted_memory_bytes
    from executor.validation.refit import refit_profile
    from executor.validation.run import Measurement
    from executor.validation.suite import build_case

    cluster, graphs, built = simulated
    log = tmp_path / "runs.jsonl"
    extra = [6, 4, 5]  # MiB each run grew beyond the predicted tensors: the median, 5 MiB, is the workspace
    measured = []
    for b, mib in zip(built, extra):
        peak = predicted_memory_bytes(b.result) + mib * 2**20  # the counted tensors, no workspace yet
        append_run({"step_time_s": b.result.step_time_s, "peak_memory_gib": peak / 2**30,
                    "peak_memory_source": "peak RSS growth (VmHWM)"}, log, plan=b.plan, name=b.case.name)
        measured.append(Measurement(step_time_s=b.result.step_time_s, step_times_s=(), peak_memory_bytes=peak,
                                    memory_source="recorded", losses=()))
    append_run({"step_time_s": 1.0, "peak_memory_gib": 9.0, "peak_memory_source": "process peak RSS"}, log,
               plan=built[0].plan, name="execute on cpu: whole-process RSS, not comparable")
    out = tmp_path / "refit.json"
    refit = refit_profile(str(log), "local-cpu", str(out))
    assert refit.workspace_bytes == pytest.approx(5 * 2**20, rel=1e-3)
    refitted = [build_case(b.case, load_cluster(str(out)), graphs) for b in built]
    assert all(r.workspace_bytes == refit.workspace_bytes for r in refitted)
    before, after = compare_runs(built, measured), compare_runs(refitted, measured)
    assert after.summary.memory_mape_pct < before.summary.memory_mape_pct
    assert max(abs(r.memory_error_pct) for r in after.rows) < 3.0


def test_validate_on_cuda_without_a_gpu_is_a_clear_error(capsys):
    import torch

    from soap.cli import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["validate", "--device", "cuda"]) == 2
    assert "error: --device cuda: CUDA is not available" in capsys.readouterr().err


@pytest.mark.slow
def test_one_real_run_is_measured_logged_and_compared(tmp_path):
    from executor.runs_log import read_runs
    from executor.validation.validate import ValidationConfig, run_validation
    from executor.validation.suite import suite_cases

    case = next(c for c in suite_cases() if c.name == "llama tp")
    case = replace(case, seq_len=64, train={"micro_batch": 1})
    log = tmp_path / "runs.jsonl"
    report = run_validation(ValidationConfig(steps=2, runs_log=str(log), cases=(case,)))
    assert not report.failed, report.failed
    row = report.rows[0]
    assert row.measured_step_s > 0 and row.measured_memory_bytes > 0 and row.predicted_memory_bytes > 0
    (record,) = read_runs(log)
    assert record["name"] == "llama tp" and record["plan"]["parallelism"]["tp"] == 2
    assert len(record["step_times_s"]) == 2 and all(math.isfinite(x) for x in record["losses"])


@pytest.mark.gpu
@pytest.mark.slow
def test_validate_quick_on_cuda_with_nccl(tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from executor.validation.validate import ValidationConfig, run_validation

    report = run_validation(ValidationConfig(device="cuda", quick=True, steps=3, runs_log=str(tmp_path / "r.jsonl"),
                                             cluster="local-cpu"))
    assert report.rows and not report.failed
    assert all(r.measured_memory_bytes > 0 for r in report.rows)


def test_single_device_suite_covers_checkpointing_accumulation_and_micro_batches():
    from executor.validation.suite import single_device_cases

    for device, precision in (("cpu", "fp32"), ("cuda", "bf16")):
        cases = single_device_cases(device)
        assert len(cases) >= 10 and all(c.dims == {} for c in cases)
        trains = [c.train for c in cases]
        assert {t.get("recompute", "none") for t in trains} == {"none", "full", "selective"}
        assert any(t.get("grad_accum", 1) > 1 for t in trains)
        assert len({t["micro_batch"] for t in trains}) >= 3
        assert {c.family for c in cases} == {"gpt2", "llama", "bert"}
        assert {t["precision"] for t in trains} == {precision}
    cuda = single_device_cases("cuda")[0].model_fields()
    assert cuda["n_embd"] >= 1024 and cuda["vocab_size"] >= 32000


@pytest.mark.slow
def test_validate_with_one_rank_runs_the_single_device_suite(tmp_path, capsys):
    from soap.cli import main

    assert main(["validate", "--nproc", "1", "--quick", "--steps", "2", "--json",
                 "--runs-log", str(tmp_path / "runs.jsonl")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not report["failed"] and len(report["plans"]) == 4
    names = {p["name"] for p in report["plans"]}
    assert {"llama full-ckpt", "llama accum4"} <= names
    assert all(p["measured_step_time_s"] > 0 and p["measured_peak_memory_bytes"] > 0 for p in report["plans"])


def test_validate_refuses_three_ranks(capsys):
    from soap.cli import main

    assert main(["validate", "--nproc", "3"]) == 2
    assert "--nproc 3" in capsys.readouterr().err


def test_calibration_plans_share_no_model_or_plan_with_the_suite():
    """A profile refitted on the calibration plans' runs is judged on the suite as on unseen plans."""
    from executor.validation.suite import calibration_cases, case_strategy, hf_config, suite_cases

    calib, suite = calibration_cases(), suite_cases()
    assert len(calib) >= 10
    suite_models = {json.dumps(hf_config(c), sort_keys=True) for c in suite}
    assert not {json.dumps(hf_config(c), sort_keys=True) for c in calib} & suite_models
    assert {c.family for c in calib} == {"gpt2", "llama", "bert"}
    strategies = [case_strategy(c) for c in calib]
    dims = [s.dims for s in strategies]
    assert any(d.tp > 1 for d in dims) and any(d.pp > 1 for d in dims) and any(d.dp_shard > 1 for d in dims) \
        and any(d.dp_replicate > 1 for d in dims)
    assert {s.train.recompute for s in strategies} >= {"none", "full", "selective"}
    assert any(s.train.grad_accum > 1 for s in strategies) and any(s.train.sequence_parallel for s in strategies)


def test_calibration_suite_runs_at_two_ranks_only(capsys):
    from soap.cli import main

    assert main(["validate", "--suite", "calibration", "--nproc", "1"]) == 2
    assert "--suite calibration" in capsys.readouterr().err


def test_the_suite_has_a_real_2d_mesh_run_on_its_own_ranks(monkeypatch):
    """The 2-D plan (FSDP x TP) needs 4 ranks: it runs in a spawn of its own, after its own warm-up run, and
    its result lands in its row."""
    import executor.validation.validate as validation
    from executor.validation.validate import ValidationConfig, case_world, default_cases, execute_by_world

    cases = default_cases(ValidationConfig())
    two_d = [c for c in cases if sum(v > 1 for v in c.dims.values()) >= 2]
    assert two_d and all(case_world(c) == 4 for c in two_d)
    calls = []

    def fake(texts, *, world, steps, device):
        calls.append((world, list(texts)))
        return [f"{world}:{t}" for t in texts]

    monkeypatch.setattr(validation, "execute_plans", fake)
    got = execute_by_world(["a", "b", "c", "d"], [2, 4, 2, 4], steps=3, device="cpu")
    assert got == ["2:a", "4:b", "2:c", "4:d"]
    assert calls == [(2, ["a", "a", "c"]), (4, ["b", "b", "d"])]  # each group's first plan warms up first
