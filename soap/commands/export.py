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
            if adjustment.changed:
                print(dropped_line(name, adjustment.dropped, plan, target, base), file=sys.stderr)
        files = module.render(target, path)
        for file, text in files.items():
            write_atomic(file, text, what=f"--export {name}")
        print(f"wrote {', '.join(map(str, files))}; launch: {module.launch(target, path)}", file=sys.stderr)


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
