"""Single-device microbenchmarks: the kernels whose timings calibrate a device profile.

A `KernelCase` names one kernel at one shape and dtype. It knows three things:
- how to build the torch call that runs it (`build_kernel`), on CPU or CUDA;
- its FLOPs and bytes moved, counted the way `tracer` counts them for an `OpNode`
  (matmul: 2·m·k·n FLOPs and every operand read or written once; memory-bound kernels: no FLOPs, their
  inputs, weights and output once; attention: 4·b·h·s²·d FLOPs for QKᵀ and PV, causal or not);
- the `OpNode` the cost model prices for it (`KernelCase.op_node`), so held-out points are predicted
  by the very function the simulator uses.

Timing (`time_kernel`): warm-up calls, then repeated samples of `inner` back-to-back calls each long
enough (≥ `sample_s`) for the timer's resolution not to matter; the result is the median sample divided
by `inner`. Every call pays its own dispatch, so per-kernel overhead stays in the figure. On CUDA the
samples are bracketed by `torch.cuda.synchronize()`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tracer.ir import DimRole, OpKind, OpNode, ParamMeta, TensorMeta

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

PRECISION_OF_DTYPE: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}
"""The profile's precision key for each tensor dtype (tf32 is fp32 tensors with TF32 matmuls on)."""

MEMORY_BOUND_OPS: dict[str, OpKind] = {
    "add": OpKind.ELEMENTWISE,
    "mul": OpKind.ELEMENTWISE,
    "gelu": OpKind.ELEMENTWISE,
    "silu": OpKind.ELEMENTWISE,
    "tanh": OpKind.ELEMENTWISE,
    "dropout": OpKind.ELEMENTWISE,
    "layer_norm": OpKind.NORM,
    "rms_norm": OpKind.NORM,
    "softmax": OpKind.SOFTMAX,
}
"""Memory-bound kernels by name, with the OpKind the tracer gives them."""

DROPOUT_P = 0.1
"""Dropout probability of the dropout case (GPT-2's and BERT's default); its cost is the random mask."""

_S, _A, _P, _N = DimRole.SAMPLE, DimRole.ATTRIBUTE, DimRole.PARAMETER, DimRole.NONE


@dataclass(frozen=True)
class KernelCase:
    """One kernel at one shape and dtype.

    `shape` by op: mm (m, k, n); bmm (b, m, k, n); memory-bound ops (rows, cols) with the norm or
    softmax over cols; sdpa (batch, heads, seq, head_dim), causal.
    """

    op: str
    shape: tuple[int, ...]
    dtype: str
    precision: str = ""
    """The profile precision key; defaults to the dtype's (set "tf32" for fp32 with TF32 matmuls)."""

    @property
    def precision_key(self) -> str:
        return self.precision or PRECISION_OF_DTYPE[self.dtype]

    @property
    def kind(self) -> OpKind:
        if self.op in ("mm", "bmm"):
            return OpKind.MATMUL
        if self.op == "sdpa":
            return OpKind.ATTENTION
        return MEMORY_BOUND_OPS[self.op]

    @property
    def family(self) -> str:
        """The kernel family results are reported by: matmul, attention, elementwise, norm, softmax."""
        return self.kind.value

    @property
    def label(self) -> str:
        return f"{self.op} {'x'.join(map(str, self.shape))} {self.precision_key}"

    @property
    def itemsize(self) -> int:
        return TensorMeta((), self.dtype, ()).itemsize

    @property
    def flops(self) -> float:
        return float(self.op_node().fwd_flops)

    @property
    def bytes_moved(self) -> float:
        return float(self.op_node().bytes_moved)

    def op_node(self) -> OpNode:
        """The OpNode the tracer would record for this kernel (batch dimension = SAMPLE)."""
        dt = self.dtype
        if self.op == "mm":
            m, k, n = self.shape
            x, w, y = TensorMeta((m, k), dt, (_S, _P)), TensorMeta((k, n), dt, (_P, _P)), TensorMeta((m, n), dt, (_S, _P))
            return _node(self, OpKind.MATMUL, "aten.mm.default", (x, w), (y,), 2 * m * k * n, ())
        if self.op == "bmm":
            b, m, k, n = self.shape
            x, w = TensorMeta((b, m, k), dt, (_S, _A, _P)), TensorMeta((b, k, n), dt, (_S, _P, _A))
            y = TensorMeta((b, m, n), dt, (_S, _A, _A))
            return _node(self, OpKind.MATMUL, "aten.bmm.default", (x, w), (y,), 2 * b * m * k * n, ())
        if self.op == "sdpa":
            b, h, s, d = self.shape
            q = TensorMeta((b, h, s, d), dt, (_S, _P, _A, _N))
            attrs = {"heads": h, "kv_heads": h, "head_dim": d, "causal": True}
            return _node(
                self, OpKind.ATTENTION, "aten.scaled_dot_product_attention.default", (q, q, q), (q,),
                4 * b * h * s * s * d, (), attrs,
            )
        rows, cols = self.shape
        x = TensorMeta((rows, cols), dt, (_S, _P))
        if self.op in ("add", "mul"):
            return _node(self, self.kind, f"aten.{self.op}.Tensor", (x, x), (x,), 0, ())
        if self.op in ("gelu", "silu", "tanh", "dropout"):
            return _node(self, self.kind, f"aten.{self.op}.default", (x,), (x,), 0, ())
        if self.op == "softmax":
            return _node(self, self.kind, "aten._softmax.default", (x,), (x,), 0, ())
        weights = ("weight",) if self.op == "rms_norm" else ("weight", "bias")
        params = tuple(ParamMeta(f"norm.{w}", (cols,), dt) for w in weights)
        return _node(self, self.kind, f"aten.{self.op}.default", (x, *params_as_inputs(params)), (x,), 0, ())


def params_as_inputs(params: tuple[ParamMeta, ...]) -> tuple[TensorMeta, ...]:
    """Norm weights as the tracer records them: extra inputs of the op."""
    return tuple(TensorMeta(p.shape, p.dtype, (_P,)) for p in params)


def _node(case: KernelCase, kind: OpKind, target: str, inputs, outputs, flops: int, params, attrs=None) -> OpNode:
    param_bytes = sum(p.numel * TensorMeta((), p.dtype, ()).itemsize for p in params)
    moved = sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs) + param_bytes
    return OpNode(
        name=f"calibrate.{case.op}",
        kind=kind,
        target=target,
        module_fqn="calibrate",
        block_id=None,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        params=tuple(params),
        fwd_flops=int(flops),
        bwd_flops=int(2 * flops),
        bytes_moved=int(moved),
        saved=(),
        attrs=attrs or {},
    )


def build_kernel(case: KernelCase, device: str) -> Callable[[], object]:
    """Allocate the case's operands on `device` and return a zero-argument call running the kernel once."""
    dt = TORCH_DTYPES[case.dtype]
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, dtype=torch.float32)
        return t.to(device=device, dtype=dt)

    if case.op in ("mm", "bmm"):
        torch.backends.cuda.matmul.allow_tf32 = case.precision_key == "tf32"  # stays so while this case is timed
    if case.op == "mm":
        m, k, n = case.shape
        a, b = rand(m, k), rand(n, k).t() if dt == torch.float8_e4m3fn else rand(k, n)
        if dt == torch.float8_e4m3fn:
            one = torch.ones((), device=device)
            return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return lambda: torch.mm(a, b)
    if case.op == "bmm":
        bs, m, k, n = case.shape
        a, b = rand(bs, m, k), rand(bs, k, n)
        return lambda: torch.bmm(a, b)
    if case.op == "sdpa":
        bs, h, s, d = case.shape
        q, k_, v = rand(bs, h, s, d), rand(bs, h, s, d), rand(bs, h, s, d)
        return lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True)
    rows, cols = case.shape
    x, y = rand(rows, cols), rand(rows, cols)
    w, bias = rand(cols), rand(cols)
    calls: dict[str, Callable[[], object]] = {
        "add": lambda: torch.add(x, y),
        "mul": lambda: torch.mul(x, y),
        "gelu": lambda: F.gelu(x),
        "silu": lambda: F.silu(x),
        "tanh": lambda: torch.tanh(x),
        "dropout": lambda: F.dropout(x, DROPOUT_P, training=True),
        "layer_norm": lambda: F.layer_norm(x, (cols,), w, bias),
        "rms_norm": lambda: F.rms_norm(x, (cols,), w),
        "softmax": lambda: torch.softmax(x, dim=-1),
    }
    return calls[case.op]


@dataclass(frozen=True, kw_only=True)
class TimingConfig:
    """How long and how often each kernel is timed."""

    warmup: int = 3
    """Untimed calls before measuring (allocator, caches, lazy initialisation)."""
    samples: int = 7
    """Timed samples; the median is kept."""
    sample_s: float = 2e-3
    """Minimum length of one sample: fast kernels are called `inner` times back to back to reach it."""
    max_case_s: float = 1.0
    """Soft cap on the time spent measuring one case (fewer samples for slow kernels, never fewer than 3)."""


def time_kernel(call: Callable[[], object], device: str, timing: TimingConfig) -> float:
    """Median seconds per call of `call` (see the module docstring)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(timing.warmup):
        call()
    sync()
    start = time.perf_counter()
    call()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, int(timing.sample_s / once))
    samples = max(3, min(timing.samples, int(timing.max_case_s / (once * inner))))
    times = []
    for _ in range(samples):
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            call()
        sync()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def host_link_bandwidth(device: str, timing: TimingConfig, nbytes: int = 256 << 20) -> float | None:
    """Bytes/s of a pinned host-to-device copy on CUDA; None on CPU, where host memory is device memory."""
    if not device.startswith("cuda"):
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / time_kernel(lambda: dev.copy_(host, non_blocking=True), device, timing)


@dataclass(frozen=True)
class KernelSample:
    """One measured kernel."""

    case: KernelCase
    seconds: float


def measure_case(case: KernelCase, device: str, timing: TimingConfig) -> KernelSample:
    return KernelSample(case, time_kernel(build_kernel(case, device), device, timing))
