"""`soap simulate PLAN`: re-trace the plan's model, simulate one step, summarize it (and draw it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("simulate", help="simulate one training step of a plan.json")
    parser.add_argument("plan", metavar="PLAN", help="plan.json written by `soap plan`")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome trace (open it in Perfetto)")
    parser.add_argument("--png", metavar="FILE", help="draw the per-stage timeline with memory beneath")
    return parser


def simulate_plan(plan):
    """(graph, SimResult) for a loaded Plan: the model re-traced from its inline config, in the precision
    regime the plan runs in (planner.regimes)."""
    import tracer
    from dataclasses import replace

    from costmodel.profiles import cluster_from_dict
    from costmodel.simulator import simulate
    from planner.plan import stage_bounds

    strategy = plan.strategy()
    cluster = cluster_from_dict(plan.cluster.profile)
    from planner.regimes import regime_dtype

    dtype = regime_dtype(strategy.dims, strategy.train, cluster.device)
    preset = _same_preset(plan.model)
    if preset is not None:  # the planner's own path: traced by name, preset front-end chain, disk cache
        graph = replace(preset, peft=plan.model.peft_spec()).trace(task=plan.model.task, seq_len=plan.seq_len,
                                                                   dtype=dtype)
    else:
        graph = tracer.trace(_config(plan.model.config), task=plan.model.task, seq_len=plan.seq_len, dtype=dtype,
                             peft=plan.model.peft_spec())
    return graph, simulate(graph, strategy, cluster, stages=stage_bounds(plan, graph))


def _same_preset(record):
    """The planner's ModelRef for a plan made from a shipped preset whose config is still the one shipped;
    None otherwise (the plan's inline config is traced instead)."""
    if record.source != "preset":
        return None
    from planner.model_ref import model_ref
    from planner.plan import config_hash
    from tracer.errors import SoapError

    try:
        ref = model_ref(record.name, task=record.task)
    except SoapError:  # a preset this version of soap no longer ships
        return None
    return ref if ref.source == "preset" and config_hash(ref.config_json) == record.config_hash else None


def _config(config: dict):
    from transformers import AutoConfig

    from tracer.errors import SoapError

    data = dict(config)
    model_type = data.pop("model_type", None)
    if not model_type:
        raise SoapError("model.config has no model_type; regenerate the plan with `soap plan`")
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as exc:
        raise SoapError(f"model.config cannot be rebuilt ({exc}); regenerate the plan with `soap plan`") from None


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from planner.plan import load_plan

    from tracer.files import check_writable, write_atomic

    plan = load_plan(args.plan)
    for path, flag in ((args.trace, "--trace"), (args.png, "--png")):
        if path:
            check_writable(path, what=flag)
    start = time.perf_counter()
    graph, result = simulate_plan(plan)
    elapsed = time.perf_counter() - start
    if args.trace:
        from costmodel.timeline import chrome_trace

        write_atomic(args.trace, json.dumps(chrome_trace(result)), what="--trace")
    if args.png:
        from costmodel.timeline import gantt_png

        gantt_png(result, args.png)
    if args.json:
        from planner.report import plan_device

        out = result.to_contract()
        out["memory_limit_gib"] = plan_device(plan).memory_bytes / 2**30
        json.dump(out, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
    else:
        _print_summary(plan, graph, result, elapsed, args)
    return 0


def _on_off(value: object) -> str:
    return "on" if value else "off"


def batching(p: dict) -> str:
    """How a rank's batch is cut: the pipeline schedule and its micro-batches, or, without a pipeline, the
    micro-batch and its accumulation steps."""
    micro = f"micro-batch{'es' if p['num_microbatches'] != 1 else ''}"
    if p["pp"] > 1:
        return f"{p['schedule']} with {p['num_microbatches']} {micro} of {p['micro_batch']}"
    accumulation = p.get("grad_accum", p["num_microbatches"])
    steps = f" x {accumulation} accumulation steps" if accumulation > 1 else ""
    return f"no pipeline, micro-batch {p['micro_batch']}{steps}"


def _print_summary(plan, graph, result, elapsed: float, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from planner.report import memory_table, plan_device

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 140
    c = result.to_contract()
    p = c["parallelism"]
    device = plan_device(plan)
    console.print(f"[bold]{plan.model.name}[/] ({graph.params_total / 1e9:.2f} B params) on {plan.cluster.gpus} x "
                  f"{plan.cluster.name}: tp {p['tp']}, pp {p['pp']}, dp {p['dp']} (zero {p['zero']}), cp {p['cp']}, "
                  f"{batching(p)}, recompute {p['recompute']}, {p['precision']}, "
                  f"offload {_on_off(p.get('offload_optimizer'))}, "
                  f"compile {_on_off(p.get('compile'))}")
    table = Table(show_header=False, box=None)
    table.add_row("step time", f"{c['step_time_s'] * 1e3:.2f} ms")
    table.add_row("throughput", f"{c['tokens_per_s']:,.0f} tokens/s, {c['samples_per_s']:.2f} samples/s")
    table.add_row("MFU / HFU", f"{c['mfu']:.1%} / {c['hfu']:.1%} ({c['model_tflops_per_gpu']:.1f} model TFLOP/s per "
                               f"{device.rank_noun})")
    table.add_row("peak memory", f"{c['peak_memory_gib']:.2f} GiB (max over ranks)")
    for key, value in c["breakdown_s"].items():
        table.add_row(f"  {key}", f"{value * 1e3:.2f} ms ({value / c['step_time_s']:.1%})" if c["step_time_s"] else "0")
    console.print(table)
    console.print(memory_table(result.memory, device.memory_bytes, device))
    for stage in plan.stages:
        mods = stage.modules
        span = mods[0] if len(mods) == 1 else f"{mods[0]} .. {mods[-1]}"
        console.print(f"stage {stage.index} on pipeline rank {stage.rank}: {span} ({len(mods)} modules)")
    console.print(f"simulated in {elapsed:.2f} s (tracing included)"
                  + (f"; trace written to {args.trace}" if args.trace else "")
                  + (f"; timeline drawn to {args.png}" if args.png else ""), style="dim")
