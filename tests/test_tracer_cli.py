"""`soap trace`: the JSON contract and the bad-input catalogue (one line, `error: ...`, exit 2)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from soap.cli import main
from tracer.spec import PRESET_DIR

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def private_trace_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SOAP_CACHE_DIR", str(tmp_path / "cache"))


def test_json_has_the_contract_keys(capsys):
    assert main(["trace", "gpt2", "--seq-len", "64", "--batch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 124_439_808
    assert out["params_trainable"] == out["params"]
    assert out["frontend"] == "dispatch"  # presets try dispatch first (tracer/capture.py)
    assert out["blocks"] == [{"id": "transformer.h", "module_type": "GPT2Block", "count": 12, "traced": 2,
                              "stack": "transformer.h", "indices": list(range(12))}]
    assert out["flops_per_token"] > 6 * 85e6  # 6 x non-embedding params, plus attention
    assert {"matmul", "attention", "norm", "loss"} <= set(out["by_kind"])
    assert out["activation_bytes_per_sample"] > 0 and out["trace_time_s"] > 0
    assert out["batch"] == 2 and out["seq_len"] == 64


def test_second_cli_trace_comes_from_the_disk_cache(capsys):
    assert main(["trace", "gpt2", "--seq-len", "48", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["trace", "gpt2", "--seq-len", "48", "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["params"] == first["params"] and second["flops_per_token"] == first["flops_per_token"]
    assert main(["trace", "gpt2", "--seq-len", "48", "--json", "--no-cache"]) == 0
    assert json.loads(capsys.readouterr().out)["by_kind"] == first["by_kind"]


def test_table_names_front_end_and_blocks(capsys):
    assert main(["trace", "bert-base-uncased", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "bert.encoder.layer" in out and "dispatch" in out and "109,514,298" in out


def _bad_inputs(tmp_path):
    malformed = tmp_path / "malformed.json"
    malformed.write_text("{not json")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    no_type = tmp_path / "no_type.json"
    no_type.write_text('{"hidden_size": 8}')
    return {
        "unknown preset": ["no-such-model-preset"],
        "missing path": [str(tmp_path / "missing" / "config.json")],
        "directory without config": [str(tmp_path)],
        "malformed config.json": [str(malformed)],
        "config.json nested too deeply": [str(deep)],
        "config without model_type": [str(no_type)],
        "Hub id while offline": ["meta-llama/Llama-3.1-8B"],
        "unsupported task": ["gpt2", "--task", "translation"],
        "task the model has no head for": ["gpt2", "--task", "seq2seq-lm"],
        "zero seq-len": ["gpt2", "--seq-len", "0"],
        "negative seq-len": ["gpt2", "--seq-len", "-5"],
        "zero batch": ["gpt2", "--batch", "0"],
        "seq-len beyond learned positions": ["gpt2", "--seq-len", "4096"],
        "remote code not trusted": [str(_remote_code_config(tmp_path))],
    }


def _remote_code_config(tmp_path):
    d = tmp_path / "remote"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoConfig": "x.Y"}}))
    return d


@pytest.mark.parametrize("case", ["unknown preset", "missing path", "directory without config",
                                  "malformed config.json", "config.json nested too deeply",
                                  "config without model_type", "Hub id while offline",
                                  "unsupported task", "task the model has no head for", "zero seq-len",
                                  "negative seq-len", "zero batch", "seq-len beyond learned positions",
                                  "remote code not trusted"])
def test_bad_input_is_one_error_line_and_exit_2(case, tmp_path, capsys):
    args = _bad_inputs(tmp_path)[case]
    assert main(["trace", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_bad_input_via_subprocess_has_no_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "soap", "trace", str(tmp_path / "nope.json")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: no such file") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESET_DIR.glob("*.json")))
def test_preset_states_encoder_decoder_as_its_class(preset):
    """Every preset says `is_encoder_decoder`, as its config class would: without it the planner imports
    transformers' config classes to read the default, which cost 1.9 s of a 2.9 s warm `soap plan gpt2`."""
    from transformers import CONFIG_MAPPING

    config = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    assert "is_encoder_decoder" in config
    assert config["is_encoder_decoder"] == bool(getattr(CONFIG_MAPPING[config["model_type"]](), "is_encoder_decoder", False))
