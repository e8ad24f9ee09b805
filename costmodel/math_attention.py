"""An attention core that runs as torch SDPA's math path: an fp32 or tf32 plan on a GPU.

With 4-byte queries torch's SDPA has neither FlashAttention nor cuDNN, and in a Llama step as soap's executor runs it
(HF's sdpa attention with its causal mask) torch ran the math path, not the memory-efficient kernel: one profiled tf32
step of Llama 3.2 1B (4 x 2,048 tokens a micro-batch, 32 heads of 64) on a lent H200, 2026-11-28
(benchmarks/data/h200-2026-11-28b/step-profile-1b-tf32.json), launched no attention kernel but, per core, TF32
batched GEMMs over the whole [b, h, s_q, s_k] score matrix S and memory-bound kernels over it: `where` (the mask,
forward and backward; 0.83 ms each), softmax (1.37 ms) and its backward (1.48 ms), `isneginf` (0.61 ms) and a boolean
`all` (0.29 ms), the fully-masked-row check of torch's `_safe_softmax`. The memory-efficient kernel alone at that
shape and mask (benchmarks/sdpa_fp32.py) was slower still (15.9 ms forward and backward against the math path's
12.5 ms), so the price does not hinge on which of the two a given call picks. The memory model keeps eager's saves
for the same regime (`costmodel.memory_activations.SDPA_FP32`).

Priced per core, on the local S = fwd_flops / (4 d) scores (the op's FLOPs are the full square's: 2 x 2 S d
forward, 4 x 2 S d backward, `torch.utils.flop_counter.sdpa_flop_count`), with w = 4 bytes a score:

    forward   2 GEMMs of 2 S d FLOPs, each moving S w bytes (Q K^T writes S, P V reads it)
              + passes over S of MATH_FWD_BYTES bytes a score: where (read, write), softmax (read, write),
                isneginf (read, a byte written), all (a byte read)
    backward  4 GEMMs of 2 S d FLOPs, each moving S w bytes (dP = dO V^T writes S; dV = P^T dO, dQ = dS K,
                dK = dS^T Q read it)
              + MATH_BWD_BYTES a score: softmax's backward (P and dP read, dS written), the mask's where

each GEMM a roofline kernel at the precision's matmul peak, efficiency and `matmul` factor (`opcost.kernel_time`;
at head size 64 they are bound by S's bytes), each pass at the device's memory curve with no kernel factor (these
passes stream gigabytes: the profile's ran at 79-97% of the H200's datasheet bandwidth, where the profiled bf16
step's small elementwise kernels ran 2.5x slower than that). On the profiled step (per core, 4 x 32 x 2,048^2
scores) the memory-bound kernels are priced 5.29 ms on `h200-x1-measured` against 5.41 ms measured, the core 8.77 ms
in all (the fused kernel's price had been 1.17; its six GEMMs are priced 3.48 ms, which the profile's kernel names do
not separate from the weight GEMMs'), and the tf32 step 1.53 s against 1.85 measured (1.05 s before). Under
torch.compile the core is priced the same (not measured). `tests/test_math_attention.py` holds these numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SCORE_BYTES = 4
"""Bytes of a score in S: fp32 (tf32 and fp32 plans keep fp32 activations)."""
MATH_FWD_BYTES = 4 + 4 + 4 + 4 + 4 + 1 + 1
"""Bytes a score the forward's memory-bound kernels move: where (4 read, 4 written), softmax (4, 4), isneginf (4
read, 1 written), all (1 read)."""
MATH_BWD_BYTES = 4 + 4 + 4 + 4 + 4
"""Bytes a score the backward's memory-bound kernels move: softmax's backward (P and dP read, dS written), where
(4 read, 4 written)."""
FWD_GEMMS, BWD_GEMMS = 2, 4


def runs_math_path(device: Any, precision: str) -> bool:
    """Whether an attention core runs as SDPA's math path: on a GPU at a 4-byte precision (fp32, tf32)."""
    return device.kind == "gpu" and precision in ("fp32", "tf32")


def math_core_time(head_dim: int, fwd_flops: float, bwd_flops: float, *, gemm_time: Callable[[float, float], float],
                   pass_time: Callable[[float], float]) -> tuple[float, float]:
    """(forward, backward) seconds of one core of `fwd_flops` / `bwd_flops` (local) as the math path (module
    docstring); `gemm_time(flops, nbytes)` prices one GEMM, `pass_time(nbytes)` one memory-bound pass."""
    scores = fwd_flops / (4 * head_dim) if head_dim > 0 else 0.0
    if scores <= 0:
        return 0.0, 0.0
    s_bytes = scores * SCORE_BYTES
    fwd = FWD_GEMMS * gemm_time(fwd_flops / FWD_GEMMS, s_bytes) + pass_time(scores * MATH_FWD_BYTES)
    if bwd_flops <= 0:
        return fwd, 0.0
    return fwd, BWD_GEMMS * gemm_time(bwd_flops / BWD_GEMMS, s_bytes) + pass_time(scores * MATH_BWD_BYTES)
