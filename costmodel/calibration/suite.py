"""What `soap calibrate` measures: kernel sweeps and collective sweeps, full or quick.

Each sweep is a list of cases along one axis (a kernel at growing shapes, a collective at growing
message sizes). Held-out validation splits every sweep by position (`fit.held_out`), so
held-out points lie between fitted ones and test interpolation, never extrapolation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from costmodel.calibration.microbench import MEMORY_BOUND_OPS, KernelCase
from costmodel.calibration.microbench_comm import COMM_KINDS, CommCase

OVERHEAD_CASE = KernelCase("add", (1, 1), "float32")
"""A kernel that moves 12 bytes: its time is the per-kernel overhead."""


@dataclass(frozen=True)
class Sweep:
    name: str
    cases: tuple


def kernel_dtypes(device: str) -> tuple[tuple[str, str], ...]:
    """(dtype, precision key) pairs worth measuring on `device`: fp32 and bf16 on CPU; on CUDA also
    fp16, tf32 (fp32 tensors with TF32 matmuls) and fp8 where the GPU has it (compute capability ≥ 8.9)."""
    if device == "cpu":
        return (("float32", "fp32"), ("bfloat16", "bf16"))
    pairs = [("float32", "fp32"), ("float32", "tf32"), ("float16", "fp16"), ("bfloat16", "bf16")]
    if torch.cuda.get_device_capability() >= (8, 9):
        pairs.append(("float8_e4m3fn", "fp8"))
    return tuple(pairs)


UNALIGNED_VOCAB = 50257
"""GPT-2's vocabulary: an LM head GEMM whose width is not a multiple of 8 elements (`opcost.unaligned_matmul`)."""
LONG_CONTEXT_SEQS = (8192, 16384, 32768)
"""On a GPU, SDPA is also timed at these sequence lengths with head size 128: an attention factor measured only
up to 4k tokens at head size 64 would be extrapolated to the corpus's 32k-256k-token Llama rows."""


def kernel_sweeps(device: str, *, quick: bool) -> list[Sweep]:
    gpu = device == "cuda"
    scale = 4 if gpu else 1
    squares = [32, 64, 128, 256] if quick else [32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    if gpu:
        squares = [s * scale for s in squares] + ([] if quick else [8192])
    rows_mm = [8, 64, 512] if quick else [8, 32, 128, 256, 512, 1024, 2048]
    rows_mem = [1, 16, 256, 1024] if quick else [2**k for k in range(13)]  # 1 ... 4096, dense: caches bend the curve
    seqs = [64, 128, 256] if quick else [64, 128, 256, 512, 1024]
    mem_ops = ("add", "gelu", "layer_norm", "softmax") if quick else tuple(MEMORY_BOUND_OPS)
    sweeps: list[Sweep] = []
    for dtype, prec in kernel_dtypes(device):
        p = prec if prec == "tf32" else ""
        sweeps.append(Sweep(f"mm square {prec}", tuple(KernelCase("mm", (n, n, n), dtype, p) for n in squares)))
        if dtype == "float8_e4m3fn":
            continue  # fp8 exists for matmuls only
        for k, n in ((512, 2048), (2048, 512), (256, 768), (1024, 256)):
            sweeps.append(Sweep(f"mm m x {k} x {n} {prec}",
                                tuple(KernelCase("mm", (m * scale, k * scale, n * scale), dtype, p) for m in rows_mm)))
        sweeps.append(Sweep(f"bmm scores {prec}", tuple(KernelCase("bmm", (8, s, 64, s), dtype, p) for s in seqs)))
        if gpu and not quick and prec in ("bf16", "fp16"):  # GPT-2's LM head: cuBLAS leaves its fast kernels
            sweeps.append(Sweep(f"mm unaligned {prec}", tuple(KernelCase("mm", (m, 768, UNALIGNED_VOCAB), dtype)
                                                               for m in (1024, 4096, 16384, 32768))))
        if prec == "tf32":
            continue  # TF32 changes matmuls only
        sdpa = [KernelCase("sdpa", (1, 8, s * scale, 64), dtype) for s in seqs]
        if gpu and not quick:  # long context at Llama's head size: the corpus's 32k-256k rows rest on these
            sdpa += [KernelCase("sdpa", (1, 8, s, 128), dtype) for s in LONG_CONTEXT_SEQS]
        sweeps.append(Sweep(f"sdpa {prec}", tuple(sdpa)))
        for op in mem_ops:
            sweeps.append(Sweep(f"{op} {prec}", tuple(KernelCase(op, (r * scale * scale, 1024), dtype) for r in rows_mem)))
    return sweeps


def comm_sizes(*, quick: bool) -> list[int]:
    """Message sizes: 4 KiB to 1 MiB by factors of 4 (quick), or 4 KiB to 64 MiB by factors of 2 (full:
    every held-out size lies between two fitted ones a factor 2 away, and the largest is fitted)."""
    top, step = (1 << 20, 4) if quick else (64 << 20, 2)
    sizes, s = [], 4096
    while s <= top:
        sizes.append(s)
        s *= step
    return sizes


def group_sizes(nproc: int, *, quick: bool) -> list[int]:
    """Collective group sizes: 2, 4, 8 ... up to `nproc` (quick: 2 only)."""
    sizes, n = [], 2
    while n <= nproc:
        sizes.append(n)
        n *= 2
        if quick:
            break
    return sizes


def comm_sweeps(nproc: int, *, quick: bool) -> list[Sweep]:
    """Every collective at every group size, except send_recv beyond 2 ranks: `collective_time` prices a
    send/recv as one pair, so only a lone pair measures what it prices."""
    return [
        Sweep(f"{kind} x{n}", tuple(CommCase(kind, size, n) for size in comm_sizes(quick=quick)))
        for n in group_sizes(nproc, quick=quick)
        for kind in COMM_KINDS
        if kind != "send_recv" or n == 2
    ]
