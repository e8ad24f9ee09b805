"""Why this plan: one short sentence per technique the chosen plan uses, naming what decided it.

Each sentence is a counterfactual over the estimated candidates (`planner.search.Candidate`): the
best candidate *without* the technique (tp = 1, pp = 1, cp = 1, no sharding, no recompute, no
offload) either does not exist — nothing without it fits in memory — or is slower by a factor,
which the sentence states. Link facts from the cluster (intra- against inter-node bandwidth) explain
where TP and PP sit. The last sentence names the largest part of the chosen plan's simulated step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from costmodel.profiles import ClusterSpec
from planner.search import Candidate

GIB = 2**30


def _best_without(candidates: Sequence[Candidate], keep: Callable[[Candidate], bool]) -> Candidate | None:
    for c in candidates:  # sorted by estimate already
        if keep(c):
            return c
    return None


def _versus(chosen: Candidate, other: Candidate | None, fits_reason: str) -> str:
    if other is None:
        return f"because {fits_reason}"
    ratio = other.estimate.step_time_s / chosen.estimate.step_time_s
    return f"because it is {ratio:.2f}x faster than the best plan without it (estimated)"


def explain(
    chosen: Candidate,
    candidates: Sequence[Candidate],
    *,
    model: str,
    cluster: ClusterSpec,
    memory_limit: float,
    breakdown: dict[str, float],
) -> tuple[str, ...]:
    d, t = chosen.mesh.dims, chosen.train
    gpn = cluster.gpus_per_node
    link_ratio = cluster.intra_node.bandwidth / cluster.inter_node.bandwidth
    limit = f"{memory_limit / GIB:.0f} GiB"
    lines: list[str] = []
    if d.tp > 1:
        where = "inside nodes" if d.tp <= gpn else "across nodes"
        reason = _versus(chosen, _best_without(candidates, lambda c: c.mesh.dims.tp == 1),
                         f"{model} at {t.precision} does not fit in {limit} per GPU without it")
        lines.append(f"TP={d.tp} {where} {reason}; it rides the intra-node link ({link_ratio:.0f}x the inter-node bandwidth).")
    if d.pp > 1:
        spans = d.dp * d.cp * d.tp >= gpn
        where = "across nodes" if spans else "inside nodes"
        reason = _versus(chosen, _best_without(candidates, lambda c: c.mesh.dims.pp == 1),
                         f"no plan without pipelining fits in {limit} per GPU")
        extra = (f"; pipeline sends are small, so they tolerate inter-node links {link_ratio:.0f}x slower than "
                 "the intra-node one" if spans else "")
        lines.append(f"PP={d.pp} ({t.schedule}, {t.num_microbatches} micro-batches) {where} {reason}{extra}.")
    if d.cp > 1:
        reason = _versus(chosen, _best_without(candidates, lambda c: c.mesh.dims.cp == 1),
                         f"a {t.seq_len}-token sequence does not fit in {limit} per GPU without splitting it")
        lines.append(f"CP={d.cp} splits the {t.seq_len}-token sequence {reason}.")
    if d.dp > 1:
        form = {0: "replicated (DDP)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[chosen.mesh.zero]
        if chosen.mesh.zero == 3 and d.dp_replicate > 1:
            form = f"HSDP (shard {d.dp_shard} in a node, replicate {d.dp_replicate})"
        if chosen.mesh.zero > 0:
            reason = _versus(chosen, _best_without(candidates, lambda c: c.mesh.zero == 0),
                             f"replicated model state does not fit in {limit} per GPU")
        else:
            reason = "because the model state fits replicated, so no sharding traffic is needed"
        lines.append(f"DP={d.dp}, {form}, {reason}.")
    if t.recompute != "none":
        reason = _versus(chosen, _best_without(candidates, lambda c: c.train.recompute == "none"),
                         f"activations do not fit in {limit} per GPU otherwise")
        lines.append(f"{t.recompute.capitalize()} activation recomputation {reason}.")
    if t.offload_optimizer:
        lines.append("Optimizer state is offloaded to host memory because nothing fits on the GPUs with it.")
    if t.precision == "fp8":
        lines.append("FP8 matmuls, since this device runs them at twice the bf16 rate.")
    if breakdown:
        total = sum(breakdown.values()) or 1.0
        part = max(breakdown, key=lambda k: (breakdown[k], k))
        lines.append(f"Bottleneck: {part.replace('_', ' ')} ({100 * breakdown[part] / total:.0f}% of the step).")
    return tuple(lines)
