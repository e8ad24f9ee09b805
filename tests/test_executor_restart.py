"""Workers restarted by the elastic agent continue from the last checkpoint instead of step 0."""

from executor.train import RunConfig, _should_resume


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

    shared = dist.HashStore()
    key = "0//cpu//0/1"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    attempt_store(shared).set(key, "address of the rank that was killed")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not attempt_store(shared).check([key])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert attempt_store(shared).check([key])
