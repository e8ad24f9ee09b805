"""Why this plan: one short sentence per technique the chosen plan uses, naming what decided it.

A degree or technique the user pinned says so ("as pinned (--tp 8)"): the search never tried the plan
without it, so no counterfactual exists. Every other sentence is a counterfactual: the fastest simulated
plan *without* the technique (tp = 1, pp = 1, cp = 1, no sharding, no recompute, no compile), or failing
that the best estimated candidate, either does not exist (nothing without it fits in memory) or is slower
by a factor, which the sentence states (with whether the factor was simulated or estimated). Link facts
from the cluster (intra- against inter-node bandwidth) explain where TP and PP sit. The last sentence names
the largest part of the chosen plan's simulated step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from costmodel.offload import offload_syncs
from costmodel.profiles import ClusterSpec
from planner.estimate import group_ranks_per_node
from planner.search import Candidate, Priced
from planner.space import Pins

GIB = 2**30


def _versus(chosen: Priced, priced: Sequence[Priced], candidates: Sequence[Candidate],
            keep: Callable[[Candidate], bool], fits_reason: str) -> str:
    """Compare with the fastest simulated plan without the technique (else the best estimate)."""
    simulated = next((p for p in priced if keep(p.candidate)), None)
    if simulated is not None:
        ratio, how = simulated.step_time_s / chosen.step_time_s, "simulated"
    else:
        estimated = next((c for c in candidates if keep(c)), None)
        if estimated is None:
            return f"because {fits_reason}"
        ratio, how = estimated.estimate.step_time_s / chosen.candidate.estimate.step_time_s, "estimated"
    if ratio >= 1.005:
        return f"because the best plan without it is {ratio:.2f}x slower ({how})"
    return f"although the best plan without it is about as fast ({ratio:.2f}x, {how}); it won the tie-break"


def explain(
    chosen_plan: Priced,
    priced: Sequence[Priced],
    candidates: Sequence[Candidate],
    *,
    model: str,
    cluster: ClusterSpec,
    memory_limit: float,
    breakdown: dict[str, float],
    pins: Pins | None = None,
) -> tuple[str, ...]:
    chosen = chosen_plan.candidate
    d, t = chosen.mesh.dims, chosen.train
    pins = pins or Pins()

    def versus(keep: Callable[[Candidate], bool], fits_reason: str, *, pinned: str | None = None) -> str:
        if pinned:
            return f"as pinned ({pinned})"
        return _versus(chosen_plan, priced, candidates, keep, fits_reason)

    gpn = cluster.domain_size  # GPUs sharing NVLink: the node, or a larger NVLink domain
    link_ratio = cluster.intra_node.bandwidth / cluster.inter_node.bandwidth
    limit = f"{memory_limit / GIB:.0f} GiB"
    noun = cluster.device.rank_noun
    lines: list[str] = []
    if d.tp > 1:
        inside = group_ranks_per_node(d.tp, 1, gpn) == d.tp
        where = "inside nodes" if inside else "across nodes"
        reason = versus(lambda c: c.mesh.dims.tp == 1,
                        f"{model} at {t.precision} does not fit in {limit} per {noun} without it",
                        pinned=pins.tp and f"--tp {pins.tp}")
        link = (f"it rides the intra-node link ({link_ratio:.0f}x the inter-node bandwidth)" if inside else
                f"its per-layer collectives cross the inter-node link ({link_ratio:.0f}x slower than the intra-node one)")
        lines.append(f"TP={d.tp} {where} {reason}; {link}.")
    if d.pp > 1:
        # the pipeline dimension is outermost: its ranks sit dp*cp*tp apart (costmodel.simulator.pricing.mesh_groups)
        spans = group_ranks_per_node(d.pp, d.dp * d.cp * d.tp, gpn) < d.pp
        where = "across nodes" if spans else "inside nodes"
        reason = versus(lambda c: c.mesh.dims.pp == 1, f"no plan without pipelining fits in {limit} per {noun}",
                        pinned=pins.pp and f"--pp {pins.pp}")
        extra = (f"; pipeline sends are small, so they tolerate inter-node links {link_ratio:.0f}x slower than "
                 "the intra-node one" if spans else "")
        lines.append(f"PP={d.pp} ({t.schedule}, {t.num_microbatches} micro-batches) {where} {reason}{extra}.")
    if d.cp > 1:
        reason = versus(lambda c: c.mesh.dims.cp == 1,
                        f"a {t.seq_len}-token sequence does not fit in {limit} per {noun} without splitting it",
                        pinned=pins.cp and f"--cp {pins.cp}")
        lines.append(f"CP={d.cp} splits the {t.seq_len}-token sequence {reason}.")
    if d.dp > 1:
        form = {0: "replicated (DDP)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[chosen.mesh.zero]
        if chosen.mesh.zero == 3 and d.dp_replicate > 1:
            inside = group_ranks_per_node(d.dp_shard, d.cp * d.tp, gpn) >= d.dp_shard
            form = f"HSDP (shard {d.dp_shard} {'in a node' if inside else 'across nodes'}, replicate {d.dp_replicate})"
        if pins.zero is not None:
            reason = f"as pinned (--zero {pins.zero})"
        elif chosen.mesh.zero > 0:
            reason = versus(lambda c: c.mesh.zero == 0, f"replicated model state does not fit in {limit} per {noun}")
        else:
            reason = "because the model state fits replicated, so no sharding traffic is needed"
        lines.append(f"DP={d.dp}, {form}, {reason}.")
    if t.recompute != "none":
        reason = versus(lambda c: c.train.recompute == "none",
                        f"activations do not fit in {limit} per {noun} otherwise",
                        pinned=pins.recompute and f"--recompute {pins.recompute}")
        lines.append(f"{t.recompute.capitalize()} activation recomputation {reason}.")
    if t.offload_optimizer:
        reason = versus(lambda c: not c.train.offload_optimizer, f"no plan without it fits in {limit} per {noun}",
                        pinned="--offload" if pins.offload else None)
        line = ("Offload (FSDP2 CPUOffloadPolicy): fp32 master weights, gradients and optimizer state live in "
                f"host memory and the optimizer steps on the CPU, {reason}")
        syncs, _ = offload_syncs(pp=d.pp, train=t)
        if syncs > 1:  # costmodel.offload: FSDP2's blocking copy-and-add of each later gradient
            line += (f"; each of the step's {syncs - 1} gradient syncs after the first copies the gradients to the "
                     "host blocking and adds them there (a lent H200 took 3.4 s each for a 1.2B model), priced in "
                     "its optimizer time")
        lines.append(line + ".")
    if t.compile:
        reason = versus(lambda c: not c.train.compile, "compile was pinned on",
                        pinned="--compile" if pins.compile else None)
        if not cluster.device.compile_factors:
            reason = (f"as pinned; {cluster.device.name}'s profile has no measured compile factors, so it is priced "
                      "as no faster than eager")
        lines.append(f"torch.compile on each block, {reason}; its one-time compilation is not in the step time.")
    if t.precision == "fp8":
        ratio = cluster.device.effective_peak("fp8") / cluster.device.effective_peak("bf16")
        line = (f"FP8 matmuls in the blocks' Linear layers (torchao float8), which this device runs at {ratio:.2g}x "
                "its bf16 rate")
        if not t.compile:  # costmodel.opcost.fp8_cast_kernels: the casts op by op
            line += ("; without torch.compile their casts run op by op and are priced so (an H100 ran four "
                     "Llama-3-8B layers 1.6x slower in eager fp8 than in bf16)")
        lines.append(line + ".")
    if breakdown:
        total = sum(breakdown.values()) or 1.0
        part = max(breakdown, key=lambda k: (breakdown[k], k))
        lines.append(f"Bottleneck: {part.replace('_', ' ')} ({100 * breakdown[part] / total:.0f}% of the step).")
    return tuple(lines)
