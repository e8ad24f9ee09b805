"""The kernel benchmarks made for a lent GPU, run here at their smoke shapes: `benchmarks/sdpa_backends.py` (every
SDPA backend gets a row, the ones this torch cannot run say why, torch's own choice is one of the timed ones) and
`benchmarks/qlora_dequant.py` (each weight timed and priced by `costmodel.peft.dequantize_seconds`)."""

from __future__ import annotations

import json

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
    assert "| smoke | 256 x 512 |" in capsys.readouterr().out
