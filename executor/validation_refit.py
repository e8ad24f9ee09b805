"""The simulator's step split into the terms `costmodel.calibrate_runs` refits, for a plan that ran.

    K = T - T(kernel overhead 0)
    M = T - T(communication free: link bandwidth x1e9, latency 0)
    C = T - K - M

Each T is a full simulation of the plan (same graph, strategy and stages) on a modified profile, so the
split follows overlap and the pipeline schedule the way the simulator does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from costmodel.calibrate_runs import StepParts
from costmodel.profiles import ClusterSpec

FREE_LINK_SCALE = 1e9


def simulate_on(plan: Any, graph: Any, cluster: ClusterSpec) -> Any:
    """SimResult of `plan` (its strategy and stages) for `graph` on `cluster`."""
    from costmodel.simulator import simulate
    from planner.plan import stage_bounds

    return simulate(graph, plan.strategy(), cluster, stages=stage_bounds(plan, graph))


def step_parts(plan: Any, graph: Any, cluster: ClusterSpec, measured_s: float) -> StepParts:
    total = simulate_on(plan, graph, cluster).step_time_s
    no_overhead = simulate_on(plan, graph, replace(cluster, device=replace(cluster.device, kernel_overhead_s=0.0)))
    free = simulate_on(plan, graph, free_links(cluster))
    overhead = max(0.0, total - no_overhead.step_time_s)
    comm = max(0.0, total - free.step_time_s)
    return StepParts(compute_s=max(total - overhead - comm, 0.0), kernel_overhead_s=overhead,
                     communication_s=comm, measured_s=measured_s)


def free_links(cluster: ClusterSpec) -> ClusterSpec:
    def free(link: Any) -> Any:
        return replace(link, bandwidth=link.bandwidth * FREE_LINK_SCALE, latency_s=0.0)

    return replace(cluster, intra_node=free(cluster.intra_node), inter_node=free(cluster.inter_node))


def trace_plan_model(plan: Any) -> Any:
    """The OpGraph of the plan's model at its sequence length (rebuilt from the inline config)."""
    from transformers import AutoConfig

    import tracer

    fields = dict(plan.model.config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return tracer.trace(config, task=plan.model.task, seq_len=plan.seq_len)
