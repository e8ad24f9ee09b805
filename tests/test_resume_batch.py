"""Issue 33 §3: resuming under a plan that cannot keep the data order (another global batch or sequence
length) is refused before anything runs; another layout of the same run is accepted."""

from __future__ import annotations

import json

import pytest
from exec_helpers import make_plan

from executor.checkpoint import RUN_FILE, check_resumable, run_record
from soap.cli import main
from tracer.errors import SoapError


def _checkpoint(root, plan) -> None:
    """A checkpoint directory as `save_checkpoint` leaves it (no weights needed: nothing is loaded)."""
    step = root / "step-00000002"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / RUN_FILE).write_text(json.dumps(run_record(plan)))
    (root / "latest").write_text("step-00000002\n")


def test_another_layout_of_the_same_run_may_resume(tmp_path):
    _checkpoint(tmp_path, make_plan("llama", dp_replicate=2, micro_batch=2))
    check_resumable(make_plan("llama", pp=2, micro_batch=2, num_microbatches=2), tmp_path)
    check_resumable(make_plan("llama", dp_shard=4, zero=3, micro_batch=1), tmp_path)


def test_a_global_batch_that_changed_is_refused_before_anything_runs(tmp_path, capsys):
    _checkpoint(tmp_path / "ckpt", make_plan("llama", dp_replicate=2, micro_batch=2))
    plan = make_plan("llama", dp_replicate=2, micro_batch=3)  # global batch 6, not 4
    plan.save(tmp_path / "plan.json")
    assert main(["execute", str(tmp_path / "plan.json"), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
                 "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "global batch of 4 x 16 tokens and this plan has 6 x 16" in err[0]
    assert "data order" in err[0] and "soap replan" in err[0]
    assert not (tmp_path / "plan.run.json").exists()


def test_another_sequence_length_or_model_is_refused(tmp_path):
    _checkpoint(tmp_path, make_plan("llama", dp_replicate=2, micro_batch=2))
    with pytest.raises(SoapError, match="4 x 32"):
        check_resumable(make_plan("llama", dp_replicate=2, micro_batch=2, seq_len=32), tmp_path)
    with pytest.raises(SoapError, match="another model"):
        check_resumable(make_plan("gpt2", dp_replicate=2, micro_batch=2), tmp_path)


@pytest.mark.parametrize("flags, words", [
    (["--elastic", "--nnodes", "1:2"], "--elastic resumes re-planned workers from checkpoints"),
    (["--nnodes", "1:2", "--rdzv-conf", "last_call_timeout"], "--rdzv-conf 'last_call_timeout': expected key=value"),
    (["--elastic", "--nnodes", "1:2", "--checkpoint-dir", "ckpt"], "pass --rdzv-id JOB, the same on every node"),
])
def test_elastic_flags_are_checked_before_anything_runs(tmp_path, capsys, flags, words):
    make_plan("llama", dp_replicate=2, micro_batch=2).save(tmp_path / "plan.json")
    assert main(["execute", str(tmp_path / "plan.json"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]
