"""Search: enumerate, prune by estimate, price the survivors by full simulation, refine.

Pipeline (`search`):
1. Enumerate (`enumerate_candidates`): every mesh of `planner.space`, then its training
   configurations. A mesh whose most memory-frugal configuration (smallest micro-batch, full
   recompute, offloaded optimizer state) does not fit is dropped whole. For the rest, recompute and
   offload only ever add time, so per (micro-batch, schedule, precision, optimizer) only the first
   fitting recompute policy is kept, with and without offload (offload only when it lets a cheaper
   recompute policy fit).
2. Estimate: `planner.estimate.Estimator` prices each survivor analytically.
3. Price: the best estimate of each of the `simulate_meshes` best meshes, the `simulate_top` best
   estimates overall, and every baseline family's best estimates are simulated (`price`, the full
   simulator). Plans whose simulated peak memory exceeds the limit are dropped; the rest are ranked
   by simulated step time. Since each baseline's configuration is priced the same way, the chosen
   plan is never slower than a baseline.
4. Refine (optional, `--time-budget`): FlexFlow-style MCMC over the estimated candidates. From the
   current plan, propose a random neighbour (a candidate differing in at most two coordinates, so
   moving a factor between two mesh dimensions is one move), simulate it, and accept it with
   probability min(1, exp(-beta (t_new - t_cur) / t_cur)). Proposals come from `random.Random(seed)`,
   so a run is reproducible for a seed and a step count; the budget only decides how many steps run.

Determinism: candidates are ordered by (time, key) where the key is a total order over every field
of the strategy; nothing iterates a set or depends on hashing.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from costmodel.strategy import Strategy, TrainingConfig
from planner.estimate import Estimate, Estimator
from planner.space import MeshChoice, SpaceRequest, mesh_choices, training_choices

RECOMPUTE_ORDER = ("none", "selective", "full")


def train_key(t: TrainingConfig) -> tuple:
    return (
        t.micro_batch, t.num_microbatches, t.grad_accum, t.schedule, t.virtual_stages, t.precision,
        t.optimizer, RECOMPUTE_ORDER.index(t.recompute), int(t.offload_optimizer),
    )


@dataclass(frozen=True)
class Candidate:
    mesh: MeshChoice
    train: TrainingConfig
    estimate: Estimate

    @property
    def strategy(self) -> Strategy:
        return Strategy(dims=self.mesh.dims, train=self.train)

    @property
    def key(self) -> tuple:
        """A total order over strategies (ties in time never depend on enumeration order)."""
        return (*self.mesh.sort_key, *train_key(self.train))


@dataclass(frozen=True)
class Priced:
    """A candidate with its full simulation."""

    candidate: Candidate
    step_time_s: float
    peak_memory_bytes: float
    result: Any
    """The simulator's SimResult (plus whatever the pricing function attached)."""
    fits: bool

    @property
    def order(self) -> tuple:
        return (self.step_time_s, self.candidate.key)


Price = Callable[[Candidate], Priced]


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    top_k: int = 5
    """Alternatives kept besides the chosen plan."""
    simulate_meshes: int = 24
    """Meshes whose best-estimated configuration is simulated."""
    simulate_top: int = 16
    """Best estimates overall that are simulated (often variants of the best meshes)."""
    baseline_tries: int = 3
    """Best estimates of each baseline family that are simulated."""
    time_budget_s: float | None = None
    """Wall-clock seconds for MCMC refinement after ranking; None skips it."""
    max_refine_steps: int | None = None
    """Cap on MCMC steps (tests use it to make a refined run reproducible)."""
    seed: int = 0
    beta: float = 20.0
    """MCMC inverse temperature on relative step-time changes."""


@dataclass(frozen=True)
class SearchOutcome:
    ranked: tuple[Priced, ...]
    """Fitting plans, fastest first (the chosen plan, then alternatives)."""
    baselines: tuple[tuple[str, Priced | None], ...]
    """(baseline name, its best fitting plan or None when the family does not fit)."""
    candidates: int
    """Configurations estimated."""
    simulated: int
    refine_steps: int = 0
    rejected_by_simulation: tuple[Priced, ...] = field(default=())
    """Simulated plans whose simulated memory exceeded the limit."""


def _recompute_options(req: SpaceRequest) -> tuple[str, ...]:
    return (req.pins.recompute,) if req.pins.recompute else RECOMPUTE_ORDER


def enumerate_candidates(
    req: SpaceRequest, estimator: Estimator, memory_limit: float
) -> tuple[list[Candidate], int]:
    """Candidates that fit by estimate, sorted by (estimated time, key), and how many were estimated."""
    kept: list[Candidate] = []
    estimated = 0
    recomputes = _recompute_options(req)
    for mesh in mesh_choices(req):
        configs = list(training_choices(req, mesh))
        if not configs:
            continue
        frugal = min(configs, key=lambda t: (t.micro_batch, -RECOMPUTE_ORDER.index(t.recompute), -t.offload_optimizer))
        estimated += 1
        if estimator.estimate(mesh, frugal).memory_bytes > memory_limit:
            continue
        groups: dict[tuple, dict[tuple[str, bool], TrainingConfig]] = {}
        for t in configs:
            head = (t.micro_batch, t.num_microbatches, t.grad_accum, t.schedule, t.virtual_stages, t.precision,
                    t.optimizer)
            groups.setdefault(head, {})[(t.recompute, t.offload_optimizer)] = t
        for options in groups.values():
            fitting_level = len(recomputes)
            for offload in (False, True):
                for level, recompute in enumerate(recomputes[:fitting_level]):
                    t = options.get((recompute, offload))
                    if t is None:
                        continue
                    est = estimator.estimate(mesh, t)
                    estimated += 1
                    if est.memory_bytes <= memory_limit:
                        kept.append(Candidate(mesh, t, est))
                        fitting_level = level
                        break
                if fitting_level == 0:
                    break
    kept.sort(key=lambda c: (c.estimate.step_time_s, c.key))
    return kept, estimated


def select_for_simulation(candidates: Sequence[Candidate], config: SearchConfig) -> list[Candidate]:
    chosen: dict[tuple, Candidate] = {}
    for c in candidates[: config.simulate_top]:
        chosen.setdefault(c.key, c)
    meshes_seen: list[tuple] = []
    for c in candidates:
        if len(meshes_seen) >= config.simulate_meshes:
            break
        mesh_key = c.mesh.sort_key
        if mesh_key not in meshes_seen:
            meshes_seen.append(mesh_key)
            chosen.setdefault(c.key, c)
    return sorted(chosen.values(), key=lambda c: (c.estimate.step_time_s, c.key))


class _PriceCache:
    def __init__(self, price: Price) -> None:
        self._price, self._seen, self.calls = price, {}, 0

    def __call__(self, c: Candidate) -> Priced:
        if c.key not in self._seen:
            self._seen[c.key] = self._price(c)
            self.calls += 1
        return self._seen[c.key]

    @property
    def priced(self) -> list[Priced]:
        return sorted(self._seen.values(), key=lambda p: p.order)


def search(
    candidates: Sequence[Candidate],
    price: Price,
    *,
    baselines: Callable[[Candidate], Sequence[Any]] | None = None,
    config: SearchConfig = SearchConfig(),
    estimated: int = 0,
) -> SearchOutcome:
    """Rank `candidates` (sorted by estimate) by full simulation; see the module docstring.

    `baselines(best)` names the baseline families (objects with `.name` and `.member(candidate)`)
    once the best plan is known; their best members are simulated and join the ranking.
    """
    cache = _PriceCache(price)
    for c in select_for_simulation(candidates, config):
        cache(c)
    steps = 0
    fitting_now = [p for p in cache.priced if p.fits]
    if config.time_budget_s and fitting_now:
        steps = refine(fitting_now[0], candidates, cache, config)
        fitting_now = [p for p in cache.priced if p.fits]
    family_best: list[tuple[str, Priced | None]] = []
    if baselines is not None and fitting_now:
        for family in baselines(fitting_now[0].candidate):
            members = [c for c in candidates if family.member(c)][: config.baseline_tries]
            fitting = sorted((p for p in map(cache, members) if p.fits), key=lambda p: p.order)
            family_best.append((family.name, fitting[0] if fitting else None))
    priced = cache.priced
    ranked = tuple(p for p in priced if p.fits)
    return SearchOutcome(
        ranked=ranked[: config.top_k + 1], baselines=tuple(family_best), candidates=estimated or len(candidates),
        simulated=cache.calls, refine_steps=steps, rejected_by_simulation=tuple(p for p in priced if not p.fits),
    )


def _coordinates(candidates: Sequence[Candidate]) -> np.ndarray:
    """Each candidate's fields as integer codes, for vectorised neighbour look-ups."""
    keys = [c.key for c in candidates]
    columns = list(zip(*keys))
    codes = []
    for col in columns:
        values = sorted(set(col), key=lambda v: (str(type(v)), v))
        index = {v: i for i, v in enumerate(values)}
        codes.append([index[v] for v in col])
    return np.array(codes, dtype=np.int64).T


def refine(start: Priced, candidates: Sequence[Candidate], cache: _PriceCache, config: SearchConfig) -> int:
    """MCMC from `start`; every simulated proposal lands in `cache`. Returns the steps taken."""
    if len(candidates) < 2:
        return 0
    coords = _coordinates(candidates)
    position = {c.key: i for i, c in enumerate(candidates)}
    rng = random.Random(config.seed)
    current = start
    deadline = time.monotonic() + float(config.time_budget_s or 0.0)
    steps = 0
    while time.monotonic() < deadline and (config.max_refine_steps is None or steps < config.max_refine_steps):
        i = position.get(current.candidate.key)
        if i is None:
            break
        distance = (coords != coords[i]).sum(axis=1)
        neighbours = np.flatnonzero((distance >= 1) & (distance <= 2))
        if neighbours.size == 0:
            break
        proposal = cache(candidates[int(neighbours[rng.randrange(neighbours.size)])])
        steps += 1
        if not proposal.fits:
            continue
        delta = (proposal.step_time_s - current.step_time_s) / current.step_time_s
        if delta <= 0 or rng.random() < math.exp(-config.beta * delta):
            current = proposal
    return steps
