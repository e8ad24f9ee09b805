"""Predicted vs measured time of real ops from traced tiny models, on this CPU, with the local-cpu profile.

Tiny GPT-2 and Llama configs are traced (`tracer.trace`); every distinct matmul, attention, norm,
softmax and elementwise op with floating-point inputs is run as its ATen kernel at the traced shapes
(random inputs, one torch thread, like a local-cpu rank) and timed with `costmodel.calibration.microbench.time_kernel`.
The prediction is `costmodel.opcost.op_time` on the traced OpNode itself (forward time).

    flock -x /tmp/soap-cpu.lock python -m benchmarks.ops_accuracy
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.report import update_section
from costmodel.calibration.microbench import TimingConfig, time_kernel
from costmodel.opcost import kernel_class, op_time
from costmodel.profiles import load_device
from tracer.ir import OpGraph, OpKind, OpNode

KINDS = {OpKind.MATMUL, OpKind.ATTENTION, OpKind.NORM, OpKind.SOFTMAX, OpKind.ELEMENTWISE}
UNARY = {"tanh", "silu", "gelu", "neg", "rsqrt", "exp", "sigmoid", "relu", "dropout"}


def tiny_graphs() -> list[tuple[str, OpGraph]]:
    import tracer
    from transformers import GPT2Config, LlamaConfig

    gpt2 = GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=1000, n_positions=512, bos_token_id=0, eos_token_id=0)
    llama = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=1000, max_position_embeddings=512)
    return [
        ("tiny gpt2 b2 s128", tracer.trace(gpt2, batch=2, seq_len=128)),
        ("tiny gpt2 b4 s256", tracer.trace(gpt2, batch=4, seq_len=256)),
        ("tiny llama b2 s128", tracer.trace(llama, batch=2, seq_len=128)),
        ("tiny llama b1 s512", tracer.trace(llama, batch=1, seq_len=512)),
    ]


def kernel_for(op: OpNode) -> Callable[[], object] | None:
    """The op's ATen kernel on random inputs of the traced shapes, or None where it is not rebuilt here."""
    floats = [t for t in op.inputs if t.dtype in ("float32", "bfloat16", "float16")]
    if not floats or len(floats) != len(op.inputs) and op.kind is not OpKind.ATTENTION:
        return None
    x = [torch.randn(t.shape).to(getattr(torch, t.dtype)) for t in op.inputs]
    name = op.target.split(".")[1]
    if name == "addmm":
        return lambda: torch.addmm(*x)
    if name in ("mm", "bmm"):
        return lambda: getattr(torch, name)(*x)
    if name == "linear":
        return lambda: F.linear(*x)
    if name == "matmul":
        return lambda: torch.matmul(*x)
    if name == "scaled_dot_product_attention":
        q, k, v = x[:3]
        if len(x) > 3 and op.inputs[3].dtype == "bool":
            mask = torch.ones(op.inputs[3].shape, dtype=torch.bool).tril()
            return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(op.attrs.get("causal", False)))
    if name == "layer_norm":
        return lambda: F.layer_norm(x[0], x[1].shape, *x[1:])
    if name in ("softmax", "_softmax"):
        return lambda: torch.softmax(x[0], dim=-1)
    if name in ("add", "mul", "sub", "div") and len(x) == 2 and x[0].shape == x[1].shape:
        return lambda: getattr(torch, name)(x[0], x[1])
    if name in ("add", "mul") and len(x) == 1:
        return lambda: getattr(torch, name)(x[0], 0.5)
    if name == "pow" and len(x) == 1:
        return lambda: torch.pow(x[0], 3.0)
    if name in UNARY and len(x) == 1:
        fn = {"gelu": F.gelu, "silu": F.silu, "dropout": lambda t: F.dropout(t, 0.1, True)}.get(name, getattr(torch, name, None))
        return (lambda: fn(x[0])) if fn else None
    return None


def measure(graphs: list[tuple[str, OpGraph]]) -> list[dict]:
    device = load_device("local-cpu")
    timing = TimingConfig()
    rows, seen = [], set()
    torch.set_num_threads(1)
    for model, graph in graphs:
        for op in graph.ops:
            key = (op.target, tuple(t.shape for t in op.inputs))
            if op.kind not in KINDS or key in seen:
                continue
            call = kernel_for(op)
            if call is None:
                continue
            seen.add(key)
            measured = time_kernel(call, "cpu", timing)
            predicted = op_time(op, device=device, precision="fp32", micro_batch=graph.batch, batch_traced=graph.batch).fwd_s
            rows.append({"model": model, "op": op.name, "kind": op.kind.value, "class": kernel_class(op), "target": op.target,
                         "shapes": " ".join("x".join(map(str, t.shape)) for t in op.inputs),
                         "measured_us": measured * 1e6, "predicted_us": predicted * 1e6,
                         "err": abs(predicted - measured) / measured * 100})
    return rows


def main() -> None:
    rows = measure(tiny_graphs())
    lines = ["| model | op | kind | class | input shapes | measured µs | predicted µs | abs err % |",
             "|---|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | `{r['op']}` ({r['target']}) | {r['kind']} | {r['class']} | {r['shapes']} | "
                     f"{r['measured_us']:.1f} | {r['predicted_us']:.1f} | {r['err']:.1f} |")
    summary = ["| kernel class | ops | median abs err % |", "|---|---:|---:|"]
    for cls in sorted({r["class"] for r in rows}):
        sel = [r for r in rows if r["class"] == cls]
        summary.append(f"| {cls} | {len(sel)} | {statistics.median(r['err'] for r in sel):.1f} |")
    overall = statistics.median(r["err"] for r in rows)
    summary.append(f"| **all** | {len(rows)} | **{overall:.1f}** |")
    body = (
        "Distinct ops of tiny GPT-2 (hidden 256, 2 layers) and Llama (hidden 256, 2 layers) traced with "
        "`tracer.trace`, each run as its ATen kernel at the traced shapes (fp32, one thread) and compared with "
        "`op_time` on the traced OpNode using `profiles/devices/local-cpu.json`, whose `kernel_factors` (per "
        "kernel class and precision, fitted by `soap calibrate`) `op_time` applies. Target: median ≤ 15%.\n\n"
        + "\n".join(summary) + "\n\n" + "\n".join(lines)
    )
    update_section("ops_accuracy", "Op cost: predicted vs measured on this CPU (local-cpu profile)", body)
    print(f"ops: {len(rows)}, median abs err {overall:.1f}%")


if __name__ == "__main__":
    main()
