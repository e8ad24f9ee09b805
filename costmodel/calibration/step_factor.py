"""A training step's memory-bound kernels against the microbenchmarks' price: the device's step factor.

`soap calibrate` times each kernel class alone: contiguous, vectorized kernels at chosen sizes, one at a time. A
training step's memory-bound kernels are not those: autocast's casts and copies, broadcast and strided elementwise
kernels, fp32 norms and a loss over the whole vocabulary, all sharing the GPU with the step's GEMMs. On an H100
(2026-11-26, docs/benchmarks.md "One H100, 2026-11-26") a profiled step of four Llama-3-8B layers had its GEMMs and
attention within 2-15% of calibrate's price and its memory-bound kernels 2.2x over it; soap's own runs of five
models, each predicted with the factor fitted on the others, came within 6% (`benchmarks.h100_measured`).

So on a GPU, calibrate also runs one training step of a reference model (`REFERENCE`: a Llama-shaped decoder
with as many key/value heads as query heads, so that torch < 2.13 can trace it) the way soap's executor runs a
single-rank bf16 plan (fp32 parameters, `torch.autocast(cuda, bf16)`, cross-entropy on the fp32 logits, fused
AdamW), under torch.profiler, and sums its CUDA kernels by group (`kernel_groups`: GEMMs, attention, the
optimizer, and the rest, memory-bound). The same step is traced and priced by the just-fitted device
(`priced_groups`), and

    T_priced(memory-bound; k) = T_measured(memory-bound)

solved for k (`solve_step_factor`: the factor scales each kernel's data time, not its launch, so the price is
linear in k) multiplies the kernel factor of every memory-bound class (`MEMORY_BOUND`) at every precision
(`with_step_factor`). k is kept within `BOUNDS`: below 1/3.3 the kernels would beat the microbenchmarks by more than
noise explains; above 3.3 they would run under 30% of the measured bandwidth, which a step's kernels did not.

The same step with each decoder layer compiled (as the executor compiles its blocks; the embedding, LM head and
loss eager) gives the compile factor k_c (`apply_compile_factor`): the memory-bound classes' compile factors, from
the one-class chains of `costmodel.calibration.microbench_compile`, times k_c so that the compiled step's
memory-bound kernels are priced as measured. In a block Inductor fuses across classes (the norm into the weight
casts, the SiLU into the gate's product), which one-class chains cannot show: k_c was 0.71 on a lent H100 and
0.63 on an H200 (four Llama-3-8B layers, `benchmarks.h100_measured`, `benchmarks.h200_measured`).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

MEMORY_BOUND = ("arithmetic", "transcendental", "tanh", "softmax", "norm", "dropout")
PRECISIONS = ("bf16", "fp16", "fp32", "tf32")
GROUPS = (("gemm", r"nvjet|cutlass|gemm|xmma"), ("attention", r"sdpa|flash|fmha"), ("optimizer", r"multi_tensor_apply"))
"""CUDA kernel name patterns of each compute-bound group (cuBLAS, cuDNN/flash attention, torch's fused optimizer);
every other kernel is memory-bound."""
BOUNDS = (1 / 3.3, 3.3)
REFERENCE = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 2,
             "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000,
             "max_position_embeddings": 4096, "tie_word_embeddings": False}
REFERENCE_BATCH, REFERENCE_SEQ = 4, 2048


def kernel_groups(kernels: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Seconds per group of (CUDA kernel name, seconds) pairs: `GROUPS` by name, the rest memory-bound."""
    out = {name: 0.0 for name, _ in GROUPS} | {"memory-bound": 0.0}
    for name, seconds in kernels:
        out[next((g for g, pattern in GROUPS if re.search(pattern, name)), "memory-bound")] += seconds
    return out


def priced_groups(graph: Any, device: Any, micro_batch: int, precision: str = "bf16",
                  compile: bool = False) -> dict[str, float]:
    """What `device` prices one forward and backward of `graph` at, per group (no optimizer, no host floor);
    `compile`: its blocks under torch.compile, as the executor runs them."""
    from costmodel.opcost import kernel_class, op_time

    out = {"gemm": 0.0, "attention": 0.0, "memory-bound": 0.0}
    for segment in graph.segments():
        for op in segment.ops:
            cost = op_time(op, device=device, precision=precision, micro_batch=micro_batch, batch_traced=graph.batch,
                           compile=compile)
            kind = kernel_class(op)
            group = "gemm" if kind == "matmul" else "attention" if kind == "attention" else "memory-bound"
            out[group] += (cost.fwd_s + cost.bwd_s) * segment.repeat
    return out


def with_step_factor(device_json: dict, k: float, source: str) -> dict:
    """`device_json` with every memory-bound class's kernel factor multiplied by `k` (flat `k` where it had none)."""
    out = json.loads(json.dumps(device_json))
    table = out.setdefault("kernel_factors", {"source": "", "factors": {}})
    factors = table["factors"]
    for kind in MEMORY_BOUND:
        for precision in PRECISIONS:
            key = f"{kind}/{precision}"
            factors[key] = [[x, round(v * k, 4)] for x, v in factors[key]] if key in factors else [[1.0, round(k, 4)]]
    table["source"] = "; ".join(p for p in (table.get("source", ""), f"{', '.join(MEMORY_BOUND)} (every precision) "
                                            f"x{k:.2f}: {source}") if p)
    return out


def with_compile_factor(device_json: dict, k: float, source: str) -> dict:
    """`device_json` with every memory-bound class's torch.compile factor (`compile_factors`, both passes)
    multiplied by `k` (flat `k` where it had none), within `MIN_COMPILE_FACTOR`..1: compiled kernels are
    no slower than eager ones."""
    from costmodel.profiles_json import MIN_COMPILE_FACTOR

    def bound(v: float) -> float:
        return round(min(max(v, MIN_COMPILE_FACTOR), 1.0), 4)

    out = json.loads(json.dumps(device_json))
    table = out.setdefault("compile_factors", {"source": "", "factors": {}})
    factors = table["factors"]
    for kind in MEMORY_BOUND:
        for direction in ("fwd", "bwd"):
            key = f"{kind}/{direction}"
            factors[key] = [[x, bound(v * k)] for x, v in factors[key]] if key in factors else [[1.0, bound(k)]]
    table["source"] = "; ".join(p for p in (table.get("source", ""), f"{', '.join(MEMORY_BOUND)} (both passes) "
                                            f"x{k:.2f}: {source}") if p)
    return out


def apply_compile_factor(device_json: dict, measured: dict[str, float], *, graph: Any, micro_batch: int,
                         source: str, step: str) -> tuple[dict, float]:
    """`device_json` with the compile factor of a profiled compiled step (`measured`, seconds by group; the
    executor's step: blocks compiled, the rest eager), and the factor k_c: solved like the step factor, so that

        T_priced(memory-bound, blocks compiled; k_c) = T_measured(memory-bound)

    The microbenchmarks' compile chains fuse one class alone; in a block Inductor fuses across classes (the
    norm into the weight casts, the SiLU into the gate's product, RoPE into the projections), so on a step
    each class's factor is smaller than its chain's. k_c scales them all alike."""
    import functools

    from costmodel.profiles_json import device_from_json

    @functools.cache
    def price(k: float) -> float:
        scaled = with_compile_factor(device_json, k, "") if k != 1 else device_json
        return priced_groups(graph, device_from_json(scaled, "calibrated device"), micro_batch,
                             compile=True)["memory-bound"]

    # compile factors scale a kernel's launch too and are capped at 1, so probe below 1: price = C + k B there
    # (C the eager ops outside the blocks), and k stops where the largest factor reaches 1
    at_1, at_half = price(1.0), price(0.5)
    table = device_json.get("compile_factors", {}).get("factors", {})
    largest = max((v for key, curve in table.items() if key.split("/")[0] in MEMORY_BOUND for _, v in curve),
                  default=1.0)
    blocks = 2 * (at_1 - at_half)
    k = 1 + (measured["memory-bound"] - at_1) / blocks if blocks > 0 else 1.0
    k = min(max(k, 0.05), 1 / largest)
    note = (f"a profiled compiled bf16 training step's memory-bound kernels ({measured['memory-bound'] * 1e3:.1f} ms; "
            f"{step}) over this profile's price of the same ops, blocks compiled ({price(1.0) * 1e3:.1f} ms), {source}")
    return with_compile_factor(device_json, k, note), k


def reference_config() -> Any:
    """`REFERENCE` as a transformers config."""
    from transformers import AutoConfig

    fields = dict(REFERENCE)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def reference_graph() -> Any:
    """`REFERENCE` traced at its batch and sequence in the executor's bf16 autocast regime."""
    import tracer

    return tracer.trace(reference_config(), task="causal-lm", seq_len=REFERENCE_SEQ, batch=REFERENCE_BATCH,
                        dtype="autocast-bfloat16")


def cuda_kernels(prof: Any) -> list[tuple[str, float]]:
    """(name, seconds) of every CUDA kernel a torch.profiler run recorded, one entry per launch. User annotations
    on the GPU timeline (`Optimizer.step#AdamW.step`, `record_function` ranges) are device events too but span
    kernels already counted: they are left out (counted, they put the optimizer step into the memory-bound sum a
    second time)."""
    import torch

    return [(e.name, e.device_time_total * 1e-6) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def measure_step(warmup: int = 3, compile: bool = False) -> dict[str, float]:
    """One profiled bf16-autocast training step of `REFERENCE` on the GPU, its kernels' seconds by group; `compile`:
    each decoder layer torch.compiled in place, as the executor compiles its blocks (`executor.api.compile_blocks`)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    import tracer

    model = tracer.build_model(tracer.resolve_spec(reference_config(), task="causal-lm"), device="cuda")
    if compile:
        for layer in model.model.layers:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, REFERENCE["vocab_size"], (REFERENCE_BATCH, REFERENCE_SEQ), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids, use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    time.sleep(0.1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    del model, optimizer
    torch.cuda.empty_cache()
    return kernel_groups(cuda_kernels(prof))


def apply_step_factor(device_json: dict, measured: dict[str, float], *, source: str, graph: Any = None,
                      micro_batch: int = REFERENCE_BATCH,
                      step: str = "REFERENCE of costmodel.calibration.step_factor") -> tuple[dict, float]:
    """`device_json` with the step factor of a profiled step (`measured`, seconds by group), and k: by default the
    `REFERENCE` step calibrate runs; another profiled step passes its `graph`, `micro_batch` and what it was."""
    import functools

    from costmodel.profiles_json import device_from_json

    graph = reference_graph() if graph is None else graph

    @functools.cache
    def price(k: float) -> float:
        scaled = with_step_factor(device_json, k, "") if k != 1 else device_json
        return priced_groups(graph, device_from_json(scaled, "calibrated device"), micro_batch)["memory-bound"]

    k = solve_step_factor(price, measured["memory-bound"])
    note = (f"a profiled bf16 training step's memory-bound kernels ({measured['memory-bound'] * 1e3:.1f} ms; "
            f"{step}) over this profile's price of the same ops ({price(1.0) * 1e3:.1f} ms), {source}")
    return with_step_factor(device_json, k, note), k


def solve_step_factor(price: Callable[[float], float], measured_s: float,
                      bounds: tuple[float, float] = BOUNDS) -> float:
    """The k at which `price(k)` (the memory-bound ops' price with the factor) is `measured_s`, within `bounds`.
    A factor scales a kernel's data time, not its launch, so the price is L + k D: two prices give L and D."""
    at_1, at_2 = price(1.0), price(2.0)
    data = at_2 - at_1
    k = (measured_s - (at_1 - data)) / data if data > 0 else measured_s / at_1
    return min(max(k, bounds[0]), bounds[1])
