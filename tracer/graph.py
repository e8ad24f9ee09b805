"""Captured RawOps + block types -> OpGraph.

Passes, in program order:
1. aliases: views and no-op casts share their input's base tensor;
2. needs-grad: trainable parameters need grad; an op's floating output needs grad when grad mode was on
   and any input needs grad (or, where the front-end saw autograd's own mark, when autograd tracked it);
   ops run without grad save nothing;
3. parameter-derived ("weight-like") tensors: parameters, and outputs of ops whose floating inputs are
   all weight-like (transposed or gathered weights). They are not activations;
4. dimension roles (roles.py) and per-op kind, FLOPs, bytes and saved tensors (oprules.py);
5. saved tensors are deduplicated by base: a tensor saved by several ops counts at the first, and a
   saved view counts as its whole base (which autograd keeps alive: a slice of a fused QKV output
   keeps the fused output). A tensor
   produced outside every block and saved inside two or more block instances (rotary cos/sin, a shared
   mask) counts once, at its producer, instead of once per layer;
6. blocks: ops inside stack instances are tagged with their block id; only the representative (first
   traced, or with `last_instance` the last) instance of each block type is kept, and `Block.count`
   carries the full count.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from tracer.blocks import BlockType, instance_of
from tracer.capture import Capture, RawOp, Value
from tracer.ir import Block, DTYPE_BYTES, ModelDims, OpGraph, OpKind, OpNode, ParamMeta, TensorMeta
from tracer.oprules import (KIND_BY_NAME, base_name, bwd_flops, bytes_moved, fwd_flops, is_alias, kind_of,
                            saved_tensors, tensor_args)
from tracer.roles import RoleInference

FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "complex64"}
NON_DIFFERENTIABLE = {"zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "bernoulli",
                      "arange", "zeros", "ones", "full", "empty", "new_zeros", "new_ones", "new_full", "new_empty",
                      "detach", "scalar_tensor", "eq", "ne", "lt", "gt", "le", "ge"}


def build_graph(*, capture: Capture, types: list[BlockType], name: str, task: str, batch: int, seq_len: int,
                params_total: int, params_trainable: int, dims: ModelDims, config: Any,
                last_instance: bool = False, fp8_linears: frozenset[str] = frozenset()) -> OpGraph:
    """The graph of a captured model (see the module docstring). `last_instance`: each block type is
    represented by its last traced instance rather than its first, for models whose first instance differs
    from the rest in what needs grad (with PEFT the embeddings are frozen, so only from the second block on
    does a block's input carry a gradient, through the adapters before it). `fp8_linears`: the modules an fp8
    plan runs in fp8 (`tracer.fp8`), whose GEMMs are marked."""
    ops = capture.ops
    base: dict[int, int] = {}
    needs_grad: dict[int, bool] = {}
    weight_bytes: dict[int, int] = {}
    param_sources: dict[int, frozenset[str]] = {}
    for v in capture.values:
        base[v.vid] = v.vid
        if v.param is not None:
            needs_grad[v.vid] = v.trainable
            weight_bytes[v.vid] = _nbytes(v)
            param_sources[v.vid] = frozenset() if v.buffer else frozenset([v.param])
    roles = RoleInference(batch, seq_len)
    for op in ops:
        ins = tensor_args(op)
        alias = is_alias(op)
        grad = op.grad_enabled and any(needs_grad.get(t.vid, False) for t in ins) \
            and base_name(op.target) not in NON_DIFFERENTIABLE
        float_ins = [t for t in ins if t.dtype in FLOAT_DTYPES]
        weighty = bool(float_ins) and all(t.vid in weight_bytes for t in float_ins) \
            and KIND_BY_NAME.get(base_name(op.target)) is not OpKind.EMBEDDING
        for o in op.outputs:
            base[o.vid] = base[ins[0].vid] if alias and ins else o.vid
            needs_grad[o.vid] = o.requires_grad if o.requires_grad is not None else grad and o.dtype in FLOAT_DTYPES
            if weighty:
                weight_bytes[o.vid] = sum(weight_bytes[t.vid] for t in {t.vid: t for t in float_ins}.values())
                param_sources[o.vid] = frozenset().union(*(param_sources[t.vid] for t in float_ins))
        roles.infer(op, set(weight_bytes))

    stacks = sorted({t.stack for t in types}, key=len, reverse=True)
    type_of_instance = {(t.stack, i): t for t in types for i in t.indices}
    representative = {t.id: None for t in types}
    traced = Counter()
    instance_key: list[tuple[str, int] | None] = []
    for op in ops:
        inst = instance_of(op.module_fqn, stacks)
        if inst is not None and inst not in type_of_instance:
            inst = None
        instance_key.append(inst)
    seen_instances: dict[str, set[int]] = defaultdict(set)
    for inst in instance_key:
        if inst is not None:
            t = type_of_instance[inst]
            seen_instances[t.id].add(inst[1])
            if representative[t.id] is None or last_instance:
                representative[t.id] = inst[1]
    for bid, idx in seen_instances.items():
        traced[bid] = len(idx)

    # Saved tensors: who saves which base, then dedupe.
    saved_raw = [saved_tensors(op, needs_grad) if op.grad_enabled else [] for op in ops]
    savers: dict[int, set] = defaultdict(set)
    for i, entries in enumerate(saved_raw):
        for value, _, _ in entries:
            if value is not None:
                savers[base[value.vid]].add(instance_key[i])
    by_vid = {v.vid: v for v in capture.values}
    producer_of = {o.vid: i for i, op in enumerate(ops) for o in op.outputs}
    moved_to_producer: dict[int, list[Value]] = defaultdict(list)
    counted: set[int] = set()
    saved_per_op: list[list[TensorMeta]] = []
    for i, entries in enumerate(saved_raw):
        metas: list[TensorMeta] = []
        for value, shape, dtype in entries:
            if value is None:
                metas.append(TensorMeta(tuple(shape), dtype, roles.guess(tuple(shape))))
                continue
            b = base[value.vid]
            if b in counted or b in weight_bytes or value.vid in weight_bytes:
                continue
            counted.add(b)
            shared = sum(1 for k in savers[b] if k is not None) >= 2
            prod = producer_of.get(b)
            if shared and prod is not None and instance_key[prod] is None:
                moved_to_producer[prod].append(by_vid[b])
                continue
            metas.append(_meta(by_vid[b], roles))
        saved_per_op.append(metas)
    for prod, values in moved_to_producer.items():
        saved_per_op[prod].extend(_meta(v, roles) for v in values)

    nodes: list[OpNode] = []
    names: Counter = Counter()
    for i, op in enumerate(ops):
        inst = instance_key[i]
        block_id = None
        if inst is not None:
            t = type_of_instance[inst]
            if inst[1] != representative[t.id]:
                continue
            block_id = t.id
        kind = kind_of(op)
        label = f"{op.module_fqn or 'model'}:{base_name(op.target)}"
        names[label] += 1
        if names[label] > 1:
            label = f"{label}#{names[label]}"
        ins = tensor_args(op)
        nodes.append(OpNode(
            name=label, kind=kind, target=op.target, module_fqn=op.module_fqn, block_id=block_id,
            inputs=tuple(_meta(t, roles) for t in ins), outputs=tuple(_meta(o, roles) for o in op.outputs),
            params=_params(ins, param_sources, capture.values), fwd_flops=fwd_flops(op),
            bwd_flops=bwd_flops(op, needs_grad), bytes_moved=bytes_moved(op, weight_bytes),
            saved=tuple(saved_per_op[i]), attrs=_attrs(op, kind, task, config, fp8_linears),
        ))
    blocks = tuple(Block(id=t.id, module_type=t.module_type, count=len(t.indices), traced=traced.get(t.id, 0),
                         stack=t.stack, indices=t.indices)
                   for t in types if representative[t.id] is not None)
    return OpGraph(model=name, task=task, batch=batch, seq_len=seq_len, ops=tuple(nodes), blocks=blocks,
                   params_total=params_total, params_trainable=params_trainable, dims=dims,
                   frontend=capture.frontend)


def _nbytes(v: Value) -> int:
    n = 1
    for s in v.shape:
        n *= s
    return n * DTYPE_BYTES.get(v.dtype, 4)


def _meta(v: Value, roles: RoleInference) -> TensorMeta:
    return TensorMeta(v.shape, v.dtype, roles.of(v))


def _params(ins: list[Value], sources: dict[int, frozenset[str]], values: list[Value]) -> tuple[ParamMeta, ...]:
    by_name = {v.param: v for v in values if v.param is not None}
    names: list[str] = []
    for t in ins:
        for n in sorted(sources.get(t.vid, ())):
            if n not in names:
                names.append(n)
    return tuple(ParamMeta(n, by_name[n].shape, by_name[n].dtype, by_name[n].trainable) for n in names)


def _attrs(op: RawOp, kind: OpKind, task: str, config: Any, fp8_linears: frozenset[str] = frozenset()) -> dict[str, Any]:
    if kind is OpKind.MATMUL and op.module_fqn in fp8_linears:
        return {"fp8_linear": True}  # tracer.fp8: an fp8 plan runs this GEMM in fp8
    if kind is not OpKind.ATTENTION:
        return {}
    q, k = op.args[0], op.args[1]
    is_causal = bool(op.kwargs.get("is_causal", op.args[5] if len(op.args) > 5 else False))
    fqn = op.module_fqn.lower()
    decoder_self = task == "causal-lm" or (task == "seq2seq-lm" and "decoder" in fqn and "cross" not in fqn
                                            and "encdec" not in fqn and q.shape[-2] == k.shape[-2])
    is_decoder_model = not getattr(config, "is_encoder_decoder", False) and task == "causal-lm"
    heads, kv_heads = int(q.shape[1]), int(k.shape[1])
    configured = getattr(config, "num_key_value_heads", None)
    if kv_heads == heads and isinstance(configured, int) and 0 < configured < heads and heads % configured == 0:
        kv_heads = configured  # K/V were repeated to all heads before SDPA (HF's repeat_kv)
    dropout = op.kwargs.get("dropout_p", op.args[4] if len(op.args) > 4 else 0.0)
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": int(q.shape[-1]),
            "causal": is_causal or decoder_self or is_decoder_model,
            "dropout": float(dropout) if isinstance(dropout, (int, float)) else 0.0}
