"""`soap plan` reports what it is doing, for the progress bar of plans that take more than a second."""

from planner.api import plan_report
from soap.commands.plan import DelayedProgress


def test_plan_report_tells_progress_each_phase():
    heard = []
    plan_report("gpt2", gpus=8, progress=lambda phase, done, total: heard.append((phase, done, total)))
    phases = [phase for phase, _, _ in heard]
    assert phases[0] == "tracing" and "estimating" in phases and "simulating" in phases
    assert all(total is None or 0 <= done <= total for _, done, total in heard)


def test_progress_bar_draws_nothing_without_a_terminal(capsys):
    progress = DelayedProgress(delay_s=0.0)
    progress("estimating", 3, 10)
    progress._timer.join()
    progress("simulating", 1, None)
    progress.close()
    assert capsys.readouterr().err == ""
