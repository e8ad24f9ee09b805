"""Issue 8 §5: the same inputs give a byte-identical plan.json across runs and across PYTHONHASHSEED.

Two models (the gpt2 preset and a tiny Llama config.json) are planned in two fresh processes with
PYTHONHASHSEED=0 and PYTHONHASHSEED=12345, each with its own cold trace cache, and once more in this
process from the warm cache. Every run writes to the same relative file names (in its own working
directory), so the files must be equal byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_reliability_support import cli

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 256}
PLANS = {"gpt2.plan.json": ["gpt2", "--gpus", "2"],
         "llama.plan.json": ["tiny-llama", "--gpus", "4", "--cluster", "dgx-a100-80g"]}


def _commands() -> list[list[str]]:
    return [["plan", *args, "-o", name] for name, args in PLANS.items()]


def _start_planning(workdir: Path, hash_seed: str) -> subprocess.Popen:
    script = ("import sys; from soap.cli import main; "
              f"sys.exit(max(main(argv) for argv in {_commands()!r}))")
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "HF_HUB_OFFLINE": "1",
           "SOAP_CACHE_DIR": str(workdir / "trace-cache"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", script], cwd=workdir, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _plans(proc: subprocess.Popen, workdir: Path) -> dict[str, bytes]:
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    return {name: (workdir / name).read_bytes() for name in PLANS}


def _workdir(root: Path, name: str) -> Path:
    workdir = root / name
    (workdir / "tiny-llama").mkdir(parents=True)
    (workdir / "tiny-llama" / "config.json").write_text(json.dumps(TINY_LLAMA))
    return workdir


def test_plan_json_is_byte_identical_across_runs_and_hash_seeds(tmp_path, monkeypatch):
    dirs = {seed: _workdir(tmp_path, f"seed{seed}") for seed in ("0", "12345")}
    procs = {seed: _start_planning(workdir, seed) for seed, workdir in dirs.items()}  # both at once: 2 cores
    seed0, seed12345 = (_plans(procs[seed], dirs[seed]) for seed in ("0", "12345"))
    for name in PLANS:
        assert seed0[name] == seed12345[name], f"{name} differs between PYTHONHASHSEED=0 and 12345"
        assert json.loads(seed0[name])["schema_version"] == 1

    here = _workdir(tmp_path, "in-process")
    monkeypatch.chdir(here)
    monkeypatch.setenv("SOAP_CACHE_DIR", str(tmp_path / "seed0" / "trace-cache"))  # warm: graphs from the cache
    for argv in _commands():
        code, _, err = cli(argv)
        assert code == 0, err
    for name in PLANS:
        assert (here / name).read_bytes() == seed0[name], f"{name} differs between two runs (warm trace cache)"
