"""Moving a plan's parallelism to what an export target can run.

A target expresses a subset of soap's plans; each rule here changes the parallelism fields (a dict
shaped like `planner.plan.ParallelismRecord`) to the nearest plan inside that subset and says what it
dropped. The batch is kept: `global_batch = dp * micro_batch * num_microbatches` holds afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from costmodel.strategy import runs_on_fsdp2
from tracer.errors import SoapError


@dataclass
class Adjustment:
    """The parallelism fields a target runs and what it could not express."""

    parallelism: dict[str, Any]
    dropped: list[str] = field(default_factory=list)
    """One phrase per change, e.g. `ZeRO-1 (-> ZeRO-2)`."""
    drop_op_splits: bool = True
    """Whether the target applies only default (Megatron) per-op placements."""

    @property
    def changed(self) -> bool:
        return bool(self.dropped)


def start(plan) -> Adjustment:
    return Adjustment(parallelism=plan.parallelism.model_dump())


def rebatch(p: dict[str, Any], global_batch: int) -> None:
    """Re-split `global_batch` over the (changed) data-parallel degree, keeping the micro-batch where it
    divides the per-rank batch, and the schedule's accumulation where the pipeline remains."""
    p["dp"] = p["dp_replicate"] * p["dp_shard"]
    if global_batch % p["dp"]:
        raise SoapError(f"the global batch {global_batch} does not divide over dp={p['dp']}; no nearest plan "
                        "exists for this target: re-plan with a --global-batch that is a multiple of the GPU count")
    per_rank = global_batch // p["dp"]
    p["micro_batch"] = math.gcd(per_rank, p["micro_batch"])
    p["num_microbatches"] = per_rank // p["micro_batch"]
    if p["pp"] == 1:
        p["grad_accum"] = p["num_microbatches"]
        p["schedule"], p["virtual_stages"] = "1F1B", 1
    else:
        p["grad_accum"] = math.gcd(p["grad_accum"], p["num_microbatches"])


def fold_into_data_parallel(adj: Adjustment, global_batch: int, dims: tuple[str, ...], *, why: str) -> None:
    """Give the ranks of mesh dimensions `dims` (tp, cp, pp) to the sharded data-parallel dimension."""
    p = adj.parallelism
    for dim in dims:
        degree = p[dim]
        if degree == 1:
            continue
        extra = f", {p['schedule']}" + (f" x{p['virtual_stages']} stages per rank" if p["virtual_stages"] > 1 else "") \
            if dim == "pp" else ""
        adj.dropped.append(f"{_NAMES[dim]} ({dim}={degree}{extra}; {why}) -> data parallel")
        p[dim] = 1
        p["dp_shard"] *= degree
    if p["tp"] == 1:
        p["sequence_parallel"] = False
    rebatch(p, global_batch)


def drop_expert_parallel(adj: Adjustment, why: str) -> None:
    p = adj.parallelism
    if p["ep"] > 1:
        adj.dropped.append(f"expert parallelism (ep={p['ep']}; {why}) -> experts replicated")
        p["ep"] = 1


def on_fsdp2(p: dict[str, Any]) -> bool:
    """Whether soap runs this data parallelism on FSDP2 (the executor's rule, `runs_on_fsdp2`)."""
    return runs_on_fsdp2(dp=p["dp"], cp=p["cp"], tp=p["tp"], pp=p["pp"], zero=p["zero"],
                         offload=p["offload_optimizer"])


def shard_all(adj: Adjustment, dropped: str) -> None:
    """Shard over every data-parallel rank (dp_shard = dp, no replication), recording `dropped`."""
    p = adj.parallelism
    adj.dropped.append(dropped)
    p["dp_shard"], p["dp_replicate"] = p["dp"], 1


def fsdp2_layout(adj: Adjustment, *, target: str) -> None:
    """The layout FSDP2-based trainers (accelerate, torchtitan) run: DDP for a plain data-parallel plan
    of ZeRO-0; otherwise FSDP2 over dp_shard, replicated over dp_replicate (HSDP), which they run only
    with dp_shard > 1 beside other mesh dimensions. ZeRO-1 on DDP (torch's ZeroRedundancyOptimizer) has
    no FSDP2 form: the nearest is ZeRO-2 (parameters kept gathered between forward and backward)."""
    p = adj.parallelism
    if p["dp"] == 1:
        return
    if p["zero"] == 1 and not on_fsdp2(p):
        adj.dropped.append(f"ZeRO-1 (optimizer-only sharding; {target} runs FSDP2) -> ZeRO-2")
        p["zero"] = 2
    if not on_fsdp2(p):
        return
    if p["dp_shard"] == 1 and (p["tp"] > 1 or p["cp"] > 1 or p["pp"] > 1):
        shard_all(adj, f"replicated data parallelism beside tp/cp/pp (dp_replicate={p['dp_replicate']}; "
                       f"{target} needs a sharded dimension) -> dp_shard={p['dp']}")


def optimizer_to(adj: Adjustment, allowed: tuple[str, ...], nearest: str, *, target: str) -> None:
    p = adj.parallelism
    if p["optimizer"] not in allowed:
        adj.dropped.append(f"optimizer {p['optimizer']} (not in {target}) -> {nearest}")
        p["optimizer"] = nearest


CROSS_ENTROPY_NAMES = {"chunked": "the chunked cross-entropy (1.25-3x the fp32 logits at its peak)",
                       "upcast": "cross_entropy on an fp32 copy (3x the fp32 logits at its peak)",
                       "megatron": "the vocab-parallel cross-entropy (2x the fp32 logits at its peak)"}


def cross_entropy_to(adj: Adjustment, theirs: str, *, target: str) -> None:
    """The target computes the loss its way (`TrainingConfig.cross_entropy`): priced as it holds it."""
    p = adj.parallelism
    if p["cross_entropy"] != theirs:
        adj.dropped.append(f"{CROSS_ENTROPY_NAMES[p['cross_entropy']]} (not in {target}) -> "
                           f"{target}'s {CROSS_ENTROPY_NAMES[theirs]}")
        p["cross_entropy"] = theirs


_NAMES = {"tp": "tensor parallelism", "cp": "context parallelism", "pp": "pipeline parallelism"}
