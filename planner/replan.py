"""Re-planning a plan.json for new resources (`soap replan PLAN --gpus N`): what carries over, what is
searched again, and what changed.

A plan is a point in the SOAP space chosen for one cluster. When the cluster changes (GPUs added, removed
or replaced), the *training run* must stay the same run and only its *layout* may change:

    kept (the run):     model and task, global batch B, sequence length S, precision, optimizer
    searched (layout):  dp, zero, tp, pp, cp, ep, micro-batching, schedule, virtual stages, recompute,
                        offload, compile
    new plan = argmin_{layout fits on the new cluster} simulated step time, subject to the kept fields
               and to the pins given on the command line (`planner.api.plan_report` does the search).

Why this split: the run's fields decide what the optimizer sees (the same B x S tokens per step in the
same order, the same arithmetic and update rule), so a run checkpointed under the old plan resumes under
the new one and follows the same loss curve (`executor.checkpoint` reshards the state; the data position is
step x B). The layout fields only decide how that work is spread; the old layout is a fact about the old
resources (dp4 on 8 GPUs says nothing about 6), so it is searched again rather than carried, and a plan.json
does not record which of its values a user had pinned.

Kept pins that no longer make sense are dropped, each with its reason (`kept_pins`): a precision the new
device has no peak for (fp8 on an A100, bf16 on a V100) falls back to the planner's default.

The global batch: B is kept. Changing it changes the optimization (and the data position of a resumed
run: step k of the old run covered samples [kB, (k+1)B)), so a different `--global-batch` is refused unless
`allow_batch_change` is given (`batch_change`); when the search finds no plan for B on the new resources
(e.g. no data-parallel degree that fits divides it) the refusal says so and names the flag. With the flag
and no new B, B is scaled with the GPU count (the per-GPU batch kept, rounded to a multiple of the GPUs).
The learning-rate implication is stated, not applied: by the linear scaling rule (Goyal et al., 2017) the
learning rate scales by B_new / B_old (for Adam-type optimizers the square-root rule, sqrt(B_new / B_old),
is the common alternative), with a warm-up after the change.

`diff_plans` lists what differs between the old and new plan as typed `Change` records (degrees, schedule,
micro-batching, predicted step time, throughput and memory); `replan` returns a `Replan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from planner.plan import Plan
from planner.report import PlanReport
from tracer.errors import SoapError

KEPT_PINS = ("precision", "optimizer")
"""The plan's fields that define the run and are carried to the new plan as pins (when still valid)."""
LAYOUT_FIELDS = ("dp", "dp_replicate", "dp_shard", "zero", "tp", "pp", "cp", "ep", "sequence_parallel",
                 "micro_batch", "num_microbatches", "grad_accum", "schedule", "virtual_stages", "recompute",
                 "offload_optimizer", "compile")
"""The parallelism fields compared by `diff_plans` (searched again on the new resources)."""
PREDICTED_FIELDS = ("step_time_s", "tokens_per_s", "peak_memory_gib", "mfu")


@dataclass(frozen=True, kw_only=True)
class Change:
    """One field that differs between the old and the new plan."""

    field: str
    """`gpus`, `cluster`, a parallelism field (`dp`, `schedule`, ...) or a predicted metric."""
    old: Any
    new: Any


@dataclass(frozen=True, kw_only=True)
class PinDecision:
    """A field of the old plan offered as a pin to the new search, and whether it was kept."""

    name: str
    value: Any
    kept: bool
    reason: str


@dataclass(frozen=True, kw_only=True)
class BatchChange:
    """A global batch changed by `--allow-batch-change`, and what it means for the learning rate."""

    old: int
    new: int

    @property
    def lr_factor(self) -> float:
        """The linear scaling rule's learning-rate factor."""
        return self.new / self.old

    @property
    def note(self) -> str:
        return (f"global batch {self.old} -> {self.new}: the optimization changes. By the linear scaling rule scale "
                f"the learning rate by {self.new}/{self.old} = {self.lr_factor:.4g} (Adam-type optimizers often use "
                f"sqrt: {math.sqrt(self.lr_factor):.4g}) with a short warm-up; a resumed run's data position is "
                f"step x batch, so it no longer continues the old order")


@dataclass(frozen=True, kw_only=True)
class Replan:
    old: Plan
    report: PlanReport
    pins: tuple[PinDecision, ...]
    changes: tuple[Change, ...]
    batch_change: BatchChange | None = None

    @property
    def new(self) -> Plan:
        return self.report.plan


def kept_pins(old: Plan, precisions: tuple[str, ...]) -> tuple[PinDecision, ...]:
    """The old plan's run-defining fields (`KEPT_PINS`), each kept or dropped with its reason, for a new
    device with peak FLOPs for `precisions`."""
    p = old.parallelism
    decisions = []
    if p.precision in precisions:
        decisions.append(PinDecision(name="precision", value=p.precision, kept=True,
                                     reason="the run's arithmetic; the new device supports it"))
    else:
        decisions.append(PinDecision(name="precision", value=p.precision, kept=False,
                                     reason=f"the new device has no {p.precision} (it has {', '.join(precisions)}); "
                                     "the planner's default is used"))
    decisions.append(PinDecision(name="optimizer", value=p.optimizer, kept=True, reason="the run's update rule"))
    return tuple(decisions)


def diff_plans(old: Plan, new: Plan) -> tuple[Change, ...]:
    """What differs between two plans: resources, parallelism fields, global batch and predicted metrics."""
    changes = []
    for name, a, b in (("gpus", old.cluster.gpus, new.cluster.gpus), ("cluster", old.cluster.name, new.cluster.name),
                       ("gpus_per_node", old.cluster.gpus_per_node, new.cluster.gpus_per_node),
                       ("global_batch", old.global_batch, new.global_batch), ("seq_len", old.seq_len, new.seq_len)):
        if a != b:
            changes.append(Change(field=name, old=a, new=b))
    po, pn = old.parallelism.model_dump(), new.parallelism.model_dump()
    changes += [Change(field=k, old=po[k], new=pn[k]) for k in (*LAYOUT_FIELDS, *KEPT_PINS) if po[k] != pn[k]]
    changes += [Change(field=k, old=old.predicted.get(k), new=new.predicted.get(k)) for k in PREDICTED_FIELDS
                if old.predicted.get(k) != new.predicted.get(k)]
    return tuple(changes)


def _model_of(old: Plan) -> Any:
    """What `plan_report` takes for the old plan's model: the preset's name, else its inline config."""
    if old.model.source == "preset":
        return old.model.name
    from transformers import AutoConfig

    fields = dict(old.model.config)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def new_batch(old: Plan, gpus: int, global_batch: int | None, allow_batch_change: bool) -> int:
    """The new plan's global batch: the old one unless a change is allowed (see the module docstring)."""
    if global_batch is not None and global_batch != old.global_batch and not allow_batch_change:
        raise SoapError(f"--global-batch {global_batch} changes the run's global batch {old.global_batch} (and so its "
                        "optimization and data order); pass --allow-batch-change to accept that")
    if not allow_batch_change:
        return old.global_batch
    if global_batch is not None:
        return global_batch
    return max(1, round(old.global_batch / old.world_size)) * gpus


def replan(old: Plan, *, gpus: int, cluster: Any = None, gpus_per_node: int | None = None,
           global_batch: int | None = None, allow_batch_change: bool = False, mem_limit_gib: float | None = None,
           time_budget_s: float | None = None, seed: int = 0, progress: Any = None, **pins: Any) -> Replan:
    """Search `old`'s run on `gpus` GPUs of `cluster` (default: the plan's own cluster profile). `pins` are
    the command line's (`planner.api.PIN_NAMES`); they win over the kept ones."""
    from costmodel.profiles import cluster_from_dict, load_cluster
    from planner.api import plan_report

    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise SoapError(f"--gpus={gpus!r} must be a positive integer")
    spec = cluster_from_dict(old.cluster.profile) if cluster is None else (
        load_cluster(cluster) if isinstance(cluster, str) else cluster)
    if cluster is None and gpus_per_node is None:
        gpus_per_node = old.cluster.gpus_per_node
    batch = new_batch(old, gpus, global_batch, allow_batch_change)
    decisions = kept_pins(old, tuple(spec.device.peak_flops))
    given = {k: v for k, v in pins.items() if v is not None}
    search_pins = {d.name: d.value for d in decisions if d.kept and d.name not in given}
    decisions = tuple(d if d.kept is False or d.name not in given else
                      PinDecision(name=d.name, value=d.value, kept=False, reason=f"--{d.name} {given[d.name]} given")
                      for d in decisions)
    def search(global_batch: int) -> PlanReport:
        return plan_report(_model_of(old), gpus=gpus, cluster=spec, gpus_per_node=gpus_per_node,
                           task=old.model.task, global_batch=global_batch, seq_len=old.seq_len,
                           mem_limit_gib=mem_limit_gib, time_budget_s=time_budget_s, seed=seed, progress=progress,
                           **({"peft": old.model.peft_spec()} if old.model.peft and "peft" not in given else {}),
                           **search_pins, **given)

    try:
        report = search(batch)
    except SoapError as exc:
        if allow_batch_change:
            raise
        # the batch is to blame only if a batch the GPU count divides has a plan
        other = gpus * max(1, old.global_batch // gpus)
        try:
            search(other)
        except SoapError:
            raise exc from None
        raise SoapError(f"no plan on {gpus} GPUs keeps the global batch {old.global_batch} ({exc}); to change it "
                        f"pass --allow-batch-change [--global-batch B], e.g. B = {other} (the learning rate then "
                        "needs scaling)") from None
    return Replan(old=old, report=report, pins=decisions, changes=diff_plans(old, report.plan),
                  batch_change=BatchChange(old=old.global_batch, new=batch) if batch != old.global_batch else None)


def replan_json(r: Replan) -> dict[str, Any]:
    """`soap replan --json`'s object: the new plan's contract (as `soap plan --json`) plus the diff."""
    from planner.report import report_json

    out = report_json(r.report)
    out["replan"] = {
        "old": {"gpus": r.old.world_size, "cluster": r.old.cluster.name, "global_batch": r.old.global_batch,
                "parallelism": r.old.parallelism.model_dump(), "predicted": {k: r.old.predicted.get(k)
                                                                            for k in PREDICTED_FIELDS}},
        "changes": [{"field": c.field, "old": c.old, "new": c.new} for c in r.changes],
        "pins": [{"name": d.name, "value": d.value, "kept": d.kept, "reason": d.reason} for d in r.pins],
        "batch_change": None if r.batch_change is None else {
            "old": r.batch_change.old, "new": r.batch_change.new, "lr_factor_linear": r.batch_change.lr_factor,
            "note": r.batch_change.note},
    }
    return out
