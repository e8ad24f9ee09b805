"""Every plan soap writes executes (issue 15): a CI-sized, fixed-seed sample of `benchmarks.plans_execute`.

Random tiny llama, gpt2, bert, t5 and mixtral models on 1-4 gloo ranks with random pins go through
`soap plan` -> plan.json -> the launcher's rule check -> 2 training steps. The planner may refuse pins
no plan meets (with a `SoapError`, the `error:` line); every plan it writes must train, and fp32 plans
must reproduce the same model's 1-rank plan's losses. `python -m benchmarks.plans_execute` runs a
larger sample.
"""

from __future__ import annotations

import pytest

from benchmarks.plans_execute import FAMILIES, FOCUS, run, sample_cases, summary

pytestmark = pytest.mark.slow

SEED = 0
CASES = len(FOCUS)
"""One case per FOCUS pin: every family twice, every split pinned once."""


@pytest.fixture(scope="module")
def cases():
    return run(sample_cases(SEED, CASES))


def test_every_written_plan_trains_and_fp32_plans_match_one_rank(cases):
    bad = [f"{c.name} [{summary(c)}]: {c.outcome}" for c in cases if not c.outcome.startswith(("ran", "refused"))]
    assert not bad, "\n".join(bad)


def test_the_sample_exercises_the_planner_and_the_executor(cases):
    """A sample where the planner refused everything, or ran one family only, would prove nothing."""
    ran = [c for c in cases if c.outcome == "ran"]
    assert len(ran) >= CASES // 2, [c.outcome for c in cases]
    assert {c.family for c in ran} == set(FAMILIES)
    assert any(c.world > 1 and c.reference is not None for c in ran), "no multi-rank fp32 plan was compared"
    for degree in ("pp", "tp", "cp", "ep", "dp"):
        assert any(c.plan["parallelism"][degree] > 1 for c in ran), f"no plan with {degree} > 1 ran"


def test_refusals_name_what_to_change(cases):
    for case in cases:
        if case.outcome.startswith("refused"):
            message = case.outcome.removeprefix("refused: ")
            assert message and "Traceback" not in message and len(message.splitlines()) == 1, case.name
