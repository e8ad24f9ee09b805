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
