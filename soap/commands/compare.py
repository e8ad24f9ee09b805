"""`soap compare MODEL --clusters A,B,...`: the best plan on each cluster, ranked by cost per token
(`planner.compare`); a table, `--png` a tokens/s-against-cost picture, `--json` one object."""

from __future__ import annotations

import argparse
import json

from soap.commands.plan import add_request_arguments, pins_of


def _gpus(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU count or auto") from None


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from planner.compare import DEFAULT_MAX_GPUS, KNEE_GAIN

    p = subparsers.add_parser(
        "compare", help="compare clusters (and GPU counts) by time and cost for one training run",
        description="Plan MODEL on each cluster as `soap plan` would (one trace, shared) and rank the clusters by "
        "cost per million tokens. --gpus auto searches powers of two, node doublings and NVLink-domain multiples "
        "up to --max-gpus and reports the smallest count that fits, the count with the best tokens/s per GPU, and "
        f"the knee (the first count whose doubling gains less than {KNEE_GAIN:g}x). Prices come from --price, else "
        "the dated price file (profiles/prices.json, or --prices FILE); they are defaults to edit, not current quotes.",
    )
    p.add_argument("model", metavar="MODEL", help="preset name, config.json path or directory, or Hub id")
    p.add_argument("--clusters", required=True, metavar="A,B,...", help="cluster profile names or JSON files")
    p.add_argument("--gpus", type=_gpus, default="auto", metavar="N|auto", help="GPUs per cluster (default auto)")
    p.add_argument("--max-gpus", type=int, default=DEFAULT_MAX_GPUS,
                   help=f"the largest count --gpus auto tries (default {DEFAULT_MAX_GPUS})")
    p.add_argument("--tokens", type=float, default=1e12, help="tokens to train, for time and cost (default 1e12)")
    p.add_argument("--price", metavar="A=USD,...", help="USD per GPU-hour per cluster (overrides the price file)")
    p.add_argument("--prices", metavar="FILE", help="a price file in profiles/prices.json's form")
    add_request_arguments(p)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow configs that ship their own code (auto_map); runs that code")
    p.add_argument("--png", metavar="FILE", help="draw tokens/s against cost per million tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


def run(args: argparse.Namespace) -> int:
    import sys

    from costmodel.profiles import load_cluster
    from planner.compare import compare, comparison_json
    from planner.compare_report import comparison_png, render_comparison
    from planner.prices import parse_price_flag, resolve_prices
    from tracer.files import check_writable

    clusters = [c.strip() for c in args.clusters.split(",") if c.strip()]
    for name in clusters:  # an unknown name is reported as such, before any price is looked up
        load_cluster(name)
    prices = resolve_prices(clusters, parse_price_flag(args.price), args.prices)
    if args.png:
        check_writable(args.png, what="--png")

    def progress(what: str) -> None:
        print(f"planning {what}", file=sys.stderr, flush=True)

    comparison = compare(
        args.model, clusters=clusters, prices=prices, gpus=args.gpus, tokens=args.tokens, max_gpus=args.max_gpus,
        progress=progress if sys.stderr.isatty() else None, task=args.task, global_batch=args.global_batch, seq_len=args.seq_len,
        mem_limit_gib=args.mem_limit, trust_remote_code=args.trust_remote_code, **pins_of(args),
    )
    if args.png:
        comparison_png(comparison, args.png)
    if args.json:
        print(json.dumps(comparison_json(comparison), sort_keys=True))
    else:
        render_comparison(comparison)
    if args.png:
        print(f"wrote {args.png}", file=sys.stderr)
    return 0
