"""torch.compile against eager, per kernel class: the measurement behind a device's `compile_factors`.

What compile changes is fusion: Inductor merges an elementwise op into its neighbours' loop, so the
memory passes and the launches between them disappear, while a matmul or an attention core stays the
library kernel it was. One op timed alone would miss that, so each class is timed inside the chain it
sits in in Hugging Face models (`CHAINS`):

    arithmetic      (x * a + r) * b + x              residual, bias and scale glue (all arithmetic)
    transcendental  silu(g) * u                      Llama / Mistral / Qwen SwiGLU
    tanh            0.5 x (1 + tanh(c (x + k x^3)))  GPT-2's gelu_new
    softmax         softmax(s * scale + mask)        eager attention's scores
    norm            layer_norm(x + r)                BERT / GPT-2 residual then norm
    dropout         dropout(x) + r                   residual dropout
    matmul          a @ b                            (compile keeps the BLAS kernel)
    attention       sdpa(q, k, v, causal)            (compile keeps the fused kernel)

For each chain and size, the forward (autograd recording) and the backward (`torch.autograd.grad` after
an untimed forward, so no accumulation) are timed eager (T_e) and under
`torch.compile(fullgraph=True, dynamic=False)` (T_c) with `microbench.time_kernel`, in `rounds` rounds
keeping each time's fastest. The class's factor is the chain's ratio

    f[class/pass] = T_c / T_e

charged to every op of the chain in the class's name: the glue ops (a mul, an add) are priced at their own
class's factor by `costmodel.opcost`, so this assumes the fusion saves the same share of each op of a chain
(true of one fused loop, which reads and writes each tensor once whatever the op). Sizes start at 2 MiB
tensors: a compiled graph pays a fixed host cost per call (guards, the wrapper) that a model's block of
dozens of ops pays once, and a chain of two ops at a small size would charge it all to those two.

Each factor is stored against the class op's x as `costmodel.opcost` evaluates it: bytes (FLOPs for matmul
and attention) of the forward kernel, and of one backward kernel for `bwd`. A class/pass is stored only
when every size agrees, all below 1 - `NOISE_BAND` or all above 1 + `NOISE_BAND` (`consistent`): the
same kernel, or sizes that disagree, are noise on a shared machine, and noise must not make the search pick
compile. The raw times go to the table's notes with the seconds of each chain's first compiled call (the
one-time compilation, or a hit in Inductor's on-disk cache; not part of a step, so not priced). Datasheet GPU profiles carry no compile factors: no published measurement gives per-class numbers,
and soap invents none (`soap calibrate --device cuda` measures them on the GPU, at `GPU_SIZES`; the fitted
`dgx-h100` carries the one factor its published compiled runs give).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from costmodel.calibration.microbench import DROPOUT_P, KernelCase, TimingConfig, time_kernel
from costmodel.opcost import MATMUL_LIKE, backward_kernels
from costmodel.profiles_json import MAX_COMPILE_FACTOR, MIN_COMPILE_FACTOR

NOISE_BAND = 0.05
"""Factors within 5% of 1 are left out of the profile (no change): run-to-run noise on a shared machine."""

CHAIN_OPS: dict[str, str] = {
    "arithmetic": "add", "transcendental": "silu", "tanh": "tanh", "softmax": "softmax", "norm": "layer_norm",
    "dropout": "dropout", "matmul": "mm", "attention": "sdpa",
}
"""The `microbench.KernelCase` op of each class's own kernel (its x in the profile)."""

SIZES: dict[str, tuple[tuple[int, ...], ...]] = {
    "elementwise": ((512, 1024), (2048, 2048)),
    "matmul": ((256, 1024, 1024), (1024, 1024, 1024)),
    "attention": ((1, 8, 256, 64), (1, 8, 1024, 64)),
}
GPU_SIZES: dict[str, tuple[tuple[int, ...], ...]] = {
    "elementwise": ((8192, 4096), (16384, 8192)),
    "matmul": ((4096, 4096, 4096), (8192, 8192, 8192)),
    "attention": ((4, 16, 2048, 128), (2, 32, 4096, 128)),
}
"""On a GPU, training-sized tensors (128 MiB to 512 MiB per fp32 operand): at the CPU sizes a compiled graph's
fixed host cost (~0.1 ms a call) dominates a 0.05 ms chain, and a lent H200 measured compile as a slowdown
(factors 1.2-4) while a compiled gpt2 step ran 1.55x faster than eager (docs/benchmarks.md, "One H200")."""
QUICK_SIZES: dict[str, tuple[tuple[int, ...], ...]] = {
    "elementwise": ((64, 256),), "matmul": ((64, 128, 128),), "attention": ((1, 2, 64, 32),),
}


@dataclass(frozen=True)
class CompileSample:
    """One class at one shape: the chain's (forward, backward) seconds, eager and compiled."""

    kernel: str
    shape: tuple[int, ...]
    chain_eager: tuple[float, float]
    chain_compiled: tuple[float, float]
    compile_s: float
    """One-time compilation (first call of the compiled chain, forward and backward)."""

    def ratio(self, direction: str) -> float:
        i = ("fwd", "bwd").index(direction)
        return self.chain_compiled[i] / self.chain_eager[i]

    @property
    def case(self) -> KernelCase:
        return KernelCase(CHAIN_OPS[self.kernel], self.shape, "float32")

    def x(self, direction: str) -> float:
        """The class op's size as `costmodel.opcost` evaluates a factor: FLOPs (matmul, attention) or
        bytes of the forward kernel, or of one backward kernel."""
        node = self.case.op_node()
        if direction == "fwd":
            return float(node.fwd_flops if node.kind in MATMUL_LIKE else node.bytes_moved)
        kernels = backward_kernels(node)
        return float(node.bwd_flops / kernels if node.kind in MATMUL_LIKE else 2 * node.bytes_moved / kernels)


def _shapes(kernel: str, quick: bool, device: str = "cpu") -> tuple[tuple[int, ...], ...]:
    table = QUICK_SIZES if quick else GPU_SIZES if device.startswith("cuda") else SIZES
    return table[kernel if kernel in ("matmul", "attention") else "elementwise"]


def chain(kernel: str, shape: tuple[int, ...], device: str) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]:
    """(the class's chain, its inputs) at `shape` (`CHAINS` in the module docstring)."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*dims: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(*dims, generator=gen).to(device).requires_grad_(grad)

    if kernel == "matmul":
        m, k, n = shape
        return torch.mm, (rand(m, k), rand(k, n))
    if kernel == "attention":
        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return sdpa, (rand(*shape), rand(*shape), rand(*shape))
    rows, cols = shape
    x, r = rand(rows, cols), rand(rows, cols)
    chains: dict[str, tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]] = {
        "arithmetic": (lambda x, r: (x * 0.5 + r) * 1.5 + x, (x, r)),
        "transcendental": (lambda g, u: F.silu(g) * u, (x, r)),
        "tanh": (lambda x: 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0)))), (x,)),
        "softmax": (lambda s, m: torch.softmax(s * 0.125 + m, dim=-1), (x, torch.zeros(rows, cols, device=device))),
        "norm": (lambda x, r, w, b: F.layer_norm(x + r, (cols,), w, b), (x, r, rand(cols), rand(cols))),
        "dropout": (lambda x, r: F.dropout(x, DROPOUT_P, training=True) + r, (x, r)),
    }
    if kernel not in chains:
        raise ValueError(f"no compile chain for kernel class {kernel!r}")
    return chains[kernel]


def _fwd_bwd(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], device: str,
             timing: TimingConfig) -> tuple[float, float]:
    """(forward, backward) seconds: the forward with autograd recording (`time_kernel`); the backward as
    the median of `timing.samples` timed `torch.autograd.grad` calls, each on a fresh untimed forward (a
    compiled backward cannot run twice on one graph)."""
    grads = [t for t in inputs if t.requires_grad]
    fwd = time_kernel(lambda: fn(*inputs), device, timing)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = []
    for i in range(timing.warmup + max(3, timing.samples)):
        out = fn(*inputs)
        seed = torch.ones_like(out)
        sync()
        start = time.perf_counter()
        torch.autograd.grad(out, grads, seed)
        sync()
        if i >= timing.warmup:
            times.append(time.perf_counter() - start)
    return fwd, statistics.median(times)


def measure_class(kernel: str, shape: tuple[int, ...], device: str, timing: TimingConfig) -> CompileSample:
    fn, inputs = chain(kernel, shape, device)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    start = time.perf_counter()
    out = compiled(*inputs)
    torch.autograd.grad(out, [t for t in inputs if t.requires_grad], torch.ones_like(out))
    compile_s = time.perf_counter() - start
    return CompileSample(kernel=kernel, shape=shape, chain_eager=_fwd_bwd(fn, inputs, device, timing),
                         chain_compiled=_fwd_bwd(compiled, inputs, device, timing), compile_s=compile_s)


def measure_compile(device: str, *, threads: int = 1, quick: bool = False, rounds: int = 2,
                    timing: TimingConfig = TimingConfig(),
                    progress: Callable[[str], None] = lambda _: None) -> list[CompileSample]:
    """Every class at every size, `rounds` times, keeping each time's fastest round (a shared machine slows
    rounds down, never speeds one up); `threads` torch threads (a CPU rank's cores)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = []
        for kernel, shape in compile_cases(quick, device):
            runs = [measure_class(kernel, shape, device, timing) for _ in range(rounds)]
            out.append(CompileSample(
                kernel=kernel, shape=shape,
                chain_eager=tuple(min(r.chain_eager[i] for r in runs) for i in (0, 1)),
                chain_compiled=tuple(min(r.chain_compiled[i] for r in runs) for i in (0, 1)),
                compile_s=runs[0].compile_s,
            ))
            progress(f"compile {kernel} {'x'.join(map(str, shape))}")
        return out
    finally:
        torch.set_num_threads(old)


def compile_cases(quick: bool = False, device: str = "cpu") -> list[tuple[str, tuple[int, ...]]]:
    """(kernel class, shape) of every chain `measure_compile` times on `device`."""
    return [(kernel, shape) for kernel in CHAIN_OPS for shape in _shapes(kernel, quick, device)]


def class_factors(samples: Sequence[CompileSample], *, low: float = MIN_COMPILE_FACTOR,
                  high: float = MAX_COMPILE_FACTOR) -> dict[str, list[tuple[float, float]]]:
    """`{"class/pass": [(x, factor), ...]}`: each chain's compiled-over-eager ratio, within [low, high],
    every measured class included (the caller drops the ones within the noise band)."""
    table: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for direction in ("fwd", "bwd"):
            factor = min(max(s.ratio(direction), low), high)
            table.setdefault(f"{s.kernel}/{direction}", []).append((s.x(direction), factor))
    return {k: sorted(v) for k, v in sorted(table.items())}


def consistent(factors: Iterable[float]) -> bool:
    """Whether a class's factors say the same thing at every size: all below 1 - NOISE_BAND (compile is
    faster) or all above 1 + NOISE_BAND (slower). Anything else is priced as no change."""
    values = list(factors)
    return bool(values) and (all(f < 1 - NOISE_BAND for f in values) or all(f > 1 + NOISE_BAND for f in values))


def _label(s: CompileSample) -> str:
    return f"{s.kernel} {'x'.join(map(str, s.shape))}"


def compile_factors_json(samples: Sequence[CompileSample], *, source: str, low: float = MIN_COMPILE_FACTOR,
                         high: float = MAX_COMPILE_FACTOR) -> dict:
    """The device profile's `compile_factors` object: the classes outside the noise band, and notes (every
    class's ratios, the eager and compiled milliseconds, the compile seconds)."""
    factors = class_factors(samples, low=low, high=high)
    kept = {k: [[float(f"{x:.4g}"), float(f"{f:.3g}")] for x, f in pts] for k, pts in factors.items()
            if consistent(f for _, f in pts)}
    return {
        "source": source,
        "notes": {
            "method": "costmodel.calibration.microbench_compile: each class in its Hugging Face chain, eager against "
                      "torch.compile(fullgraph=True, dynamic=False), forward and backward, fastest of the rounds; "
                      f"factor = compiled / eager chain time; a class/pass is kept only where every size is more than "
                      f"{NOISE_BAND:.0%} from 1 on the same side, else left out (= 1)",
            "eager_ms_fwd_bwd": {_label(s): [round(1e3 * t, 4) for t in s.chain_eager] for s in samples},
            "compiled_ms_fwd_bwd": {_label(s): [round(1e3 * t, 4) for t in s.chain_compiled] for s in samples},
            "compile_s": {_label(s): round(s.compile_s, 2) for s in samples},
        },
        "factors": kept,
    }
