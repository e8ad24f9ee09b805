"""`soap tune MODEL --gpus N` (or `soap tune plan.json`): try the best few plans on this cluster, refit the
profile from what they measured, re-plan, and write the plan measured fastest.

    soap tune llama-3-8b --gpus 8 --top 3 --steps 5 -o plan.json        # trials in plan.tune/
    soap tune plan.json --top 3 --budget 20                              # that plan first, 20 minutes at most
    soap tune cfg/ --gpus 4 --cluster local-cpu --mem-cap 2 --no-compile # a rank over 2 GiB is out of memory
    soap tune ... --nnodes 2 --node-rank 0 --rdzv-endpoint host:29400     # execute's launch flags

Every trial is appended to DIR/runs.jsonl (DIR: --dir, default next to -o); run the same command again after
an interrupt and it resumes: no finished trial is re-run. The refitted profile goes to DIR/cluster-refit.json,
the report to DIR/tune.json. A live table of the trials is drawn on stderr; `--json` prints the report on
stdout. Method: `soap/tuning.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from soap.commands.execute import add_launch_flags, launch_options
from soap.commands.plan import add_pin_flags, pins_of

COLUMNS = ("plan", "round", "status", "predicted s", "measured s", "predicted GiB", "measured GiB")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tune", help="try the best plans on this cluster and keep the measured fastest",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL|PLAN", help="what `soap plan` takes, or a plan.json")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in the job (a plan.json brings its own)")
    p.add_argument("--cluster", default=None,
                   help="cluster profile name or JSON file (default dgx-h100; a plan.json brings its own)")
    p.add_argument("--gpus-per-node", type=int, help="override the cluster's GPUs per node")
    p.add_argument("--task", help="causal-lm, masked-lm, seq-cls or seq2seq-lm (default: from the config)")
    add_pin_flags(p)
    p.add_argument("--mem-limit", type=float, metavar="GIB", help="usable memory per GPU for the planner")
    p.add_argument("--top", type=int, default=3, help="plans tried, differing in mesh or schedule (default 3)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per trial (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default 1)")
    p.add_argument("--budget", type=float, default=None, metavar="MINUTES",
                   help="start no trial after this many minutes (default: no limit)")
    p.add_argument("--mem-cap", type=float, default=None, metavar="GIB",
                   help="a trial whose measured peak memory per rank passes this is out of memory (default: none)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="end a trial whose rank makes no progress for this long (default: execute's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trials' weights and data")
    p.add_argument("--dir", default=None, help="the tune's directory (runs log, refitted profile, report)")
    p.add_argument("-o", "--output", metavar="plan.json", help="write the measured-best plan here")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_launch_flags(p)
    return p


def run(args: argparse.Namespace) -> int:
    import soap
    from soap.tuning import plan_input
    from tracer.errors import SoapError
    from tracer.files import check_writable

    if args.output:
        check_writable(args.output, what="-o")
    if args.timeout is not None and not args.timeout > 0:
        raise SoapError(f"--timeout {args.timeout:g}: need a positive number of seconds")
    pins = {k: v for k, v in pins_of(args).items() if v is not None}
    if pins.get("optimizer") == "adamw" and plan_input(args.model) is not None:
        pins.pop("optimizer")  # the parser's default: a plan.json's own optimizer stays
    options = {k: v for k, v in (("gpus_per_node", args.gpus_per_node), ("task", args.task),
                                 ("global_batch", args.global_batch), ("seq_len", args.seq_len),
                                 ("mem_limit_gib", args.mem_limit)) if v is not None}
    with _LiveTable() as table:
        report = soap.tune(args.model, gpus=args.gpus, cluster=args.cluster, top=args.top, steps=args.steps,
                           warmup=args.warmup, budget_min=args.budget, output=args.output, directory=args.dir,
                           launch=launch_options(args), timeout_s=args.timeout, mem_cap_gib=args.mem_cap,
                           seed=args.seed, on_update=table.update, **options, **pins)
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        _summary(report)
    return 0


def _fmt(value: Any, digits: str = ".4g") -> str:
    return "-" if value is None else format(value, digits)


def trials_table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="soap tune: trials", title_justify="left")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("plan", "round", "status") else "right")
    for r in rows:
        table.add_row(r["plan"], r["round"], r["status"], _fmt(r["predicted_step_time_s"]),
                      _fmt(r["measured_step_time_s"]), _fmt(r["predicted_peak_memory_gib"], ".3f"),
                      _fmt(r["measured_peak_memory_gib"], ".3f"))
    return table


class _LiveTable:
    """The trials as a rich table on stderr, redrawn as they start and end."""

    def __enter__(self) -> _LiveTable:
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        if not console.is_terminal:
            console.width = 140
        self._live = Live(console=console, auto_refresh=False, transient=False)
        self._live.start()
        self._drawn = False
        return self

    def update(self, rows: list[dict[str, Any]]) -> None:
        self._live.update(trials_table(rows), refresh=True)
        self._drawn = True

    def __exit__(self, *exc: Any) -> None:
        self._live.stop()
        if self._drawn and not self._live.console.is_terminal:
            self._live.console.file.write("\n")  # rich leaves the last line open: an error line starts its own


def _summary(report: dict[str, Any]) -> None:
    if report.get("follower"):
        print(f"ran {len(report['trials'])} trials; the node of rank 0 measured them, refits and re-plans",
              file=sys.stderr)
        return
    refit = report["refit"]
    lines = [
        f"measured best  {report['best_plan']}: {report['measured_step_time_s']:.4g} s/step "
        f"({'the first predicted' if report['best_is_first_predicted'] else 'not the first predicted'})",
        f"refit          step-time error on {refit['trials']} trials {refit['log_error_before_pct']:.1f}% -> "
        f"{refit['log_error_after_pct']:.1f}% (geometric mean; MAPE {refit['mape_before_pct']:.1f}% -> "
        f"{refit['mape_after_pct']:.1f}%) ({refit['profile']})",
        f"re-planned     {report['replanned']['plan']}" + (" (tried)" if report["replanned"]["new"] else
                                                           " (already a trial)")
        if report["replanned"]["plan"] else f"re-planned     none: {report['replanned'].get('error')}",
        f"report         {report['directory']}/tune.json",
    ]
    if report["output"]:
        lines.append(f"wrote          {report['output']}")
    print("\n".join(lines), file=sys.stderr)
