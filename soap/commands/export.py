"""`soap export PLAN FORMAT [-o PATH]`: write a plan.json as an accelerate, torchtitan, DeepSpeed or Megatron
configuration (also `soap plan ... --export FORMAT[=PATH]`).

Where the target cannot express part of the plan, one line on stderr says what was dropped, and the
files describe the nearest plan the target runs, whose simulated step time is shown beside soap's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    from planner.exports import DEFAULT_FILES, FORMATS

    parser = subparsers.add_parser(
        "export", help="write a plan.json as an accelerate, torchtitan, DeepSpeed or Megatron config",
        description="Write PLAN as FORMAT's configuration. Defaults, next to PLAN: "
        + ", ".join(f"{k}: {v}" for k, v in DEFAULT_FILES.items()) + ".",
    )
    parser.add_argument("plan", metavar="PLAN", help="plan.json written by `soap plan`")
    parser.add_argument("format", metavar="FORMAT", help=" | ".join(FORMATS))
    parser.add_argument("-o", "--output", metavar="PATH", help="file to write (default: next to PLAN)")
    return parser


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from planner.exports import parse_export
    from planner.plan import load_plan
    from tracer.files import check_writable

    spec = args.format + (f"={args.output}" if args.output else "")
    name, path = parse_export(spec, directory=Path(args.plan).parent)
    check_writable(path, what="-o")
    write_exports(load_plan(args.plan), [(name, path)])
    return 0


def parse_exports(specs: list[str] | None, *, directory: str | Path) -> list[tuple[str, Path]]:
    """`--export FORMAT[=PATH]` values, checked (known format, writable path) before any work is done."""
    from planner.exports import parse_export
    from tracer.files import check_writable

    exports = [parse_export(spec, directory=directory) for spec in specs or ()]
    for name, path in exports:
        check_writable(path, what=f"--export {name}")
    return exports


def write_exports(plan, exports: list[tuple[str, Path]]) -> None:
    """Write each export; say on stderr what it dropped and how the nearest plan compares."""
    from planner.exports import format_module
    from planner.exports.nearest import finish, nearest_plan
    from tracer.files import write_atomic

    traced: list = []

    def graph_and_base():
        if not traced:
            from soap.commands.simulate import simulate_plan

            traced.extend(simulate_plan(plan))
        return traced

    for name, path in exports:
        module = format_module(name)
        adjustment = module.adjust(plan)
        needs_graph = adjustment.changed or plan.strategy().op_splits or any(
            b.recompute != plan.parallelism.recompute for b in plan.blocks if not b.id.startswith("<"))
        target = plan
        if needs_graph:
            graph, base = graph_and_base()
            finish(adjustment, plan, graph)
            target = nearest_plan(plan, graph, adjustment)
            if adjustment.changed and not fits(target) and fits(plan):
                target = nearest_plan_that_fits(name, plan, graph, adjustment)
            if adjustment.changed:
                print(dropped_line(name, adjustment.dropped, plan, target, base), file=sys.stderr)
        if plan.model.peft is not None and not getattr(module, "CARRIES_PEFT", False):
            print(f"{name} cannot express PEFT ({plan.model.peft_spec().describe()}): its config trains every "
                  "parameter; export accelerate for the LoRA run (TrainingArguments with a peft config)", file=sys.stderr)
        files = module.render(target, path)
        for file, text in files.items():
            write_atomic(file, text, what=f"--export {name}")
        print(f"wrote {', '.join(map(str, files))}; launch: {module.launch(target, path)}", file=sys.stderr)


def fits(plan) -> bool:
    """Whether a plan's simulated peak fits its device (the limit `dropped_line` reports against)."""
    from planner.report import plan_device

    return plan.predicted.get("peak_memory_gib", 0.0) <= plan_device(plan).memory_bytes / 2**30


MEMORY_STEPS = (("ZeRO-3", {"zero": 3}), ("full recompute", {"recompute": "full"}))
"""What every target can add to bring a nearest plan that outgrew the device back into it, in order: shard
parameters, gradients and optimizer state over all data-parallel ranks, then recompute every block."""


def nearest_plan_that_fits(name: str, plan, graph, adjustment):
    """The nearest plan with the `MEMORY_STEPS` added one by one until it fits; a SoapError (nothing written)
    where even the last does not."""
    from planner.exports.nearest import nearest_plan
    from planner.report import plan_device
    from tracer.errors import SoapError

    p, added, candidate = adjustment.parallelism, [], None
    for what, fields in MEMORY_STEPS:
        if all(p[k] == v for k, v in fields.items()):
            continue
        p.update(fields)
        if "zero" in fields:
            p["dp_shard"], p["dp_replicate"] = p["dp"], 1
        added.append(what)
        candidate = nearest_plan(plan, graph, adjustment)
        if fits(candidate):
            adjustment.dropped.append(f"to fit the device: {' and '.join(added)}")
            return candidate
    peak = (candidate.predicted if candidate else {}).get("peak_memory_gib", 0.0)
    limit = plan_device(plan).memory_bytes / 2**30
    changes = "; ".join(adjustment.dropped) + (", with " + " and ".join(added) if added else "")
    raise SoapError(f"{name} cannot run this plan in {limit:.0f} GiB per GPU: its nearest plan ({changes}) needs "
                    f"{peak:.1f} GiB; nothing written. Export to a target that keeps the plan's tp/pp/cp, or plan "
                    "with more GPUs")


def dropped_line(name: str, dropped: list[str], plan, nearest, base) -> str:
    from planner.report import plan_device

    ours = base.to_contract()["step_time_s"]
    theirs = nearest.predicted["step_time_s"]
    peak = nearest.predicted.get("peak_memory_gib", 0.0)
    limit = plan_device(plan).memory_bytes / 2**30
    fits = f"peak {peak:.1f} GiB" + ("" if peak <= limit else f", over the {limit:.0f} GiB device")
    change = f"{(theirs / ours - 1):+.1%}" if ours else "n/a"
    return (f"{name} cannot express: {'; '.join(dropped)}. Wrote the nearest plan it runs: {theirs:.3f} s/step "
            f"simulated vs {ours:.3f} s for soap's plan ({change}), {fits}")
