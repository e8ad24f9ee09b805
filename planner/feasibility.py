"""Why nothing fits: the smallest GPU count (or memory per GPU) that would, the term that dominates, and
the cheapest single-flag fix.

For a GPU count N, the most memory-frugal configuration of each mesh (micro-batch 1, full recompute,
model state offloaded when allowed: fp32 master weights, gradients and optimizer state on the host) gives the least memory any plan of that mesh can use; the
minimum over meshes is N's floor (`memory_floor`). The error reports:
- the smallest N, doubling from the request, whose floor fits the limit (`minimum_gpus`);
- the request's own floor, as the memory per GPU it would need;
- the largest per-GPU memory term of that same floor plan (weights, gradients, optimizer state left on
  the device, activations, or framework overhead), so the term is always part of the total named;
- the cheapest fix (`cheapest_fix`): of the one-pin changes a user can make on the command line
  (`pin_changes`: a higher --zero, --optimizer adamw8bit, a stronger --recompute, a smaller
  --micro-batch, a larger --tp / --cp / --pp, a smaller --dp, a 16-bit --precision), each never the
  setting already in force, the one whose fastest fitting configuration has the least estimated step
  time, i.e. the fix that keeps the most throughput; none when no single change fits.

Pins that leave no configuration at all (each allowed alone) are named together, with the rule that refuses
every mesh where one does (`_pin_reason`: a pinned schedule's stages against the layers or micro-batches, a pinned
optimizer the meshes cannot step) and the pin whose removal frees a configuration (`_unblocking`).

When plans fit by estimate but none fits in simulation (`simulated_infeasible_error`), the term is the
simulated one of the most frugal plan simulated, and a fix counts only when its fastest candidate,
found under the limit scaled by that plan's estimated-to-simulated memory ratio, fits in simulation too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from costmodel.memory import MEMORY_TERMS, MemoryBreakdown
from costmodel.plan_rules import PLAIN_TENSOR_OPTIMIZERS, optimizer_violation
from costmodel.strategy import RECOMPUTE
from planner.estimate import Estimator
from planner.search import Candidate, Priced, enumerate_candidates
from planner.space import (
    Pins, SpaceRequest, divisors, frugal_configs, half_precision, mesh_choices, mesh_refusal,
    micro_batching, offload_choices, recompute_choices, schedule_refusal, training_heads, unpinned_ranks,
    validate_pins,
)
from tracer.errors import SoapError

GIB = 2**30
MAX_GPUS = 1 << 20
"""Give up doubling past a million GPUs."""

_PART_NAMES = {"weights": "weights", "grads": "gradients", "optimizer": "optimizer state",
               "activations": "activations", "buffers": "communication buffers and gathered parameters",
               "workspace": "framework context and workspace"}
DEVICE_TERMS = tuple(t for t in MEMORY_TERMS if t != "host")
MAX_FIX_SIMULATIONS = 3
"""Candidate fixes simulated at most, cheapest estimate first, before the simulated error gives up on one."""


def memory_floor(req: SpaceRequest, estimator: Estimator) -> MemoryBreakdown | None:
    """The least per-GPU memory over the request's meshes, or None when the pins leave no mesh."""
    best: MemoryBreakdown | None = None
    for mesh in mesh_choices(req):
        for train in frugal_configs(req, mesh):
            parts = estimator.estimate(mesh, train).memory
            if best is None or parts.total < best.total:
                best = parts
    return best


def minimum_gpus(req: SpaceRequest, estimator: Estimator, limit: float) -> int | None:
    gpus = req.gpus * 2
    while gpus <= MAX_GPUS:
        batch = -(-max(req.global_batch, gpus) // gpus) * gpus
        floor = memory_floor(replace(req, gpus=gpus, global_batch=batch, pins=replace(req.pins, dp=None)), estimator)
        if floor is not None and floor.total <= limit:
            return gpus
        gpus *= 2
    return None


def _human(nbytes: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", GIB), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"


def dominant_term(memory: MemoryBreakdown) -> str:
    """The largest device term (host memory is not on the device); the name breaks ties."""
    return max(DEVICE_TERMS, key=lambda k: (getattr(memory, k), k))


@dataclass(frozen=True)
class Fix:
    flag: str
    """The command-line change, e.g. `--recompute full`."""
    candidate: Candidate
    """The fastest configuration that fits with it, by estimate."""


def pin_changes(req: SpaceRequest) -> list[tuple[str, Pins]]:
    """One-pin changes that save memory, as (flag, new pins); only flags `soap plan` takes, never the
    value already pinned. Unpinned dimensions are searched already, so only pinned ones change (and
    the optimizer, which defaults to adamw)."""
    p, n = req.pins, req.gpus
    out: list[tuple[str, Pins]] = []
    if p.zero is not None:
        out += [(f"--zero {z}", replace(p, zero=z)) for z in range(p.zero + 1, 4)]
    if p.optimizer == "adamw":
        out.append(("--optimizer adamw8bit", replace(p, optimizer="adamw8bit")))
    elif p.optimizer in PLAIN_TENSOR_OPTIMIZERS:  # they give up FSDP and TP (costmodel.plan_rules.optimizer_violation)
        out.append(("--optimizer adamw", replace(p, optimizer="adamw")))
    if p.recompute is not None:
        out += [(f"--recompute {r}", replace(p, recompute=r)) for r in RECOMPUTE[RECOMPUTE.index(p.recompute) + 1:]]
    if p.micro_batch is not None:
        out += [(f"--micro-batch {m}", replace(p, micro_batch=m)) for m in divisors(p.micro_batch) if m < p.micro_batch]
    for name in ("tp", "cp", "pp"):
        value = getattr(p, name)
        if value is not None:
            out += [(f"--{name} {d}", replace(p, **{name: d})) for d in divisors(n) if d > value and d % value == 0]
    if p.dp is not None:
        out += [(f"--dp {d}", replace(p, dp=d)) for d in divisors(p.dp) if d < p.dp]
    if p.precision in ("fp32", "tf32") and half_precision(req) != "fp32":
        out.append((f"--precision {half_precision(req)}", replace(p, precision=half_precision(req))))
    return out


def fixes(req: SpaceRequest, estimator: Estimator, limit: float) -> list[Fix]:
    """Every one-pin change under which some configuration fits `limit` by estimate, fastest first."""
    found = []
    for flag, pins in pin_changes(req):
        changed = replace(req, pins=pins)
        try:
            validate_pins(changed)
        except SoapError:
            continue
        candidates, _ = enumerate_candidates(changed, estimator, limit, keep_meshes=1, keep_top=1)
        if candidates:
            found.append(Fix(flag, candidates[0]))
    return sorted(found, key=lambda f: (f.candidate.estimate.step_time_s, f.flag))


def cheapest_fix(req: SpaceRequest, estimator: Estimator, limit: float) -> Fix | None:
    return next(iter(fixes(req, estimator, limit)), None)


def _frugal(req: SpaceRequest) -> str:
    """How the floor plan saves memory, pins named as such."""
    mb = f"micro-batch {req.pins.micro_batch} (pinned)" if req.pins.micro_batch else "smallest micro-batch"
    recompute = recompute_choices(req)[-1]
    policy = ("no recompute" if recompute == "none" else f"{recompute} recompute") + (" (pinned)" if req.pins.recompute else "")
    offloaded = offload_choices(req, None if req.pins.optimizer == "auto" else req.pins.optimizer)[-1]
    state = "master weights, gradients and optimizer state offloaded" if offloaded else "model state on the GPU"
    return f"{mb}, {policy}, {state}"


def _pinned(req: SpaceRequest) -> bool:
    return any(getattr(req.pins, k) is not None for k in ("tp", "pp", "dp", "cp", "zero", "micro_batch", "recompute"))


def _remedy(fix: str | None, req: SpaceRequest, gpus: int | None = None) -> str:
    more = f"add GPUs (at least {gpus} by estimate)" if gpus else "add GPUs"
    if fix:
        return f"cheapest fix: {fix}; else {more} or use a larger --mem-limit"
    return f"{more} or use a larger --mem-limit" + (", or unpin dimensions" if _pinned(req) else "")


PIN_FLAGS = ("tp", "pp", "dp", "cp", "ep", "zero", "micro_batch", "grad_accum", "schedule", "virtual_stages",
             "recompute", "offload", "compile")
"""The pins an infeasibility message may name, as `soap plan` spells them (`--micro-batch`, ...)."""


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _pin_text(req: SpaceRequest) -> str:
    pinned = [(n, getattr(req.pins, n)) for n in PIN_FLAGS if getattr(req.pins, n) is not None]
    return "(" + ", ".join(f"{_flag(n)} {v}" for n, v in pinned) + ")" if pinned else "(none)"


def _any_configuration(req: SpaceRequest) -> bool:
    return any(training_heads(req, mesh) for mesh in mesh_choices(req))


def _pin_reason(req: SpaceRequest) -> str | None:
    """Why the pins leave no configuration, where one rule refuses every mesh: a model, cluster or PEFT rule every
    mesh the pinned degrees allow breaks (`planner.space.mesh_refusal`), the pinned schedule on every
    micro-batching (`planner.space.schedule_refusal`), or the pinned optimizer on every mesh
    (`costmodel.plan_rules.optimizer_violation`); the reason on the plainest mesh (the fewest unpinned ranks in tp,
    cp and ep), which the pins alone decide most. None where no one rule does."""
    refused = mesh_refusal(req)
    if refused:
        return refused
    schedule, optimizer = [], []
    for mesh in sorted(mesh_choices(req), key=lambda m: unpinned_ranks(req.pins, m.dims, ("tp", "cp", "ep"))):
        d = mesh.dims
        schedule += [schedule_refusal(req, pp=d.pp, num_microbatches=count, grad_accum=accum, zero=mesh.zero)
                     for _, count, accum in micro_batching(req, dp=d.dp, pp=d.pp)]
        if req.pins.optimizer != "auto":
            optimizer.append(optimizer_violation(req.pins.optimizer, tp=d.tp, dp=d.dp, cp=d.cp, pp=d.pp,
                                                 zero=mesh.zero))
    for reasons in (schedule, optimizer):
        if reasons and all(reasons):
            return reasons[0]
    return None


def _unblocking(req: SpaceRequest) -> str:
    """Which single pin, dropped, leaves configurations: what to unpin."""
    freeing = [n for n in PIN_FLAGS if getattr(req.pins, n) is not None
               and _any_configuration(replace(req, pins=replace(req.pins, **{n: None})))]
    if freeing:
        return "unpin " + " or ".join(_flag(n) for n in freeing)
    if _any_configuration(replace(req, pins=Pins(precision=req.pins.precision, optimizer=req.pins.optimizer,
                                                            cross_entropy=req.pins.cross_entropy))):
        return "unpin two or more of them"
    return (f"no layout of {req.gpus} GPUs splits this model at global batch {req.global_batch} even unpinned "
            "(the batch, heads, layers and sequence must divide); use another --gpus or --global-batch")


def infeasible_error(model: str, req: SpaceRequest, estimator: Estimator, limit: float) -> SoapError:
    """The SoapError for a request with no plan that fits."""
    where = f"{req.gpus} x {limit / GIB:g} GiB"
    floor = memory_floor(req, estimator)
    if floor is None:
        reason = _pin_reason(req)
        return SoapError(f"no configuration of {model} on {req.gpus} GPUs satisfies the pins "
                         f"{_pin_text(req)} together{f' ({reason})' if reason else ''}; {_unblocking(req)}")
    term = dominant_term(floor)
    need = f"{floor.total / GIB:.1f} GiB per GPU"
    more = minimum_gpus(req, estimator, limit)
    gpus = f"at least {more} GPUs, or {need}" if more else need
    on = "1 GPU" if req.gpus == 1 else f"{req.gpus} GPUs"
    fix = cheapest_fix(req, estimator, limit)
    found = f"{fix.flag} (fits by estimate, {fix.candidate.estimate.step_time_s:.3g} s per step)" if fix else None
    return SoapError(
        f"{model} does not fit on {where}: needs {gpus} (the most frugal plan on {on}: {_frugal(req)}; "
        f"its {_PART_NAMES.get(term, term)} {_human(getattr(floor, term))} per GPU dominates); {_remedy(found, req)}"
    )


def simulated_infeasible_error(model: str, req: SpaceRequest, estimator: Estimator, limit: float,
                               rejected: tuple[Priced, ...], price: Callable[[Candidate], Priced]) -> SoapError:
    """The SoapError when plans fit by estimate but none of those simulated fits (`rejected`, not empty);
    `price` simulates a candidate and says whether it fits (`planner.pricing.Pricer`)."""
    from planner.report import describe

    closest = min(rejected, key=lambda p: (p.peak_memory_bytes, p.candidate.key))
    worst = max(closest.result.memory, key=lambda m: (m.peak_bytes, -m.rank)).at_peak
    term = dominant_term(worst)
    # the estimator under-counts this plan's memory by this ratio: hold fixes' estimates to the scaled limit
    scaled = limit * min(1.0, closest.candidate.estimate.memory_bytes / closest.peak_memory_bytes)
    found = None
    for fix in fixes(req, estimator, scaled)[:MAX_FIX_SIMULATIONS]:
        priced = price(fix.candidate)
        if priced.fits:
            found = (f"{fix.flag} (simulated {priced.peak_memory_bytes / GIB:.1f} GiB per GPU, "
                     f"{priced.step_time_s:.3g} s per step)")
            break
    more = minimum_gpus(req, estimator, scaled)
    return SoapError(
        f"{model} does not fit on {req.gpus} x {limit / GIB:g} GiB: the most frugal plan simulated "
        f"({describe(closest)}) needs {closest.peak_memory_bytes / GIB:.1f} GiB per GPU; "
        f"its {_PART_NAMES.get(term, term)} {_human(getattr(worst, term))} per GPU dominates; {_remedy(found, req, more)}"
    )
