"""`soap replan`: the same run searched again for new resources (`planner/replan.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from exec_helpers import tiny_config

from planner.plan import load_plan
from soap.cli import main


@pytest.fixture(scope="module")
def old_plan(tmp_path_factory) -> Path:
    """A tiny llama planned on 4 dgx-h100 GPUs, global batch 8 x 32, fp32 and SGD (not the defaults)."""
    tmp = tmp_path_factory.mktemp("replan")
    (tmp / "config.json").write_text(json.dumps(tiny_config("llama")))
    assert main(["plan", str(tmp), "--gpus", "4", "--global-batch", "8", "--seq-len", "32", "--precision", "fp32",
                 "--optimizer", "sgd", "-o", str(tmp / "plan.json")]) == 0
    return tmp / "plan.json"


@pytest.mark.parametrize("gpus", [2, 8])
def test_replan_keeps_the_run_and_searches_the_layout_for_fewer_and_more_gpus(old_plan, tmp_path, capsys, gpus):
    old = load_plan(old_plan)
    out = tmp_path / "new.json"
    assert main(["replan", str(old_plan), "--gpus", str(gpus), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    new = load_plan(out)
    assert new.world_size == gpus and new.cluster.name == old.cluster.name
    assert (new.global_batch, new.seq_len, new.model.config_hash) == (old.global_batch, old.seq_len, old.model.config_hash)
    assert (new.parallelism.precision, new.parallelism.optimizer) == ("fp32", "sgd")
    p = new.parallelism
    assert p.dp * p.tp * p.pp * p.cp == gpus and new.global_batch % p.dp == 0
    assert f"4 x dgx-h100  {gpus} x dgx-h100   *" in text
    assert "kept precision=fp32" in text and "kept optimizer=sgd" in text and "global batch kept (8)" in text
    for row in ("dp", "pp", "schedule", "micro-batch x count", "step time s", "peak GiB/GPU"):
        assert f"  {row} " in text


def test_json_prints_one_object_with_the_diff(old_plan, capsys):
    assert main(["replan", str(old_plan), "--gpus", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    diff = data["replan"]
    assert {"field": "gpus", "old": 4, "new": 2} in diff["changes"]
    assert diff["old"]["gpus"] == 4 and diff["batch_change"] is None
    assert data["gpus"] == 2 and "step_time_s" in data and data["parallelism"]["optimizer"] == "sgd"
    assert [(d["name"], d["kept"]) for d in diff["pins"]] == [("precision", True), ("optimizer", True)]


def test_a_different_global_batch_is_refused_unless_allowed_and_the_lr_rule_is_stated(old_plan, capsys):
    assert main(["replan", str(old_plan), "--gpus", "2", "--global-batch", "12"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --global-batch 12 changes the run's global batch 8")
    assert "--allow-batch-change" in err[0]
    assert main(["replan", str(old_plan), "--gpus", "2", "--global-batch", "12", "--allow-batch-change",
                 "--json"]) == 0
    change = json.loads(capsys.readouterr().out)["replan"]["batch_change"]
    assert (change["old"], change["new"], change["lr_factor_linear"]) == (8, 12, 1.5)
    assert "linear scaling rule" in change["note"] and "12/8 = 1.5" in change["note"]


def test_allowing_a_batch_change_without_a_batch_keeps_the_per_gpu_batch(old_plan, capsys):
    assert main(["replan", str(old_plan), "--gpus", "8", "--allow-batch-change"]) == 0
    assert "global batch 8 -> 16" in capsys.readouterr().out


def test_no_plan_for_the_old_batch_is_refused_naming_the_flag(old_plan, capsys):
    assert main(["replan", str(old_plan), "--gpus", "6", "--dp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no plan on 6 GPUs keeps the global batch 8" in err[0]
    assert "--allow-batch-change" in err[0]


def test_a_pin_no_batch_can_honour_is_reported_as_itself(old_plan, capsys):
    assert main(["replan", str(old_plan), "--gpus", "6", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tp=3 does not divide 4 attention heads" in err[0] and "--allow-batch-change" not in err[0]


def test_a_precision_the_new_device_lacks_is_dropped_with_its_reason(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("llama")))
    assert main(["plan", str(tmp_path), "--gpus", "2", "--global-batch", "8", "--seq-len", "32", "--precision",
                 "bf16", "-o", str(tmp_path / "plan.json")]) == 0
    capsys.readouterr()
    assert main(["replan", str(tmp_path / "plan.json"), "--gpus", "4", "--cluster", "dgx1-v100-16g"]) == 0
    text = capsys.readouterr().out
    assert "dropped precision=bf16: the new device has no bf16" in text
    assert "4 x dgx1-v100-16g" in text


@pytest.mark.parametrize("flags, words", [
    (["--gpus", "0"], "--gpus=0"),
    (["--gpus", "2", "--seq-len", "64"], "keeps the plan's sequence length"),
])
def test_bad_input_is_one_error_line(old_plan, capsys, flags, words):
    assert main(["replan", str(old_plan), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0]


def test_a_missing_plan_file_is_one_error_line(tmp_path, capsys):
    assert main(["replan", str(tmp_path / "nope.json"), "--gpus", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
