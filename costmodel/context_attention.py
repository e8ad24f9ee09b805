"""Context parallelism's attention kernels, priced as the layout that runs them.

soap counts an attention core's FLOPs over its whole score matrix (4 b h s_q s_k d forward, causal or not), the
convention its attention rate is calibrated in: on causal kernels (`costmodel.calibration.microbench`), which
compute half the pairs. So a kernel that computes P query-key pairs is priced at the FLOPs of 2P pairs: a causal
square of n, n^2; a lower-right block of c queries by K keys (c K - c^2/2 pairs), 2 c K - c^2. Under context
parallelism cp the op's local FLOPs F are the whole causal attention's over cp (`costmodel.opcost`: the score
tensor shrinks by cp).

Layout "all-gather", soap's executor (`executor.context_parallel`): rank r holds chunks r and 2 cp - 1 - r of
c = S / (2 cp) tokens and attends each to the gathered keys at or before it, one lower-right causal kernel each.
Every rank's pairs add up to the same; rank 0's two kernels are priced:

    square       c x c (the sequence's first chunk):  F_sq = F / (4 cp)
    lower-right  c x 2 cp c (its last):               F_lr = F (4 cp - 1) / (4 cp)        F_sq + F_lr = F

each one kernel on the efficiency curve at its own FLOPs, the op's bytes shared in proportion to the keys each
reads (1 : 2 cp). torch runs a square lower-right mask as its causal kernel (the calibrated one) and a
rectangular one on FlashAttention-2 (or the memory-efficient kernel where that cannot run): the lower-right kernel
takes the device's `kernel_factors["attention-lower-right/<precision>"]` at its FLOPs, its time over the calibrated
causal kernel's (`LOWER_RIGHT_CLASS`; 1 where absent: a device whose causal kernel is FlashAttention-2 already). On a
lent H100 (torch 2.11, which runs whole causal attention on cuDNN's kernels) the executor's rank took 1.71-1.87x the
whole causal attention's time over cp at 32k-131k tokens and 2.2-6.7x at 4k-16k (`benchmarks/cp_attention.py`,
`benchmarks/data/h100-2026-11-27-cp/`): FlashAttention-2 is 1.76x cuDNN's time on whole causal attention
(`H100_LOWER_RIGHT`), and more on small kernels; the Hopper profiles carry the factor fitted by FLOPs
(`H100_LOWER_RIGHT_CURVE`).

Layout "ring" (`TrainingConfig.cp_attention`, set only to price another stack's run as it ran): a load-balanced
ring (Megatron-Core and Transformer Engine's, torch's `context_parallel` under torchtitan) runs the library's
causal kernel on its own chunks and unmasked blocks on the others', merged by their log-sum-exp; priced as one
kernel of F, as before 2026-11-27. Its kernels alone on the H100 took 1.02-1.09x that at 32k-131k tokens (cp 2-4),
1.21x at 32k cp4 and 1.32x / 2.72x at 8k cp 2 / 4: the small blocks of short sequences run further from peak than
one kernel of their total FLOPs does, a gap left in the fitted profiles' attention and collective terms.
"""

from __future__ import annotations

CP_ATTENTION = ("all-gather", "ring")
"""How a context-parallel attention core runs (`TrainingConfig.cp_attention`): soap's executor's, or a ring's."""
EXECUTED_CP_ATTENTION = "all-gather"
LOWER_RIGHT_CLASS = "attention-lower-right"
"""`kernel_factors` class of the lower-right causal kernel: its time over the `attention` class's at the same FLOPs."""
H100_LOWER_RIGHT = 1.76
"""torch's FlashAttention-2 over cuDNN's kernels (which torch 2.11 picks for whole causal attention on Hopper),
causal attention of Llama-3-8B's heads, forward and backward, geometric mean over 2k-32k tokens (1.65-1.82), on a
lent H100 of 2026-11-27 (`benchmarks/sdpa_backends.py`)."""
H100_LOWER_RIGHT_CURVE = ((6.44e10, 6.368), (1e11, 4.7), (3.16e11, 2.72), (1e12, 2.136), (3.16e12, 1.963),
                          (1e13, 1.912), (3.16e13, 1.897), (6.6e13, 1.894))
"""The Hopper profiles' `attention-lower-right` factor against the kernel's forward FLOPs: fitted
(`benchmarks/cp_attention.py`, `fit_curve`) to the executor's rank timed on a lent H100 at 4k-131k tokens and cp 2-8
(15 cases, `benchmarks/data/h100-2026-11-27-cp/cp-attention.json`), against `h100-x1-measured`'s price of its
square kernel and of its lower-right one without the factor. It falls to x1.89 on large kernels, beside the 1.76
FlashAttention-2 took on whole causal attention, and rises on small ones (x2.7 at 3e11 FLOPs, a rank's rectangle at
8k tokens cp 4), where FlashAttention-2's blocks fill the GPU worse than cuDNN's. Leaving out one cp degree at a time,
the curve fitted on the others prices the held-out cases within -19% to +13% but one at 4k tokens cp 4 below the
others' range (x1.77); the constant 1.76 was off by up to 3.6x at 4k and 1.5x at 8k."""


def pieces(flops: float, nbytes: float, cp: int) -> tuple[tuple[float, float, bool], ...]:
    """(FLOPs, bytes, whether lower-right) of each kernel rank 0 runs for a causal attention core of `flops` local
    FLOPs and `nbytes` local bytes under the all-gather layout at context parallelism `cp` (module docstring)."""
    if cp <= 1:
        return ((flops, nbytes, False),)
    square = 1 / (4 * cp)
    return (flops * square, nbytes / (2 * cp + 1), False), (flops * (1 - square), nbytes * 2 * cp / (2 * cp + 1), True)


HOPPER_PROFILES = ("h100-sxm-fitted", "h100-x1-measured", "h100-nvl", "h100-pcie", "h200-sxm-fitted",
                   "h200-x1-measured", "h200-nvl")
"""The shipped device profiles of Hopper GPUs with measured or fitted kernel terms: torch 2.11 runs whole causal
attention on cuDNN's kernels there, a rectangular lower-right one on FlashAttention-2 (`with_lower_right`)."""
LOWER_RIGHT_SOURCE = (f"{LOWER_RIGHT_CLASS} x{H100_LOWER_RIGHT_CURVE[-1][1]}-{H100_LOWER_RIGHT_CURVE[0][1]} (large to "
                      "small kernels): soap's executor's context-parallel attention timed on a lent H100 of "
                      "2026-11-27, fitted by FLOPs (benchmarks/cp_attention.py; "
                      "costmodel.context_attention.H100_LOWER_RIGHT_CURVE)")


def with_lower_right(kernel_factors: dict | None) -> dict:
    """A Hopper profile's `kernel_factors` JSON table (`{"source": ..., "factors": {...}}`) with the lower-right
    causal kernel's factor at every 16-bit precision (`H100_LOWER_RIGHT`), its source appended once."""
    from costmodel.profiles import with_measured_factors

    curve = [list(point) for point in H100_LOWER_RIGHT_CURVE]
    return with_measured_factors(kernel_factors, {f"{LOWER_RIGHT_CLASS}/{p}": curve for p in ("bf16", "fp16")},
                                 LOWER_RIGHT_SOURCE)
