"""Fits judged by the plan they pick (issue 27 item 5): per group of runs sharing model, cluster and GPU count, the
rank correlation of predicted and measured throughput and pick/best."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from executor.validation.external import Prediction, group_ranks


def _run(name: str, gpus: int, cluster: str = "dgx-h100", model: str = "m") -> SimpleNamespace:
    return SimpleNamespace(record=SimpleNamespace(name=name, model=model, gpus=gpus), cluster=SimpleNamespace(name=cluster))


def _pred(name: str, measured: float, predicted: float) -> Prediction:
    return Prediction(name=name, measured_tokens=measured, predicted_tokens=predicted, measured_memory_gib=None,
                      predicted_memory_gib=None)


def test_a_group_predicted_in_order_picks_the_best():
    runs = [_run(n, 8) for n in "abc"] + [_run("solo", 16)]
    preds = [_pred("a", 100, 90), _pred("b", 200, 180), _pred("c", 300, 330), _pred("solo", 5, 5)]
    (group,) = group_ranks(runs, preds)  # the 16-GPU run has no group
    assert group.group == "m on 8 x dgx-h100" and group.runs == 3
    assert group.spearman == pytest.approx(1.0) and group.pick_over_best == 1.0


def test_a_wrong_favourite_costs_pick_over_best():
    runs = [_run(n, 8) for n in "abc"]
    preds = [_pred("a", 100, 400), _pred("b", 200, 180), _pred("c", 300, 200)]
    (group,) = group_ranks(runs, preds)
    assert group.pick_over_best == pytest.approx(100 / 300)
    assert group.spearman == pytest.approx(-0.5)
