"""Simulate one training step: `simulate(graph, strategy, cluster) -> SimResult`.

Pipeline (each step a module):
1. `costmodel.simulator.pricing.price_step`: OpGraph + Strategy + ClusterSpec -> `StepCosts`, the
   per-micro-batch cost of every chunk (block instance) of every stage on one representative rank,
   from `costmodel.placement` (which split each op gets and the collectives it implies),
   `costmodel.opcost.op_time`, `costmodel.collectives.collective_time` and `costmodel.memory`.
2. `costmodel.simulator.step.run_step`: StepCosts + the pipeline schedule (`costmodel.schedule`)
   -> every task of each pipeline rank's streams (compute, tp-comm, dp-comm, pp-p2p), timed as it is
   issued by `costmodel.simulator.engine.RankLanes` (discrete-event simulation with link contention).
3. `costmodel.simulator.result.analyse`: step time, breakdown, memory over time, timeline.

Symmetry: all DP, TP and CP ranks of a pipeline stage do the same work, so one representative per
pipeline rank is simulated; a 16,384-GPU plan with pp=16 simulates 16 ranks.

Both entry points are pure (no I/O) and deterministic; `simulate_costs` takes hand-made cost tables.

The package may import `tracer` and the rest of `costmodel` (never `costmodel.calibration`, which fits
the profiles it reads); the planner and the executor's validation import it.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

from costmodel.profiles import ClusterSpec
from costmodel.simulator.costs import StepCosts
from costmodel.simulator.result import SimResult, StepFacts, analyse
from costmodel.simulator.step import run_step
from costmodel.strategy import Strategy
from tracer.ir import OpGraph


def simulate_costs(costs: StepCosts, facts: StepFacts | None = None) -> SimResult:
    """Simulate a step from its cost tables (hand-made in tests, or from `price_step`)."""
    # A step is tens of thousands of small acyclic objects: the cyclic collector, triggered by their
    # allocation, would rescan every live object (earlier results included) many times for nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return analyse(costs, run_step(costs), facts or StepFacts())
    finally:
        if collecting:
            gc.enable()


def simulate(
    graph: OpGraph,
    strategy: Strategy,
    cluster: ClusterSpec,
    *,
    stages: Sequence[int] | Sequence[tuple[int, int]] | None = None,
    pricer=None,
) -> SimResult:
    """Simulate one optimizer step of `strategy` for the model `graph` on `cluster`.

    `stages`: pipeline stages over the layer sequence (see `costmodel.simulator.stages`), as bounds
    `(0, b1, ..., L)` or as per-stage `(first, end)` ranges, pp * virtual_stages of them; default: a
    balanced split.
    `pricer`: the cost functions (default `ProfilePricer(cluster, strategy)`); tests inject fakes.
    """
    from costmodel.simulator.pricing import price_step

    costs, facts = price_step(graph, strategy, cluster, stage_bounds=stages, pricer=pricer)
    return simulate_costs(costs, facts)
