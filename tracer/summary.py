"""The headline numbers of an OpGraph, as `soap trace` prints them (and as its --json keys)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from tracer.ir import OpGraph


def summarize(graph: OpGraph, trace_time_s: float) -> dict[str, Any]:
    """One JSON-ready dict: params, FLOPs per token, blocks, per-kind totals, activation bytes, front-end."""
    by_kind: dict[str, dict[str, int]] = {}
    for op in graph.ops:
        n = graph.multiplicity(op)
        row = by_kind.setdefault(op.kind.value, {"ops": 0, "fwd_flops": 0, "bwd_flops": 0, "bytes": 0,
                                                 "saved_bytes": 0})
        row["ops"] += n
        row["fwd_flops"] += op.fwd_flops * n
        row["bwd_flops"] += op.bwd_flops * n
        row["bytes"] += op.bytes_moved * n
        row["saved_bytes"] += op.saved_bytes * n
    tokens = graph.tokens
    return {
        "model": graph.model,
        "task": graph.task,
        "batch": graph.batch,
        "seq_len": graph.seq_len,
        "params": graph.params_total,
        "params_trainable": graph.params_trainable,
        "flops_per_token": (graph.fwd_flops + graph.bwd_flops) / tokens,
        "fwd_flops_per_token": graph.fwd_flops / tokens,
        "bwd_flops_per_token": graph.bwd_flops / tokens,
        "fwd_flops": graph.fwd_flops,
        "bwd_flops": graph.bwd_flops,
        "blocks": [asdict(b) for b in graph.blocks],
        "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]["fwd_flops"] - kv[1]["bytes"])),
        "activation_bytes_per_sample": graph.activation_bytes / graph.batch,
        "ops_in_graph": len(graph.ops),
        "ops_in_model": sum(graph.multiplicity(op) for op in graph.ops),
        "dims": asdict(graph.dims),
        "frontend": graph.frontend,
        "trace_time_s": round(trace_time_s, 3),
    }
