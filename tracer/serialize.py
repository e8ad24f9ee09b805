"""OpGraph <-> JSON-ready dicts, and the on-disk trace cache built on them. Imports no torch.

The disk cache (used by `soap trace`, opt-in for the Python API with `persistent_cache=True`) keys a
traced graph on the exact config.json text, the trace arguments, the installed torch and transformers
versions and the tracer's own source, so any change to any of them traces afresh. It lives in
`$SOAP_CACHE_DIR` (default `~/.cache/soap/traces`); `SOAP_NO_CACHE=1` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tracer.ir import Block, DimRole, ModelDims, OpGraph, OpKind, OpNode, ParamMeta, TensorMeta

FORMAT_VERSION = 2


def graph_to_dict(graph: OpGraph) -> dict[str, Any]:
    def tensor(t: TensorMeta) -> list:
        return [list(t.shape), t.dtype, [r.value for r in t.roles]]

    return {
        "format": FORMAT_VERSION,
        "model": graph.model, "task": graph.task, "batch": graph.batch, "seq_len": graph.seq_len,
        "params_total": graph.params_total, "params_trainable": graph.params_trainable,
        "frontend": graph.frontend, "dims": asdict(graph.dims),
        "blocks": [asdict(b) for b in graph.blocks],
        "ops": [{
            "name": op.name, "kind": op.kind.value, "target": op.target, "module_fqn": op.module_fqn,
            "block_id": op.block_id, "inputs": [tensor(t) for t in op.inputs],
            "outputs": [tensor(t) for t in op.outputs],
            "params": [[p.name, list(p.shape), p.dtype, p.trainable] for p in op.params],
            "fwd_flops": op.fwd_flops, "bwd_flops": op.bwd_flops, "bytes_moved": op.bytes_moved,
            "saved": [tensor(t) for t in op.saved], "attrs": dict(op.attrs),
        } for op in graph.ops],
    }


def graph_from_dict(data: dict[str, Any]) -> OpGraph:
    if data.get("format") != FORMAT_VERSION:
        raise ValueError(f"unknown OpGraph format {data.get('format')!r}")

    def tensor(t: list) -> TensorMeta:
        return TensorMeta(tuple(t[0]), t[1], tuple(DimRole(r) for r in t[2]))

    ops = tuple(OpNode(
        name=o["name"], kind=OpKind(o["kind"]), target=o["target"], module_fqn=o["module_fqn"],
        block_id=o["block_id"], inputs=tuple(tensor(t) for t in o["inputs"]),
        outputs=tuple(tensor(t) for t in o["outputs"]),
        params=tuple(ParamMeta(p[0], tuple(p[1]), p[2], p[3]) for p in o["params"]),
        fwd_flops=o["fwd_flops"], bwd_flops=o["bwd_flops"], bytes_moved=o["bytes_moved"],
        saved=tuple(tensor(t) for t in o["saved"]), attrs=o["attrs"],
    ) for o in data["ops"])
    return OpGraph(model=data["model"], task=data["task"], batch=data["batch"], seq_len=data["seq_len"], ops=ops,
                   blocks=tuple(Block(**{**b, "indices": tuple(b.get("indices", ()))}) for b in data["blocks"]), params_total=data["params_total"],
                   params_trainable=data["params_trainable"], dims=ModelDims(**data["dims"]),
                   frontend=data["frontend"])


def cache_dir() -> Path | None:
    if os.environ.get("SOAP_NO_CACHE", "0").lower() in ("1", "true", "yes"):
        return None
    return Path(os.environ.get("SOAP_CACHE_DIR") or Path.home() / ".cache" / "soap" / "traces")


def cache_key(config_text: str, **trace_args: Any) -> str:
    from importlib import metadata

    versions = {}
    for dist in ("torch", "transformers"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "none"
    source = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        source.update(path.read_bytes())
    payload = json.dumps([config_text, trace_args, versions, source.hexdigest()], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def load_cached(key: str) -> OpGraph | None:
    directory = cache_dir()
    if directory is None:
        return None
    try:
        return graph_from_dict(json.loads((directory / f"{key}.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_cached(key: str, graph: OpGraph) -> None:
    directory = cache_dir()
    if directory is None:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f"{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(graph_to_dict(graph)))
        os.replace(tmp, directory / f"{key}.json")
    except OSError:
        pass  # a cache that cannot be written is only slower
