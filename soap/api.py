"""The public Python API: a façade over the tracer, planner and executor.

    import soap
    graph = soap.trace("llama-3-8b", seq_len=4096)
    plan = soap.plan("llama-3-8b", gpus=64, cluster="dgx-h100", tp=8)
    plan.save("plan.json")
    # inside an initialized process group (torchrun):
    parallel = soap.parallelize(model, plan)

Each function imports its subsystem lazily so `import soap` is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.plan import Plan
    from tracer.ir import OpGraph


def trace(model: Any, **kwargs: Any) -> OpGraph:
    """Trace `model` (preset name, config path, Hub id, PretrainedConfig or nn.Module) into an OpGraph."""
    import tracer

    return tracer.trace(model, **kwargs)


def plan(model: Any, *, gpus: int, cluster: str = "dgx-h100", **pins: Any) -> Plan:
    """Search for the fastest plan that fits; keyword pins (tp=, pp=, dp=, zero=, ...) fix dimensions."""
    from planner.api import plan as _plan

    return _plan(model, gpus=gpus, cluster=cluster, **pins)


def parallelize(model: Any, plan: Plan | str, **kwargs: Any) -> Any:
    """Apply `plan` to `model` inside an initialized process group; returns an `executor.api.ParallelModel`.

    Its `.model` (pp == 1) or `.parts` (this rank's pipeline stages) are the modules to train; for
    pp > 1, step `.schedule` (torch.distributed.pipelining) instead of calling the model. A model
    whose embeddings are tied to its LM head and whose pipeline puts them on different stages needs
    `.sum_tied_gradients()` between the backward (or `schedule.step`) and `optimizer.step()`; it is a
    no-op otherwise, so a training loop can always call it.
    """
    from executor.api import parallelize as _parallelize
    from planner.plan import load_plan

    if isinstance(plan, str):
        plan = load_plan(plan)
    return _parallelize(model, plan, **kwargs)


def tune(model: Any, **kwargs: Any) -> dict[str, Any]:
    """Try the best few plans on this cluster, refit the profile from them, re-plan, and return the report
    (`soap tune --json`'s object); `soap.tuning.tune` documents the arguments and the method."""
    from soap.tuning import tune as _tune

    return _tune(model, **kwargs)
