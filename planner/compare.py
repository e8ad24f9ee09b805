"""`soap compare`: which cluster, and how many of its GPUs, for one training run; by time and by cost.

Each (cluster c, GPU count n) point is `soap plan` itself: `planner.pricing.run_search` on the same
request `planner.api.make_request` builds, so a compared point and a planned one are the same plan. Its
simulated step gives the throughput X(c, n) in tokens/s (`SimResult.tokens_per_s`); with a price p_c in
USD per GPU-hour (`planner.prices`) and T tokens to train:

    time to train          T / X(c, n)                       seconds      (`Point.train_time_s`)
    cost per 1e6 tokens    n * p_c / 3600 * 1e6 / X(c, n)    USD          (`Point.cost_per_million`)
    cost to train          n * p_c / 3600 * T / X(c, n)      USD

Clusters are ranked by cost per million tokens at their headline count (the pinned `--gpus N`, or the knee
below), cheaper first, ties broken by higher throughput; clusters that fit nowhere come last.

One trace, shared (`SharedTrace`): the model is traced once per precision regime (the fp32 graph, and the
bf16/autocast graphs `planner.regimes` asks for) and every cluster and count is priced on those graphs,
so comparing k clusters at one count costs k searches and one trace, less than k `soap plan` runs
(each of which starts a process and loads its trace).

GPU counts (`--gpus auto`, `gpu_ladder`): the powers of two up to the cap, every node doubling
(gpus_per_node * 2^k) and, for a cluster whose NVLink domain is larger than a node, the domain's
multiples. From these it reports
- the smallest count that fits (`smallest_fitting`): the first ladder count whose search finds a plan,
  then bisected down over the step grid (the powers of two below a node, then whole nodes, `step_grid`)
  between it and the ladder count below it that did not fit. The count one grid step below the answer
  does not fit; memory is not strictly monotone in the count (divisibility of heads, layers and batch),
  so a yet smaller count may, which the ladder would have tried if it were a power of two or a node
  doubling;
- the best throughput per GPU: the count with the highest X(n)/n, which at one price is also the
  cheapest per token;
- the knee of the scaling curve (`knee`): walking up the doublings n -> 2n of fitting ladder counts from
  the smallest, the first n whose doubling gains less than `KNEE_GAIN` (X(2n)/X(n) < 1.6, i.e. under 80%
  scaling efficiency); beyond it each added GPU buys markedly less. If every doubling up to the cap
  gains at least that, the knee is the largest count searched and `knee_reached` is False.
The headline count of a cluster under `--gpus auto` is its knee. Under a pinned `--gpus N` nothing but N is
searched (k clusters cost k searches, the one-trace promise), so the smallest count, the best count per GPU
and the knee are left out (None); `--gpus auto` gives them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from costmodel.profiles import ClusterSpec, load_cluster
from planner.model_ref import ModelRef, model_ref
from planner.prices import Price
from planner.report import PlanReport, contract, describe
from tracer.errors import SoapError
from tracer.peft import PeftSpec
from tracer.ir import OpGraph

KNEE_GAIN = 1.6
"""A doubling of the GPU count that gains less than this factor in tokens/s is past the knee."""
DEFAULT_MAX_GPUS = 512
"""`--max-gpus`: the largest count `--gpus auto` tries (2^22-token steps keep a fixed batch up to 1024)."""
SECONDS_PER_HOUR = 3600.0


class SharedTrace:
    """The model's graph per trace dtype, traced on first use and then shared by every search; called
    as `trace(dtype=...)` (what `planner.regimes.RegimeEstimator` expects)."""

    def __init__(self, ref: ModelRef, *, task: str | None, seq_len: int) -> None:
        self.ref, self.task, self.seq_len = ref, task, seq_len
        self.graphs: dict[str, OpGraph] = {}

    def __call__(self, *, dtype: str = "float32") -> OpGraph:
        if dtype not in self.graphs:
            self.graphs[dtype] = self.ref.trace(task=self.task, seq_len=self.seq_len, dtype=dtype)
        return self.graphs[dtype]


@dataclass(frozen=True)
class Point:
    """One cluster at one GPU count: the plan `soap plan` would choose, or why none fits."""

    gpus: int
    report: PlanReport | None
    error: str | None = None

    @property
    def fits(self) -> bool:
        return self.report is not None

    @property
    def tokens_per_s(self) -> float:
        return self.report.chosen.result.tokens_per_s if self.report else 0.0

    def cost_per_million(self, price: Price) -> float:
        """USD per 1e6 trained tokens at this count (inf where nothing fits)."""
        if not self.fits or self.tokens_per_s <= 0:
            return math.inf
        return self.gpus * price.usd_per_gpu_hour / SECONDS_PER_HOUR * 1e6 / self.tokens_per_s

    def train_time_s(self, tokens: float) -> float:
        return tokens / self.tokens_per_s if self.fits and self.tokens_per_s > 0 else math.inf


@dataclass(frozen=True)
class ClusterResult:
    name: str
    """The cluster as the user named it (a shipped name or a file)."""
    cluster: ClusterSpec
    price: Price
    points: tuple[Point, ...]
    """Every count searched, ascending."""
    headline: int | None
    """The count the cluster is ranked at: the pinned count, or the knee; None where nothing fits."""
    min_gpus: int | None = None
    best_per_gpu: int | None = None
    knee: int | None = None
    knee_reached: bool = False

    def point(self, gpus: int | None) -> Point | None:
        return next((p for p in self.points if p.gpus == gpus), None)

    @property
    def chosen(self) -> Point | None:
        return self.point(self.headline)

    @property
    def cost_per_million(self) -> float:
        chosen = self.chosen
        return chosen.cost_per_million(self.price) if chosen else math.inf


@dataclass(frozen=True)
class Comparison:
    model: str
    tokens: float
    seq_len: int
    gpus: int | None
    """The pinned count, or None for `--gpus auto`."""
    max_gpus: int
    clusters: tuple[ClusterResult, ...]
    """Ranked: cheapest per token first."""


# ---------------------------------------------------------------------------------------------
# GPU counts


def gpu_ladder(gpus_per_node: int, domain: int, cap: int) -> tuple[int, ...]:
    """Powers of two up to `cap`, node doublings, and multiples of an NVLink domain larger than a node."""
    counts = {1 << k for k in range(cap.bit_length()) if 1 << k <= cap}
    n = gpus_per_node
    while n <= cap:
        counts.add(n)
        n *= 2
    if domain > gpus_per_node:
        counts.update(range(domain, cap + 1, domain))
    return tuple(sorted(counts))


def step_grid(gpus_per_node: int, cap: int) -> tuple[int, ...]:
    """The counts one "step" apart: powers of two below a node, then whole nodes."""
    below = {1 << k for k in range(gpus_per_node.bit_length()) if 1 << k < gpus_per_node}
    return tuple(sorted(below | set(range(gpus_per_node, cap + 1, gpus_per_node))))


def smallest_fitting(ladder: Sequence[int], grid: Sequence[int], fits: Callable[[int], bool]) -> int | None:
    """The first ladder count that fits, bisected down over `grid` (which holds every ladder count) to the
    count whose grid predecessor does not fit (see the module docstring); None if no ladder count fits."""
    previous = 0
    for count in ladder:
        if fits(count):
            break
        previous = count
    else:
        return None
    lo = max((i for i, g in enumerate(grid) if g <= previous), default=-1)
    hi = grid.index(count)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(grid[mid]):
            hi = mid
        else:
            lo = mid
    return grid[hi]


def knee(points: Mapping[int, float], start: int) -> tuple[int, bool]:
    """(knee count, whether a doubling fell short of KNEE_GAIN) walking doublings up from `start`;
    `points` maps fitting counts to tokens/s."""
    n = start
    while 2 * n in points:
        if points[2 * n] < KNEE_GAIN * points[n]:
            return n, True
        n *= 2
    return n, False


# ---------------------------------------------------------------------------------------------
# Planning


def _validated(clusters: Sequence[str], gpus: int | str, tokens: float, max_gpus: int) -> int | None:
    if not clusters:
        raise SoapError("--clusters names no cluster; give a comma-separated list, e.g. dgx-h100,dgx-b200")
    repeated = sorted({c for c in clusters if list(clusters).count(c) > 1})
    if repeated:
        raise SoapError(f"--clusters names {repeated[0]!r} twice; name each cluster once")
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not (math.isfinite(tokens) and tokens > 0):
        raise SoapError(f"--tokens={tokens!r} must be a positive number of tokens, e.g. 1e12")
    if isinstance(max_gpus, bool) or not isinstance(max_gpus, int) or max_gpus < 1:
        raise SoapError(f"--max-gpus={max_gpus!r} must be a positive integer")
    if gpus == "auto":
        return None
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise SoapError(f"--gpus={gpus!r} must be a positive integer or auto")
    return gpus


def compare(model: Any, *, clusters: Sequence[str], prices: Mapping[str, Price], gpus: int | str = "auto",
            tokens: float = 1e12, max_gpus: int = DEFAULT_MAX_GPUS, progress: Callable[[str], None] | None = None,
            **kwargs: Any) -> Comparison:
    """Plan `model` on every cluster (at `gpus`, or over the auto ladder) and rank them by cost per
    million tokens. `kwargs` are `planner.api.make_request`'s (pins, task, seq_len, global_batch,
    mem_limit_gib, trust_remote_code)."""
    from planner.api import request_seq_len

    pinned = _validated(clusters, gpus, tokens, max_gpus)
    specs = {name: load_cluster(name) for name in clusters}
    missing = [name for name in clusters if name not in prices]
    if missing:
        raise SoapError(f"no price for {', '.join(missing)}; give it as --price {missing[0]}=USD_PER_GPU_HOUR")
    trust = bool(kwargs.get("trust_remote_code", False))
    # the shared graphs are of the model that trains: with --peft, its adapters injected
    ref = replace(model_ref(model, task=kwargs.get("task"), trust_remote_code=trust),
                  peft=PeftSpec.from_value(kwargs.get("peft")))
    seq_len = request_seq_len(ref, seq_len=kwargs.get("seq_len"), task=kwargs.get("task"))
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise SoapError(f"--seq-len={seq_len!r} must be a positive integer")
    shared = SharedTrace(ref, task=kwargs.get("task"), seq_len=seq_len)
    if ref.config is None:  # a module without a config: trace it once, price everything on that graph
        import tracer

        shared.graphs["float32"] = tracer.trace(model, task=kwargs.get("task"), batch=1, seq_len=seq_len,
                                                trust_remote_code=trust, peft=ref.peft)

    results = []
    for name in clusters:
        spec = specs[name]
        memo: dict[int, Point] = {}

        def plan_at(count: int, spec: ClusterSpec = spec, memo: dict[int, Point] = memo, name: str = name) -> Point:
            if count not in memo:
                if progress:
                    progress(f"{name}: {count} GPUs")
                memo[count] = _plan_point(model, spec, count, shared, ref.config is None, kwargs)
            return memo[count]

        if pinned is not None:
            point = plan_at(pinned)
            results.append(ClusterResult(name, spec, prices[name], (point,), pinned if point.fits else None))
            continue
        ladder = gpu_ladder(spec.gpus_per_node, spec.domain_size, max_gpus)
        grid = tuple(sorted(set(step_grid(spec.gpus_per_node, max_gpus)) | set(ladder)))
        smallest = smallest_fitting(ladder, grid, lambda n: plan_at(n).fits)
        if smallest is not None:
            for count in ladder:
                if count > smallest:
                    plan_at(count)
        points = tuple(memo[n] for n in sorted(memo))
        fitting = {p.gpus: p.tokens_per_s for p in points if p.fits}
        if not fitting:
            results.append(ClusterResult(name, spec, prices[name], points, None))
            continue
        start = min(n for n in fitting if n in ladder)
        knee_at, reached = knee(fitting, start)
        best = max(fitting, key=lambda n: (fitting[n] / n, -n))
        results.append(ClusterResult(name, spec, prices[name], points, knee_at, min_gpus=smallest,
                                     best_per_gpu=best, knee=knee_at, knee_reached=reached))
    if not any(r.headline for r in results):
        errors = [p.error for r in results for p in r.points if p.error]
        where = f"at {pinned} GPU{'s' if pinned != 1 else ''}" if pinned else f"at any count up to --max-gpus {max_gpus}"
        raise SoapError(f"{ref.name} fits on none of {', '.join(clusters)} {where}: {errors[-1] if errors else 'no plan'}")
    ranked = sorted(results, key=lambda r: (r.headline is None, r.cost_per_million,
                                            -(r.chosen.tokens_per_s if r.chosen else 0.0), clusters.index(r.name)))
    return Comparison(model=ref.name, tokens=float(tokens), seq_len=seq_len, gpus=pinned,
                      max_gpus=max_gpus, clusters=tuple(ranked))


def _plan_point(model: Any, cluster: ClusterSpec, gpus: int, shared: SharedTrace, fixed_graph: bool,
                kwargs: Mapping[str, Any]) -> Point:
    """`soap plan MODEL --gpus N --cluster C` on the shared graphs; a SoapError (nothing fits, a pin this
    count cannot honour) is the point's `error`."""
    from planner.api import make_request
    from planner.pricing import run_search

    graph = shared(dtype="float32")
    try:
        request = make_request(model, gpus=gpus, cluster=cluster, graph=graph if fixed_graph else None, **kwargs)
        request = replace(request, space=replace(request.space, dims=graph.dims))
        report = run_search(request, graph, time_budget_s=None, seed=0, trace=None if fixed_graph else shared)
    except SoapError as exc:
        return Point(gpus, None, str(exc))
    return Point(gpus, report)


# ---------------------------------------------------------------------------------------------
# The --json object


def _point_json(point: Point, price: Price, tokens: float) -> dict[str, Any]:
    out: dict[str, Any] = {"gpus": point.gpus, "fits": point.fits}
    if not point.fits:
        out["error"] = point.error
        return out
    c = contract(point.report.chosen)
    out.update(
        plan=describe(point.report.chosen), parallelism=c["parallelism"], step_time_s=c["step_time_s"],
        tokens_per_s=c["tokens_per_s"], tokens_per_s_per_gpu=c["tokens_per_s"] / point.gpus, mfu=c["mfu"],
        peak_memory_gib=c["peak_memory_gib"], memory_limit_gib=point.report.memory_limit_bytes / 2**30,
        train_time_s=point.train_time_s(tokens), train_time_days=point.train_time_s(tokens) / 86400,
        cost_per_million_tokens_usd=point.cost_per_million(price),
        train_cost_usd=point.cost_per_million(price) * tokens / 1e6,
    )
    return out


def comparison_json(comparison: Comparison) -> dict[str, Any]:
    """The `soap compare --json` object: the headline point's keys per cluster, and every point searched."""
    clusters = []
    for rank, r in enumerate(comparison.clusters, start=1):
        row: dict[str, Any] = {
            "rank": rank, "cluster": r.name, "device": r.cluster.device.name, "gpus_per_node": r.cluster.gpus_per_node,
            "nvlink_domain": r.cluster.domain_size,
            "price": {"usd_per_gpu_hour": r.price.usd_per_gpu_hour, "as_of": r.price.as_of, "source": r.price.source},
            "min_gpus": r.min_gpus, "best_per_gpu_gpus": r.best_per_gpu, "knee_gpus": r.knee,
            "knee_reached": r.knee_reached,
        }
        chosen = r.chosen
        row.update(_point_json(chosen, r.price, comparison.tokens) if chosen else
                   {"gpus": comparison.gpus, "fits": False, "error": next((p.error for p in r.points[::-1] if p.error), None)})
        row["points"] = [_point_json(p, r.price, comparison.tokens) for p in r.points]
        clusters.append(row)
    return {
        "model": comparison.model, "tokens": comparison.tokens, "seq_len": comparison.seq_len,
        "gpus": comparison.gpus if comparison.gpus is not None else "auto", "max_gpus": comparison.max_gpus,
        "knee_gain": KNEE_GAIN, "ranking": [r.name for r in comparison.clusters], "clusters": clusters,
    }
