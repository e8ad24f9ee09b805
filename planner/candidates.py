"""The few plans worth trying on the cluster (`soap tune`): the best of a search that differ in mesh or schedule.

A search's ranking (`PlanReport`: the chosen plan, its alternatives, the best of each baseline family) is
full of near-copies: the same mesh with ZeRO-1 instead of ZeRO-0, one more micro-batch. Timing both
teaches little, so `distinct_candidates` picks K in two passes, fastest predicted first:
1. one plan per *layout*, the parallel degrees `(pp, dp, cp, tp, ep)`;
2. then, if K is not reached, one per *layout and schedule*: the pipeline schedule and its virtual stages, and
   how the data-parallel group holds the state (ZeRO stage, replicate x shard).
Plans that differ only in micro-batching, recomputation or the like are never both taken.

`plan_pins(parallelism)` turns a plan's parallelism (the contract's `parallelism` dict) into the pins that make
the planner build exactly that configuration as a `Plan` (stages, TP plan, predictions), so every candidate
is a plan.json like `soap plan` writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from planner.report import PlanReport, parallelism_of
from planner.search import Priced

LAYOUT_KEYS = ("pp", "dp", "cp", "tp", "ep")
SCHEDULE_KEYS = ("schedule", "virtual_stages", "zero", "dp_replicate", "dp_shard")
PINNED_KEYS = ("tp", "pp", "dp", "cp", "zero", "micro_batch", "grad_accum", "recompute", "schedule", "precision",
               "optimizer", "ep", "virtual_stages")


def layout_key(parallelism: Mapping[str, Any]) -> tuple:
    return tuple(parallelism[k] for k in LAYOUT_KEYS)


def schedule_key(parallelism: Mapping[str, Any]) -> tuple:
    return layout_key(parallelism) + tuple(parallelism[k] for k in SCHEDULE_KEYS)


def ranked_pool(report: PlanReport) -> list[Priced]:
    """Every plan the report priced that fits: chosen, alternatives, baselines; fastest first, each once."""
    pool: dict[tuple, Priced] = {}
    for p in (report.chosen, *report.alternatives, *(b for _, b in report.baselines if b is not None)):
        if p.fits:
            pool.setdefault(tuple(sorted(parallelism_of(p).items())), p)
    return sorted(pool.values(), key=lambda p: p.order)


def distinct_candidates(pool: Sequence[Priced], k: int) -> list[Priced]:
    """At most `k` of `pool` (ranked fastest first): one per layout, then one per layout and schedule."""
    chosen: list[Priced] = []
    for key in (layout_key, schedule_key):
        seen = {key(parallelism_of(p)) for p in chosen}
        for p in pool:
            if len(chosen) >= k:
                return chosen
            if key(parallelism_of(p)) not in seen and all(p is not c for c in chosen):
                seen.add(key(parallelism_of(p)))
                chosen.append(p)
    return chosen


def plan_pins(parallelism: Mapping[str, Any]) -> dict[str, Any]:
    """Pins that fix every searched dimension to `parallelism` (a plan's or `parallelism_of`'s dict)."""
    pins = {k: parallelism[k] for k in PINNED_KEYS}
    pins["offload"] = bool(parallelism.get("offload_optimizer", False))
    pins["compile"] = bool(parallelism.get("compile", False))
    return pins
