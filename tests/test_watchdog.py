"""No hangs: a rank that stops making progress ends the run within a bounded time, with one `error:` line
naming the rank, its pipeline stage and what it waited on (`executor.watchdog`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from exec_helpers import make_plan

from costmodel.schedule import build_schedule
from executor.launch import LaunchOptions, run_plan, worker_failure
from executor.pipeline import PipelineProgress
from executor.train import RunConfig
from executor.watchdog import MIN_STEP_S, PROCESS_GROUP_MARGIN_S, WARMUP_S, Limits, Watchdog, limits_for
from soap.cli import main
from tracer.errors import SoapError


def test_the_limits_follow_the_predicted_step_time_with_floors():
    def limits(predicted):
        return limits_for(make_plan("llama", predicted={} if predicted is None else {"step_time_s": predicted}))

    assert limits(0.5) == Limits(step_s=MIN_STEP_S, warmup_s=WARMUP_S)
    assert limits(10.0) == Limits(step_s=200.0, warmup_s=WARMUP_S)
    assert limits(30.0) == Limits(step_s=600.0, warmup_s=600.0)
    assert limits(None) == Limits(step_s=WARMUP_S, warmup_s=WARMUP_S)
    pinned = limits_for(make_plan("llama", predicted={"step_time_s": 30.0}), timeout_s=7.0)
    assert pinned == Limits(step_s=7.0, warmup_s=WARMUP_S)  # the setup and first step may compile
    assert limits_for(make_plan("llama"), timeout_s=900.0) == Limits(step_s=900.0, warmup_s=900.0)
    assert pinned.process_group_s == WARMUP_S + PROCESS_GROUP_MARGIN_S  # the process group's timeout fires later


def test_the_watchdog_names_the_rank_its_stages_and_what_it_waited_on():
    stalls: list[str] = []
    fired = threading.Event()
    dog = Watchdog(Limits(step_s=0.3, warmup_s=0.3), rank=3, poll_s=0.02,
                   on_stall=lambda message: (stalls.append(message), fired.set()))
    dog.set_stages([1, 3])
    dog.start()
    dog.activity("on all_reduce of the step's loss in step 2")
    for _ in range(6):  # progress keeps it quiet past its limit
        time.sleep(0.1)
        dog.beat()
    assert not stalls
    assert fired.wait(5)
    dog.stop()
    assert len(stalls) == 1
    assert re.match(r"rank 3 \(pp stages 1, 3\) waited 0 s on all_reduce of the step's loss in step 2 \(no progress "
                    r"within the 0\.3 s limit; .* --timeout SECONDS\)$", stalls[0]), stalls[0]


def _progress(schedule: str, rank: int, **kwargs) -> PipelineProgress:
    ir = build_schedule(schedule, 2, 2, kwargs.get("v", 1))
    return PipelineProgress(ir.actions[rank])


def test_a_pipeline_rank_waits_on_the_receive_before_its_next_action():
    """From the schedule IR and the actions the stages finished: GPipe on 2 ranks, 2 micro-batches."""
    last = _progress("GPipe", 1)
    assert last.waiting_on() == "on RECV_F from stage 0 for micro-batch 0"
    last.done.add((1, "F", 0))
    assert last.waiting_on() == "on RECV_F from stage 0 for micro-batch 1"
    first = _progress("GPipe", 0)
    first.done |= {(0, "F", 0), (0, "F", 1)}
    assert first.waiting_on() == "on RECV_B from stage 1 for micro-batch 0"
    first.running = (0, "B", 0)
    assert first.waiting_on() == "in B of stage 0 for micro-batch 0"
    first.running = None
    first.done |= {(0, "B", 0), (0, "B", 1)}
    assert first.waiting_on() == "after the run's last action (the stages' gradient reduction)"
    looped = _progress("Interleaved1F1B", 1, v=2)  # two stages per rank: the waiting one is named
    assert looped.waiting_on() == "on RECV_F of stage 1 from stage 0 for micro-batch 0"


def test_the_stages_actions_are_recorded_and_beat():
    calls = []
    stage = SimpleNamespace(stage_index=1, forward_one_chunk=lambda mb, *a, **k: calls.append(("F", mb)),
                            backward_one_chunk=lambda mb, **k: calls.append(("B", mb)),
                            backward_weight_one_chunk=lambda mb, **k: calls.append(("W", mb)))
    progress = _progress("GPipe", 1)
    beats = []
    progress.beat = lambda: beats.append(1)
    progress.watch(stage)
    stage.forward_one_chunk(0, (), {})
    stage.backward_one_chunk(0, loss=None, full_backward=False)
    stage.backward_weight_one_chunk(0, last_backward=True)
    assert calls == [("F", 0), ("B", 0), ("W", 0)]
    assert progress.done == {(1, "F", 0), (1, "I", 0), (1, "W", 0)} and len(beats) == 3
    progress.start_run()
    assert not progress.done


def test_a_stalled_rank_is_reported_by_its_own_line(tmp_path):
    message = "rank 1 (pp stage 1) waited 62 s on RECV_F from stage 0 for micro-batch 3 in step 2 (...)"
    (tmp_path / "rank-1.json").write_text(json.dumps({"error": message, "traceback": "stacks", "stalled": True}))
    line = worker_failure({1: SimpleNamespace(timestamp=1, exitcode=124)}, tmp_path)
    assert line == f"{message}; the run was stopped, and the rank's stacks are in {tmp_path / 'workers.log'}"
    assert "=== rank 1 (exit code 124) ===\nstacks" in (tmp_path / "workers.log").read_text()


def test_execute_takes_a_timeout_and_refuses_a_non_positive_one(tmp_path, capsys, monkeypatch):
    import executor.launch

    path = tmp_path / "plan.json"
    path.write_text(make_plan("llama", dp_replicate=2, micro_batch=2).to_json())
    assert main(["execute", str(path), "--timeout", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --timeout 0: need a positive number of seconds"]
    seen = []
    monkeypatch.setattr(executor.launch, "run_plan", lambda plan, run, launch: seen.append(run.timeout_s))
    assert main(["execute", str(path), "--timeout", "45", "--steps", "1"]) == 0
    assert seen == [45.0]


DROPPED = (1, 1)
"""(step, micro-batch) whose forward send stage 0 skips in `DroppedSendRun`."""


@dataclass(frozen=True, kw_only=True)
class DroppedSendRun(RunConfig):
    """A run whose pipeline deadlocks: unpickled in a worker, it makes stage 0 skip the forward send of
    micro-batch 1 in step 1, so stage 1 waits for it forever (and stage 0 for its gradient)."""

    parent_pid: int = field(default_factory=os.getpid)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if os.getpid() != self.parent_pid:  # in a worker (unpickled before it sets RANK)
            _skip_one_forward_send()


def _skip_one_forward_send() -> None:
    from torch.distributed.pipelining.stage import _PipelineStageBase

    send = _PipelineStageBase.get_fwd_send_ops
    sent = {"count": 0}

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = send(self, fwd_chunk_id)
        if self.stage_index == 0:
            sent["count"] += 1
            if ((sent["count"] - 1) // 2, fwd_chunk_id) == DROPPED:  # two micro-batches per step
                return []
        return ops

    _PipelineStageBase.get_fwd_send_ops = get_fwd_send_ops


@pytest.mark.slow
def test_a_deadlocked_pipeline_ends_with_the_waiting_rank_and_stage_named():
    plan = make_plan("llama", pp=2, micro_batch=1, num_microbatches=2, schedule="GPipe", seq_len=8)
    timeout = 20
    began = time.monotonic()
    with pytest.raises(SoapError) as info:
        run_plan(plan, DroppedSendRun(steps=3, timeout_s=timeout, progress=False), LaunchOptions())
    elapsed = time.monotonic() - began
    message = str(info.value)
    assert "\n" not in message
    match = re.match(r"rank (\d) \(pp stage (\d)\) waited (\d+) s on (RECV_F from stage 0 for micro-batch 1|"
                     r"RECV_B from stage 1 for micro-batch 0) in step 1 \(no progress within the 20 s limit; .*\); "
                     r"the run was stopped, and the rank's stacks are in (\S+workers\.log)$", message)
    assert match, message
    rank, stage, waited = (int(match.group(i)) for i in (1, 2, 3))
    assert rank == stage and waited >= timeout
    assert ("RECV_F" in message) == (rank == 1)
    log = Path(match.group(5)).read_text()
    assert f"=== rank {rank} (exit code 124) ===" in log and "Thread MainThread" in log
    shutil.rmtree(Path(match.group(5)).parent)
    # spawning and setting up two ranks, a good step, then the limit: far below gloo's default 30 minutes,
    # even on a busy 2-core machine
    assert elapsed < timeout + 300, elapsed
