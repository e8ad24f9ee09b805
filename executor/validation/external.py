"""Calibrate a GPU profile from run records of outside runs (`executor.validation.run_records`), and say how well it
predicts runs it was not fitted on.

1. Each record is planned as published (`RunRecord.pins`; `planner.api.plan_report` with every stated
   choice pinned and no memory limit, so a configuration soap thinks too big is still priced) on its
   cluster profile, as its stack runs it (`executor.validation.grid.as_run`, what the grid benchmarks price
   with too: the stack's loss, torchtitan's upcast cross-entropy or Megatron's vocab-parallel one; NeMo's 16-bit
   model, local gradient accumulation and Transformer Engine's fp8 casts), and its simulated step is split into
   parts by re-simulating with one term made free (`step_terms`):
   - compute by kernel class: `matmul` (the GEMMs), `attention` (the SDPA core;
     bf16 under fp8 too) and `memory-bound` (every other class: elementwise, norm, softmax, dropout), each
     the step time lost when that class costs nothing (its `kernel_factors` at 0), scaled so that together
     they are the step's compute C = T - K - M (what is left, the optimizer step and bubbles among it,
     is `other` and is not fitted); torchao's casts of an fp8 run's weights, `fp8-weight-casts` (T - T(their
     factor `costmodel.opcost.FP8_WEIGHT_CAST_CLASS` scaled), taken out of `memory-bound`, whose `arithmetic/bf16`
     factor they read), scale with the memory-bound kernels but not with `compile`, which the opcost does not
     apply to them;
   - `kernel-launch` K = T - T(kernel_overhead 0);
   - `host-floor`: the step's share set by the host-bound floor (`DeviceProfile.host_dispatch_s`: an eager
     chunk's kernels cannot run faster than the host dispatches them), 0 in a run whose kernels outlast it;
   - `inter-node` = T - T(inter-node links free), `intra-node` = T - T(every link free, no per-call
     overhead) - inter-node - activation; `activation` = T - T(activation collectives free) for tp, cp, ep.
2. The measured step m_i is modelled as the parts times fitted multipliers,

       m_i ~= sum_j f_ij exp(sum_k G_ijk theta_k)

   where G picks for part j of run i the parameters that scale it: the part's own term (`matmul/<precision>`
   for the GEMMs; an fp8 run's take `matmul/bf16` times `matmul/fp8`, fp8's own multiplier over bf16's, since
   both precisions' GEMMs run on the same tensor cores under the same clocks and stack and fp8 adds its casts,
   scales and rate on top: a fit on one precision predicts the other with its twin's multiplier, where two free
   multipliers left the held-out one at the prior, 73% / 35% error on torch-native / NeMo rows, 51% / 25%
   tied); `compile` for the memory-bound part of a compiled run (Inductor fuses elementwise ops; matmul and
   attention keep their library kernels); the run's stack (`stack:<name>`, every compute part of a run from a
   stack that is not torch-native, e.g. Transformer Engine's fused kernels); and, for a run that states its SDPA
   kernel (`RunRecord.sdpa_backend`), `attention/<backend>` on its attention part: that kernel's rate over the
   unstated runs' (what soap's executor runs), so runs of a torch release whose SDPA dispatched to another
   kernel share every other term with soap's own (torchtitan's runs of December 2024 ran FlashAttention-2 on
   H100, soap's own of 2026 cuDNN's Hopper kernels: `benchmarks/own_runs_corpus.py`). theta minimizes the
   squared log ratios plus a weak pull toward 0 (a term no run exercises stays as the profile had it), or, for a
   term measured apart from any run (`MEASURED_PRIORS`: an SDPA kernel's time over another's, timed on one GPU), a
   pull toward the measured value as strong as one run's (its log spread against `RUN_LOG_SD`); optionally the same
   pull on the ratio of two multipliers measured apart (`fit(ratios=...)`: `ATTENTION_OVER_MATMUL`, cuDNN's
   attention over the GEMMs on an H100, for runs that state any other kernel they ran: without it, a fit whose
   runs all share one sequence length cannot tell attention's time from the GEMMs'), by damped
   Gauss-Newton, each multiplier kept inside the profile loader's bounds (the activation collectives' at most
   `ACTIVATION_MAX`: slower is no collective), and no kernel class made faster than its
   datasheet peak (`_peak_ceilings`): the product of the parameters scaling a run's matmul or attention part (the
   class's multiplier times its stack's factor) stays at or above the value at which that part's fastest kernels run
   at the peak on the run's device, a hinge penalty (`PEAK_WEIGHT`) that binds only past it; a product left on its
   ceiling is reported (`Fit.at_peak`, printed by `soap calibrate --from-runs`). Without it a stack's factor and the
   device's multiplier trade freely where the runs cannot tell them apart: a fit on the NeMo 8B rows alone priced
   Transformer Engine's fp8 GEMMs at 4.5x the profile's fp8 rate, 2.7x the fp8 peak, and leaving out either NeMo
   model erred 16.8% on it (12.3% with the ceiling; fits that stay below every ceiling, the full corpus's among them,
   are unchanged). Optionally robust (`fit(robust=delta)`): a log
   ratio r counts as delta^2 ln(1 + (r / delta)^2) in place of r^2 (Cauchy's loss, by iteratively reweighted
   Gauss-Newton, weight 1 / (1 + (r / delta)^2)), so that a run measured many times slower than anything its
   parts can carry (a disturbed or failing run: on the Playbook grid, pipelined runs 3-50x slower than the
   same configuration at another micro-batch size) stops pulling instead of pulling with its squared log
   (Huber's linear pull still dragged a planted fit 17% off with one run in eight failed,
   tests/test_run_records.py). Off by default (`soap calibrate --from-runs` fits squares); for |r| << delta
   the two agree.
3. The fitted terms are written into the profile (`apply_fit`): `kernel_factors` per class and precision,
   `compile_factors` for the memory-bound classes, `kernel_overhead_us`, each link's bandwidth and latency,
   `activation_collective_factor`; each changed number's source names the runs whose parts it scales.
   Stack factors and SDPA-kernel multipliers are reported, not written: soap's predictions are for its own
   executor (torch-native, the attention kernel torch dispatches to today).
4. Errors are re-simulated, not read off the linear model: in-sample (every run, fitted profile) and
   leave-one-out (refit without a run, or without every run of one model, GPU count or stack, and predict
   those). A held-out stack has no stack factor to use; its runs are predicted as torch-native.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from costmodel.calibration.runs import scale_entry
from costmodel.profiles import PRECISION_KEYS, ClusterSpec, FactorCurve
from costmodel.context_attention import H100_LOWER_RIGHT
from executor.validation.run_records import TORCH_NATIVE, RunRecord
from tracer.errors import SoapError

MEMORY_BOUND_CLASSES = ("arithmetic", "transcendental", "softmax", "norm", "dropout", "tanh")
PRIOR_WEIGHT = 1e-3
"""The pull of every log-multiplier toward 0. Weaker (1e-4) recovers planted terms more exactly on noise-free data
but lets terms the corpus barely exercises drift (launch x0.09, compile x0.12) and doubles the leave-one-model-out
error on the published corpus."""
RUN_LOG_SD = 0.1
"""The log error one run is taken to carry (the corpus fits' in-sample errors are 2-7%, held out 10% and more): a
measured prior of log spread sd weighs (RUN_LOG_SD / sd)^2 runs."""
FLASH_OVER_CUDNN = H100_LOWER_RIGHT
"""torch's FlashAttention-2 kernel's time over cuDNN's (the Hopper flash kernels torch 2.11 dispatches to) for causal
attention of Llama-3-8B's heads, forward and backward: the geometric mean over sequences of 2k-32k (1.65-1.82), on
a lent H100 of 2026-11-27 (`benchmarks/sdpa_backends.py`, `benchmarks/data/h100-2026-11-27-kernels/sdpa-backends
.json`)."""
MEASURED_PRIORS: dict[str, tuple[float, float]] = {"attention/flash_attention": (FLASH_OVER_CUDNN, 0.1)}
"""Per fitted multiplier measured apart from any run: (value, log spread). FlashAttention-2 over cuDNN's kernels:
log spread 0.04 over the sequence lengths, taken as 0.1 for its carrying from torch 2.11 to the release a run used
and from a 700 W part to a 500 W one."""
H100_ATTENTION_OVER_MATMUL = 0.746
"""How much faster than the datasheet H100 profile prices them cuDNN's causal attention kernels ran on a lent H100,
over how much faster its GEMMs ran: whole causal attention of Llama-3-8B's heads timed at 4k-131k tokens (0.68-0.93
of `dgx-h100-datasheet`'s price) over the layer's GEMMs as `h100-x1-measured` prices them from its microbenchmarks
(0.97-0.99), geometric mean of the ratio over the six sequence lengths (0.69-0.95, log spread 0.12;
`benchmarks.cp_attention.attention_over_matmul`, `benchmarks/data/h100-2026-11-27-cp/`)."""
ATTENTION_OVER_MATMUL: dict[tuple[str, str], tuple[float, float]] = {
    ("attention", "matmul/bf16"): (H100_ATTENTION_OVER_MATMUL, 0.12)}
"""`fit(ratios=...)` on H100 runs that state any SDPA kernel they ran other than soap's executor's (module
docstring, step 2): the unstated attention multiplier is then cuDNN's kernels' on Hopper, the kernels timed."""
MULTIPLIER_RANGE = (1e-2, 1e2)
ACTIVATION_MAX = 3.0
"""The slowest the activation collectives (TP, CP, EP) may be fitted against soap's collective model (itself fitted to
nccl-tests logs): every fit on runs that exercise them has found x0.49-1.5 (the published H100 corpus x0.49-0.58,
vTrain's A100 grid x0.97, soap's CPU runs x1.5). Without a bound a fit whose only collective-bound rows are one
model's took the rest of that model's gap there: the NeMo 8B rows alone (context parallel) put it at x25-29, and
Nemotron-4 15B's TP rows came out 53-86% slow."""
COMPILE_RANGE = (0.02, 10.0)
"""`costmodel.profiles_json`'s MIN_COMPILE_FACTOR, MAX_COMPILE_FACTOR."""
PART_NAMES = ("matmul", "attention", "memory-bound", "fp8-weight-casts", "kernel-launch", "host-floor", "intra-node",
              "inter-node", "activation", "other")


@dataclass
class Prepared:
    """One record planned as published: its plan, traced graph, cluster and simulated step parts."""

    record: RunRecord
    plan: Any
    graph: Any
    cluster: ClusterSpec
    parts: dict[str, float]

    @property
    def compiled(self) -> bool:
        return bool(self.plan.parallelism.compile)

    @property
    def precision(self) -> str:
        return self.plan.parallelism.precision


EPSILON = 0.01
"""The relative change of one term by which its marginal share of the step is measured."""


def _scale_classes(cluster: ClusterSpec, classes: Sequence[str], factor: float) -> ClusterSpec:
    factors = dict(cluster.device.kernel_factors)
    for cls in classes:
        for precision in PRECISION_KEYS:
            old = factors.get(f"{cls}/{precision}")
            points = old.points if old is not None else ((1.0, 1.0),)
            factors[f"{cls}/{precision}"] = FactorCurve(tuple((x, f * factor) for x, f in points))
    return replace(cluster, device=replace(cluster.device, kernel_factors=factors))


def _scale_link(cluster: ClusterSpec, which: str, factor: float) -> ClusterSpec:
    link = getattr(cluster, which)
    slower = replace(link, bandwidth=link.bandwidth / factor, latency_s=link.latency_s * factor)
    out = replace(cluster, **{which: slower})
    if which == "intra_node":
        out = replace(out, device=replace(out.device,
                                          collective_call_overhead_s=out.device.collective_call_overhead_s * factor))
    return out


def _scale_weight_casts(cluster: ClusterSpec, factor: float) -> ClusterSpec:
    """`cluster` with torchao's casts of the weights alone `factor` slower (`FP8_WEIGHT_CAST_CLASS` set to the
    `arithmetic/bf16` factor they read, scaled)."""
    from costmodel.opcost import FP8_WEIGHT_CAST_CLASS

    factors = dict(cluster.device.kernel_factors)
    shared = factors.get("arithmetic/bf16")
    points = shared.points if shared is not None else ((1.0, 1.0),)
    factors[f"{FP8_WEIGHT_CAST_CLASS}/bf16"] = FactorCurve(tuple((x, f * factor) for x, f in points))
    return replace(cluster, device=replace(cluster.device, kernel_factors=factors))


def _variants(cluster: ClusterSpec, factor: float) -> dict[str, ClusterSpec]:
    device = cluster.device
    return {
        "matmul": _scale_classes(cluster, ("matmul",), factor),
        "attention": _scale_classes(cluster, ("attention",), factor),
        "memory-bound": _scale_classes(cluster, MEMORY_BOUND_CLASSES, factor),
        "fp8-weight-casts": _scale_weight_casts(cluster, factor),
        "kernel-launch": replace(cluster, device=replace(device, kernel_overhead_s=device.kernel_overhead_s * factor)),
        "host-floor": replace(cluster, device=replace(device, host_dispatch_s=device.host_dispatch_s * factor)),
        "intra-node": _scale_link(cluster, "intra_node", factor),
        "inter-node": _scale_link(cluster, "inter_node", factor),
        "activation": replace(cluster, device=replace(
            device, activation_collective_factor=device.activation_collective_factor * factor)),
    }


def step_terms(plan: Any, graph: Any, cluster: ClusterSpec) -> tuple[dict[str, float], float]:
    """The simulated step of `plan` split into `PART_NAMES`: each term's marginal share (module docstring),
    `other` what no term scales."""
    from executor.validation.refit import simulate_on

    total = simulate_on(plan, graph, cluster).step_time_s
    p = plan.parallelism
    parts = {}
    for name, variant in _variants(cluster, 1 + EPSILON).items():
        if (name == "activation" and p.tp * p.cp * p.ep == 1) or (
                name == "fp8-weight-casts" and p.precision != "fp8"):
            parts[name] = 0.0
            continue
        parts[name] = max(0.0, (simulate_on(plan, graph, variant).step_time_s - total) / EPSILON)
    # the intra-node links carry the activation collectives too: count them once, as activation
    parts["intra-node"] = max(0.0, parts["intra-node"] - parts["activation"])
    # the weights' casts read the arithmetic factor too: count them once, as fp8-weight-casts
    parts["memory-bound"] = max(0.0, parts["memory-bound"] - parts["fp8-weight-casts"])
    named = sum(parts.values())
    if named > total:
        parts = {k: v * total / named for k, v in parts.items()}
    parts["other"] = max(0.0, total - named)
    return parts, total


def prepare(record: RunRecord, *, cluster: str | None = None, graphs: dict | None = None) -> Prepared:
    """Plan `record` as published on its cluster profile and split its simulated step."""
    from costmodel.profiles import load_cluster
    from executor.validation.refit import trace_plan_model
    from planner.api import plan_report

    name = record.cluster or cluster
    if name is None:
        raise SoapError(f"{record.name}: no cluster profile; give the record a `cluster` or pass --cluster")
    spec = load_cluster(name)
    try:
        report = plan_report(record.model_spec(), cluster=spec, mem_limit_gib=1e6, **record.pins())
    except SoapError as err:
        raise SoapError(f"{record.name}: {err}") from None
    from executor.validation.grid import as_run, graph_key

    plan = as_run(report.plan, record)
    graphs = {} if graphs is None else graphs
    key = graph_key(plan, spec)
    if key not in graphs:
        graphs[key] = trace_plan_model(plan, spec)
    graph = graphs[key]
    parts, _ = step_terms(plan, graph, spec)
    return Prepared(record=record, plan=plan, graph=graph, cluster=spec, parts=parts)


# --- the fit ---------------------------------------------------------------------------------------------

def part_parameters(prepared: Prepared) -> dict[str, tuple[str, ...]]:
    """For each part of a run, the names of the parameters that scale it (G in the module docstring)."""
    native = prepared.record.stack == TORCH_NATIVE
    stack = () if native else (f"stack:{prepared.record.stack}",)
    fused = () if native else (f"stack:{prepared.record.stack}/memory-bound",)
    memory = ("memory-bound", "compile") if prepared.compiled else ("memory-bound",)
    backend = prepared.record.sdpa_backend
    kernel = (f"attention/{backend}",) if backend else ()  # a stated SDPA kernel's rate over the unstated runs'
    # an fp8 run's GEMMs are bf16's scaled by fp8's own multiplier (module docstring, step 2)
    matmul = ("matmul/bf16", "matmul/fp8") if prepared.precision == "fp8" else (f"matmul/{prepared.precision}",)
    return {
        "matmul": (*matmul, *stack),
        "attention": ("attention", *kernel, *stack),
        "memory-bound": (*memory, *fused),
        "fp8-weight-casts": ("memory-bound", *fused),  # no compile factor (module docstring, step 1)
        "kernel-launch": ("kernel-launch",),
        "host-floor": ("host-floor",),
        "intra-node": ("intra-node",),
        "inter-node": ("inter-node",),
        "activation": ("activation",),
        "other": (),
    }


AT_PEAK = 5e-3
"""How close to its ceiling (in log multiplier) a product counts as on it (`Fit.at_peak`)."""
PEAK_WEIGHT = 1e3
"""The pull of a violated peak ceiling (`_peak_ceilings`) per unit of log multiplier: a 1% excursion costs 10^2, a
run 10x off ln(10)^2 = 5.3, so the fit ends on the ceiling, not past it (within 0.1% in a test)."""


def _peak_ceilings(prepared: Sequence[Prepared], names: Sequence[str],
                   free: Collection[str] | None) -> dict[tuple[str, ...], float]:
    """Per product of parameters that scales a run's matmul or attention part (its class and, for another stack,
    the stack's factor), the smallest value that keeps the part's fastest kernels no faster than the datasheet
    peak on the run's device (module docstring, step 2): the profile prices a kernel of F FLOPs at
    P x d x e(F) / k(F) (`costmodel.opcost`), so the product may not go below the largest e(x) x d / k(x) over the
    curves' points, times the share of the counted FLOPs the kernel runs (1/2 for causal attention: torch's
    counter counts the whole score matrix, a flash kernel skips the masked half). Matmul at the run's precision
    (fp8's `dtype_efficiency` under fp8), attention at bf16 under fp8. The largest such bound over the runs."""
    out: dict[tuple[str, ...], float] = {}
    for p in prepared:
        if getattr(p, "cluster", None) is None:
            continue
        device = p.cluster.device
        for part in ("matmul", "attention"):
            if p.parts.get(part, 0.0) <= 0:
                continue
            params = tuple(n for n in part_parameters(p)[part] if (free is None or n in free) and n in names)
            if not params:
                continue
            precision = "bf16" if part == "attention" and p.precision == "fp8" else p.precision
            work = 1.0
            if part == "attention" and any(op.attrs.get("causal") for op in getattr(p.graph, "ops", ())
                                           if op.kind.value == "attention"):
                work = 0.5
            factor = device.kernel_factors.get(f"{part}/{precision}")
            xs = [x for x, _ in device.matmul_efficiency.points] + ([x for x, _ in factor.points] if factor else [])
            fastest = max(device.matmul_efficiency.at(x) / (factor.at(x) if factor else 1.0) for x in xs)
            bound = fastest * device.dtype_efficiency.get(precision, 1.0) * work
            out[params] = max(out.get(params, 0.0), bound)
    return out


def _bounds(name: str) -> tuple[float, float]:
    if name == "activation":
        return MULTIPLIER_RANGE[0], ACTIVATION_MAX
    return COMPILE_RANGE if name == "compile" else MULTIPLIER_RANGE


def _link_floors(prepared: Sequence[Prepared]) -> dict[str, float]:
    """The smallest time multiplier a link may take: a link made faster than its line rate is no calibration.
    Its large-message time is bytes / (bandwidth x e), e the efficiency curve's top, so a multiplier below e
    would move more than the line rate; the floor is the largest such e over the runs' clusters."""
    floors = {}
    for part, level in (("intra-node", "intra_node"), ("inter-node", "inter_node")):
        tops = [max(e for _, e in getattr(p.cluster, level).efficiency.points) for p in prepared
                if getattr(p, "cluster", None) is not None]
        floors[part] = max(tops) if tops else 0.0
    return floors


@dataclass(frozen=True)
class Fit:
    """Fitted multipliers (1: the profile was right) and the runs each was fitted on."""

    multipliers: dict[str, float]
    runs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per parameter, the names of the runs with a part it scales."""
    at_peak: tuple[tuple[str, ...], ...] = ()
    """The products of parameters the fit left on their datasheet-peak ceiling (`_peak_ceilings`, within 0.5%):
    the runs asked for kernels faster than the device has, so the model misses something there."""
    measured: dict[str, float] = field(default_factory=dict)
    """The terms measured apart from any run (`MEASURED_PRIORS`) that no fitted run exercised, at their measured
    value: what a held-out run that does exercise one is predicted with."""

    def multiplier(self, name: str) -> float:
        """The fitted multiplier, else the measured one, else 1 (the profile as it was)."""
        return self.multipliers.get(name, self.measured.get(name, 1.0))

    def stack_factor(self, stack: str) -> float:
        return self.multiplier(f"stack:{stack}")

    def predict_linear(self, prepared: Prepared, *, stack: bool = True) -> float:
        total = 0.0
        for part, params in part_parameters(prepared).items():
            scale = np.prod([self.multiplier(p) for p in params if stack or not p.startswith("stack:")])
            total += prepared.parts.get(part, 0.0) * float(scale)
        return total


def fit(prepared: Sequence[Prepared], *, free: Collection[str] | None = None, prior_weight: float = PRIOR_WEIGHT,
        iterations: int = 200, robust: float | None = None,
        bounds: Mapping[str, tuple[float, float]] | None = None, peak_ceiling: bool = True,
        priors: Mapping[str, tuple[float, float]] | None = None,
        ratios: Mapping[tuple[str, str], tuple[float, float]] | None = None) -> Fit:
    """Least squares on log ratios with a weak prior (module docstring). `free`: fit only these parameters
    (the rest stay 1). `robust`: Cauchy's loss at that log ratio (module docstring); None: squares. `bounds`:
    narrower ranges for some parameters (e.g. a kernel class no faster than the datasheet peak), inside the
    default ones. `priors`: (value, log spread) of the multipliers measured apart from the runs (default
    `MEASURED_PRIORS`; {} pulls every one toward 1 with `prior_weight`). `ratios`: (value, log spread) of the ratio
    of two multipliers measured apart from the runs (e.g. `ATTENTION_OVER_MATMUL`), each a pull as strong as one
    run's; default none."""
    if not prepared:
        raise SoapError("no runs to fit")
    names: list[str] = []
    runs: dict[str, list[str]] = {}
    rows = []
    for p in prepared:
        terms = []
        for part, params in part_parameters(p).items():
            value = p.parts.get(part, 0.0)
            if value <= 0:
                continue
            params = tuple(n for n in params if free is None or n in free)
            for name in params:
                if name not in names:
                    names.append(name)
                runs.setdefault(name, []).append(p.record.name)
            terms.append((value, [names.index(n) for n in params]))
        rows.append(terms)
    n = len(names)
    target = np.log([p.record.measured_step_s for p in prepared])
    # dense form: F[i, j] = value of term j of run i; G[i, j, k] = 1 if parameter k scales it
    width = max(len(t) for t in rows)
    F = np.zeros((len(rows), width))
    G = np.zeros((len(rows), width, n))
    for i, terms in enumerate(rows):
        for j, (value, params) in enumerate(terms):
            F[i, j] = value
            G[i, j, params] = 1.0
    floors = _link_floors(prepared)
    ceilings = _peak_ceilings(prepared, names, free) if peak_ceiling else {}
    ceiling_rows = [(float(np.log(value)), [names.index(n) for n in params]) for params, value in ceilings.items()]
    bounds = bounds or {}
    low = np.log([max(_bounds(nm)[0], floors.get(nm, 0.0), bounds.get(nm, (0.0,))[0]) for nm in names])
    high = np.log([min(_bounds(nm)[1], bounds.get(nm, (0.0, np.inf))[1]) for nm in names])
    priors = MEASURED_PRIORS if priors is None else priors
    centre = np.array([np.log(priors[nm][0]) if nm in priors else 0.0 for nm in names])
    prior = np.array([RUN_LOG_SD / priors[nm][1] if nm in priors else np.sqrt(prior_weight) for nm in names])
    ratios = ratios or {}
    ratio_rows = [(names.index(a), names.index(b), float(np.log(value)), RUN_LOG_SD / sd)
                  for (a, b), (value, sd) in ratios.items() if a in names and b in names]
    ratio_jac = np.zeros((len(ratio_rows), n))
    for row, (a, b, _, weight) in enumerate(ratio_rows):
        ratio_jac[row, a], ratio_jac[row, b] = weight, -weight

    def residuals(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        weights = F * np.exp(G @ theta)
        predicted = weights.sum(axis=1)
        over = [PEAK_WEIGHT * min(0.0, float(theta[idx].sum()) - floor) for floor, idx in ceiling_rows]
        related = [weight * (theta[a] - theta[b] - value) for a, b, value, weight in ratio_rows]
        r = np.concatenate([np.log(np.maximum(predicted, 1e-300)) - target, prior * (theta - centre), related, over])
        return r, weights / np.maximum(predicted[:, None], 1e-300)

    def loss(r: np.ndarray) -> float:
        if robust is None:
            return float(r @ r)
        runs_loss = robust * robust * np.log1p((r[:len(rows)] / robust) ** 2).sum()
        return float(runs_loss + r[len(rows):] @ r[len(rows):])

    def reweight(r: np.ndarray) -> np.ndarray:
        """sqrt of Cauchy's IRLS weights (1 for the prior rows and without `robust`)."""
        w = np.ones_like(r)
        if robust is not None:
            w[:len(rows)] = 1.0 / np.sqrt(1.0 + (r[:len(rows)] / robust) ** 2)
        return w

    theta = np.clip(centre, low, high)
    r, share = residuals(theta)
    cost, damping = loss(r), 1e-3
    for _ in range(iterations):
        w = reweight(r)
        hinge = np.zeros((len(ceiling_rows), n))
        for row, (floor, idx) in enumerate(ceiling_rows):
            if theta[idx].sum() < floor:
                hinge[row, idx] = PEAK_WEIGHT
        jac = np.vstack([np.einsum("ij,ijk->ik", share, G), np.diag(prior), ratio_jac, hinge]) * w[:, None]
        step = np.linalg.solve(jac.T @ jac + damping * np.eye(n), -jac.T @ (w * r))
        trial = np.clip(theta + step, low, high)
        trial_r, trial_share = residuals(trial)
        trial_cost = loss(trial_r)
        if trial_cost < cost:
            theta, r, share, cost, damping = trial, trial_r, trial_share, trial_cost, damping / 3
            if np.abs(step).max() < 1e-10:
                break
        else:
            damping *= 10
            if damping > 1e12:
                break
    at_peak = tuple(params for (params, _), (floor, idx) in zip(ceilings.items(), ceiling_rows)
                    if theta[idx].sum() < floor + AT_PEAK)
    return Fit(multipliers={nm: float(np.exp(t)) for nm, t in zip(names, theta)},
               runs={nm: tuple(dict.fromkeys(r)) for nm, r in runs.items()}, at_peak=at_peak,
               measured={nm: value for nm, (value, _) in priors.items()
                         if nm not in names and (free is None or nm in free)})


# --- writing the fitted profile --------------------------------------------------------------------------

NAMED_RUNS = 4


def _runs_text(runs: Sequence[str]) -> str:
    shown = "; ".join(runs[:NAMED_RUNS])
    return f"{len(runs)} runs ({shown}{f'; and {len(runs) - NAMED_RUNS} more' if len(runs) > NAMED_RUNS else ''})"


HALF_PRECISIONS = ("bf16", "fp16")


def half_twin(multipliers: Mapping[str, float], device: Mapping[str, Any]) -> tuple[str, str] | None:
    """(fitted, twin): the GEMM multiplier fitted on one 16-bit type's runs, and the other's, which no run
    fitted, where the device's datasheet gives both the same peak (A100, H100, H200, B200: bf16 and fp16 run on the
    same tensor cores at one rate). The twin takes the fitted one's multiplier: left at 1, an fp16 plan on a profile
    fitted on bf16 runs was priced at the datasheet's efficiency, 0.52 s against 0.74 s measured on a lent H200
    (bf16's, 0.71 s priced, 0.72 s measured; benchmarks/techniques_h200.py). None otherwise (both or neither fitted,
    a device with one 16-bit type, as the V100's fp16)."""
    fitted = [p for p in HALF_PRECISIONS if f"matmul/{p}" in multipliers]
    peaks = {k: v.get("value") if isinstance(v, dict) else v for k, v in device.get("peak_tflops", {}).items()}
    if len(fitted) != 1 or not all(peaks.get(p) for p in HALF_PRECISIONS) or peaks["bf16"] != peaks["fp16"]:
        return None
    other = next(p for p in HALF_PRECISIONS if p != fitted[0])
    return f"matmul/{fitted[0]}", f"matmul/{other}"


def apply_fit(cluster_inline: dict, result: Fit, *, source: str, stack: str | None = None,
              sdpa_backend: str | None = None) -> dict:
    """A copy of an inline cluster profile with the fitted terms written in, each changed number's source
    naming its runs. `stack`: also fold that stack's factor into the compute classes, and `sdpa_backend` that
    attention kernel's multiplier into attention (to predict runs of that stack or kernel)."""
    out = copy.deepcopy(cluster_inline)
    device = out["device"]
    today = datetime.date.today().isoformat()
    m, runs = result.multipliers, result.runs

    def stamp(name: str) -> str:
        return f"refit by soap calibrate --from-runs ({source}, {today}) on {_runs_text(runs[name])}"

    def note(name: str) -> str:
        return f"x{m[name]:.3g} {stamp(name)}"

    native = not stack or stack == TORCH_NATIVE
    core = 1.0 if native else m.get(f"stack:{stack}", 1.0)
    fused = 1.0 if native else m.get(f"stack:{stack}/memory-bound", 1.0)
    backend = result.multiplier(f"attention/{sdpa_backend}") if sdpa_backend else 1.0
    kernel = device.get("kernel_factors", {"source": "", "factors": {}})
    factors = kernel.setdefault("factors", {})
    notes = []

    def set_class(cls: str, precision: str, value: float) -> None:
        key = f"{cls}/{precision}"
        points = factors.get(key) or [[1.0, 1.0]]
        factors[key] = [[x, float(f"{min(max(f * value, 1e-3), 1e3):.4g}")] for x, f in points]

    twin = half_twin(m, device)
    if twin:
        m = {**m, twin[1]: m[twin[0]]}
    for precision in PRECISION_KEYS:
        name = f"matmul/{precision}"
        tied = m.get("matmul/bf16", 1.0) if precision == "fp8" else 1.0  # fp8's multiplier is over bf16's
        if twin and name == twin[1]:
            set_class("matmul", precision, m[name] * tied * core)
            notes.append(f"{name} as {twin[0]} (x{m[name]:.3g}: the same tensor cores at the same datasheet peak; "
                         "no run of its own)")
            continue
        if name in m or core != 1.0 or tied != 1.0:
            set_class("matmul", precision, m.get(name, 1.0) * tied * core)
        if name in m:
            notes.append(f"{name} {note(name)}" + (f" over matmul/bf16's (x{m[name] * tied:.3g} in all)"
                                                   if precision == "fp8" else ""))
    for name, classes, scale in (("attention", ("attention",), core * backend),
                                 ("memory-bound", MEMORY_BOUND_CLASSES, fused)):
        if name in m or scale != 1.0:
            for cls in classes:
                for precision in PRECISION_KEYS:
                    set_class(cls, precision, m.get(name, 1.0) * scale)
        if name in m:
            notes.append(f"{', '.join(classes)} (every precision) {note(name)}")
    for name in m:
        if name.startswith("stack:"):
            folded = "folded in here" if not native and name.split(":")[1].split("/")[0] == stack else \
                "reported, not written: soap predicts its own torch-native executor"
            notes.append(f"{name} {note(name)} ({folded})")
        elif name.startswith("attention/"):
            folded = "folded in here" if name == f"attention/{sdpa_backend}" else \
                "reported, not written: soap prices the attention kernel its executor runs"
            notes.append(f"{name} {note(name)} over attention's ({folded})")
    measured = f"attention/{sdpa_backend}"
    if sdpa_backend and measured not in m and measured in result.measured:
        notes.append(f"{measured} x{result.measured[measured]:.3g} over attention's, measured apart from the runs "
                     "(MEASURED_PRIORS; folded in here)")
    if factors:
        kernel["source"] = "; ".join(notes) if notes else kernel.get("source", "")
        device["kernel_factors"] = kernel
    if "compile" in m:
        compile_table = device.setdefault("compile_factors", {"source": "", "factors": {}})
        table = compile_table.setdefault("factors", {})
        for cls in MEMORY_BOUND_CLASSES:
            for direction in ("fwd", "bwd"):
                old = table.get(f"{cls}/{direction}") or [[1.0, 1.0]]
                table[f"{cls}/{direction}"] = [[x, float(f"{min(max(f * m['compile'], COMPILE_RANGE[0]), COMPILE_RANGE[1]):.4g}")]
                                               for x, f in old]
        compile_table["source"] = f"memory-bound classes under torch.compile {note('compile')}"
    if "kernel-launch" in m:
        scale_entry(device["kernel_overhead_us"], m["kernel-launch"], stamp("kernel-launch"))
    if "host-floor" in m and "host_dispatch_us" in device:
        scale_entry(device["host_dispatch_us"], m["host-floor"], stamp("host-floor"))
    for part, link_name in (("intra-node", "intra_node"), ("inter-node", "inter_node")):
        if part in m and link_name in out["links"]:
            link = out["links"][link_name]
            scale_entry(link["bandwidth_gbps"], 1 / m[part], stamp(part))
            scale_entry(link["latency_us"], m[part], stamp(part))
    if "intra-node" in m and "collective_call_overhead_us" in device:
        scale_entry(device["collective_call_overhead_us"], m["intra-node"], stamp("intra-node"))
    if "activation" in m:
        ratio = m["activation"] / m.get("intra-node", 1.0)
        entry = device.setdefault("activation_collective_factor", {"value": 1.0, "source": "activation collectives"})
        scale_entry(entry, ratio, f"(activation x{m['activation']:.3g} over intra-node x{m.get('intra-node', 1.0):.3g}) "
                                  f"{stamp('activation')}")
    return out


# --- errors ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    name: str
    measured_tokens: float
    predicted_tokens: float
    measured_memory_gib: float | None
    predicted_memory_gib: float | None

    @property
    def error(self) -> float:
        return self.predicted_tokens / self.measured_tokens - 1


def fitted_cluster(prepared: Prepared, result: Fit, *, with_stack: bool = True) -> ClusterSpec:
    from costmodel.profiles import cluster_from_dict, cluster_to_dict

    stack = prepared.record.stack if with_stack else None
    return cluster_from_dict(apply_fit(cluster_to_dict(prepared.cluster), result, source="leave-one-out", stack=stack,
                                       sdpa_backend=prepared.record.sdpa_backend))


def predict(prepared: Prepared, result: Fit | None, *, with_stack: bool = True) -> Prediction:
    """Re-simulate the run on its cluster refitted by `result` (None: the profile as it is)."""
    from executor.validation.refit import simulate_on

    record = prepared.record
    cluster = prepared.cluster if result is None else fitted_cluster(prepared, result, with_stack=with_stack)
    sim = simulate_on(prepared.plan, prepared.graph, cluster)
    tokens = record.batch * record.seq / (sim.step_time_s * record.gpus)
    memory = max(m.at_peak.total for m in sim.memory) / 2**30
    return Prediction(name=record.name, measured_tokens=record.measured_tokens_per_s_per_gpu, predicted_tokens=tokens,
                      measured_memory_gib=record.memory_gib, predicted_memory_gib=memory)


GROUPINGS: dict[str, Callable[[RunRecord], str]] = {
    "run": lambda r: r.name,
    "model": lambda r: str(r.model if isinstance(r.model, str) else r.model.get("name", r.model)),
    "gpus": lambda r: str(r.gpus),
    "stack": lambda r: r.stack,
    "precision": lambda r: r.precision,  # fp8 rows predicted by a fit on their bf16 twins, and the other way
}


def leave_out(prepared: Sequence[Prepared], grouping: str, *,
              progress: Callable[[], None] | None = None, robust: float | None = None,
              key: Callable[[RunRecord], str] | None = None,
              ratios: Mapping[tuple[str, str], tuple[float, float]] | None = None) -> list[Prediction]:
    """Every run predicted by a fit on the runs outside its group (`GROUPINGS[grouping]`, or `key` where a
    caller groups its own way; `robust` and `ratios` as `fit`'s); runs in groups whose removal leaves nothing to
    fit are skipped."""
    key = key or GROUPINGS[grouping]
    out = []
    for group in dict.fromkeys(key(p.record) for p in prepared):
        held = [p for p in prepared if key(p.record) == group]
        rest = [p for p in prepared if key(p.record) != group]
        if not rest:
            continue
        result = fit(rest, robust=robust, ratios=ratios)
        for p in held:
            out.append(predict(p, result))
            if progress:
                progress()
    return out


def mape(predictions: Sequence[Prediction]) -> float:
    return 100 * float(np.mean([abs(p.error) for p in predictions])) if predictions else float("nan")


# --- soap calibrate --from-runs on outside records --------------------------------------------------------

@dataclass(frozen=True)
class ExternalRefit:
    """What `refit_external` fitted, wrote and measured."""

    fit: Fit
    prepared: tuple[Prepared, ...]
    before: tuple[Prediction, ...]
    """Every run on its profile as it was."""
    in_sample: tuple[Prediction, ...]
    leave_out: dict[str, tuple[Prediction, ...]]
    """Per grouping (`GROUPINGS`), every run predicted by a fit without its group."""
    profile: dict
    """The fitted target cluster profile, device inline."""
    written: tuple[Any, ...] = ()


@dataclass(frozen=True)
class GroupRank:
    """How well predictions rank the runs of one group (same model, cluster and GPU count): the plan soap would pick
    among them is the one it predicts fastest."""

    group: str
    runs: int
    spearman: float | None
    """Rank correlation of predicted and measured tokens/s (None under 3 runs or with ties only)."""
    pick_over_best: float
    """Measured tokens/s of the run predicted fastest over the best measured run of the group."""


def group_ranks(prepared: Sequence[Prepared], predictions: Sequence[Prediction]) -> list[GroupRank]:
    """Per group of two or more runs sharing model, cluster and GPU count: rank correlation and pick/best."""
    from executor.validation.grid import spearman

    by_name = {q.name: q for q in predictions}
    groups: dict[str, list[Prediction]] = {}
    for p in prepared:
        model = p.record.model if isinstance(p.record.model, str) else p.record.model.get("name", "model")
        key = f"{model} on {p.record.gpus} x {p.cluster.name}"
        if p.record.name in by_name:
            groups.setdefault(key, []).append(by_name[p.record.name])
    out = []
    for key, members in groups.items():
        if len(members) < 2:
            continue
        measured = [q.measured_tokens for q in members]
        predicted = [q.predicted_tokens for q in members]
        pick = members[int(np.argmax(predicted))].measured_tokens
        rho = spearman(predicted, measured) if len(members) >= 3 and len(set(predicted)) > 1 else None
        out.append(GroupRank(group=key, runs=len(members), spearman=rho,
                             pick_over_best=pick / max(measured)))
    return out


def split_path(spec: str) -> tuple[str, str | None]:
    """`FILE` or `FILE:CLUSTER` (the cluster profile for the file's records that name none)."""
    from pathlib import Path

    if Path(spec).exists() or ":" not in spec:
        return spec, None
    path, cluster = spec.rsplit(":", 1)
    return path, cluster or None


def load_records(specs: Sequence[str], *, cluster: str | None) -> list[RunRecord]:
    from executor.validation.run_records import read_records

    records: list[RunRecord] = []
    for spec in specs:
        path, file_cluster = split_path(spec)
        records.extend(read_records(path, cluster=file_cluster or cluster).records)
    names = [r.name for r in records]
    seen: dict[str, int] = {}
    unique = []
    for record in records:
        if names.count(record.name) > 1:  # fitted sources and error tables name runs: make twins tell apart
            seen[record.name] = seen.get(record.name, 0) + 1
            record = record.model_copy(update={"name": f"{record.name} (seq {record.seq}, #{seen[record.name]})"})
        unique.append(record)
    return unique


def refit_external(records: Sequence[RunRecord], *, target: str | None = None,
                   progress: Callable[[str], None] | None = None,
                   ratios: Mapping[tuple[str, str], tuple[float, float]] | None = None) -> ExternalRefit:
    """Plan every record, fit (with `ratios`, `fit`'s), and measure before / in-sample / leave-one-out (module
    docstring); the fitted profile is `target` (default: the cluster of the first torch-native record) refitted."""
    from costmodel.profiles import cluster_to_dict, load_cluster

    graphs: dict = {}
    prepared = []
    for record in records:
        prepared.append(prepare(record, graphs=graphs))
        if progress:
            progress(record.name)
    result = fit(prepared, ratios=ratios)
    groupings = {}
    for grouping in GROUPINGS:
        if len({GROUPINGS[grouping](p.record) for p in prepared}) > 1:
            groupings[grouping] = tuple(leave_out(prepared, grouping, ratios=ratios))
    name = target or next((p.cluster.name for p in prepared if p.record.stack == TORCH_NATIVE), prepared[0].cluster.name)
    source = f"{len(records)} run records"
    profile = apply_fit(cluster_to_dict(load_cluster(name)), result, source=source)
    return ExternalRefit(fit=result, prepared=tuple(prepared), before=tuple(predict(p, None) for p in prepared),
                         in_sample=tuple(predict(p, result) for p in prepared), leave_out=groupings, profile=profile)


def write_fitted(profile: dict, *, name: str, output: Any = None, device_name: str | None = None,
                 description: str | None = None) -> tuple[Any, ...]:
    """Write the fitted profile: one inline file at `output`, else device and cluster files in the user's profile folder
    as NAME (cluster) and `device_name` (default: the device's name with NAME's suffix). `description`: the cluster's
    (default: the base profile's, marked refitted)."""
    import json
    from pathlib import Path

    from costmodel.profiles import cluster_from_dict, user_profile_paths
    from tracer.files import write_atomic

    profile = copy.deepcopy(profile)
    base = profile["name"]
    profile["name"] = name
    device = profile["device"]
    suffix = name[len(base):] if name.startswith(base) else f"-{name}"
    device["name"] = device_name or f"{device['name']}{suffix}"
    profile["description"] = description or f"{profile.get('description', base)}; refitted by soap calibrate --from-runs"
    cluster_from_dict(profile)  # the loader's bounds hold for every fitted number
    if output is not None:
        targets = {Path(output): profile}
    else:
        device_path, cluster_path = user_profile_paths(device["name"], name)
        targets = {device_path: device, cluster_path: {**profile, "device": device["name"]}}
    for path, data in targets.items():
        write_atomic(path, json.dumps(data, indent=2) + "\n", what="profile")
    return tuple(targets)
