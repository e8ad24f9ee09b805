"""Why nothing fits: the smallest GPU count (or memory per GPU) that would, and the term that dominates.

For a GPU count N, the most memory-frugal configuration of each mesh (micro-batch 1, full recompute,
model state offloaded when allowed: fp32 master weights, gradients and optimizer state on the host) gives the least memory any plan of that mesh can use; the
minimum over meshes is N's floor (`memory_floor`). The error reports:
- the smallest N, doubling from the request, whose floor fits the limit (`minimum_gpus`);
- the request's own floor, as the memory per GPU it would need;
- the largest per-GPU memory term of that same floor plan (weights, gradients, optimizer state left on
  the device, activations, or framework overhead), so the term is always part of the total named.
"""

from __future__ import annotations

from dataclasses import replace

from costmodel.memory import MemoryBreakdown
from planner.estimate import Estimator
from planner.space import SpaceRequest, mesh_choices, recompute_choices, training_config, training_heads
from tracer.errors import SoapError

GIB = 2**30
MAX_GPUS = 1 << 20
"""Give up doubling past a million GPUs."""

_PART_NAMES = {"weights": "weights", "grads": "gradients", "optimizer": "optimizer state",
               "activations": "activations", "buffers": "communication buffers and gathered parameters",
               "workspace": "framework context and workspace"}


def memory_floor(req: SpaceRequest, estimator: Estimator) -> MemoryBreakdown | None:
    """The least per-GPU memory over the request's meshes, or None when the pins leave no mesh."""
    best: MemoryBreakdown | None = None
    recompute = recompute_choices(req)[-1]
    for mesh in mesh_choices(req):
        heads = training_heads(req, mesh)
        smallest = min((h.micro_batch for h in heads), default=None)
        for head in heads:
            if head.micro_batch != smallest:
                continue
            parts = estimator.estimate(mesh, training_config(req, mesh, head, recompute=recompute, offload=True)).memory
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


def infeasible_error(model: str, req: SpaceRequest, estimator: Estimator, limit: float) -> SoapError:
    """The SoapError for a request with no plan that fits."""
    where = f"{req.gpus} x {limit / GIB:g} GiB"
    floor = memory_floor(req, estimator)
    if floor is None:
        return SoapError(f"no configuration of {model} on {req.gpus} GPUs satisfies the pins; unpin a dimension")
    parts = {"weights": floor.weights, "grads": floor.grads, "optimizer": floor.optimizer,
             "activations": floor.activations, "buffers": floor.buffers, "workspace": floor.workspace}
    term = max(parts, key=lambda k: (parts[k], k))
    need = f"{floor.total / GIB:.1f} GiB per GPU"
    more = minimum_gpus(req, estimator, limit)
    gpus = f"at least {more} GPUs, or {need}" if more else need
    on = "1 GPU" if req.gpus == 1 else f"{req.gpus} GPUs"
    frugal = (f"smallest micro-batch, {recompute_choices(req)[-1]} recompute, "
              "master weights, gradients and optimizer state offloaded")
    hint = "add GPUs or use a larger --mem-limit"
    if _optimizer(req) == "adamw" and term == "optimizer":
        hint += ", --optimizer adamw8bit"
    if any(getattr(req.pins, k) is not None for k in ("tp", "pp", "dp", "cp", "zero", "micro_batch", "recompute")):
        hint += ", or unpin dimensions"
    return SoapError(
        f"{model} does not fit on {where}: needs {gpus} (the most frugal plan on {on}: {frugal}; "
        f"its {_PART_NAMES[term]} {_human(parts[term])} per GPU dominates); {hint}"
    )


def _optimizer(req: SpaceRequest) -> str:
    return "adamw" if req.pins.optimizer == "auto" else req.pins.optimizer
