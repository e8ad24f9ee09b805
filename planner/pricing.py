"""Price a candidate by full simulation, and run the whole search for one request.

Pricing one candidate (`Pricer.__call__`):
1. stage partition (pp > 1): the estimator's (`Estimator.stage_bounds`: `planner.stages.partition_stages`
   over the layer sequence, time-balanced), so the simulated memory is the memory the search pruned by;
2. `costmodel.simulator.simulate(graph, strategy, cluster, stages=bounds)` under the Megatron
   placement, with the simulator's default `ProfilePricer` whose op and collective prices are memoized
   across the search's candidates (`CachedPrices`: pure functions of their arguments); with tp > 1, also under the per-op splits of the exact split search
   (`planner.block_splits.chosen_op_splits`, solved once per block type and degrees) where they
   cost less than it under the search's tables, keeping whichever fits and simulates faster, so the searched splits are never
   slower than the default under the simulator;
3. the plan fits when the simulated peak memory (max over ranks) is within the limit and, offloaded, its
   nodes' host memory within the cluster's (`planner.host_memory`; the estimator stage checks it too).

`run_search` wires enumeration, ranking, baselines and the report together (see `planner.api`); the
chosen plan's per-op placements in plan.json are the ones its simulation priced.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache

from costmodel.placement import tp_plan
from costmodel.simulator import simulate
from costmodel.simulator.pricing import ProfilePricer, node_ranks
from planner.api import PlanRequest
from planner.baselines import baseline_families, baseline_mesh
from planner.block_splits import block_placements, chosen_op_splits
from planner.estimate import Estimator
from planner.explain import explain
from planner.feasibility import infeasible_error, simulated_infeasible_error
from planner.host_memory import HostMemoryCheck, host_memory_error, rejected_by_host_memory
from planner.intra_op import BlockSplitCache
from planner.planfile import build_plan
from planner.regimes import RegimeEstimator
from planner.report import PlanReport
from planner.search import (Candidate, Priced, Progress, SearchConfig, compile_variant, enumerate_candidates, search,
                            simulation_work)
from planner.space import mesh_choices
from planner.units import layer_units, model_units
from tracer.ir import OpGraph


class CachedPrices:
    """A `ProfilePricer` whose op and collective prices are computed once per search: candidates share
    most of them (the same ops at the same local shapes, the same collectives), and both are pure."""

    def __init__(self, inner: ProfilePricer) -> None:
        self.inner = inner
        self._ops: dict[tuple, tuple[float, float, float]] = {}
        self._collectives: dict[tuple, float] = {}

    def op(self, op, split, micro_batch: int, batch_traced: int) -> tuple[float, float, float]:
        key = (id(op), tuple(split.items()), micro_batch, batch_traced)  # the graphs outlive the search
        price = self._ops.get(key)
        if price is None:
            price = self._ops[key] = self.inner.op(op, split, micro_batch, batch_traced)
        return price

    def collective(self, kind: str, nbytes: float, group) -> float:
        key = (kind, nbytes, group)
        price = self._collectives.get(key)
        if price is None:
            price = self._collectives[key] = self.inner.collective(kind, nbytes, group)
        return price

    def memory_time(self, nbytes: float) -> float:
        return self.inner.memory_time(nbytes)

    def optimizer_time(self, optimizer: str, elements: float) -> float:
        return self.inner.optimizer_time(optimizer, elements)

    def offload_time(self, elements: float, *, pp: int, train) -> float:
        return self.inner.offload_time(elements, pp=pp, train=train)


class Pricer:
    """Simulates candidates of one request on the estimator's stage partition."""

    def __init__(self, request: PlanRequest, graph: OpGraph, estimator: RegimeEstimator,
                 host: HostMemoryCheck | None = None, progress: Progress | None = None) -> None:
        self.request, self.graph, self.estimator, self.progress = request, graph, estimator, progress
        self.simulated = 0
        self.host = host or HostMemoryCheck(request.cluster, request.space.gpus_per_node, graph)
        self.layers = layer_units(estimator.units)
        self.stage_bounds = lru_cache(maxsize=None)(self._stage_bounds)
        self._cache = BlockSplitCache()
        self._splits: dict[tuple, tuple] = {}
        self._prices: dict[tuple, CachedPrices] = {}

    def _stage_bounds(self, candidate: Candidate) -> tuple[int, ...] | None:
        """The estimate's partition (`Estimator.stage_bounds`), so that the memory the search pruned by is
        the memory simulated."""
        d, t = candidate.mesh.dims, candidate.train
        if d.pp == 1:
            return None
        return self.estimator.for_strategy(candidate.strategy).stage_bounds(d.pp, t.virtual_stages)

    def __call__(self, candidate: Candidate) -> Priced:
        """The simulation of `candidate` under the Megatron placement, or under the per-op splits of the
        split search where those simulate faster (or fit where the default does not)."""
        bounds = self.stage_bounds(candidate)
        graph = self.estimator.graph_for(candidate.strategy)
        priced = self._simulate(candidate, graph, bounds)
        splits = self._op_splits(candidate, graph)
        if splits:
            searched = self._simulate(replace(candidate, op_splits=splits), graph, bounds)
            if (not searched.fits, searched.step_time_s) < (not priced.fits, priced.step_time_s):
                return searched
        return priced

    def prices(self, candidate: Candidate) -> CachedPrices:
        """The simulator's default pricer for the candidate (`costmodel.simulator.pricing.price_step`'s), memoized."""
        cluster, strategy = self.request.cluster, candidate.strategy
        t = strategy.train
        key = (t.precision, node_ranks(strategy, cluster), t.compile, t.cross_entropy)
        if key not in self._prices:
            self._prices[key] = CachedPrices(ProfilePricer(cluster, t.precision, node_ranks=key[1], compile=t.compile,
                                                           cross_entropy=t.cross_entropy))
        return self._prices[key]

    def _simulate(self, candidate: Candidate, graph: OpGraph, bounds: tuple[int, ...] | None) -> Priced:
        if self.progress:
            self.progress("simulating", self.simulated, None)
        self.simulated += 1
        result = simulate(graph, candidate.strategy, self.request.cluster, stages=bounds, pricer=self.prices(candidate))
        peak = float(result.peak_memory_bytes)
        fits = peak <= self.request.memory_limit and self.host.simulation_fits(candidate.mesh.dims, candidate.train,
                                                                               result)
        return Priced(candidate=candidate, step_time_s=result.step_time_s, peak_memory_bytes=peak, result=result,
                      fits=fits)

    def _op_splits(self, candidate: Candidate, graph: OpGraph) -> tuple:
        d, t = candidate.mesh.dims, candidate.train
        if d.tp == 1:
            return ()
        # solved once per block layout question (degrees, precision, sequence parallelism), at the first
        # candidate's micro-batch: costs scale with it nearly uniformly, and each use is re-simulated
        key = (id(graph), d.cp, d.tp, d.ep, t.precision, t.sequence_parallel)
        if key not in self._splits:
            units = self.estimator.for_strategy(candidate.strategy).units
            self._splits[key] = chosen_op_splits(units, graph, candidate.strategy, self.request.cluster, self._cache)
        return self._splits[key]


def run_search(request: PlanRequest, graph: OpGraph, *, time_budget_s: float | None, seed: int,
               trace: Callable[..., OpGraph] | None = None, progress: Progress | None = None) -> PlanReport:
    """`trace(dtype=...)` traces the model again at a precision regime's dtype (planner.regimes); None prices
    every candidate on `graph`. `progress` hears what the search is doing (`planner.search.Progress`)."""
    # The search allocates millions of small, acyclic objects (estimates, simulated tasks) and keeps many:
    # the cyclic collector, triggered by the allocations, would rescan them all again and again (a fifth of
    # a plan's time) to free nothing. Reference counting still frees everything the search drops.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _run_search(request, graph, time_budget_s=time_budget_s, seed=seed, trace=trace, progress=progress)
    finally:
        if collecting:
            gc.enable()


def _run_search(request: PlanRequest, graph: OpGraph, *, time_budget_s: float | None, seed: int,
                trace: Callable[..., OpGraph] | None, progress: Progress | None) -> PlanReport:
    units = model_units(graph)
    estimator = RegimeEstimator(graph, Estimator(graph, request.cluster, units), trace)
    widest_tp = max((m.dims.tp for m in mesh_choices(request.space)), default=1)
    # refinement walks every mesh, so with a time budget nothing is pruned by the bound
    keep = 1 << 30 if time_budget_s else SearchConfig.keep_meshes
    host = HostMemoryCheck(request.cluster, request.space.gpus_per_node, graph)
    candidates, estimated = enumerate_candidates(
        request.space, estimator, request.memory_limit, keep_meshes=keep, keep_top=max(keep, SearchConfig.simulate_top),
        always=lambda m: baseline_mesh(m, widest_tp=widest_tp), host_fits=host.estimate_fits, progress=progress,
    )
    if not candidates:
        raise (host_memory_error(request.model_name, request.space, estimator, request.memory_limit, host)
               or infeasible_error(request.model_name, request.space, estimator, request.memory_limit))
    pricer = Pricer(request, graph, estimator, host, progress)
    bandwidth = request.cluster.intra_node.bandwidth
    outcome = search(
        candidates, pricer,
        baselines=lambda best: baseline_families(best, candidates, intra_node_bandwidth=bandwidth),
        config=SearchConfig(time_budget_s=time_budget_s, seed=seed), estimated=estimated,
        work=lambda c: simulation_work(c, len(pricer.layers)),
        compile_variants=compile_variant(request.space, request.cluster.device.compile_pays),
    )
    if not outcome.ranked:
        raise (rejected_by_host_memory(request.model_name, request.space.gpus, request.memory_limit,
                                       outcome.rejected_by_simulation, host)
               or simulated_infeasible_error(request.model_name, request.space, estimator, request.memory_limit,
                                             outcome.rejected_by_simulation, pricer))
    chosen = outcome.ranked[0]
    why = explain(
        chosen, outcome.priced, candidates, model=request.model_name, cluster=request.cluster,
        memory_limit=request.memory_limit, breakdown=chosen.result.breakdown.as_dict(), pins=request.space.pins,
    )
    if request.model.peft is not None:
        from planner.peft_why import peft_sentence

        why = (peft_sentence(request, graph, task=graph.task), *why)
    strategy = chosen.candidate.strategy
    blocks = block_placements(units, graph, strategy)
    tp_styles = {k: v for u in units if not u.id.startswith("<") for k, v in tp_plan(u.ops, strategy).items()}
    plan = build_plan(request, graph, chosen, pricer.stage_bounds(chosen.candidate), blocks=blocks, tp_plan=tp_styles)
    return PlanReport(
        plan=plan, chosen=chosen, alternatives=outcome.ranked[1:], baselines=outcome.baselines, why=why,
        model=request.model_name, cluster=request.cluster.name, gpus=request.space.gpus,
        memory_limit_bytes=request.memory_limit, candidates=outcome.candidates, simulated=outcome.simulated,
        limit=request.limit, baselines_outside=outcome.baselines_outside,
    )
