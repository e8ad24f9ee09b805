"""`soap trace MODEL`: capture a model's training step as an operator graph and summarize it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("trace", help="trace a model into an operator graph and summarize it")
    parser.add_argument("model", metavar="MODEL", help="preset name, config.json file or directory, or Hub id")
    parser.add_argument("--task", help="causal-lm, masked-lm, seq-cls, seq2seq-lm or image-cls "
                                       "(default: from the config's architectures)")
    parser.add_argument("--seq-len", type=int, help="tokens per sample (default: min(max positions, 2048))")
    parser.add_argument("--batch", type=int, default=1, help="samples in the traced batch (default 1)")
    parser.add_argument("--frontend", default="auto", choices=("auto", "export", "hf-fx", "dispatch"),
                        help="capture front-end (default: export, falling back to dispatch)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow configs that ship model code")
    parser.add_argument("--no-cache", action="store_true",
                        help="trace afresh, ignoring the on-disk trace cache ($SOAP_CACHE_DIR, ~/.cache/soap/traces)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return parser


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # config warnings are noise for a summary
    import tracer
    from tracer.summary import summarize

    start = time.perf_counter()
    graph = tracer.trace(args.model, task=args.task, batch=args.batch, seq_len=args.seq_len,
                         frontend=args.frontend, trust_remote_code=args.trust_remote_code,
                         persistent_cache=not args.no_cache)
    summary = summarize(graph, time.perf_counter() - start)
    if args.json:
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_table(summary)
    return 0


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".rstrip()


def _bytes(x: float) -> str:
    for scale, prefix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}"
    return f"{x:.0f} B"


def _print_table(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    head = Table(title=f"{s['model']} — {s['task']}, batch {s['batch']} × {s['seq_len']} tokens", show_header=False)
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_row("parameters (total)", f"{s['params']:,}")
    head.add_row("parameters (trainable)", f"{s['params_trainable']:,}")
    head.add_row("FLOPs per token (fwd + bwd)", f"{_si(s['flops_per_token'], 'FLOP')} "
                 f"({_si(s['fwd_flops_per_token'])} + {_si(s['bwd_flops_per_token'])})")
    head.add_row("activation bytes per sample", _bytes(s["activation_bytes_per_sample"]))
    head.add_row("ops (graph / full model)", f"{s['ops_in_graph']:,} / {s['ops_in_model']:,}")
    head.add_row("front-end", s["frontend"])
    head.add_row("time taken", f"{s['trace_time_s']:.2f} s")
    console.print(head)
    blocks = Table(title="repeated blocks")
    for col in ("block", "layer type", "count", "traced"):
        blocks.add_column(col, justify="right" if col in ("count", "traced") else "left")
    for b in s["blocks"]:
        blocks.add_row(b["id"], b["module_type"], str(b["count"]), str(b["traced"]))
    console.print(blocks)
    kinds = Table(title="by op kind (full model)")
    for col in ("kind", "ops", "fwd FLOPs", "bwd FLOPs", "bytes moved", "saved for bwd"):
        kinds.add_column(col, justify="left" if col == "kind" else "right")
    for kind, row in s["by_kind"].items():
        kinds.add_row(kind, f"{row['ops']:,}", _si(row["fwd_flops"]), _si(row["bwd_flops"]), _bytes(row["bytes"]),
                      _bytes(row["saved_bytes"]))
    console.print(kinds)
