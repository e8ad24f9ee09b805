"""Issue 8 §3: a worker killed during `soap execute` (CPU, gloo, 2 ranks) loses no work.

The kill is deterministic: a `sitecustomize.py` written by the test into a directory on PYTHONPATH is
imported when a worker's interpreter starts (on this CPU host the forkserver's, which forks the workers),
and on rank 1 of the first attempt only (TORCHELASTIC_RESTART_COUNT=0) it SIGKILLs its own process (the
decision is taken when the hook fires: the elastic agent sets RANK in the worker after the interpreter
started)
- `step:N`: right after the N-th optimizer step (a global torch optimizer-step hook): mid-run;
- `save:N`: inside the DCP save of step N, after rank 1 wrote its shard and before the checkpoint's
  metadata exists: mid-save.
Nothing in soap is patched; the executor sees a worker die exactly as it would from an OOM kill.

Runs: an uninterrupted reference (6 steps, checkpoint every 2), a run killed at step 3 with
`--max-restarts 1`, and a run killed while saving step 4 that is then continued with `--resume`.
Final weights are read from the last DCP checkpoint of each run (without a process group) and compared
tensor by tensor.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_reliability_support import tiny_plan

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
EVERY = 2

FAULT_HOOK = '''
import os

_fault = os.environ.get("SOAP_TEST_FAULT", "")
if _fault:
    import signal

    _kind, _, _n = _fault.partition(":")
    _n = int(_n)

    def _die():
        # the elastic agent sets RANK and the restart count inside the worker, after interpreter start
        if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)

    if _kind == "step":
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _count = [0]

        def _after_step(optimizer, args, kwargs):
            _count[0] += 1
            if _count[0] == _n:
                _die()

        register_optimizer_step_post_hook(_after_step)
    elif _kind == "save":
        from torch.distributed.checkpoint import filesystem as _fs

        _write_data = _fs._FileSystemWriter.write_data

        def write_data(self, plan, planner):
            future = _write_data(self, plan, planner)
            future.wait()
            if f"step-{_n:08d}" in str(getattr(self, "path", "")):
                _die()
            return future

        _fs._FileSystemWriter.write_data = write_data
'''


def _execute(tmp: Path, name: str, plan: Path, *flags: str, fault: str = "",
             timeout: float = 150) -> tuple[subprocess.CompletedProcess, Path]:
    """Run `soap execute` in its own session; past `timeout` the whole process tree is killed."""
    hooks = tmp / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(FAULT_HOOK)
    ckpt = tmp / f"{name}-ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), str(ROOT), str(ROOT / "tests")]),
           "SOAP_TEST_FAULT": fault, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "soap", "execute", str(plan), "--steps", str(STEPS), "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", str(EVERY), "--report", str(tmp / f"{name}.run.json"), "--json", *flags]
    proc = subprocess.Popen(argv, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers: nothing is left running
        out, err = proc.communicate()
        err += f"\nTIMEOUT: soap execute did not finish in {timeout} s; killed its process group"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), ckpt


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _checkpoint_tensors(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, read without a process group (and without unpickling code)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=True)


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert any(k.startswith("model.") for k in a) and any(k.startswith("optim.") for k in a)
    assert sorted(a) == sorted(b)
    for key in sorted(a):
        same = torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
        assert same, f"{key} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """An uninterrupted run: 6 steps, a checkpoint every 2."""
    tmp = tmp_path_factory.mktemp("faults")
    plan = tiny_plan(tmp / "tiny.plan.json")
    proc, ckpt = _execute(tmp, "reference", plan)
    return {"tmp": tmp, "plan": plan, "result": _result(proc), "final": ckpt / f"step-{STEPS:08d}"}


@pytest.fixture(scope="module")
def killed(reference) -> dict:
    """Rank 1 killed right after optimizer step 3, with one elastic restart allowed."""
    proc, ckpt = _execute(reference["tmp"], "killed", reference["plan"], "--max-restarts", "1", fault="step:3",
                          timeout=75)
    return {"proc": proc, "ckpt": ckpt}


@pytest.fixture(scope="module")
def save_killed(reference) -> dict:
    """Rank 1 killed inside the DCP save of step 4 (no restart)."""
    proc, ckpt = _execute(reference["tmp"], "save-killed", reference["plan"], fault=f"save:{2 * EVERY}")
    return {"proc": proc, "ckpt": ckpt}


def test_killed_worker_is_restarted_and_training_finishes_with_the_same_weights(reference, killed):
    result = _result(killed["proc"])
    final = reference["final"]
    assert (final.parent / "latest").read_text().strip() == final.name
    assert (killed["ckpt"] / "latest").read_text().strip() == final.name
    assert result["losses"][-1] == reference["result"]["losses"][-1]
    tmp = reference["tmp"]
    _assert_same_weights(_checkpoint_tensors(final, tmp), _checkpoint_tensors(killed["ckpt"] / final.name, tmp))


def test_restarted_workers_resume_from_the_last_checkpoint(killed):
    result = _result(killed["proc"])
    assert result["first_step"] == EVERY, f"restarted at step {result['first_step']}, not at the checkpoint {EVERY}"
    assert len(result["losses"]) == STEPS - EVERY


def test_kill_during_a_checkpoint_save_leaves_the_previous_one_loadable(reference, save_killed):
    tmp, plan, ckpt = reference["tmp"], reference["plan"], save_killed["ckpt"]
    failed = save_killed["proc"]
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert failed.stderr.strip().splitlines()[-1].startswith("error: ")
    partial = ckpt / f".tmp-step-{2 * EVERY:08d}"
    assert partial.is_dir() and not (partial / ".metadata").exists(), "the kill did not land inside the save"
    assert (ckpt / "latest").read_text().strip() == f"step-{EVERY:08d}"
    previous = _checkpoint_tensors(ckpt / f"step-{EVERY:08d}", tmp)
    assert int(previous["step"]) == EVERY

    resumed, _ = _execute(tmp, "save-killed", plan, "--resume")
    result = _result(resumed)
    assert result["first_step"] == EVERY and len(result["losses"]) == STEPS - EVERY
    assert result["losses"][-1] == reference["result"]["losses"][-1]
    _assert_same_weights(_checkpoint_tensors(reference["final"], tmp),
                         _checkpoint_tensors(ckpt / reference["final"].name, tmp))


def test_a_dead_worker_is_reported_as_one_error_line(save_killed):
    last = save_killed["proc"].stderr.strip().splitlines()[-1]
    assert last.startswith("error: a worker failed (rank 1"), last
