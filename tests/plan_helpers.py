"""The planner's pieces for tests that price candidates one by one, as the search does."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any


def search_pieces(config: dict[str, Any], folder: Path, *, gpus: int = 4, global_batch: int = 16, seq_len: int = 64,
                  allocator_reserve: float | None = None, **pins: Any) -> tuple[Any, Any, Any]:
    """(request, estimator, pricer) for `config` (written to `folder`) on dgx-h100 without a memory limit, bf16
    unless pinned otherwise: `Estimator.estimate` and `Pricer` for candidates built from `mesh_choices` and
    `training_choices` of `request.space`. `allocator_reserve`: the device's fitted allocator reserve
    fraction (the shipped profile has none)."""
    from planner.api import make_request
    from planner.estimate import Estimator
    from planner.pricing import Pricer
    from planner.regimes import RegimeEstimator
    from planner.units import model_units

    (folder / "config.json").write_text(json.dumps(config))
    req = make_request(str(folder), gpus=gpus, global_batch=global_batch, seq_len=seq_len, mem_limit_gib=1e6,
                       cluster="dgx-h100", **{"precision": "bf16", **pins})
    graph = req.model.trace(task=None, seq_len=seq_len)
    req = replace(req, space=replace(req.space, dims=graph.dims))
    if allocator_reserve is not None:
        device = replace(req.cluster.device, allocator_reserve_fraction=allocator_reserve)
        req = replace(req, cluster=replace(req.cluster, device=device))
    estimator = RegimeEstimator(graph, Estimator(graph, req.cluster, model_units(graph)),
                                partial(req.model.trace, task=None, seq_len=seq_len))
    return req, estimator, Pricer(req, graph, estimator)


def simulated_as_estimated(estimator: Any, pricer: Any, mesh: Any, train: Any) -> tuple[Any, Any] | None:
    """(the priced candidate, its worst rank's memory at the peak) for `train` on `mesh`, after checking that the
    estimate's memory is the simulation's, total and activations; None where the split search placed ops
    differently (the estimate prices the default placement)."""
    import pytest

    from planner.search import Candidate

    candidate = Candidate(mesh=mesh, train=train, estimate=estimator.estimate(mesh, train))
    priced = pricer(candidate)
    if priced.candidate.op_splits:
        return None
    simulated = max((m.at_peak for m in priced.result.memory), key=lambda b: b.total)
    assert candidate.estimate.memory.total == pytest.approx(simulated.total, rel=1e-9, abs=16), (mesh, train)
    assert candidate.estimate.memory.activations == pytest.approx(simulated.activations, rel=1e-9, abs=16)
    return priced, simulated
