"""`soap replan plan.json --gpus N`: the same run (model, global batch, sequence, precision, optimizer)
searched again for new resources; prints old vs new and writes the new plan. Method: `planner/replan.py`.

    soap replan plan.json --gpus 16 -o plan16.json
    soap replan plan.json --gpus 6 --cluster dgx-a100-80g --json
    soap replan plan.json --gpus 6 --global-batch 1020 --allow-batch-change   # states the LR implication
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from soap.commands.plan import add_pin_flags, pins_of

DEGREES = ("dp", "zero", "tp", "pp", "cp", "ep")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("replan", help="re-plan a plan.json for more, fewer or other GPUs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", metavar="PLAN", help="the plan.json to re-plan")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the new job")
    p.add_argument("--cluster", default=None, help="cluster profile name or JSON file (default: the plan's own)")
    p.add_argument("--gpus-per-node", type=int, help="override the cluster's GPUs per node")
    add_pin_flags(p)
    p.set_defaults(optimizer=None)  # the plan's own optimizer stays unless one is named
    p.add_argument("--allow-batch-change", action="store_true",
                   help="allow a global batch other than the plan's (--global-batch B, or the per-GPU batch kept); "
                   "the learning rate then needs scaling (linear rule: x new/old)")
    p.add_argument("--mem-limit", type=float, metavar="GIB", help="usable memory per GPU in GiB (default: the device's)")
    p.add_argument("--time-budget", type=float, metavar="SECONDS", help="refine with simulator-guided MCMC this long")
    p.add_argument("--seed", type=int, default=0, help="seed of the MCMC refinement (default 0)")
    p.add_argument("-o", "--output", metavar="plan.json", help="write the new plan here")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


def run(args: argparse.Namespace) -> int:
    from planner.plan import load_plan
    from planner.replan import replan, replan_json
    from tracer.errors import SoapError
    from tracer.files import check_writable

    if args.output:
        check_writable(args.output, what="-o")
    if args.seq_len is not None:
        raise SoapError("--seq-len: replan keeps the plan's sequence length; plan the new run with `soap plan`")
    old = load_plan(args.plan)
    pins = pins_of(args)
    result = replan(old, gpus=args.gpus, cluster=args.cluster, gpus_per_node=args.gpus_per_node,
                    global_batch=args.global_batch, allow_batch_change=args.allow_batch_change,
                    mem_limit_gib=args.mem_limit, time_budget_s=args.time_budget, seed=args.seed, **pins)
    if args.output:
        result.new.save(args.output)
    if args.json:
        print(json.dumps(replan_json(result), sort_keys=True, default=str))
    else:
        print(render_replan(result))
        if args.output:
            print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def render_replan(result: Any) -> str:
    """Old vs new as plain text: resources, degrees, schedule, micro-batching, predictions, pins, batch."""
    old, new = result.old, result.new
    po, pn = old.parallelism, new.parallelism

    def batching(p: Any) -> str:
        return f"{p.micro_batch} x {p.num_microbatches}" + (f" (accum {p.grad_accum})" if p.grad_accum > 1 else "")

    def schedule(p: Any) -> str:
        return "-" if p.pp == 1 else p.schedule + (f" v{p.virtual_stages}" if p.virtual_stages > 1 else "")

    rows = [("GPUs", f"{old.world_size} x {old.cluster.name}", f"{new.world_size} x {new.cluster.name}"),
            ("global batch", f"{old.global_batch} x {old.seq_len}", f"{new.global_batch} x {new.seq_len}")]
    rows += [(name, _fmt(getattr(po, name)), _fmt(getattr(pn, name))) for name in DEGREES]
    rows += [("schedule", schedule(po), schedule(pn)), ("micro-batch x count", batching(po), batching(pn)),
             ("recompute", po.recompute, pn.recompute), ("offload", _fmt(po.offload_optimizer), _fmt(pn.offload_optimizer)),
             ("precision", po.precision, pn.precision), ("optimizer", po.optimizer, pn.optimizer)]
    for key, label, digits in (("step_time_s", "step time s", ".4g"), ("tokens_per_s", "tokens/s", ",.0f"),
                               ("peak_memory_gib", "peak GiB/GPU", ".1f"), ("mfu", "MFU", ".3f")):
        a, b = old.predicted.get(key), new.predicted.get(key)
        rows.append((label, "-" if a is None else format(a, digits), "-" if b is None else format(b, digits)))
    width = max(len(r[0]) for r in rows)
    left = max(len(r[1]) for r in rows)
    lines = [f"soap replan: {old.model.name}, {old.world_size} -> {new.world_size} GPUs",
             f"  {'':<{width}}  {'old':<{left}}  new"]
    lines += [f"  {name:<{width}}  {a:<{left}}  {b}" + ("" if a == b else "   *") for name, a, b in rows]
    for d in result.pins:
        lines.append(f"  {'kept' if d.kept else 'dropped'} {d.name}={d.value}: {d.reason}")
    lines.append("  searched again: degrees, zero, schedule, micro-batching, recompute, offload, compile "
                 "(the old layout was chosen for the old resources)")
    if result.batch_change is not None:
        lines.append(f"  note: {result.batch_change.note}")
    else:
        lines.append(f"  global batch kept ({old.global_batch}): a checkpoint of the old run resumes under the new "
                     "plan on the same data order")
    return "\n".join(lines)
