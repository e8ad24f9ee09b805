"""`soap plan` on the command line: JSON contract, plan.json, errors, determinism."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from costmodel.profiles import list_clusters, load_cluster
from planner.api import make_request, plan_report
from planner.plan import load_plan
from soap.cli import main
from tracer.errors import SoapError

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 8,
    "vocab_size": 8192, "n_positions": 1024,
}
MEDIUM_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
}
CONTRACT_KEYS = {"step_time_s", "tokens_per_s", "samples_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
                 "mfu", "hfu", "peak_memory_gib", "parallelism", "breakdown_s", "memory_breakdown_gib"}
PARALLELISM_KEYS = {"dp", "zero", "tp", "pp", "cp", "micro_batch", "grad_accum", "num_microbatches", "schedule",
                    "recompute", "precision", "optimizer"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    (path / "config.json").write_text(json.dumps(TINY_GPT2))
    return str(path)


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    path = tmp_path_factory.mktemp("medium-llama")
    (path / "config.json").write_text(json.dumps(MEDIUM_LLAMA))
    return str(path)


def test_json_output_holds_the_contract_keys_and_the_baselines(tiny, capsys):
    assert main(["plan", tiny, "--gpus", "8", "--global-batch", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert CONTRACT_KEYS <= set(out) and PARALLELISM_KEYS <= set(out["parallelism"])
    assert set(out["breakdown_s"]) == {"compute", "exposed_comm", "bubble", "optimizer", "other"}
    assert [b["name"] for b in out["baselines"]] == ["DDP", "FSDP / ZeRO-3", "Megatron grid", "rules of thumb"]
    assert all(b.get("fits") is False or b["speedup_of_chosen"] >= 1.0 for b in out["baselines"])
    assert out["why"]


def test_baselines_the_pins_exclude_say_so_rather_than_that_they_do_not_fit(tiny, capsys):
    """No baseline offloads optimizer state: under `--offload` each family is outside the pins, not out of memory."""
    assert main(["plan", tiny, "--gpus", "8", "--global-batch", "64", "--offload", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parallelism"]["offload_optimizer"]
    assert all(b["fits"] is False and b["outside_pins"] for b in out["baselines"])
    assert main(["plan", tiny, "--gpus", "8", "--global-batch", "64", "--offload"]) == 0
    summary = capsys.readouterr().out
    assert "outside the pins" in summary and "does not fit" not in summary


def test_plan_json_round_trips_and_matches_the_prediction(tiny, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", tiny, "--gpus", "8", "--global-batch", "64", "--pp", "2", "-o", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "Baselines" in summary and "why:" in summary
    plan = load_plan(out)
    assert plan.parallelism.pp == 2 and len(plan.stages) == 2 * plan.parallelism.virtual_stages
    assert plan.cluster.gpus == 8 and plan.predicted["step_time_s"] > 0
    assert plan.blocks and all(op.soap.get("operator") == 2 for b in plan.blocks for op in b.ops)


def test_plan_is_byte_identical_across_runs_and_hash_seeds(tiny, tmp_path):
    first = tmp_path / "first.json"
    plan_report(tiny, gpus=8, global_batch=64).plan.save(first)
    second = tmp_path / "second.json"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-m", "soap", "plan", tiny, "--gpus", "8", "--global-batch", "64", "-o", str(second)],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    assert first.read_bytes() == second.read_bytes()


def test_infeasible_request_names_the_gpus_needed_and_the_dominating_term(medium, capsys):
    assert main(["plan", medium, "--gpus", "1", "--mem-limit", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert "does not fit on 1 x 4 GiB" in err and "needs at least" in err and "dominates" in err


def test_infeasible_message_names_a_dominant_term_no_larger_than_the_memory_it_needs(medium):
    with pytest.raises(SoapError) as info:
        plan_report(medium, gpus=1, mem_limit_gib=1)
    message = str(info.value)
    need = re.search(r"needs (?:at least \d+ GPUs, or )?([0-9.]+) GiB per GPU", message)
    term = re.search(r"its [a-z ]+ ([0-9.]+) (GiB|MiB) per GPU dominates", message)
    assert need and term, message
    term_gib = float(term.group(1)) / (1 if term.group(2) == "GiB" else 1024)
    assert 0 < term_gib <= float(need.group(1))
    assert "optimizer state offloaded" in message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpus": 16, "tp": 8}, "does not divide 12 attention heads"),
        ({"gpus": 8, "pp": 8, "dp": 2}, "multiply to 16"),
        ({"gpus": 16, "pp": 16}, "larger than the 12 layers"),
        ({"gpus": 0}, "--gpus"),
        ({"gpus": 8, "cp": 4, "seq_len": 100}, "divisible by 2\\*cp=8"),
        ({"gpus": 8, "precision": "fp8", "cluster": "dgx-a100-80g"}, "no fp8 support"),
        ({"gpus": 8, "schedule": "Zigzag"}, "unknown --schedule"),
        ({"gpus": 8, "cluster": "no-such-cluster"}, "no-such-cluster"),
    ],
)
def test_impossible_pins_are_clear_errors_before_tracing(kwargs, message):
    with pytest.raises(SoapError, match=message):
        make_request("gpt2", **kwargs)


def test_python_api_returns_a_plan_with_the_pins(tiny):
    import soap

    plan = soap.plan(tiny, gpus=8, global_batch=64, tp=2, recompute="selective")
    assert (plan.parallelism.tp, plan.parallelism.recompute) == (2, "selective")
    assert plan.strategy().dims.world_size == 8


def test_precision_defaults_to_bf16_and_fp8_is_opt_in(medium, capsys):
    precisions = {}
    for flag in ((), ("--precision", "auto"), ("--precision", "fp8")):
        assert main(["plan", medium, "--gpus", "8", "--global-batch", "64", "--json", *flag]) == 0
        out = json.loads(capsys.readouterr().out)
        precisions[flag] = (out["parallelism"]["precision"], out["step_time_s"])
    assert precisions[()][0] == "bf16"
    assert precisions[("--precision", "fp8")][0] == "fp8"
    # auto searches both and keeps the faster; fp8 is priced faster than bf16 but well under the 2x peak ratio
    assert precisions[("--precision", "auto")][0] == "fp8"
    assert 1.0 < precisions[()][1] / precisions[("--precision", "fp8")][1] < 1.6


@pytest.mark.parametrize("which", ["preset", "config file"])
def test_simulate_reproduces_the_plans_prediction(which, tiny, tmp_path, capsys):
    """`soap simulate` re-traces the model the way `soap plan` did (a preset by name, through the preset
    front-end chain), so it predicts the plan's own step time and memory, not those of another graph."""
    model, extra = ("gpt2", []) if which == "preset" else (tiny, ["--global-batch", "64"])
    out = tmp_path / "plan.json"
    assert main(["plan", model, "--gpus", "8", *extra, "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(out), "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    predicted = load_plan(out).predicted
    assert simulated["step_time_s"] == pytest.approx(predicted["step_time_s"], rel=1e-9)
    assert simulated["peak_memory_gib"] == pytest.approx(predicted["peak_memory_gib"], rel=1e-9)


@pytest.mark.parametrize("cluster", list_clusters())
def test_every_shipped_cluster_plans_with_the_defaults(tiny, cluster, capsys):
    """Pipeline candidates are partitioned at one precision the device has (a V100 has no bf16 rate;
    a hard-coded bf16 there stopped every default plan on `dgx1-v100-16g`)."""
    assert main(["plan", tiny, "--gpus", "16", "--cluster", cluster, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parallelism"]["precision"] in load_cluster(cluster).device.peak_flops
