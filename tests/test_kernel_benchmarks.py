"""benchmarks/sdpa_backends.py, the SDPA kernels timed against each other (run on a lent GPU): on the CPU at its
smoke shape, every backend gets a row, the ones this torch cannot run say why, and torch's own choice is one of
the timed ones."""

from __future__ import annotations

import json

from benchmarks import sdpa_backends


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
