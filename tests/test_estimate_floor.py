"""The search's branch and bound (`planner.search.enumerate_candidates`) skips a mesh or a training head when its time
floor (`Estimator.time_floor`) cannot beat what it already holds: sound only if no configuration of the head is
estimated under its floor. Checked on every mesh and head of real searches, across model families, precisions,
pipelines, compile and the loss."""

from __future__ import annotations

import math

import pytest

from planner.api import make_request
from planner.estimate import Estimator
from planner.regimes import RegimeEstimator
from planner.search import _bubble_factor, _expand
from planner.space import mesh_choices, training_heads
from planner.units import model_units


@pytest.mark.parametrize("model,gpus,pins", [
    ("llama-3-8b", 16, {"compile": "off"}),
    ("llama-3-8b", 16, {"compile": "on", "cross_entropy": "upcast"}),
    ("gpt2", 8, {"compile": "off", "precision": "fp32"}),
    ("mixtral-8x7b", 16, {"compile": "off", "micro_batch": 1}),
])
def test_no_configuration_is_estimated_under_its_heads_time_floor(model, gpus, pins):
    request = make_request(model, gpus=gpus, cluster="dgx-h100", **pins)
    graph = request.model.trace(task=None, seq_len=request.space.seq_len)
    req = request.space
    estimator = RegimeEstimator(graph, Estimator(graph, request.cluster, model_units(graph)), None)
    compiled = req.pins.compile is True
    checked = 0
    for mesh in list(mesh_choices(req))[::3]:
        for head in training_heads(req, mesh)[::2]:
            floor = estimator.time_floor(mesh, head.micro_batch, head.num_microbatches, head.grad_accum,
                                         head.precision, _bubble_factor(head), compiled, req.pins.cross_entropy)
            found, _ = _expand(req, estimator, mesh, [(floor, head)], math.inf, math.inf)
            for candidate in found:
                assert candidate.estimate.step_time_s >= floor * (1 - 1e-9), (candidate.key, floor)
                checked += 1
    assert checked >= 10
