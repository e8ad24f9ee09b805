"""Workers restarted by the elastic agent continue from the last checkpoint instead of step 0."""

import json
import os

from exec_helpers import make_plan

from executor.checkpoint import RUN_FILE, run_record
from executor.train import RunConfig, _should_resume, layout_change


def _config(tmp_path, **kw):
    return RunConfig(steps=6, checkpoint_dir=str(tmp_path), checkpoint_every=2, **kw)


def test_restarted_workers_resume_when_a_checkpoint_exists(tmp_path, monkeypatch):
    (tmp_path / "latest").write_text("step-00000002\n")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _should_resume(_config(tmp_path))


def test_first_attempt_or_no_checkpoint_starts_from_step_zero(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not _should_resume(_config(tmp_path))  # restarted before any checkpoint was written
    (tmp_path / "latest").write_text("step-00000002\n")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not _should_resume(_config(tmp_path))
    assert _should_resume(_config(tmp_path, resume=True))


def test_each_restart_attempt_rendezvous_in_its_own_key_space(monkeypatch):
    """The elastic agent's store outlives a killed worker group: the restarted group must not read the
    gloo peer addresses (`.../cpu//0/RANK`) its predecessor left there."""
    import torch.distributed as dist

    from executor.launch import attempt_store

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    shared = dist.HashStore()
    key = "0//cpu//0/1"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    attempt_store(shared).set(key, "address of the rank that was killed")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not attempt_store(shared).check([key])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert attempt_store(shared).check([key])


def test_a_group_with_a_store_of_its_own_joins_it_without_a_prefix(monkeypatch):
    """A c10d round's fresh store (`fresh_store_per_round`) is shared by nodes whose restart counts differ
    (a node whose workers were stopped for a membership change does not count a restart): a per-attempt
    prefix would put them in different key spaces, and the group would never form."""
    import torch.distributed as dist

    from executor.launch import attempt_store, fresh_store_per_round

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    attempt_store(store).set("0//cpu//0/1", "rank 1's address")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert attempt_store(store).check(["0//cpu//0/1"])
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    with fresh_store_per_round(enabled=True):
        assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ


def _job_checkpoint(root, job):
    (root / "step-00000002").mkdir(parents=True)
    (root / "step-00000002" / RUN_FILE).write_text(json.dumps(run_record(make_plan("llama"), job=job)))
    (root / "latest").write_text("step-00000002\n")


def test_a_group_reformed_after_a_membership_change_resumes_its_jobs_checkpoint(tmp_path, monkeypatch):
    """The agent does not count a restart for nodes that left or joined, so every node of the re-formed
    group may say restart 0: the checkpoint's job, the same on every node, decides alike for all."""
    _job_checkpoint(tmp_path, "job1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert _should_resume(_config(tmp_path), "job1")
    assert not _should_resume(_config(tmp_path), "job2")  # another job's checkpoints are not continued
    assert not _should_resume(_config(tmp_path), None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # counted on some nodes only: the job decides for all
    assert _should_resume(_config(tmp_path), "job1")
    assert not _should_resume(_config(tmp_path), "job2")


def test_a_resume_under_another_layout_is_recorded_as_a_replan():
    dp4, dp3 = make_plan("llama", dp_replicate=4, micro_batch=3), make_plan("llama", dp_replicate=3, micro_batch=4)
    assert layout_change(run_record(dp4), dp4, 2) == []
    assert layout_change(None, dp3, 0) == []
    [change] = layout_change(json.loads(json.dumps(run_record(dp4))), dp3, 2)
    assert (change["from_ranks"], change["to_ranks"], change["resumed_from_step"]) == (4, 3, 2)
    assert (change["from"]["dp_replicate"], change["to"]["dp_replicate"]) == (4, 3)
