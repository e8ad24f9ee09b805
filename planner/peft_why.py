"""Why PEFT changes the plan: the sentence `soap plan --peft` adds to its "why".

With adapters the trainable parameters are the adapters' (`graph.params_trainable`, counted on the
model traced with them, tracer/peft.py), so the gradients and optimizer state are the adapters' only and
the frozen base weights are held once, in the run's compute dtype (or 4-bit under QLoRA). The sentence
names the trainable share and compares with full fine-tuning of the same model on the same GPUs: its
memory floor (`planner.feasibility.memory_floor`: the least per-GPU memory over every mesh's most
frugal configuration, on the model traced without adapters and estimated by the same `Estimator`)
either exceeds the limit (full fine-tuning does not fit, PEFT does) or not.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from planner.api import PlanRequest
from planner.estimate import Estimator
from planner.feasibility import memory_floor
from planner.regimes import RegimeEstimator
from planner.units import model_units
from tracer.ir import OpGraph

GIB = 2**30


def full_training_floor(request: PlanRequest, task: str | None) -> float | None:
    """Bytes per GPU of full fine-tuning's most frugal plan on the request's GPUs (None: no mesh)."""
    ref = replace(request.model, peft=None)
    space = replace(request.space, peft=None)
    trace = partial(ref.trace, task=task, seq_len=space.seq_len)
    graph = trace()
    estimator = RegimeEstimator(graph, Estimator(graph, request.cluster, model_units(graph)), trace)
    floor = memory_floor(space, estimator)
    return None if floor is None else floor.total


def peft_sentence(request: PlanRequest, graph: OpGraph, *, task: str | None) -> str:
    """One line: the trainable share, and whether full fine-tuning would fit where this plan does."""
    spec = request.model.peft
    assert spec is not None
    share = graph.params_trainable / max(graph.params_total, 1)
    limit = request.memory_limit
    floor = full_training_floor(request, task)
    gpus = request.space.gpus
    head = (f"PEFT {spec.describe()} trains "
            f"{graph.params_trainable / 1e6:,.1f}M parameters ({share:.2%} of {graph.params_total / 1e9:.2f}B): the "
            "frozen base weights keep no gradients or optimizer state")
    if floor is None:
        return head + "."
    if floor > limit:
        return (head + f", so it fits in {limit / GIB:.0f} GiB per GPU on {gpus} GPUs where full fine-tuning does not "
                f"(its most frugal plan needs {floor / GIB:.1f} GiB per GPU).")
    return head + f"; full fine-tuning would fit too (its most frugal plan needs {floor / GIB:.1f} GiB per GPU)."
