"""The caching allocator's reserve: a device-profile term fitted from runs that report both CUDA peaks."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from costmodel.calibration.runs import fit_allocator_reserve
from costmodel.memory import reserve_bytes
from costmodel.profiles import GIB, device_to_dict, load_cluster, load_device
from costmodel.profiles_json import MAX_ALLOCATOR_RESERVE, device_from_json
from executor.runs_log import append_run, read_runs
from executor.validation.refit import allocator_reserve_entry
from executor.validation.run import Measurement
from tracer.errors import SoapError


def _run(name: str, allocated: float, reserved: float) -> dict:
    return {"name": name, "step_time_s": 1.0, "peak_memory_gib": allocated, "peak_memory_source": "cuda max_memory_allocated",
            "peak_memory_allocated_gib": allocated, "peak_memory_reserved_gib": reserved}


def test_without_a_fitted_reserve_soap_predicts_allocated_memory():
    device = load_device("h100-sxm")
    assert device.allocator_reserve_fraction is None
    assert not device.predicts_reserved_memory and device.predicted_memory_kind == "allocated"
    assert reserve_bytes(device, 10 * GIB) == 0.0
    assert "allocator_reserve_fraction" not in device_to_dict(device)


def test_a_fitted_reserve_makes_predictions_reserved_memory():
    device = replace(load_device("h100-sxm"), allocator_reserve_fraction=0.25)
    assert device.predicts_reserved_memory and device.predicted_memory_kind == "reserved"
    assert reserve_bytes(device, 8 * GIB) == 2 * GIB


def test_reserve_round_trips_through_the_json_writer_with_its_source():
    device = replace(load_device("h100-sxm"), allocator_reserve_fraction=0.125,
                     sources={**load_device("h100-sxm").sources, "allocator_reserve_fraction": "measured runs"})
    data = json.loads(json.dumps(device_to_dict(device)))
    assert data["allocator_reserve_fraction"] == {"value": 0.125, "source": "measured runs"}
    again = device_from_json(data, "round trip")
    assert again.allocator_reserve_fraction == 0.125 and again.sources["allocator_reserve_fraction"] == "measured runs"
    zero = device_from_json({**data, "allocator_reserve_fraction": {"value": 0, "source": "x"}}, "zero")
    assert zero.allocator_reserve_fraction == 0.0 and zero.predicts_reserved_memory


@pytest.mark.parametrize("value", [-0.1, MAX_ALLOCATOR_RESERVE + 0.5, "10%"])
def test_loader_rejects_a_reserve_outside_its_bounds(value):
    data = {**device_to_dict(load_device("h100-sxm")), "allocator_reserve_fraction": {"value": value, "source": "x"}}
    with pytest.raises(SoapError) as info:
        device_from_json(data, "bad.json")
    assert "allocator_reserve_fraction" in str(info.value)


def test_reserve_is_the_median_excess_of_reserved_over_allocated_bounded():
    assert fit_allocator_reserve([(10, 11), (10, 12), (10, 19)]) == pytest.approx(0.2)  # one fragmented run moves nothing
    assert fit_allocator_reserve([(10, 12), (20, 25)]) == pytest.approx(0.225)
    assert fit_allocator_reserve([(10, 9)]) == 0.0  # reserved below allocated is a measurement error
    assert fit_allocator_reserve([(1, 5)]) == MAX_ALLOCATOR_RESERVE
    with pytest.raises(SoapError, match="max_memory_reserved"):
        fit_allocator_reserve([(0, 0)])


def test_reserve_entry_fits_the_runs_that_report_both_peaks_and_names_them():
    records = [_run("gpt2 plain", 10, 11), _run("llama fsdp", 20, 26), _run("bert", 10, 12),
               {"name": "cpu run", "peak_memory_gib": 3.0, "peak_memory_source": "peak RSS growth (VmHWM)"}]
    entry = allocator_reserve_entry(records)
    assert entry["value"] == pytest.approx(0.2)
    assert "3 runs (gpt2 plain, llama fsdp, bert)" in entry["source"] and "--from-runs" in entry["source"]
    assert allocator_reserve_entry(records[3:]) is None


def test_refit_from_runs_writes_the_reserve_into_the_device_profile(tmp_path):
    from executor.validation.refit import refit_profile
    from executor.validation.suite import build_case, suite_cases

    cluster = load_cluster("local-cpu")
    case = next(c for c in suite_cases() if c.name == "gpt2 ddp")
    built = build_case(case, cluster, {})
    log = tmp_path / "runs.jsonl"
    for name, allocated, reserved in (("a", 1.0, 1.1), ("b", 2.0, 2.6), ("c", 1.0, 1.2)):
        append_run({**_run(name, allocated, reserved), "step_time_s": built.result.step_time_s}, log,
                   plan=built.plan, name=name)
    out = tmp_path / "refit.json"
    refit = refit_profile(str(log), "local-cpu", str(out))
    # the median run's gap less the segment the loss's fp32 transient keeps (the plan's logits, upcast loss)
    from executor.runs_log import read_runs
    from executor.validation.refit import loss_transient_gib

    plan = read_runs(str(log))[0]["plan"]
    transient = loss_transient_gib(plan)
    tokens = plan["parallelism"]["micro_batch"] * plan["seq_len"]
    assert transient == pytest.approx(tokens * plan["model"]["config"]["vocab_size"] * 4 / 2**30) and transient > 0
    assert refit.allocator_reserve_fraction == pytest.approx(0.2 - transient, abs=1e-3)
    device = load_cluster(str(out)).device
    assert device.allocator_reserve_fraction == pytest.approx(0.2 - transient, abs=1e-3)
    assert device.predicted_memory_kind == "reserved"
    assert "3 runs (a, b, c)" in device.sources["allocator_reserve_fraction"]


def test_runs_log_and_reports_keep_both_cuda_peaks(tmp_path):
    log = tmp_path / "runs.jsonl"
    append_run({"step_time_s": 1.0, "peak_memory_gib": 5.0, "peak_memory_allocated_gib": 5.0,
                "peak_memory_reserved_gib": 6.0, "peak_memory_source": "cuda max_memory_allocated"}, log)
    (record,) = read_runs(log)
    assert record["peak_memory_allocated_gib"] == 5.0 and record["peak_memory_reserved_gib"] == 6.0
    cuda = Measurement(step_time_s=1.0, step_times_s=(), peak_memory_bytes=GIB, memory_source="cuda max_memory_allocated",
                       losses=(), peak_allocated_bytes=2 * GIB, peak_reserved_bytes=3 * GIB)
    assert cuda.to_json()["peak_memory_reserved_gib"] == 3.0 and cuda.allocator_peaks_gib()["peak_memory_allocated_gib"] == 2.0
    cpu = Measurement(step_time_s=1.0, step_times_s=(), peak_memory_bytes=GIB, memory_source="peak RSS growth (VmHWM)",
                      losses=())
    assert cpu.allocator_peaks_gib() == {} and "peak_memory_reserved_gib" not in cpu.to_json()


def test_execute_report_holds_allocated_and_reserved_peaks_on_cuda():
    from executor.train import RunResult

    result = RunResult(losses=[1.0], step_times_s=[0.5], tokens_per_step=8, peak_memory_per_rank_gib=[4.0, 5.0],
                       memory_source="cuda max_memory_allocated", predicted_step_time_s=None,
                       predicted_peak_memory_gib=None, parallelism={}, peak_memory_reserved_per_rank_gib=[6.0, 5.5])
    report = result.to_json()
    assert report["peak_memory_gib"] == report["peak_memory_allocated_gib"] == 5.0
    assert report["peak_memory_reserved_gib"] == 6.0
    cpu = RunResult(losses=[1.0], step_times_s=[0.5], tokens_per_step=8, peak_memory_per_rank_gib=[4.0],
                    memory_source="process peak RSS", predicted_step_time_s=None, predicted_peak_memory_gib=None,
                    parallelism={})
    assert "peak_memory_reserved_gib" not in cpu.to_json()


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096,
         "max_position_embeddings": 256, "tie_word_embeddings": False}


def test_the_reserve_holds_the_loss_transient_and_the_fraction_of_the_tensors():
    assert reserve_bytes(replace(load_device("h100-sxm"), allocator_reserve_fraction=0.25), 8 * GIB,
                         loss_transient=GIB) == 3 * GIB
    assert reserve_bytes(load_device("h100-sxm"), 8 * GIB, loss_transient=GIB) == 0.0  # no fitted reserve
    # the fit takes each run's transient off its gap before the median
    assert fit_allocator_reserve([(10, 13, 2), (10, 12, 1), (10, 20, 1)]) == pytest.approx(0.1)


@pytest.mark.parametrize("pins", [{}, {"tp": 2}, {"pp": 2}], ids=str)
def test_a_profile_with_a_reserve_adds_the_rank_s_loss_transient_in_estimate_and_simulation(pins, tmp_path,
                                                                                           monkeypatch):
    """On a device with a fitted reserve (r = 0 here), the predicted peak is the allocated one plus the loss's
    largest fp32 transient on the rank that holds the loss (`costmodel.memory_activations.loss_transient`): the
    fp32 logits of a micro-batch under the upcast loss, one of 8 slices under the chunked one; the estimate
    and the simulation agree (`plan_helpers.simulated_as_estimated`)."""
    import costmodel.opcost
    from plan_helpers import search_pieces, simulated_as_estimated

    from planner.space import mesh_choices, training_choices

    seq = 64
    (tmp_path / "plain").mkdir()
    (tmp_path / "reserved").mkdir()
    monkeypatch.setattr(costmodel.opcost, "CROSS_ENTROPY_SLICE_BYTES", 1)  # 8 slices whatever the logits
    plain = search_pieces(LLAMA, tmp_path / "plain", seq_len=seq, **pins)
    reserved = search_pieces(LLAMA, tmp_path / "reserved", seq_len=seq, allocator_reserve=0.0, **pins)
    compared = 0
    for mesh in mesh_choices(plain[0].space):
        trains = list(training_choices(plain[0].space, mesh))
        for train in trains[::max(1, len(trains) // 4)]:
            for loss in ("chunked", "upcast"):
                train = replace(train, cross_entropy=loss)
                a, b = simulated_as_estimated(*plain[1:], mesh, train), simulated_as_estimated(*reserved[1:], mesh, train)
                if a is None or b is None:
                    continue
                d = mesh.dims
                vocab = LLAMA["vocab_size"] // (d.tp if d.tp > 1 else 1)
                logits = train.micro_batch * seq // d.cp * vocab * 4
                transient = logits / 8 if loss == "chunked" else logits
                ranks = [(x.at_peak.total - y.at_peak.total) for x, y in zip(b[0].result.memory, a[0].result.memory)]
                assert max(ranks) == pytest.approx(transient, rel=1e-6), (mesh, train)
                if d.pp > 1:  # the first stage holds no loss
                    assert min(ranks) == 0
                compared += 1
    assert compared > 0
