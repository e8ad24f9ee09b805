"""Search: enumerate, prune by estimate, price the survivors by full simulation, refine.

Pipeline (`search`):
1. Enumerate (`enumerate_candidates`): every mesh of `planner.space`. A mesh whose most
   memory-frugal configuration (smallest micro-batch, full recompute, offloaded model state)
   does not fit is dropped whole (the memory bound). The rest are visited by a lower bound on their
   estimated step time (the compute bound: `Estimator.time_floor`) and expanded until the bound
   exceeds the estimate of the `keep_meshes`-th best mesh found (branch and bound). Expanding a
   mesh: recompute and offload only ever add time, so per (micro-batch, schedule, precision,
   optimizer) only the first fitting recompute policy is kept, with and without offload (offload
   only when it lets a cheaper recompute policy fit). An offloaded configuration fits only when its
   nodes' host memory does too (`host_fits`: `planner.host_memory`).
2. Estimate: `planner.estimate.Estimator` prices each expanded configuration analytically.
3. Price: the best estimate of each of the `simulate_meshes` best meshes, the `simulate_top` best
   estimates overall, and every baseline family's best estimates are simulated (`price`, the full
   simulator), within `simulation_budget`; the `always_simulate` best estimates have a budget of
   their own, so the top of a huge job's ranking is simulated, not estimated. Plans whose simulated peak memory exceeds the limit are dropped; the rest are ranked
   by simulated step time (when none fits, the candidates with the least estimated memory are
   simulated next, within the budget). Since each baseline's configuration is priced the same way,
   the chosen plan is never slower than a baseline.
3b. Compile (after refinement): where the request leaves torch.compile free and the device's compile factors make some
   kernel class faster (`planner.space.compile_choices`), the `compile_top` best fitting simulated plans
   are simulated again with compile on (`compile_variant`) and join the ranking. The estimator prices
   compile only where it is pinned on (every candidate compiles), and compile only lowers memory in soap's model (`costmodel.memory_activations.compiled_keep`:
   a plan that fits eager fits compiled), so this is not a dimension the enumeration doubles; on a tie the plan without compile wins (the key orders off first).
4. Refine (optional, `--time-budget`): FlexFlow-style MCMC over the estimated candidates. From the
   current plan, propose a random neighbour (a candidate differing in one or two independent choices,
   `_move_key`: moving a factor between tp and dp is one move, tp to pp two), simulate it, and accept it with
   probability min(1, exp(-beta (t_new - t_cur) / t_cur)). Proposals come from `random.Random(seed)`,
   so a run is reproducible for a seed and a step count; the budget only decides how many steps run.

Determinism: candidates are ordered by (time, key) where the key is a total order over every field
of the strategy; nothing iterates a set or depends on hashing.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from costmodel.strategy import Strategy, TrainingConfig
from planner.estimate import Estimate, Estimator
from planner.space import (
    MeshChoice,
    SpaceRequest,
    TrainingHead,
    compile_choices,
    frugal_configs,
    mesh_choices,
    offload_choices,
    recompute_choices,
    training_config,
    training_heads,
)

RECOMPUTE_ORDER = ("none", "selective", "full")


def train_key(t: TrainingConfig) -> tuple:
    return (
        t.micro_batch, t.num_microbatches, t.grad_accum, t.schedule, t.virtual_stages, t.precision,
        t.optimizer, RECOMPUTE_ORDER.index(t.recompute), int(t.offload_optimizer), int(t.compile),
    )


@dataclass(frozen=True)
class Candidate:
    mesh: MeshChoice
    train: TrainingConfig
    estimate: Estimate
    op_splits: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()
    """Per-op splits the simulation chose over the Megatron default (`planner.block_splits`)."""

    @property
    def strategy(self) -> Strategy:
        return Strategy(dims=self.mesh.dims, train=self.train, op_splits=self.op_splits)

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
    keep_meshes: int = 24
    """Meshes whose best estimate must be exact after enumeration (the branch-and-bound's target)."""
    simulate_meshes: int = 24
    """Meshes whose best-estimated configuration is simulated (at most keep_meshes)."""
    simulate_top: int = 16
    """Best estimates overall that are simulated (often variants of the best meshes)."""
    baseline_tries: int = 6
    """Most members of a baseline family simulated, best estimates first, until one fits in simulation
    (budget permitting; the first is always simulated)."""
    always_simulate: int = 4
    """The best estimates simulated from a budget of their own (another `simulation_budget`; the best is
    simulated whatever its work), so a 405B ranking rests on full simulation of its top candidates
    rather than on the analytic estimate, while a step of ~1,000 micro-batches over 64 stages cannot
    take minutes."""
    simulation_budget: float = 300_000.0
    """Simulation work allowed (see `simulation_work`): about 25 s on a quiet 2-core machine (a
    405B-on-16k-GPU candidate costs ~65k). Two thirds go to the best estimates, the rest to baselines;
    the best estimate and each family's best are always simulated, so a huge job still gets its plan
    and its baselines."""
    compile_top: int = 4
    """Best fitting simulated plans simulated again with torch.compile on, where compile is searched."""
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
    baselines_outside: tuple[str, ...] = ()
    """Baseline families with no member in the searched space (the pins exclude them: no baseline offloads, say)."""
    priced: tuple[Priced, ...] = field(default=())
    """Every simulated plan that fits, fastest first (the explanation's counterfactuals)."""


def _bubble_factor(head: TrainingHead) -> float:
    return (0.5 if head.schedule == "ZBVZeroBubble" else 1.0) / head.virtual_stages


HostFits = Callable[[MeshChoice, TrainingConfig, Estimate], bool]
Progress = Callable[[str, int, "int | None"], None]
"""`progress(phase, done, total)`: what the search is doing ("estimating", "simulating"), for a progress
bar; total None where it is not known in advance."""
"""Whether an estimated configuration fits host memory (`planner.host_memory.HostMemoryCheck.estimate_fits`)."""


def _any_host(mesh: MeshChoice, train: TrainingConfig, estimate: Estimate) -> bool:
    return True


def _frugal_fits(req: SpaceRequest, estimator: Estimator, mesh: MeshChoice, heads: list[TrainingHead],
                 memory_limit: float, host_fits: HostFits = _any_host) -> bool:
    """Whether the mesh's most memory-frugal configuration fits (smallest micro-batch, the strongest
    recompute policy allowed, model state offloaded; or not offloaded, where offloading does not fit
    host memory)."""
    for frugal in frugal_configs(req, mesh, heads):
        for offload in [o for o in (True, False) if o in offload_choices(req, frugal.optimizer)]:
            t = dataclasses.replace(frugal, offload_optimizer=offload)
            est = estimator.estimate(mesh, t)
            if est.memory_bytes > memory_limit:
                break  # without offload the device holds more still
            if host_fits(mesh, t, est):
                return True
    return False


def _expand(req: SpaceRequest, estimator: Estimator, mesh: MeshChoice, heads: list[tuple[float, TrainingHead]],
            memory_limit: float, global_bar: float, host_fits: HostFits = _any_host) -> tuple[list[Candidate], int]:
    """The mesh's fitting configurations: per head, the first recompute policy that fits, without
    offload and (only when offload lets a cheaper policy fit) with it. Heads come sorted by their time
    floor; a head is skipped once its floor can beat neither this mesh's best so far nor `global_bar`."""
    kept: list[Candidate] = []
    estimated = 0
    best = math.inf
    recomputes = recompute_choices(req)
    for floor, head in heads:
        if floor > best and floor > global_bar:
            continue
        fitting_level = len(recomputes)
        for offload in offload_choices(req, head.optimizer):
            for level, recompute in enumerate(recomputes[:fitting_level]):
                t = training_config(req, mesh, head, recompute=recompute, offload=offload)
                est = estimator.estimate(mesh, t)
                estimated += 1
                if est.memory_bytes <= memory_limit and host_fits(mesh, t, est):
                    kept.append(Candidate(mesh, t, est))
                    best = min(best, est.step_time_s)
                    fitting_level = level
                    break
            if fitting_level == 0:
                break
    return kept, estimated


def enumerate_candidates(
    req: SpaceRequest, estimator: Estimator, memory_limit: float, *, keep_meshes: int = 24, keep_top: int = 16,
    always: Callable[[MeshChoice], bool] = lambda mesh: False, host_fits: HostFits = _any_host,
    progress: Progress | None = None,
) -> tuple[list[Candidate], int]:
    """Candidates that fit by estimate, sorted by (estimated time, key), and how many were estimated.

    Branch and bound over meshes and their heads: meshes are visited by their time floor
    (`Estimator.time_floor`). A mesh is skipped when its floor exceeds both the `keep_meshes`-th best
    mesh's estimate and the `keep_top`-th best candidate's (it can enter neither set that
    `select_for_simulation` draws from), unless `always(mesh)`: the baseline families' meshes are
    always expanded. A configuration fits when its estimated device memory is within `memory_limit` and
    `host_fits` accepts it (host memory of offload plans). `progress` hears of every mesh checked and
    every mesh expanded."""
    scored = []
    estimated = 0
    compiled = req.pins.compile is True  # pinned on: every candidate compiles, and its floor is the compiled one
    meshes = list(mesh_choices(req))
    for i, mesh in enumerate(meshes):
        if progress:
            progress("estimating", i, 2 * len(meshes))
        heads = training_heads(req, mesh)
        if not heads:
            continue
        estimated += 1
        if not _frugal_fits(req, estimator, mesh, heads, memory_limit, host_fits):
            continue
        floors = sorted(
            ((estimator.time_floor(mesh, h.micro_batch, h.num_microbatches, h.grad_accum, h.precision,
                                   _bubble_factor(h), compiled, req.pins.cross_entropy), i, h)
             for i, h in enumerate(heads)),
            key=lambda x: (x[0], x[1]),
        )
        scored.append((floors[0][0], mesh.sort_key, mesh, [(f, h) for f, _, h in floors]))
    scored.sort(key=lambda x: (x[0], x[1]))
    kept: list[Candidate] = []
    mesh_best: list[float] = []
    top: list[float] = []
    for i, (floor, _, mesh, heads) in enumerate(scored):
        if progress:
            progress("estimating", len(meshes) + i * len(meshes) // max(len(scored), 1), 2 * len(meshes))
        mesh_bar = mesh_best[keep_meshes - 1] if len(mesh_best) >= keep_meshes else math.inf
        top_bar = top[keep_top - 1] if len(top) >= keep_top else math.inf
        forced = always(mesh)
        if floor > mesh_bar and floor > top_bar and not forced:
            continue
        found, n = _expand(req, estimator, mesh, heads, memory_limit, math.inf if forced else top_bar, host_fits)
        estimated += n
        if found:
            kept.extend(found)
            bisect.insort(mesh_best, min(c.estimate.step_time_s for c in found))
            for c in found:
                bisect.insort(top, c.estimate.step_time_s)
            del top[keep_top:]
    kept.sort(key=lambda c: (c.estimate.step_time_s, c.key))
    return kept, estimated


CompileVariant = Callable[[Candidate], "Candidate | None"]
"""A candidate's torch.compile variant to simulate as well, or None (`compile_variant`)."""


def compile_variant(req: SpaceRequest, compile_pays: bool) -> CompileVariant | None:
    """The compile-on copy of a candidate, when the request searches compile (`compile_choices`); None
    when compile is pinned or cannot pay on the device (nothing extra is simulated)."""
    if compile_choices(req, compile_pays) != (False, True):
        return None

    def variant(c: Candidate) -> Candidate | None:
        return None if c.train.compile else dataclasses.replace(c, train=dataclasses.replace(c.train, compile=True))

    return variant


SIMULATION_OVERHEAD = 400.0
"""Work units one simulation costs regardless of size (pricing, stage DP, analysis)."""


def simulation_work(candidate: Candidate, layers: int) -> float:
    """A deterministic proxy for a simulation's cost: the simulator's task count grows with the
    micro-batches times (layers + pipeline transfers)."""
    d, t = candidate.mesh.dims, candidate.train
    return SIMULATION_OVERHEAD + t.num_microbatches * (layers + 4 * d.pp * t.virtual_stages)


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

    def has(self, c: Candidate) -> bool:
        return c.key in self._seen

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
    work: Callable[[Candidate], float] = lambda c: 1.0,
    compile_variants: CompileVariant | None = None,
) -> SearchOutcome:
    """Rank `candidates` (sorted by estimate) by full simulation; see the module docstring.
    `compile_variants` gives a candidate's torch.compile copy (step 3b), None when compile is not searched.

    `baselines(best)` names the baseline families (objects with `.name` and `.member(candidate)`)
    once the best plan is known; their best members are simulated and join the ranking.
    """
    cache = _PriceCache(price)
    spent = 0.0
    top_spent = 0.0
    for rank, c in enumerate(select_for_simulation(candidates, config)):
        if rank < config.always_simulate:  # a budget of their own; the first is always simulated
            if rank and top_spent + work(c) > config.simulation_budget:
                continue
            top_spent += work(c)
            cache(c)
            continue
        if spent + work(c) > config.simulation_budget * 2 / 3:
            continue
        spent += work(c)
        cache(c)
    if not any(p.fits for p in cache.priced):
        # the simulator found every estimate-best plan over the memory limit: try the most frugal ones
        for c in sorted(candidates, key=lambda c: (c.estimate.memory_bytes, c.key)):
            if cache.has(c):
                continue
            if spent + work(c) > config.simulation_budget:
                break
            spent += work(c)
            if cache(c).fits:
                break
    steps = 0
    fitting_now = [p for p in cache.priced if p.fits]
    if config.time_budget_s and fitting_now:
        steps = refine(fitting_now[0], candidates, cache, config)
        fitting_now = [p for p in cache.priced if p.fits]
    if compile_variants is not None:  # after refinement, whose walk is over the (compile-off) candidates
        for p in fitting_now[: config.compile_top]:
            variant = compile_variants(p.candidate)
            if variant is not None:
                cache(variant)
        fitting_now = [p for p in cache.priced if p.fits]
    family_best: list[tuple[str, Priced | None]] = []
    outside: list[str] = []
    if baselines is not None and fitting_now:
        for family in baselines(fitting_now[0].candidate):
            members = [c for c in candidates if family.member(c)][: config.baseline_tries]
            if not members:
                outside.append(family.name)
            tried: list[Priced] = []
            for i, c in enumerate(members):
                if not cache.has(c):
                    if i and spent + work(c) > config.simulation_budget:
                        continue
                    spent += work(c)
                tried.append(cache(c))
                if tried[-1].fits:
                    break
            fitting = sorted((p for p in tried if p.fits), key=lambda p: p.order)
            family_best.append((family.name, fitting[0] if fitting else None))
    priced = cache.priced
    ranked = tuple(p for p in priced if p.fits)
    return SearchOutcome(
        ranked=ranked[: config.top_k + 1], baselines=tuple(family_best), baselines_outside=tuple(outside),
        candidates=estimated or len(candidates),
        simulated=cache.calls, refine_steps=steps, rejected_by_simulation=tuple(p for p in priced if not p.fits),
        priced=ranked,
    )


def _move_key(c: Candidate) -> tuple:
    """The independent choices of a candidate (dp, micro-batch counts and accumulation follow from
    them), so one MCMC move changes one or two of them."""
    d, t = c.mesh.dims, c.train
    return (d.pp, d.tp, d.cp, d.ep, (c.mesh.zero, d.dp_replicate > 1 and d.dp_shard > 1), t.micro_batch,
            (t.schedule, t.virtual_stages), t.precision, t.optimizer, t.recompute, t.offload_optimizer, t.compile)


def _coordinates(candidates: Sequence[Candidate]) -> np.ndarray:
    """Each candidate's choices as integer codes, for vectorised neighbour look-ups."""
    keys = [_move_key(c) for c in candidates]
    columns = list(zip(*keys))
    codes = []
    for col in columns:
        values = sorted(set(col), key=repr)
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
