"""`plan(MODEL, gpus=N, ...)`: the planner's entry point (re-exported as `soap.plan`).

Steps: resolve the model and cluster, fill the defaults, validate the pins (before any tracing, so a
bad request fails fast), trace, enumerate and estimate the search space (`planner.search`), price
the survivors by simulation (`planner.pricing`), pick the fastest plan that fits, and build its
`Plan` with alternatives, baselines and the "why".

Defaults:
- sequence length: min(the model's maximum positions, 4096) (4096 when the config names none);
- global batch: about 4M tokens per step, i.e. 2^22 / seq samples, rounded up to a multiple of
  the GPU count (so every data-parallel degree divides it, and every GPU gets at least one sample).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from costmodel.allocator import MemoryLimit, planning_limit
from costmodel.profiles import ClusterSpec, load_cluster
from planner.model_ref import ModelRef, model_ref
from planner.plan import Plan
from planner.report import PlanReport
from planner.space import Pins, SpaceRequest, validate_pins
from tracer.errors import SoapError
from tracer.ir import OpGraph
from tracer.peft import PeftSpec

GIB = 2**30
DEFAULT_MAX_SEQ_LEN = 4096
TOKENS_PER_STEP = 1 << 22
PIN_NAMES = ("tp", "pp", "dp", "cp", "zero", "micro_batch", "grad_accum", "recompute", "schedule", "precision",
             "optimizer", "ep", "virtual_stages", "offload", "compile", "cross_entropy")
SWITCH_PINS = ("offload", "compile")
"""Pins that are on or off: True/False, or the CLI's "on"/"off"."""


def _switch(name: str, value: Any) -> Any:
    """"on"/"off" as True/False for a switch pin; anything else is left for `Pins` to judge."""
    if name in SWITCH_PINS and isinstance(value, str) and value.lower() in ("on", "off"):
        return value.lower() == "on"
    return value


def default_seq_len(config: Any, task: str) -> int:
    from tracer.inputs import POSITION_KEYS, default_seq_len as traced_default

    if task == "image-cls":
        return traced_default(config, task)
    for key in POSITION_KEYS:
        value = getattr(config, key, None) if config is not None else None
        if isinstance(value, int) and value > 0:
            return min(value, DEFAULT_MAX_SEQ_LEN)
    return DEFAULT_MAX_SEQ_LEN


def default_global_batch(gpus: int, seq_len: int) -> int:
    samples = max(1, TOKENS_PER_STEP // seq_len)
    return -(-samples // gpus) * gpus


def request_seq_len(ref: ModelRef, *, seq_len: int | None, task: str | None) -> int | None:
    """The planned sequence length: the pinned one, else the model's default (validated by `make_request`)."""
    return seq_len if seq_len is not None else default_seq_len(ref.config, task or (ref.spec and ref.spec.task))


@dataclass(frozen=True)
class PlanRequest:
    """Everything a search depends on, after defaults are filled in."""

    model: ModelRef
    cluster: ClusterSpec
    space: SpaceRequest
    memory_limit: float
    """Usable bytes per GPU."""
    limit: MemoryLimit | None = None
    """How `memory_limit` was set (`costmodel.allocator`): the margin kept for the caching allocator."""

    @property
    def model_name(self) -> str:
        return self.model.name


def resolve_cluster(cluster: str | ClusterSpec, gpus_per_node: int | None) -> ClusterSpec:
    spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)
    if gpus_per_node is not None:
        if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise SoapError(f"--gpus-per-node={gpus_per_node!r} must be a positive integer")
        spec = replace(spec, gpus_per_node=gpus_per_node)
    return spec


def make_request(
    model: Any, *, gpus: int, cluster: str | ClusterSpec = "dgx-h100", gpus_per_node: int | None = None,
    task: str | None = None, global_batch: int | None = None, seq_len: int | None = None,
    mem_limit_gib: float | None = None, graph: OpGraph | None = None, trust_remote_code: bool = False,
    peft: Any = None, **pins: Any,
) -> PlanRequest:
    """Resolve, default and validate a request. The model's dimensions come from its config, or from
    `graph` (a plain nn.Module has no config, so it is traced first). `peft`: LoRA/QLoRA settings
    (`tracer.peft.PeftSpec.from_value`: "lora", "qlora" or a dict of method, rank, alpha, targets, dropout)."""
    from tracer.api import model_dims

    unknown = sorted(set(pins) - set(PIN_NAMES))
    if unknown:
        raise SoapError(f"unknown pin {unknown[0]!r}; pins are {', '.join(PIN_NAMES)}")
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise SoapError(f"--gpus={gpus!r} must be a positive integer")
    ref = replace(model_ref(model, task=task, trust_remote_code=trust_remote_code), peft=PeftSpec.from_value(peft))
    cluster_spec = resolve_cluster(cluster, gpus_per_node)
    seq = request_seq_len(ref, seq_len=seq_len, task=task)
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise SoapError(f"--seq-len={seq!r} must be a positive integer")
    batch = global_batch if global_batch is not None else default_global_batch(gpus, seq)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise SoapError(f"--global-batch={batch!r} must be a positive integer")
    limit = planning_limit(cluster_spec.device, mem_limit_gib)
    if graph is not None:
        dims = graph.dims
    elif ref.config is not None:
        dims = model_dims(ref.config, [])
    else:
        raise SoapError("a module without a config must be traced before planning; pass graph=tracer.trace(module)")
    space = SpaceRequest(
        gpus=gpus, gpus_per_node=cluster_spec.gpus_per_node, tp_across_nodes=cluster_spec.tp_across_nodes,
        nvlink_domain=cluster_spec.nvlink_domain, peft=ref.peft.method if ref.peft else None,
        dims=dims, seq_len=seq, global_batch=batch, precisions=tuple(cluster_spec.device.peak_flops),
        pins=Pins(**{k: _switch(k, v) for k, v in pins.items() if v is not None}),
    )
    validate_pins(space)
    return PlanRequest(model=ref, cluster=cluster_spec, space=space, memory_limit=limit.bytes, limit=limit)


def plan_report(
    model: Any, *, gpus: int, cluster: str | ClusterSpec = "dgx-h100", graph: OpGraph | None = None,
    time_budget_s: float | None = None, seed: int = 0, progress: Any = None, **kwargs: Any,
) -> PlanReport:
    """Search and return the full report (chosen plan, alternatives, baselines, why). `progress(phase, done,
    total)` hears what the planner is doing (`planner.search.Progress`), for a progress bar."""
    import tracer
    from planner.pricing import run_search

    trust = bool(kwargs.get("trust_remote_code", False))
    if progress:
        progress("tracing", 0, None)
    if graph is None and model_ref(model, task=kwargs.get("task"), trust_remote_code=trust).config is None:
        graph = tracer.trace(model, task=kwargs.get("task"), batch=1, seq_len=kwargs.get("seq_len"),
                             trust_remote_code=trust, peft=kwargs.get("peft"))
    request = make_request(model, gpus=gpus, cluster=cluster, graph=graph, **kwargs)
    trace = None
    if graph is None:
        graph = request.model.trace(task=kwargs.get("task"), seq_len=request.space.seq_len)
        request = replace(request, space=replace(request.space, dims=graph.dims))
        trace = partial(request.model.trace, task=kwargs.get("task"), seq_len=request.space.seq_len)
    elif graph.seq_len != request.space.seq_len:
        raise SoapError(f"the graph was traced at sequence length {graph.seq_len}, not {request.space.seq_len}; "
                        "trace it at the planned --seq-len")
    return run_search(request, graph, time_budget_s=time_budget_s, seed=seed, trace=trace, progress=progress)


def plan(model_or_spec: Any, *, gpus: int, cluster: str | ClusterSpec = "dgx-h100", **pins: Any) -> Plan:
    """The fastest plan that fits; keyword pins (tp=, pp=, dp=, cp=, zero=, ep=, micro_batch=, grad_accum=,
    recompute=, schedule=, virtual_stages=, precision=, optimizer=, offload=, compile=) fix dimensions, and
    gpus_per_node=, task=, global_batch=, seq_len=, mem_limit_gib=, time_budget_s=, seed=, graph= and peft=
    ("lora", "qlora" or {"method": ..., "rank": ..., "alpha": ..., "targets": [...], "dropout": ...}) are
    passed through. `ep` is the expert-parallel degree (torchtitan's expert_parallel_degree), `virtual_stages`
    the pipeline stages per rank, `offload` the optimizer state and step on the CPU and `compile` torch.compile
    per block: True/False (or "on"/"off"); left out, the search decides them. A pin no plan can honour is
    refused before the search, with the numbers and a fix."""
    return plan_report(model_or_spec, gpus=gpus, cluster=cluster, **pins).plan
