"""No hangs: a rank that stops making progress ends the run within a bounded time, naming what it waited on.

Two limits, from the plan's predicted step time (`limits_for`; `soap execute --timeout SECONDS` pins
the first, and the second is then at least that):
- `Limits.step_s` = max(MIN_STEP_S, STEP_FACTOR x predicted step time): how long one unit of progress
  may take inside a step (a pipeline action, a micro-batch's forward and backward, the optimizer step,
  the loss all-reduce). Without a prediction (a plan built in Python) it is `WARMUP_S`.
- `Limits.warmup_s` = max(step_s, WARMUP_S): the same for the setup (building and parallelizing the
  model), the first step (lazy initialization, shape inference, compilation) and checkpoints.
The process group's own timeout (`init_process_group(timeout=...)`, gloo's and NCCL's wait on a
collective) is `Limits.process_group_s`, a margin above both, so a wait that never returns still ends
if this watchdog cannot run; normally the watchdog fires first and says more.

`Watchdog` is a daemon thread in each worker. The training loop (`executor.train`) tells it what the
rank is doing (`activity`) and each time it gets further (`beat`); pipeline actions beat from the stages
themselves (`executor.pipeline.PipelineProgress`, which names the receive or send the rank waits on from
the schedule IR). When nothing happened for the current limit, the watchdog calls `on_stall` with one
line, `rank 1 (pp stage 1) waited 62 s on RECV_F from stage 0 for micro-batch 3 in step 2 (...)`; the
launcher's handler (`executor.launch`) records it with every thread's stack and ends the process, and
the launcher then stops the other ranks and reports the line (`executor.launch.worker_failure`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

from planner.plan import Plan

MIN_STEP_S = 60.0
"""The smallest derived limit: a short predicted step still gets a minute per unit of progress."""
STEP_FACTOR = 20.0
"""Headroom over the predicted step time: a plan priced for another device, or a slower host, runs
several times slower than predicted without being stuck."""
WARMUP_S = 300.0
"""The least time allowed for the setup, the first step and checkpoints (and the limit when the plan
predicts no step time)."""
PROCESS_GROUP_MARGIN_S = 30.0
"""How much later than the watchdog the process group's own timeout fires."""


@dataclass(frozen=True)
class Limits:
    """How long a rank may go without progress (see the module docstring)."""

    step_s: float
    """Inside a step."""
    warmup_s: float
    """During the setup, the first step and checkpoints."""

    @property
    def process_group_s(self) -> float:
        return max(self.step_s, self.warmup_s) + PROCESS_GROUP_MARGIN_S


def limits_for(plan: Plan, timeout_s: float | None = None) -> Limits:
    """The limits of a run of `plan`; `timeout_s` (`--timeout`) pins the one inside steps (the setup and
    the first step, which may compile, keep at least `WARMUP_S`)."""
    if timeout_s is not None:
        return Limits(step_s=timeout_s, warmup_s=max(timeout_s, WARMUP_S))
    predicted = plan.predicted.get("step_time_s")
    if not isinstance(predicted, (int, float)) or not math.isfinite(predicted) or predicted <= 0:
        return Limits(step_s=WARMUP_S, warmup_s=WARMUP_S)
    step = max(MIN_STEP_S, STEP_FACTOR * float(predicted))
    return Limits(step_s=step, warmup_s=max(step, WARMUP_S))


Description = str | Callable[[], str]
"""What a rank is doing, phrased to follow `waited N s `: `on all_reduce of the step's loss in step 2`,
or a function returning that (evaluated only when the watchdog fires)."""


class Watchdog:
    """Calls `on_stall(message)` once if the rank makes no progress within the current limit."""

    def __init__(self, limits: Limits, *, rank: int, on_stall: Callable[[str], None], poll_s: float = 1.0) -> None:
        self.limits = limits
        self.rank = rank
        self.who = f"rank {rank}"
        """How the message names this rank; `set_stages` adds its pipeline stages."""
        self._on_stall = on_stall
        self._poll_s = min(poll_s, max(limits.step_s, 0.01) / 10)
        self._what: Description = "on the setup"
        self._limit = limits.warmup_s
        self._since = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="soap-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def set_stages(self, stages: list[int]) -> None:
        if stages:
            self.who = f"rank {self.rank} (pp stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))})"

    def activity(self, what: Description, *, warmup: bool = False) -> None:
        """The rank starts `what` (progress); `warmup` allows it `Limits.warmup_s`."""
        self._what, self._limit = what, self.limits.warmup_s if warmup else self.limits.step_s
        self.beat()

    def beat(self) -> None:
        """The rank got further in its current activity."""
        self._since = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            waited = time.monotonic() - self._since
            if waited > self._limit:
                self._stop.set()
                self._on_stall(self.message(waited))

    def message(self, waited: float) -> str:
        what = self._what() if callable(self._what) else self._what
        return (f"{self.who} waited {waited:.0f} s {what} (no progress within the {self._limit:g} s limit; "
                "a deadlock or a lost peer, or raise the limit with --timeout SECONDS)")


class NoWatchdog:
    """Stands in for a `Watchdog` where none runs (`train` called from Python)."""

    who = ""

    def set_stages(self, stages: list[int]) -> None:
        pass

    def activity(self, what: Description, *, warmup: bool = False) -> None:
        pass

    def beat(self) -> None:
        pass
