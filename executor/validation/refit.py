"""The simulator's step split into the terms `costmodel.calibration.runs` refits, for a plan that ran.

    K = T - T(kernel overhead 0)
    A = T - T(activation collectives free: `activation_collective_factor` 0)
    M = T - T(communication free: link bandwidth x1e9, latency 0, no per-call framework overhead) - A
    C = T - K - M - A

Each T is a full simulation of the plan (same graph, strategy and stages) on a modified profile, so the
split follows overlap and the pipeline schedule the way the simulator does.

Memory: the device's runtime workspace (`runtime_workspace_mib`) is refitted as the median, over the
runs whose peak memory was measured comparably (peak growth during the plan, or CUDA's allocated
peak), of measured minus predicted peak (context excluded, workspace not yet added), at least 0.
The device's `allocator_reserve_fraction` is refitted (`costmodel.calibration.runs.fit_allocator_reserve`)
from the records that report both `peak_memory_allocated_gib` and `peak_memory_reserved_gib` (CUDA runs
of `soap validate` and `soap execute`; they need no plan), its source naming the runs; without such
records the profile's fraction is kept as it was.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from costmodel.calibration.runs import Multipliers, StepParts
from costmodel.profiles import ClusterSpec
from tracer.errors import SoapError

FREE_LINK_SCALE = 1e9
COMPARABLE_MEMORY_SOURCES = ("peak RSS growth (VmHWM)", "cuda max_memory_allocated")
"""How `soap validate` (and `soap execute` on CUDA) measure peak memory; a whole process's peak RSS is not
comparable with the simulator's peak (it holds the interpreter and libraries)."""


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
    activation = 0.0
    if plan.parallelism.tp * plan.parallelism.cp * plan.parallelism.ep > 1:
        no_activation = simulate_on(plan, graph, replace(cluster, device=replace(cluster.device,
                                                                                 activation_collective_factor=0.0)))
        activation = min(comm, max(0.0, total - no_activation.step_time_s))
    return StepParts(compute_s=max(total - overhead - comm, 0.0), kernel_overhead_s=overhead,
                     communication_s=comm - activation, activation_communication_s=activation, measured_s=measured_s)


def free_links(cluster: ClusterSpec) -> ClusterSpec:
    def free(link: Any) -> Any:
        return replace(link, bandwidth=link.bandwidth * FREE_LINK_SCALE, latency_s=0.0)

    return replace(cluster, intra_node=free(cluster.intra_node), inter_node=free(cluster.inter_node),
                   device=replace(cluster.device, collective_call_overhead_s=0.0))


def trace_plan_model(plan: Any, cluster: ClusterSpec) -> Any:
    """The OpGraph of the plan's model at its sequence length (rebuilt from the inline config), traced in
    the precision regime the plan runs in on `cluster` (planner.regimes)."""
    from transformers import AutoConfig

    import tracer
    from planner.regimes import regime_dtype

    fields = dict(plan.model.config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    strategy = plan.strategy()
    return tracer.trace(config, task=plan.model.task, seq_len=plan.seq_len,
                        dtype=regime_dtype(strategy.dims, strategy.train, cluster.device), peft=plan.model.peft_spec())


@dataclass(frozen=True)
class Refit:
    """`soap calibrate --from-runs`: what was fitted and written."""

    multipliers: Multipliers
    workspace_bytes: int | None
    """The refitted runtime workspace (None: no run measured memory comparably)."""
    runs: int
    before_mape_pct: float
    """Step-time MAPE of the runs on the old profile (the fit set itself)."""
    after_mape_pct: float
    """The same with the fitted multipliers (linear model, before re-simulation)."""
    written: tuple[Path, ...]
    allocator_reserve_fraction: float | None = None
    """The device's allocator reserve after the refit (None: no run reported both peaks, none before)."""


def refit_cluster(records: Sequence[dict[str, Any]], cluster: ClusterSpec,
                  graphs: dict[str, Any] | None = None) -> tuple[Multipliers, dict, list[StepParts]]:
    """Fit the multipliers and the runtime workspace on `records` (runs-log records with their plan) and
    refit `cluster` by them."""
    from costmodel.calibration.runs import apply_multipliers, fit_multipliers
    from costmodel.profiles import cluster_to_dict
    from planner.plan import plan_from_dict
    from planner.regimes import regime_dtype

    graphs = {} if graphs is None else graphs
    usable = [r for r in records if isinstance(r.get("plan"), dict) and r.get("step_time_s", 0) > 0]
    if not usable:
        raise SoapError("the runs log has no run with its plan; run `soap validate` (or `soap execute`) to record some")
    parts, residuals = [], []
    for record in usable:
        plan = plan_from_dict(record["plan"], origin="runs log")
        strategy = plan.strategy()
        dtype = regime_dtype(strategy.dims, strategy.train, cluster.device)
        key = f"{plan.model.config_hash}/{plan.model.task}/{plan.seq_len}/{dtype}"
        if key not in graphs:
            graphs[key] = trace_plan_model(plan, cluster)
        parts.append(step_parts(plan, graphs[key], cluster, record["step_time_s"]))
        if record.get("peak_memory_source") in COMPARABLE_MEMORY_SOURCES and record.get("peak_memory_gib", 0) > 0:
            predicted = max(m.at_peak.total - m.at_peak.workspace for m in simulate_on(plan, graphs[key], cluster).memory)
            residuals.append(record["peak_memory_gib"] * 2**30 - predicted)
    multipliers = fit_multipliers(parts)
    source = f"refit by soap calibrate --from-runs on {len(parts)} runs"
    refitted = apply_multipliers(cluster_to_dict(cluster), multipliers, source=source)
    if residuals:
        workspace = max(0.0, statistics.median(residuals)) / 2**20
        refitted["device"]["runtime_workspace_mib"] = {
            "value": float(f"{workspace:.4g}"),
            "source": f"median measured minus predicted peak memory of {len(residuals)} runs, {source}, "
                      f"{datetime.date.today().isoformat()}"}
    reserve = allocator_reserve_entry(records)
    if reserve is not None:
        refitted["device"]["allocator_reserve_fraction"] = reserve
    return multipliers, refitted, parts


RESERVE_KEYS = ("peak_memory_allocated_gib", "peak_memory_reserved_gib")
NAMED_RUNS = 6
"""Runs named one by one in the reserve's source; more are counted."""


def allocator_reserve_entry(records: Sequence[dict[str, Any]]) -> dict | None:
    """The profile entry `{"value": f, "source": ...}` fitted from the records that report both allocator
    peaks, or None when none does."""
    from costmodel.calibration.runs import fit_allocator_reserve

    def positive(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0

    both = [r for r in records if all(positive(r.get(k)) for k in RESERVE_KEYS)]
    if not both:
        return None
    fraction = fit_allocator_reserve([(r["peak_memory_allocated_gib"], r["peak_memory_reserved_gib"],
                                       loss_transient_gib(r.get("plan"))) for r in both])
    names = [str(r.get("name") or r.get("time") or "unnamed") for r in both]
    shown = ", ".join(names[:NAMED_RUNS]) + (f" and {len(names) - NAMED_RUNS} more" if len(names) > NAMED_RUNS else "")
    return {"value": float(f"{fraction:.4g}"),
            "source": f"median (max_memory_reserved - max_memory_allocated - the loss's fp32 transient) / "
                      f"max_memory_allocated of {len(both)} runs ({shown}), refit by soap calibrate --from-runs, "
                      f"{datetime.date.today().isoformat()}"}


def loss_transient_gib(plan: dict[str, Any] | None) -> float:
    """The loss's largest fp32 transient of a logged plan's micro-batch on one rank
    (`costmodel.memory_activations.logits_transient_bytes`), 0 without a plan or a vocabulary."""
    from costmodel.memory_activations import logits_transient_bytes
    from costmodel.strategy import shards_vocabulary

    try:
        p, config = plan["parallelism"], plan["model"]["config"]
        tokens, vocab = p["micro_batch"] * plan["seq_len"] // p.get("cp", 1), int(config["vocab_size"])
    except (KeyError, TypeError):
        return 0.0
    tp = p.get("tp", 1)
    if shards_vocabulary(tp=tp, pp=p.get("pp", 1)):
        vocab = -(-vocab // tp)
    return logits_transient_bytes(tokens, vocab, p.get("cross_entropy", "upcast")) / 2**30


def refit_profile(log: str | None, cluster_name: str, output: str | None) -> Refit:
    """Read the runs log, refit `cluster_name`'s profile and write it (to `output`, else the user's profile
    folder, `costmodel.profiles.user_profiles_dir`)."""
    import json

    from costmodel.profiles import load_cluster, user_profile_paths
    from executor.runs_log import read_runs
    from executor.validation.metrics import mape
    from tracer.files import write_atomic

    cluster = load_cluster(cluster_name)
    multipliers, refitted, parts = refit_cluster(read_runs(log), cluster)
    measured = [p.measured_s for p in parts]
    if output:
        targets = {Path(output): refitted}
    else:
        device = refitted["device"]
        device_path, cluster_path = user_profile_paths(device["name"], refitted["name"])
        targets = {device_path: device, cluster_path: {**refitted, "device": device["name"]}}
    for path, data in targets.items():
        write_atomic(path, json.dumps(data, indent=2) + "\n", what="profile")
    workspace = refitted["device"].get("runtime_workspace_mib", {}).get("value")
    return Refit(multipliers=multipliers, workspace_bytes=None if workspace is None else int(workspace * 2**20),
                 allocator_reserve_fraction=refitted["device"].get("allocator_reserve_fraction", {}).get("value"),
                 runs=len(parts),
                 before_mape_pct=mape([sum(p.features) for p in parts], measured),
                 after_mape_pct=mape([multipliers.predict(p) for p in parts], measured),
                 written=tuple(targets))
