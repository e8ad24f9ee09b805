"""The kernel benchmarks made for a lent GPU, run here at their smoke shapes: `benchmarks/sdpa_backends.py` (every
SDPA backend gets a row, the ones this torch cannot run say why, torch's own choice is one of the timed ones) and
`benchmarks/qlora_dequant.py` (each weight timed and priced by `costmodel.peft.dequantize_seconds`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import qlora_dequant, sdpa_backends


def test_every_backend_is_timed_or_says_why_it_did_not_run(tmp_path, capsys):
    out = tmp_path / "sdpa.json"
    result = sdpa_backends.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    assert [r["backend"] for r in rows] == list(sdpa_backends.BACKENDS)
    chosen = [r for r in rows if r["torch_choice"]]
    assert len(chosen) == 1 and chosen[0]["seconds"] > 0
    for r in rows:
        assert (r["seconds"] is None) == ("why" in r)
        if r["seconds"] is not None:
            assert r["tflops"] > 0
    assert {"FLASH_ATTENTION", "MATH"} <= {r["backend"] for r in rows if r["seconds"]}  # the CPU's two kernels
    assert "| 256 x 2 | " in capsys.readouterr().out


def test_the_dequantization_is_timed_and_priced_weight_by_weight(tmp_path, capsys):
    from costmodel.peft import nf4_bytes

    out = tmp_path / "dequant.json"
    result = qlora_dequant.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    (row,) = result["rows"]
    numel = row["shape"][0] * row["shape"][1]
    assert row["bytes"] == nf4_bytes(numel) + 2 * numel
    assert row["seconds"] > 0 and row["priced_s"] > 0
    assert row["tb_per_s"] * 1e12 * row["seconds"] == pytest.approx(row["bytes"])
    assert row["kernel_s"] is None and row["in_step_s"] is None  # no GPU: no device time to read
    assert "| smoke | 256 x 512 |" in capsys.readouterr().out


DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "h100-2026-11-27-kernels"


def test_the_dequantization_rate_is_the_one_measured():
    """`NF4_DEQUANTIZE_RATE` prices the H200's measured kernel time of a Llama-3-8B layer's seven projections
    (GPU time, torch.profiler) within 5% on the datasheet H200, and the 4-bit forward and backward in a step cost
    about two such dequantizations (their GEMMs' time subtracted)."""
    from benchmarks.gpu_kernels_docs import layer_dequantization

    for name in ("dequant-h200.json", "dequant-h200-repeat.json"):
        measured, priced, in_step = layer_dequantization(json.loads((DATA / name).read_text()), "dgx-h200")
        assert priced == pytest.approx(measured, rel=0.05)
        assert in_step == pytest.approx(2 * measured, rel=0.15)


def test_the_fp8_casts_are_priced_nearer_what_an_h100_measured_than_either_old_way():
    """`benchmarks/fp8_casts.py` from its files: on the measured H100 profile both profiled steps' casts cost more
    than the compile factor on every cast priced them, and the split soap prices (the factor on the activations'
    casts only) is nearer, in log ratio, than either the factor on every cast or on none, and alike on both steps."""
    import math

    from benchmarks import fp8_casts

    ratios = {}
    for suffix in fp8_casts.RUNS:
        extra = fp8_casts.extra_memory_bound(suffix)
        ratios[suffix] = {mode: extra / fp8_casts.priced("h100-x1-measured", mode, suffix=suffix)
                          for mode in fp8_casts.MODES}
        assert ratios[suffix]["every"] > ratios[suffix]["priced"] > ratios[suffix]["none"]
    worst = {mode: max(abs(math.log(r[mode])) for r in ratios.values()) for mode in fp8_casts.MODES}
    assert worst["priced"] < min(worst["every"], worst["none"])
    split = [r["priced"] for r in ratios.values()]
    assert max(split) / min(split) < 1.3  # one shortfall for both models, a rate rather than a shape error


def test_every_context_parallel_layout_is_timed_and_the_executors_checked(tmp_path, capsys):
    """`benchmarks/cp_attention.py` at its smoke shape: every layout of a cp rank's attention gets a time, the
    executor's own (`soap`) with its difference from the whole causal attention (none beyond rounding); the H100's
    record says the same of its bf16 kernels."""
    from benchmarks import cp_attention

    out = tmp_path / "cp.json"
    result = cp_attention.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert {r["layout"] for r in result["rows"]} == set(cp_attention.LAYOUTS)
    assert all(r["seconds"] > 0 for r in result["rows"])
    soap = next(r for r in result["rows"] if r["layout"] == "soap")
    assert soap["max_abs_error"] < 1e-5
    assert "| 256 | 2 |" in capsys.readouterr().out
    recorded = json.loads(cp_attention.DATA.read_text())
    assert [r["max_abs_error"] for r in recorded["rows"] if r["layout"] == "soap"]
    assert all(r["max_abs_error"] < 1e-3 for r in recorded["rows"] if r["layout"] == "soap")
