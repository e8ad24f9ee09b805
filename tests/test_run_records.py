"""Run records from outside soap (`executor.validation.run_records`) and the fit on them (`executor.validation.external`):
the schema and its errors, the fit recovering multipliers it planted, fitted profiles inside the loader's
bounds and naming their runs, and `soap calibrate --from-runs` on a file of outside records."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from executor.validation.run_records import RunRecord, read_records
from executor.validation.external import (
    Fit,
    Prepared,
    apply_fit,
    fit,
    load_records,
    part_parameters,
    prepare,
    step_terms,
)
from tracer.errors import SoapError

TINY = {"hidden": 256, "ffn": 512, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512}
FP8_TINY = {**TINY, "hidden": 1024, "ffn": 2048, "heads": 8, "kv_heads": 4}


def _row(**overrides):
    row = dict(name="tiny dp8", model=TINY, gpus=8, dp=8, zero=3, micro_batch=4, global_batch=32, seq=512,
               precision="bf16", recompute="none", torch_compile=False, tokens_per_s_per_gpu=1000.0)
    row.update(overrides)
    return row


def test_a_published_table_file_gives_its_defaults_to_every_row(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"source": "a table", "stack": "nemo-te", "rows": [
        _row(name="a", zero=None, recompute=None, dp=4, tp=2, fsdp=None), _row(name="b", stack="torch-native")]}))
    a, b = read_records(path, cluster="dgx-h100").records
    assert (a.stack, b.stack, a.cluster) == ("nemo-te", "torch-native", "dgx-h100")
    # NeMo's distributed optimizer and no recompute when the table leaves them unstated
    assert a.pins()["zero"] == 1 and a.pins()["recompute"] == "none" and a.pins()["tp"] == 2
    assert b.pins()["zero"] == 3


def test_fsdp_degree_stands_for_zero3_and_tokens_give_the_step(tmp_path):
    record = RunRecord.model_validate(_row(dp=None, zero=None, fsdp=8, global_batch=None, micro_batch=2))
    pins = record.pins()
    assert pins["dp"] == 8 and pins["zero"] == 3 and pins["global_batch"] == 16
    assert record.measured_step_s == pytest.approx(16 * 512 / (1000.0 * 8))


def test_jsonl_records_and_their_errors_name_the_row_and_field(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(_row()) + "\n" + json.dumps(_row(name="bad", precision="fp4")) + "\n")
    with pytest.raises(SoapError, match=r"bad: precision"):
        read_records(path)
    path.write_text(json.dumps(_row(tokens_per_s_per_gpu=None)) + "\n")
    with pytest.raises(SoapError, match="tokens_per_s_per_gpu or step_time_s"):
        read_records(path)
    path.write_text("{not json\n")
    with pytest.raises(SoapError, match=r"runs.jsonl:1: not JSON"):
        read_records(path)


def test_twin_names_are_told_apart(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(_row(seq=512)) + "\n" + json.dumps(_row(seq=1024)) + "\n")
    names = [r.name for r in load_records([str(path)], cluster="dgx-h100")]
    assert len(set(names)) == 2 and "seq 1024" in names[1]


def _fake(name, parts, measured, *, compiled=False, precision="bf16", stack="torch-native", sdpa_backend=None):
    record = RunRecord.model_validate(_row(name=name, stack=stack, step_time_s=measured, sdpa_backend=sdpa_backend))
    plan = SimpleNamespace(parallelism=SimpleNamespace(compile=compiled, precision=precision))
    return Prepared(record=record, plan=plan, graph=None, cluster=None, parts=parts)


def test_the_fit_recovers_the_multipliers_it_planted():
    import random

    rng = random.Random(3)
    truth = {"matmul/bf16": 1.6, "matmul/fp8": 1.4, "attention": 1.9, "memory-bound": 0.8, "compile": 0.3,
             "kernel-launch": 0.4, "host-floor": 1.3, "intra-node": 1.2, "inter-node": 1.5, "activation": 0.7,
             "stack:nemo-te": 0.7, "stack:nemo-te/memory-bound": 0.2}
    runs = []
    for i in range(60):
        parts = {k: rng.uniform(0.05, 2.0) for k in ("matmul", "attention", "memory-bound", "kernel-launch",
                                                     "host-floor", "intra-node", "inter-node", "activation")}
        parts["other"] = 0.01
        parts["fp8-weight-casts"] = rng.uniform(0.05, 0.5) if i % 2 else 0.0
        probe = _fake(f"r{i}", parts, 1.0, compiled=i % 3 == 0, precision="fp8" if i % 2 else "bf16",
                      stack="nemo-te" if i % 4 == 1 else "torch-native")
        measured = sum(parts[p] * float(__import__("math").prod(truth[k] for k in ks))
                       for p, ks in part_parameters(probe).items())
        runs.append(replace(probe, record=probe.record.model_copy(update={"step_time_s": measured})))
    result = fit(runs, prior_weight=1e-5)  # noise-free: the pull toward 1 would only bias the rarely-seen terms
    for name, value in truth.items():
        assert result.multipliers[name] == pytest.approx(value, rel=0.03), name
    assert set(result.runs["compile"]) == {f"r{i}" for i in range(0, 60, 3)}


def test_a_robust_fit_is_not_dragged_by_a_few_runs_many_times_slower_than_their_parts():
    """Cauchy's loss (`fit(robust=...)`): one run in eight failed, 10-30x slower than its parts, pulls a square fit's
    main terms 23-67% off the truth (launch to its floor); a robust fit lets them go and its main terms come back
    within 5%. Without failed runs the two agree."""
    import math
    import random

    rng = random.Random(5)
    truth = {"matmul/bf16": 1.3, "inter-node": 2.0, "kernel-launch": 0.5}
    runs = []
    for i in range(40):
        parts = {"matmul": rng.uniform(0.1, 1.0), "inter-node": rng.uniform(0.05, 1.0),
                 "kernel-launch": rng.uniform(0.01, 0.2), "other": 0.01,
                 "attention": 0.0, "memory-bound": 0.0, "intra-node": 0.0, "activation": 0.0}
        probe = _fake(f"r{i}", parts, 1.0)
        measured = sum(parts.get(p, 0.0) * math.prod(truth.get(k, 1.0) for k in ks) for p, ks in part_parameters(probe).items())
        runs.append(replace(probe, record=probe.record.model_copy(update={"step_time_s": measured})))
    clean = [fit(runs, prior_weight=1e-6), fit(runs, prior_weight=1e-6, robust=math.log(2))]
    for result in clean:
        for name, value in truth.items():
            assert result.multipliers[name] == pytest.approx(value, rel=0.02), name
    failed = [replace(r, record=r.record.model_copy(update={"step_time_s": r.record.step_time_s * (10 + 5 * (i // 8))}))
              if i % 8 == 0 else r for i, r in enumerate(runs)]
    square, robust = fit(failed, prior_weight=1e-6), fit(failed, prior_weight=1e-6, robust=math.log(2))
    for name in ("matmul/bf16", "inter-node"):  # the terms that carry most of each step
        assert abs(math.log(square.multipliers[name] / truth[name])) > 0.2, name
        assert robust.multipliers[name] == pytest.approx(truth[name], rel=0.08), name
    # launch carries 1-20% of a step: the failed runs push a square fit onto its floor; the robust one less far
    assert square.multipliers["kernel-launch"] == pytest.approx(0.01)
    assert robust.multipliers["kernel-launch"] > 0.05


def _on_h100(run, graph=None):
    from costmodel.profiles import load_cluster

    return replace(run, cluster=load_cluster("dgx-h100-datasheet"), graph=graph)


def test_the_fit_makes_no_kernel_class_faster_than_its_datasheet_peak():
    """A stack's runs alone cannot tell its factor from the device's matmul multiplier: runs planted at matmul x0.5
    (faster than the H100's bf16 peak, which the profile prices at 0.807 of it at best) are fitted on the peak, the
    product of the matmul multiplier and the stack factor at 0.807 (within 0.1%), the rest of the step taken up by
    the other terms; a run above the peak fits as before, with or without the ceiling."""
    import math
    import random

    rng = random.Random(11)
    top = 0.807  # h100-sxm's matmul_efficiency top
    runs = []
    for i in range(12):
        parts = {"matmul": rng.uniform(0.5, 1.0), "memory-bound": rng.uniform(0.1, 0.4), "kernel-launch": 0.02,
                 "other": 0.01}
        probe = _on_h100(_fake(f"r{i}", parts, 1.0, stack="nemo-te"))
        truth = {"matmul/bf16": 0.8, "stack:nemo-te": 0.625, "memory-bound": 1.2}  # matmul x0.5 in all
        measured = sum(parts.get(k, 0.0) * math.prod(truth.get(n, 1.0) for n in ns)
                       for k, ns in part_parameters(probe).items())
        runs.append(replace(probe, record=probe.record.model_copy(update={"step_time_s": measured})))
    free = fit(runs, prior_weight=1e-6, peak_ceiling=False)
    capped = fit(runs, prior_weight=1e-6)
    assert free.multipliers["matmul/bf16"] * free.multipliers["stack:nemo-te"] < 0.6
    product = capped.multipliers["matmul/bf16"] * capped.multipliers["stack:nemo-te"]
    assert product == pytest.approx(top, rel=1e-3)
    assert capped.at_peak == (("matmul/bf16", "stack:nemo-te"),) and free.at_peak == ()
    slow = [replace(r, record=r.record.model_copy(update={"step_time_s": 2 * r.record.step_time_s})) for r in runs]
    a, b = fit(slow, prior_weight=1e-6, peak_ceiling=False), fit(slow, prior_weight=1e-6)
    assert a.multipliers == pytest.approx(b.multipliers, rel=1e-6) and b.at_peak == ()


def test_causal_attention_may_run_at_half_its_counted_flops():
    """torch's FLOP counter counts a causal SDPA's whole score matrix; a flash kernel skips the masked half, so its
    ceiling is half the matmul curve's top. fp8 matmuls take fp8's rate (0.75 of the fp8 peak on h100-sxm)."""
    from executor.validation.external import _peak_ceilings

    def sdpa(causal: bool) -> SimpleNamespace:
        return SimpleNamespace(ops=(SimpleNamespace(kind=SimpleNamespace(value="attention"), attrs={"causal": causal}),))

    parts = {"matmul": 1.0, "attention": 0.5, "other": 0.0}
    causal = _on_h100(_fake("causal", parts, 1.0, stack="nemo-te"), graph=sdpa(True))
    full = _on_h100(_fake("full", parts, 1.0, precision="fp8"), graph=sdpa(False))
    names = ["matmul/bf16", "matmul/fp8", "attention", "stack:nemo-te"]
    ceilings = _peak_ceilings([causal], names, None)
    assert ceilings[("attention", "stack:nemo-te")] == pytest.approx(0.807 / 2, rel=1e-3)
    assert ceilings[("matmul/bf16", "stack:nemo-te")] == pytest.approx(0.807, rel=1e-3)
    ceilings = _peak_ceilings([full], names, None)
    assert ceilings[("attention",)] == pytest.approx(0.807, rel=1e-3)
    assert ceilings[("matmul/bf16", "matmul/fp8")] == pytest.approx(0.807 * 0.75, rel=1e-3)


def test_fp8_gemms_are_fitted_over_bf16s():
    """An fp8 run's GEMMs take bf16's multiplier times fp8's own (module docstring): the written fp8 factor is their
    product, and a fit on bf16 runs alone predicts fp8 runs with bf16's multiplier, not the prior."""
    from costmodel.profiles import cluster_from_dict, cluster_to_dict, load_cluster

    assert part_parameters(_fake("f", {}, 1.0, precision="fp8"))["matmul"] == ("matmul/bf16", "matmul/fp8")
    base = cluster_to_dict(load_cluster("dgx-h100-datasheet"))
    fitted = cluster_from_dict(apply_fit(base, Fit(multipliers={"matmul/bf16": 1.5, "matmul/fp8": 0.8}, runs={
        "matmul/bf16": ("a",), "matmul/fp8": ("b",)}), source="test"))
    assert fitted.device.kernel_factors["matmul/fp8"].at(1e9) == pytest.approx(1.2)
    assert fitted.device.kernel_factors["matmul/bf16"].at(1e9) == pytest.approx(1.5)
    bf16_only = cluster_from_dict(apply_fit(base, Fit(multipliers={"matmul/bf16": 1.5}, runs={"matmul/bf16": ("a",)}),
                                            source="test"))
    assert bf16_only.device.kernel_factors["matmul/fp8"].at(1e9) == pytest.approx(1.5)


def test_a_16_bit_gemm_fit_stands_for_its_twin_at_the_same_peak():
    """bf16 and fp16 GEMMs run on the same tensor cores at one datasheet peak (H100): a fit on bf16 runs writes
    fp16's multiplier too, so an fp16 plan is priced as its bf16 twin (within fp16's loss scaling), not at the
    datasheet's efficiency. Not on a device with fp16 alone (the V100), and not over a multiplier of fp16's own."""
    from costmodel.profiles import cluster_from_dict, cluster_to_dict, load_cluster
    from planner.api import plan as make

    bf16_fit = Fit(multipliers={"matmul/bf16": 1.5}, runs={"matmul/bf16": ("a",)})
    base = cluster_to_dict(load_cluster("dgx-h100-datasheet"))
    written = apply_fit(base, bf16_fit, source="test")
    fitted = cluster_from_dict(written)
    assert fitted.device.kernel_factors["matmul/fp16"].at(1e9) == pytest.approx(1.5)
    assert "matmul/fp16 as matmul/bf16" in written["device"]["kernel_factors"]["source"]
    both = Fit(multipliers={"matmul/bf16": 1.5, "matmul/fp16": 1.2},
               runs={"matmul/bf16": ("a",), "matmul/fp16": ("b",)})
    own = cluster_from_dict(apply_fit(base, both, source="test"))
    assert own.device.kernel_factors["matmul/fp16"].at(1e9) == pytest.approx(1.2)
    v100 = cluster_to_dict(load_cluster("dgx1-v100-16g"))
    fp16_fit = Fit(multipliers={"matmul/fp16": 1.5}, runs={"matmul/fp16": ("a",)})
    assert "matmul/bf16" not in apply_fit(v100, fp16_fit, source="test")["device"]["kernel_factors"]["factors"]
    times = {p: make("gpt2", gpus=1, cluster=fitted, precision=p, global_batch=8, seq_len=512, micro_batch=8,
                     recompute="none", compile="off", offload="off").predicted["step_time_s"] for p in ("bf16", "fp16")}
    assert times["fp16"] == pytest.approx(times["bf16"], rel=0.05)


def test_a_stated_sdpa_kernel_is_fitted_over_the_unstated_runs_attention(tmp_path):
    """Runs of a torch whose SDPA ran another kernel (FlashAttention-2 where soap's executor runs cuDNN's) share
    every term with the unstated runs but their attention's own multiplier: planted, the fit finds both; the
    written profile keeps the unstated runs' attention and folds the kernel's in only to predict its runs."""
    import math
    import random

    from costmodel.profiles import cluster_from_dict, cluster_to_dict, load_cluster

    path = tmp_path / "table.json"
    path.write_text(json.dumps({"sdpa_backend": "flash_attention", "rows": [_row(name="a"), _row(name="b")]}))
    assert {r.sdpa_backend for r in read_records(path, cluster="dgx-h100").records} == {"flash_attention"}
    path.write_text(json.dumps(_row(sdpa_backend="flash-attn-3")))
    with pytest.raises(SoapError, match="sdpa_backend"):
        read_records(path)

    assert part_parameters(_fake("f", {}, 1.0, sdpa_backend="flash_attention"))["attention"] == (
        "attention", "attention/flash_attention")
    assert part_parameters(_fake("n", {}, 1.0))["attention"] == ("attention",)
    rng = random.Random(5)
    truth = {"matmul/bf16": 1.2, "attention": 0.8, "attention/flash_attention": 2.2, "memory-bound": 1.5}
    runs = []
    for i in range(30):
        parts = {k: rng.uniform(0.05, 2.0) for k in ("matmul", "attention", "memory-bound")}
        probe = _fake(f"r{i}", parts, 1.0, sdpa_backend="flash_attention" if i % 3 == 0 else None)
        measured = sum(parts[p] * math.prod(truth[k] for k in ks) for p, ks in part_parameters(probe).items()
                       if p in parts)
        runs.append(replace(probe, record=probe.record.model_copy(update={"step_time_s": measured})))
    result = fit(runs, prior_weight=1e-5, priors={})  # planted apart from the measured value: no pull toward it
    for name, value in truth.items():
        assert result.multipliers[name] == pytest.approx(value, rel=0.03), name
    assert set(result.runs["attention/flash_attention"]) == {f"r{i}" for i in range(0, 30, 3)}

    base = cluster_to_dict(load_cluster("dgx-h100-datasheet"))
    written = apply_fit(base, result, source="test")
    assert cluster_from_dict(written).device.kernel_factors["attention/bf16"].at(1e9) == pytest.approx(0.8, rel=0.03)
    assert "attention/flash_attention x2.2" in written["device"]["kernel_factors"]["source"]
    assert "reported, not written" in written["device"]["kernel_factors"]["source"]
    folded = cluster_from_dict(apply_fit(base, result, source="test", sdpa_backend="flash_attention"))
    assert folded.device.kernel_factors["attention/bf16"].at(1e9) == pytest.approx(0.8 * 2.2, rel=0.05)


def test_a_kernel_measured_apart_from_the_runs_predicts_held_out_runs_that_ran_it():
    """FlashAttention-2 over cuDNN's kernels, timed on one GPU (`MEASURED_PRIORS`): a fit on runs none of which
    states the kernel keeps it as measured and predicts a held-out run that does with it (leave-one-model-out on
    the corpus, where only the 8B's rows ran FlashAttention-2); runs that state it pull it toward what they need,
    and against the measured value as one run would."""
    import math

    from costmodel.profiles import cluster_from_dict, cluster_to_dict, load_cluster
    from executor.validation.external import FLASH_OVER_CUDNN, MEASURED_PRIORS

    assert MEASURED_PRIORS["attention/flash_attention"][0] == FLASH_OVER_CUDNN
    data = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "h100-2026-11-27-kernels"
                       / "sdpa-backends.json").read_text())["rows"]
    seconds = {(r["seq"], r["backend"]): r["seconds"] for r in data}
    ratios = [seconds[seq, "FLASH_ATTENTION"] / seconds[seq, "CUDNN_ATTENTION"] for seq, _ in seconds]
    assert math.exp(sum(map(math.log, ratios)) / len(ratios)) == pytest.approx(FLASH_OVER_CUDNN, abs=0.005)

    parts = {"matmul": 1.0, "attention": 0.5, "memory-bound": 0.3}
    unstated = [_fake(f"u{i}", {k: v * (1 + i / 10) for k, v in parts.items()}, 0.9 * 1.8 * (1 + i / 10))
                for i in range(4)]
    result = fit(unstated)
    assert "attention/flash_attention" not in result.multipliers and not result.runs.get("attention/flash_attention")
    assert result.multiplier("attention/flash_attention") == FLASH_OVER_CUDNN
    held_out = _fake("h", parts, 1.0, sdpa_backend="flash_attention")
    attention = result.multiplier("attention")
    assert result.predict_linear(held_out) - result.predict_linear(_fake("n", parts, 1.0)) == pytest.approx(
        0.5 * attention * (FLASH_OVER_CUDNN - 1), rel=1e-6)
    folded = apply_fit(cluster_to_dict(load_cluster("dgx-h100-datasheet")), result, source="test",
                       sdpa_backend="flash_attention")
    assert "measured apart from the runs" in folded["device"]["kernel_factors"]["source"]
    assert cluster_from_dict(folded).device.kernel_factors["attention/bf16"].at(1e9) == pytest.approx(
        attention * FLASH_OVER_CUDNN, rel=1e-3)

    def stated(need: float, n: int) -> list:
        return [replace(p, record=p.record.model_copy(update={"sdpa_backend": "flash_attention",
                                                               "step_time_s": 1.3 + 0.5 * need}))
                for p in (_fake(f"s{i}", parts, 1.0) for i in range(n))]

    exact = [_fake(f"e{i}", parts, 1.8) for i in range(4)]  # pin matmul, attention, memory-bound at 1
    one = fit(exact + stated(2.5, 1), free={"attention/flash_attention"}).multipliers["attention/flash_attention"]
    many = fit(exact + stated(2.5, 10), free={"attention/flash_attention"}).multipliers["attention/flash_attention"]
    assert FLASH_OVER_CUDNN < one < math.sqrt(FLASH_OVER_CUDNN * 2.5) < many < 2.5  # one run weighs as the prior


def test_a_measured_ratio_of_two_multipliers_tells_apart_what_the_runs_cannot():
    """Runs at one sequence length carry attention and GEMMs in one proportion, so a fit on them alone trades one
    for the other and a held-out run of a longer sequence comes out far off (the corpus without its 8-GPU rows:
    +80% and +97% on the long ones). Attention's multiplier over the GEMMs', measured on a lent H100
    (`ATTENTION_OVER_MATMUL`, from the timed kernels' data file), pins the split."""
    import math

    from benchmarks.cp_attention import DATA, attention_over_matmul
    from executor.validation.external import ATTENTION_OVER_MATMUL, H100_ATTENTION_OVER_MATMUL

    measured = attention_over_matmul(json.loads(DATA.read_text()))
    assert len(measured) == 6 and all(0.6 < a < 1.0 and 0.95 < m < 1.0 for _, a, m in measured)
    logs = [math.log(a / m) for _, a, m in measured]
    assert math.exp(sum(logs) / len(logs)) == pytest.approx(H100_ATTENTION_OVER_MATMUL, abs=0.005)

    truth = {"matmul": 1.0, "attention": H100_ATTENTION_OVER_MATMUL}

    def run(name, parts):
        return _fake(name, parts, sum(v * truth[k] for k, v in parts.items()))

    short = [run(f"s{i}", {"matmul": 1.0 + i / 10, "attention": 0.2 * (1.0 + i / 10)}) for i in range(6)]
    long = run("long", {"matmul": 1.0, "attention": 4.0})
    alone, pinned = fit(short), fit(short, ratios=ATTENTION_OVER_MATMUL)
    assert predict_error(long, alone) > 0.1
    assert abs(predict_error(long, pinned)) < 0.01
    assert pinned.multipliers["attention"] / pinned.multipliers["matmul/bf16"] == pytest.approx(
        H100_ATTENTION_OVER_MATMUL, rel=0.01)


def predict_error(prepared, result) -> float:
    """The linear prediction's step over the measured one, minus 1."""
    return result.predict_linear(prepared) / prepared.record.measured_step_s - 1


def test_the_activation_collectives_are_fitted_no_slower_than_a_collective_runs():
    """A model's rows with an excess no term of theirs explains, whose only collective-bound part is small, once
    took the multiplier of the activation collectives to x25-29 (NeMo's 8B at cp2 without Nemotron's TP rows), and
    the held-out model's TP rows came out 53-86% slow. It stops at `ACTIVATION_MAX`; a fit under it is unchanged
    (the planted x0.7 above is recovered)."""
    from executor.validation.external import ACTIVATION_MAX

    runs = [_fake(f"a{i}", {"matmul": 1.0 + i / 10, "activation": 0.01 * (1 + i / 5)}, 1.3 * (1 + i / 10))
            for i in range(5)]
    assert fit(runs, free={"activation"}).multipliers["activation"] == pytest.approx(ACTIVATION_MAX)
    fair = [_fake(f"f{i}", {"matmul": 1.0 + i / 10, "activation": 0.1 * (1 + i / 5)}, 1.0 + i / 10 + 0.2 * (1 + i / 5))
            for i in range(5)]
    assert fit(fair, free={"activation"}).multipliers["activation"] == pytest.approx(2.0, rel=0.01)


def test_fitted_profiles_stay_inside_the_loaders_bounds_and_name_their_runs():
    from costmodel.profiles import cluster_from_dict, cluster_to_dict, load_cluster

    base = cluster_to_dict(load_cluster("dgx-h100-datasheet"))
    extreme = Fit(multipliers={"matmul/bf16": 100.0, "compile": 0.001, "memory-bound": 0.01, "kernel-launch": 0.01,
                               "intra-node": 100.0, "activation": 0.01, "stack:nemo-te": 0.5},
                  runs={k: ("run A", "run B") for k in ("matmul/bf16", "compile", "memory-bound", "kernel-launch",
                                                        "intra-node", "activation", "stack:nemo-te")})
    for stack in (None, "nemo-te"):
        profile = apply_fit(base, extreme, source="test", stack=stack)
        cluster = cluster_from_dict(profile)  # raises past any bound
        assert "run A" in cluster.device.sources["kernel_factors"]
        assert "run A" in profile["device"]["kernel_overhead_us"]["source"]
    native = cluster_from_dict(apply_fit(base, extreme, source="test"))
    assert native.device.kernel_factors["matmul/bf16"].at(1e9) == pytest.approx(100.0)
    folded = cluster_from_dict(apply_fit(base, extreme, source="test", stack="nemo-te"))
    assert folded.device.kernel_factors["matmul/bf16"].at(1e9) == pytest.approx(50.0)


def test_step_terms_add_up_to_the_simulated_step():
    """On the datasheet H100 every term has its share; on the shipped dgx-h100, whose host-bound floor (soap's
    eager executor dispatching kernels) outlasts this tiny model's kernels, the floor's share is the compute."""
    for cluster in ("dgx-h100-datasheet", "dgx-h100"):
        record = RunRecord.model_validate(_row(cluster=cluster, dp=4, tp=2, global_batch=16))
        p = prepare(record)
        parts, total = step_terms(p.plan, p.graph, p.cluster)
        assert sum(parts.values()) == pytest.approx(total, rel=1e-6)
        assert parts["activation"] > 0
        if cluster == "dgx-h100":
            assert parts["host-floor"] > 0 and parts["matmul"] == 0
        else:
            assert parts["matmul"] > 0 and parts["kernel-launch"] > 0 and parts["host-floor"] == 0


def test_the_weights_fp8_casts_are_a_part_that_compile_does_not_scale(tmp_path):
    """torchao's compiled casts of the weights run whole (the activations' fuse into their neighbours): the device's
    compile factor scales the activations' casts and not the weights' (`costmodel.opcost._cast_time`), so in the fit
    the weights' casts are a part of their own (`fp8-weight-casts`, the memory-bound multiplier's and not
    `compile`'s), and the linear model agrees with a compiled fp8 step and its bf16 twin re-simulated on the written
    profile (with every cast inside `memory-bound`, a fitted compile factor moved the linear model's weight casts and
    not the simulator's)."""
    from costmodel.profiles import cluster_from_dict, cluster_to_dict, load_cluster
    from executor.validation.refit import simulate_on

    # no launch overhead: the compile factor scales a kernel's launch too, which the linear model keeps apart
    profile = cluster_to_dict(load_cluster("dgx-h100-datasheet"))
    profile["device"]["kernel_overhead_us"] = {"value": 0.0, "source": "test: no launches"}
    cluster = tmp_path / "no-launch.json"
    cluster.write_text(json.dumps(profile))
    runs = {precision: prepare(RunRecord.model_validate(_row(
        name=precision, model=FP8_TINY, cluster=str(cluster), gpus=1, dp=1, zero=0, precision=precision,
        torch_compile=True))) for precision in ("fp8", "bf16")}
    for p in runs.values():
        parts, total = step_terms(p.plan, p.graph, p.cluster)
        assert sum(parts.values()) == pytest.approx(total, rel=1e-6)
        assert parts["kernel-launch"] == 0
    assert runs["fp8"].parts["fp8-weight-casts"] > 0.01 * sum(runs["fp8"].parts.values())
    assert runs["bf16"].parts["fp8-weight-casts"] == 0

    def gap(planted: dict) -> tuple[float, float]:
        """fp8's step over its bf16 twin's, (re-simulated on the written profile, the linear model's)."""
        fitted = Fit(multipliers=planted, runs={k: ("x",) for k in planted})
        simulated = [simulate_on(p.plan, p.graph, cluster_from_dict(apply_fit(cluster_to_dict(p.cluster), fitted,
                                                                              source="planted"))).step_time_s
                     for p in runs.values()]
        linear = [fitted.predict_linear(p) for p in runs.values()]
        return simulated[0] - simulated[1], linear[0] - linear[1]

    for planted in ({"compile": 0.3}, {"memory-bound": 1.5, "compile": 0.3}):
        simulated, linear = gap(planted)
        assert simulated == pytest.approx(linear, rel=0.01), planted


def test_a_fit_on_runs_simulated_with_known_terms_finds_them():
    """Measured steps made by the simulator on a profile whose matmuls take 2x and launches 0.5x: the fit on
    the unchanged profile finds both, and predicts the runs within 2% after re-simulation."""
    from costmodel.profiles import cluster_from_dict, cluster_to_dict
    from executor.validation.external import predict
    from executor.validation.refit import simulate_on

    planted = Fit(multipliers={"matmul/bf16": 2.0, "kernel-launch": 0.5},
                  runs={"matmul/bf16": ("planted",), "kernel-launch": ("planted",)})
    runs = []
    for i, (mb, seq) in enumerate(((1, 256), (8, 512), (4, 1024), (16, 1024))):
        record = RunRecord.model_validate(_row(name=f"mb{mb} seq{seq}", cluster="dgx-h100-datasheet", micro_batch=mb,
                                               global_batch=8 * mb, seq=seq))
        p = prepare(record)
        truth = cluster_from_dict(apply_fit(cluster_to_dict(p.cluster), planted, source="planted"))
        measured = simulate_on(p.plan, p.graph, truth).step_time_s
        runs.append(replace(p, record=record.model_copy(update={"step_time_s": measured,
                                                                "tokens_per_s_per_gpu": None})))
    result = fit(runs, free=("matmul/bf16", "kernel-launch"))  # four runs cannot tell five terms apart
    assert result.multipliers["matmul/bf16"] == pytest.approx(2.0, rel=0.05)
    assert result.multipliers["kernel-launch"] == pytest.approx(0.5, rel=0.05)
    assert all(abs(predict(p, result).error) < 0.02 for p in runs)


def test_calibrate_from_outside_records_writes_a_profile_and_prints_leave_one_out(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [_row(name=f"tiny mb{mb}", micro_batch=mb, global_batch=8 * mb, tokens_per_s_per_gpu=t)
            for mb, t in ((1, 9000.0), (4, 20000.0), (8, 26000.0))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "fitted.json"
    done = subprocess.run([sys.executable, "-m", "soap", "calibrate", "--from-runs", str(path), "--cluster", "dgx-h100",
                           "-o", str(out), "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["runs"] == 3 and summary["written"] == [str(out)]
    assert "run" in summary["mape_leave_one_out_pct"]
    from costmodel.profiles import load_cluster

    fitted = load_cluster(str(out))
    # the tiny model's steps are set by dgx-h100's host-bound floor: the fit scales that, naming the runs
    assert fitted.name == "dgx-h100-fitted" and "tiny mb1" in fitted.device.sources["host_dispatch_us"]
    assert fitted.device.host_dispatch_s != load_cluster("dgx-h100").device.host_dispatch_s


def test_calibrate_from_runs_faster_than_the_device_says_which_kernels_it_held_at_the_peak(tmp_path):
    """A run measured at 5M tokens/s per GPU on a 0.1B-parameter model (8e15 FLOP/s, 8x the H100's bf16 peak): the fit
    holds the GEMMs at the datasheet peak and says so, in --json and on stderr."""
    path = tmp_path / "fast.jsonl"
    model = {"hidden": 2048, "ffn": 8192, "layers": 4, "heads": 16, "kv_heads": 16, "vocab": 512}
    path.write_text(json.dumps(_row(name="too fast", model=model, seq=2048, micro_batch=8, global_batch=64,
                                    tokens_per_s_per_gpu=5e6)) + "\n")
    args = [sys.executable, "-m", "soap", "calibrate", "--from-runs", str(path), "--cluster", "dgx-h100-datasheet",
            "-o", str(tmp_path / "fitted.json")]
    done = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "matmul/bf16" in json.loads(done.stdout)["at_datasheet_peak"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert "note: held at the datasheet peak: matmul/bf16" in done.stderr


def test_calibrate_from_a_bad_record_is_one_error_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_row(gpus=0)) + "\n")
    done = subprocess.run([sys.executable, "-m", "soap", "calibrate", "--from-runs", str(path), "--cluster", "dgx-h100"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error:") and "gpus" in done.stderr and "Traceback" not in done.stderr


def test_calibrate_from_runs_takes_the_measured_ratio_of_attention_to_the_gemms(tmp_path, capsys):
    """`--attention-over-matmul` (`external.ATTENTION_OVER_MATMUL`): runs at one sequence length cannot tell attention's
    time from the GEMMs'; the flag pulls their multipliers' ratio toward the measured one (or a given one), and says
    so in --json. Without outside records it is one error line."""
    from soap.cli import main

    path = tmp_path / "mine.jsonl"
    model = {"hidden": 1024, "ffn": 4096, "layers": 4, "heads": 8, "kv_heads": 8, "vocab": 512}
    rows = [_row(name=f"mb{mb}", model=model, seq=2048, micro_batch=mb, global_batch=8 * mb, tokens_per_s_per_gpu=t)
            for mb, t in ((2, 60000.0), (4, 70000.0), (8, 75000.0))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ratios = {}
    for flag in ([], ["--attention-over-matmul"], ["--attention-over-matmul", "0.3"]):
        out = tmp_path / f"fitted{len(flag)}.json"
        assert main(["calibrate", "--from-runs", str(path), "--cluster", "dgx-h100-datasheet", "-o", str(out),
                     "--json", *flag]) == 0
        summary = json.loads(capsys.readouterr().out)
        m = summary["multipliers"]
        ratios[len(flag)] = (summary["attention_over_matmul"], m["attention"] / m["matmul/bf16"])
    from executor.validation.external import H100_ATTENTION_OVER_MATMUL

    assert ratios[0][0] is None and ratios[1][0] == H100_ATTENTION_OVER_MATMUL and ratios[2][0] == 0.3
    assert ratios[1][1] == pytest.approx(H100_ATTENTION_OVER_MATMUL, rel=0.15)
    assert ratios[2][1] == pytest.approx(0.3, rel=0.15) and abs(ratios[0][1] / 0.3 - 1) > 0.3
    assert main(["calibrate", "--attention-over-matmul"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --attention-over-matmul needs --from-runs")
