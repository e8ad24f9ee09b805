"""Issue 8 §1: every bad input gets one line `error: ...` naming the problem, exit code 2, no traceback.

Each case runs `soap.cli.main` in-process on cheap inputs (the gpt2 preset, tiny config.json files and a
tiny 2-rank plan; nothing is launched, no worker is spawned). `python tests/test_bad_input_catalogue.py`
prints the catalogue as a markdown table with today's error lines (the source of docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from test_reliability_support import assert_one_error_line, cli, gpt2_plan_text, tiny_plan

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 96, "max_position_embeddings": 64}


@dataclass(frozen=True)
class Case:
    name: str
    """What is wrong, as the catalogue lists it."""
    argv: Callable[[Path], list[str]]
    """`soap` arguments, given a fresh temporary directory to write inputs into."""
    named: tuple[str, ...]
    """Words the error line must contain (the problem, the field, the fix)."""
    missing: str | None = None
    """Why soap does not meet the contract yet (the test is a strict xfail until it does)."""
    marks: tuple = field(default=())


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _bytes(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _plan_with(tmp: Path, edit: Callable[[dict], None], name: str = "plan.json") -> str:
    data = json.loads(gpt2_plan_text())
    edit(data)
    return _write(tmp / name, json.dumps(data))


def _set(path: str, value) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            data = data[key]
        data[last] = value
    return edit


def _drop(path: str) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            data = data[key]
        del data[last]
    return edit


def _config(tmp: Path, **extra) -> str:
    return _write(tmp / "config.json", json.dumps({**TINY_LLAMA, **extra}))


def _corrupt_checkpoint(tmp: Path) -> str:
    ckpt = tmp / "ckpt"
    (ckpt / "step-00000004").mkdir(parents=True)
    (ckpt / "step-00000004" / "__0_0.distcp").write_bytes(b"\x00" * 64)
    (ckpt / "latest").write_text("step-00000004\n")
    return str(ckpt)


def _execute(tmp: Path, *flags: str) -> list[str]:
    return ["execute", str(tiny_plan(tmp / "tiny.json")), "--steps", "2", *flags]


CASES = [
    # impossible pins
    Case("zero GPUs", lambda t: ["plan", "gpt2", "--gpus", "0"], ("--gpus",)),
    Case("negative GPUs", lambda t: ["plan", "gpt2", "--gpus", "-8"], ("--gpus",)),
    Case("tp does not divide the GPU count", lambda t: ["plan", "gpt2", "--gpus", "6", "--tp", "4"], ("--tp", "6")),
    Case("pp does not divide the GPU count", lambda t: ["plan", "gpt2", "--gpus", "6", "--pp", "4"], ("--pp", "6")),
    Case("dp does not divide the GPU count", lambda t: ["plan", "gpt2", "--gpus", "6", "--dp", "4"], ("--dp", "6")),
    Case("cp does not divide the GPU count", lambda t: ["plan", "gpt2", "--gpus", "6", "--cp", "4"], ("--cp", "6")),
    Case("tp does not divide the attention heads", lambda t: ["plan", "gpt2", "--gpus", "8", "--tp", "8"],
         ("tp=8", "12", "heads")),
    Case("pp larger than the layer count", lambda t: ["plan", "gpt2", "--gpus", "16", "--pp", "16"],
         ("pp=16", "12 layers")),
    Case("cp does not divide the sequence", lambda t: ["plan", "gpt2", "--gpus", "3", "--cp", "3", "--seq-len", "1000"],
         ("cp=3", "1000")),
    # unknown names
    Case("unknown cluster", lambda t: ["plan", "gpt2", "--gpus", "2", "--cluster", "dgx-z900"],
         ("dgx-z900", "dgx-h100")),
    Case("unknown preset", lambda t: ["plan", "gpt-9000", "--gpus", "2"], ("gpt-9000", "llama-3-8b")),
    Case("unknown task", lambda t: ["plan", "gpt2", "--gpus", "2", "--task", "translation"],
         ("translation", "causal-lm")),
    Case("unknown schedule", lambda t: ["plan", "gpt2", "--gpus", "2", "--pp", "2", "--schedule", "ZigZag"],
         ("ZigZag", "1F1B")),
    Case("unknown precision", lambda t: ["plan", "gpt2", "--gpus", "2", "--precision", "fp4"], ("fp4", "bf16")),
    Case("fp8 on a device without it", lambda t: ["plan", "gpt2", "--gpus", "2", "--cluster", "dgx-a100-80g",
                                                  "--precision", "fp8"], ("fp8", "bf16")),
    Case("an optimizer on a layout it cannot step", lambda t: ["plan", "gpt2", "--gpus", "2", "--tp", "2",
                                                               "--optimizer", "adafactor"], ("adafactor", "adamw")),
    # memory
    Case("memory limit below anything feasible", lambda t: ["plan", "gpt2", "--gpus", "2", "--mem-limit", "0.01"],
         ("does not fit", "--mem-limit")),
    Case("zero sequence length", lambda t: ["plan", "gpt2", "--gpus", "2", "--seq-len", "0"], ("--seq-len",)),
    Case("model name longer than a file name may be", lambda t: ["plan", "x" * 300, "--gpus", "2"],
         ("unknown model",)),
    Case("plan path longer than a file name may be", lambda t: ["simulate", "x" * 300], ("cannot read plan file", "File name too long")),
    Case("non-positive memory limit", lambda t: ["plan", "gpt2", "--gpus", "2", "--mem-limit", "0"], ("--mem-limit",)),
    # plan files
    Case("plan.json missing", lambda t: ["simulate", str(t / "nope.json")], ("nope.json", "soap plan")),
    Case("plan.json malformed", lambda t: ["simulate", _write(t / "p.json", "{not json")], ("not valid JSON",)),
    Case("plan.json truncated", lambda t: ["simulate", _write(t / "p.json", gpt2_plan_text()[:5000])],
         ("not valid JSON",)),
    Case("plan.json is not an object", lambda t: ["simulate", _write(t / "p.json", "[1, 2]")], ("JSON object",)),
    Case("plan.json field missing", lambda t: ["simulate", _plan_with(t, _drop("seq_len"))], ("seq_len",)),
    Case("plan.json field of the wrong type", lambda t: ["simulate", _plan_with(t, _set("parallelism.tp", "two"))],
         ("parallelism.tp",)),
    Case("plan.json unknown field", lambda t: ["simulate", _plan_with(t, _set("parallelism.speed", 11))],
         ("parallelism.speed",)),
    Case("plan.json tampered model config", lambda t: ["simulate", _plan_with(t, _set("model.config.n_layer", 2))],
         ("config_hash",)),
    Case("plan.json tampered mesh", lambda t: ["simulate", _plan_with(t, _set("mesh.degrees", [1, 1, 4, 1, 1]))],
         ("mesh.degrees",)),
    Case("plan.json world size tampered", lambda t: ["simulate", _plan_with(t, _set("cluster.gpus", 4))],
         ("cluster.gpus",)),
    Case("plan.json unknown precision", lambda t: ["simulate", _plan_with(t, _set("parallelism.precision", "fp4"))],
         ("parallelism.precision",)),
    Case("plan.json unknown schedule", lambda t: ["simulate", _plan_with(t, _set("parallelism.schedule", "ZigZag"))],
         ("parallelism.schedule",)),
    Case("plan.json tampered cluster profile", lambda t: ["simulate", _plan_with(t, _set("cluster.profile", {}))],
         ("inline cluster", "plan.json", "missing key")),
    Case("plan.json unknown schema version", lambda t: ["simulate", _plan_with(t, _set("schema_version", 99))],
         ("schema_version", "99")),
    Case("plan.json without schema version", lambda t: ["simulate", _plan_with(t, _drop("schema_version"))],
         ("schema_version",)),
    Case("plan world size differs from the launched one", lambda t: _execute(t, "--nproc-per-node", "3"),
         ("2 ranks", "launched 3", "--nproc-per-node 2")),
    # checkpoints
    Case("missing checkpoint directory",
         lambda t: _execute(t, "--resume", "--checkpoint-dir", str(t / "no-such-ckpt")), ("no checkpoint",)),
    Case("corrupt checkpoint", lambda t: _execute(t, "--resume", "--checkpoint-dir", _corrupt_checkpoint(t)),
         ("corrupt", "step-00000004")),
    Case("--resume without --checkpoint-dir", lambda t: _execute(t, "--resume"), ("--checkpoint-dir",)),
    Case("--memory-snapshot names a file", lambda t: _execute(t, "--memory-snapshot", _write(t / "snap", "x")),
         ("--memory-snapshot", "not a directory")),
    # models
    Case("architecture the tracer cannot capture",
         lambda t: ["trace", _config(t, num_key_value_heads=3), "--seq-len", "16", "--no-cache"],
         ("could not capture", "tried export", "dispatch")),
    Case("config needing remote code (trace)", lambda t: ["trace", _config(t, auto_map={"AutoConfig": "x.Y"})],
         ("auto_map", "--trust-remote-code")),
    Case("config needing remote code (plan)", lambda t: ["plan", _config(t, auto_map={"AutoConfig": "x.Y"}),
                                                         "--gpus", "1"], ("auto_map", "--trust-remote-code")),
    Case("config.json nested 100,000 deep", lambda t: ["trace", _write(t / "config.json", "[" * 100_000)],
         ("config.json",)),
    Case("cluster profile nested 100,000 deep",
         lambda t: ["plan", "gpt2", "--gpus", "2", "--cluster", _write(t / "cluster.json", "[" * 100_000)],
         ("cluster.json", "nested too deeply")),
    Case("cluster profile of nested objects 100,000 deep",
         lambda t: ["plan", "gpt2", "--gpus", "2", "--cluster", _write(t / "cluster.json", '{"a":' * 100_000)],
         ("cluster.json", "nested too deeply")),
    Case("cluster profile that is not UTF-8",
         lambda t: ["plan", "gpt2", "--gpus", "2", "--cluster", _bytes(t / "cluster.json", b'{"name": "\xff"}')],
         ("cluster.json", "UTF-8")),
    Case("cluster profile that is a folder",
         lambda t: ["plan", "gpt2", "--gpus", "2", "--cluster", str(t) + "/"], ("profile", "directory")),
    Case("cluster profile path longer than a file name may be",
         lambda t: ["plan", "gpt2", "--gpus", "2", "--cluster", "x" * 300 + ".json"], ("cluster profile", "too long")),
    Case("device profile nested 100,000 deep",
         lambda t: ["profiles", "--check", _write(t / "device.json", "[" * 100_000)], ("device.json", "nested too deeply")),
    Case("config.json that is not JSON", lambda t: ["plan", _write(t / "config.json", "{"), "--gpus", "1"],
         ("not valid JSON",)),
]


def _params():
    for case in CASES:
        marks = (pytest.mark.xfail(strict=True, reason=case.missing),) if case.missing else ()
        yield pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", _params())
def test_bad_input_is_one_error_line_naming_the_problem(case, tmp_path, monkeypatch):
    monkeypatch.setenv("SOAP_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = cli(case.argv(tmp_path))
    line = assert_one_error_line(code, err, *case.named)
    assert "(rerun with --debug" not in line, "an exception nobody validated (not a SoapError)"
    assert out == ""


REMOTE_CODE = """from transformers import LlamaConfig, LlamaForCausalLM


class TinyConfig(LlamaConfig):
    model_type = "llama"


class TinyForCausalLM(LlamaForCausalLM):
    config_class = TinyConfig
"""


def _remote_code_model(tmp: Path) -> str:
    """A model directory whose config ships its own code (auto_map), like many Hub models."""
    _write(tmp / "tinyconf.py", REMOTE_CODE)
    return str(Path(_config(tmp, auto_map={"AutoConfig": "tinyconf.TinyConfig",
                                           "AutoModelForCausalLM": "tinyconf.TinyForCausalLM"})).parent)


@pytest.mark.parametrize("command", [["trace", "--seq-len", "16", "--json"],
                                     ["plan", "--gpus", "1", "--cluster", "local-cpu", "--json"]],
                         ids=["trace", "plan"])
def test_trust_remote_code_lifts_the_refusal(command, tmp_path, monkeypatch):
    monkeypatch.setenv("SOAP_CACHE_DIR", str(tmp_path / "cache"))
    model = _remote_code_model(tmp_path)
    code, _, err = cli([command[0], model, *command[1:]])
    assert_one_error_line(code, err, "auto_map", "--trust-remote-code")
    code, out, err = cli([command[0], model, *command[1:], "--trust-remote-code"])
    assert code == 0, err
    assert json.loads(out)


def test_debug_shows_the_traceback_and_the_default_does_not(tmp_path):
    """The contract through a real process: one line without --debug, the traceback with it."""
    argv = [sys.executable, "-m", "soap", "simulate", _write(tmp_path / "p.json", "{")]
    plain = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and plain.stderr.startswith("error: ") and "Traceback" not in plain.stderr
    debug = subprocess.run([*argv, "--debug"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_an_unknown_model_without_network_is_one_line_at_once(tmp_path):
    """Not offline by setting, but no Hub to reach (a closed port here): one error line within seconds,
    instead of huggingface_hub's five retries (about 25 s, a warning line each)."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), SOAP_CACHE_DIR=str(tmp_path / "cache"))
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "soap", "plan", "nope-model", "--gpus", "8"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert_one_error_line(run.returncode, run.stderr, "unknown model", "nope-model", "cannot be reached")
    assert time.monotonic() - start < 20


def _shown(arg: str, tmp: str) -> str:
    if tmp in arg:
        return "…/" + Path(arg).name
    return arg if len(arg) <= 40 else f"{arg[:3]}…({len(arg)} characters)"


def catalogue_markdown() -> str:
    """The catalogue with today's error line of every case (for docs/reliability.md)."""
    import tempfile

    rows = ["| bad input | command | today's error line (exit code) |", "|---|---|---|"]
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            argv = case.argv(Path(tmp))
            code, _, err = cli(argv)
            shown = " ".join(_shown(a, tmp) for a in argv)
            line = " / ".join(x for x in err.strip().splitlines() if x.strip()).replace(tmp, "…").replace("|", "\\|")
            line = line.replace("x" * 300, "x…x")
            status = f" **(open: {case.missing})**" if case.missing else ""
            rows.append(f"| {case.name}{status} | `soap {shown}` | `{line}` ({code}) |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    print(catalogue_markdown())
