"""`soap profiles`: list the device and cluster profiles with their key numbers, or check one file."""

from __future__ import annotations

import argparse
import json
import sys

from costmodel.profiles import (
    GIB,
    ClusterSpec,
    DeviceProfile,
    check_profile,
    cluster_to_dict,
    device_to_dict,
    list_clusters,
    list_devices,
    load_cluster,
    load_device,
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("profiles", help="list device and cluster profiles")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--check", metavar="NAME|FILE", help="validate one device or cluster profile (a JSON file or a shipped name)")
    parser.add_argument("--show", metavar="NAME|FILE", help="print every number of one profile with its source")
    return parser


def device_row(d: DeviceProfile) -> dict:
    return {
        "name": d.name,
        "description": d.description,
        "peak_bf16_tflops": d.peak_flops.get("bf16", 0.0) / 1e12 or None,
        "peak_fp16_tflops": d.peak_flops.get("fp16", 0.0) / 1e12 or None,
        "peak_fp8_tflops": d.peak_flops.get("fp8", 0.0) / 1e12 or None,
        "memory_gib": d.memory_bytes / GIB,
        "memory_bandwidth_gbps": d.memory_bandwidth / 1e9,
    }


def cluster_row(c: ClusterSpec) -> dict:
    return {
        "name": c.name,
        "description": c.description,
        "device": c.device.name,
        "gpus_per_node": c.gpus_per_node,
        "host_memory_gib": None if c.host_memory_bytes is None else c.host_memory_bytes / GIB,
        "intra_node_gbps": c.intra_node.bandwidth / 1e9,
        "inter_node_gbps": c.inter_node.bandwidth / 1e9,
        "intra_node_sharp": c.intra_node.sharp,
        "inter_node_sharp": c.inter_node.sharp,
    }


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _print_tables(devices: list[dict], clusters: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped or captured: no terminal width to fit
        console.width = 160
    # names are what --cluster takes: always whole (the other columns wrap on a narrow terminal)
    names = max((len(str(x["name"])) for x in (*devices, *clusters)), default=4)
    dev = Table(title="Devices")
    for col in ("name", "bf16 TF", "fp16 TF", "fp8 TF", "memory GiB", "HBM GB/s"):
        dev.add_column(col, no_wrap=col == "name", min_width=names if col == "name" else None)
    for d in devices:
        dev.add_row(*(_fmt(d[k]) for k in (
            "name", "peak_bf16_tflops", "peak_fp16_tflops", "peak_fp8_tflops", "memory_gib", "memory_bandwidth_gbps"
        )))
    clu = Table(title="Clusters (bandwidth per GPU, one direction)")
    for col in ("name", "device", "GPUs/node", "host GiB/node", "intra GB/s", "inter GB/s", "SHARP intra/inter"):
        named = col in ("name", "device")
        clu.add_column(col, no_wrap=named, min_width=names if named else None)
    for c in clusters:
        sharp = f"{_fmt(c['intra_node_sharp'])}/{_fmt(c['inter_node_sharp'])}"
        clu.add_row(
            c["name"], c["device"], _fmt(c["gpus_per_node"]), _fmt(c["host_memory_gib"] and round(c["host_memory_gib"], 1)),
            _fmt(c["intra_node_gbps"]), _fmt(c["inter_node_gbps"]),
            sharp,
        )
    console.print(dev)
    console.print(clu)


def provenance_rows(document: dict, path: str = "") -> list[tuple[str, str, str]]:
    """(field, value, source) for every number and curve of a profile document."""
    rows: list[tuple[str, str, str]] = []
    for key, value in document.items():
        field = f"{path}.{key}" if path else key
        if isinstance(value, dict) and "source" in value and ("value" in value or "points" in value):
            shown = value["value"] if "value" in value else " ".join(f"{x:g}:{e:g}" for x, e in value["points"])
            rows.append((field, _fmt(shown), value["source"]))
        elif isinstance(value, dict) and set(value) == {"source", "factors"}:  # kernel/collective factor tables
            for kind, points in value["factors"].items():
                rows.append((f"{field}.{kind}", " ".join(f"{x:g}:{f:g}" for x, f in points), value["source"]))
        elif isinstance(value, dict) and key not in ("fit", "notes"):
            rows.extend(provenance_rows(value, field))
    return rows


def _show(name_or_path: str, as_json: bool) -> None:
    profile = check_profile(name_or_path)
    document = cluster_to_dict(profile) if isinstance(profile, ClusterSpec) else device_to_dict(profile)
    if as_json:
        print(json.dumps(document))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{document['name']}: {document['description']}", show_lines=True)
    for col in ("field", "value", "source"):
        table.add_column(col, overflow="fold")
    for row in provenance_rows(document):
        table.add_row(*row)
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    if args.show:
        _show(args.show, args.json)
        return 0
    if args.check:
        profile = check_profile(args.check)
        kind = "cluster" if isinstance(profile, ClusterSpec) else "device"
        if args.json:
            print(json.dumps({"ok": True, "kind": kind, "name": profile.name}))
        else:
            print(f"{args.check}: valid {kind} profile {profile.name}")
        return 0
    devices = [device_row(load_device(n)) for n in list_devices()]
    clusters = [cluster_row(load_cluster(n)) for n in list_clusters()]
    if args.json:
        print(json.dumps({"devices": devices, "clusters": clusters}))
    else:
        _print_tables(devices, clusters)
    sys.stdout.flush()
    return 0
