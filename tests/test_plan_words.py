"""What soap says matches what it did: pinned choices say they were pinned, CPU ranks are not called GPUs,
a plan without a pipeline is not described as one, names print whole, `print(plan)` is short, usage
errors point to the command's own help, and a default batch or a sequence the model was not made for gets
a hint."""

from __future__ import annotations

import json

import pytest

from planner.api import plan_report
from soap.cli import main

SMALL_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 2048,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("words")
    (root / "config.json").write_text(json.dumps(SMALL_LLAMA))
    return str(root)


def test_a_pinned_degree_says_it_was_pinned(small_llama):
    report = plan_report(small_llama, gpus=8, tp=2, global_batch=32, seq_len=256)
    line, = [w for w in report.why if w.startswith("TP=2")]
    assert "as pinned (--tp 2)" in line and "does not fit" not in line, line


def test_a_cpu_plan_counts_processes_not_gpus(small_llama, capsys):
    from planner.report import render_summary

    render_summary(plan_report(small_llama, gpus=2, cluster="local-cpu", global_batch=4, seq_len=64))
    out = capsys.readouterr().out
    head = out.splitlines()[:2]
    assert "on 2 CPU processes (local-cpu)" in head[0] and "GiB per CPU process" in head[1], head
    assert "GPU" not in out


@pytest.mark.parametrize("parallelism, words", [
    (dict(pp=1, schedule="1F1B", num_microbatches=1, micro_batch=2, grad_accum=1), "no pipeline, micro-batch 2"),
    (dict(pp=1, schedule="1F1B", num_microbatches=4, micro_batch=1, grad_accum=4),
     "no pipeline, micro-batch 1 x 4 accumulation steps"),
    (dict(pp=2, schedule="1F1B", num_microbatches=1, micro_batch=1, grad_accum=1), "1F1B with 1 micro-batch of 1"),
    (dict(pp=4, schedule="GPipe", num_microbatches=8, micro_batch=2, grad_accum=1), "GPipe with 8 micro-batches of 2"),
])
def test_simulate_describes_the_batching_the_plan_has(parallelism, words):
    from soap.commands.simulate import batching

    assert batching(parallelism) == words


def test_profile_names_print_whole_on_a_narrow_terminal(monkeypatch, capsys):
    from rich.console import Console

    from costmodel.profiles import list_clusters, list_devices

    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["profiles"]) == 0
    cells = {cell.strip() for line in capsys.readouterr().out.splitlines() for cell in line.split("│")}
    assert set(list_clusters()) | set(list_devices()) <= cells


def test_print_plan_is_a_short_summary_and_repr_the_whole_record(small_llama):
    plan = plan_report(small_llama, gpus=2, global_batch=8, seq_len=128).plan
    text = str(plan)
    assert text.startswith(f"Plan: {small_llama} (causal-lm) on 2 x dgx-h100") and len(text.splitlines()) <= 5
    assert "predicted" in text and "config_hash" not in text
    assert repr(plan).startswith("Plan(schema_version=") and "config_hash" in repr(plan)


def test_an_argument_a_command_does_not_take_points_to_its_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["trace", "gpt2", "--cluster", "foo"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "error: unrecognized arguments: --cluster foo (see `soap trace --help`)"


def test_the_default_batch_on_cpu_gets_a_hint(small_llama, capsys):
    assert main(["plan", small_llama, "--gpus", "2", "--cluster", "local-cpu", "--seq-len", "512"]) == 0
    err = capsys.readouterr().err
    assert "batch: the default 8,192 sequences of 512 (4,194,304 tokens, a GPU-cluster size)" in err, err
    assert "choose one with --global-batch" in err
    assert main(["plan", small_llama, "--gpus", "2", "--cluster", "local-cpu", "--seq-len", "64",
                 "--global-batch", "4"]) == 0
    assert "batch: the default" not in capsys.readouterr().err


def test_a_sequence_longer_than_the_models_positions_is_noted(small_llama, capsys):
    assert main(["plan", small_llama, "--gpus", "2", "--seq-len", "1024", "--global-batch", "2"]) == 0
    err = capsys.readouterr().err
    assert f"note: --seq-len 1024 is longer than the 512 positions {small_llama} declares" in err, err


def test_an_unaligned_vocabulary_is_noted_where_the_profile_prices_it(capsys):
    """GPT-2's 50,257 tokens on the default H100 (which carries the measured unaligned-GEMM factor) get one
    note naming the padded size; on a CPU profile, which measured no such factor, nothing is said."""
    assert main(["plan", "gpt2", "--gpus", "8", "--global-batch", "64", "--seq-len", "1024"]) == 0
    err = capsys.readouterr().err
    assert "note: the vocabulary (50,257) is not a multiple of 8" in err and "50,304" in err, err
    assert main(["plan", "gpt2", "--gpus", "2", "--cluster", "local-cpu", "--global-batch", "4", "--seq-len", "64"]) == 0
    assert "vocabulary" not in capsys.readouterr().err
