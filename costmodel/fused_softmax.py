"""Megatron's fused attention softmax, and the unfused path it falls back to where its kernel is unavailable.

Model. Megatron's attention (megatron/model/transformer.py, `ParallelAttention` / `CoreAttention`, the path that
Megatron-LM before Transformer Engine and Megatron-DeepSpeed run without flash attention) computes the scores
with `baddbmm`, normalizes them with `FusedScaleMaskSoftmax` (megatron/model/fused_softmax.py) and multiplies by
the values with `bmm`. The softmax runs as one fused CUDA kernel (scale, causal mask and softmax in 16-bit,
`scaled_upper_triang_masked_softmax`) only where `FusedScaleMaskSoftmax.is_kernel_available` says so
(`fused_kernel_available`), for scores of shape [b, np, sq, sk] (np: the heads of one TP rank):

    input in fp16 or bf16,  16 < sk <= 4096,  sq % 4 == 0,  sk % 4 == 0,
    attn_batches = b x np divisible by 4 and by batch_per_block (causal mask)

where batch_per_block is the CUDA kernel's (csrc/megatron/scaled_masked_softmax.h, `get_batch_per_block`):
p = sk rounded up to a power of two, warp = min(p, 32), 2 rows per warp when p <= 128 else 1, 128 threads a
block, so batch_per_block = (128 / warp) x rows per warp (4 at sk = 1024). With a model's heads split over tp
ranks, np = heads / tp, so a 16-head model at tp8 has np = 2 and micro-batch 1 gives attn_batches = 2: the fused
kernel is unavailable, at micro-batch 2 it is available again.

Elsewhere the softmax runs as PyTorch ops (`forward_torch_softmax`): with Megatron's default query-key layer
scaling (`apply_query_key_layer_scaling`, which sets `attention_softmax_in_fp32`) a 16-bit input is cast to
fp32, multiplied by the layer's scale, masked in place (`attention_mask_func`: `masked_fill_`), normalized by
`torch.nn.Softmax` and cast back; autograd runs one backward kernel for each. Over S = b x np x sq x sk scores
of w bytes (2 in fp16/bf16; 4 in fp32, where nothing is cast), per micro-batch and layer (`unfused_path`):

    kernel          forward bytes        backward bytes
    cast up         (w + 4) S            (4 + w) S          (w < 4 only)
    scale           8 S                  8 S
    mask            8 S                  8 S
    softmax         8 S                  12 S               (reads the gradient and the output, writes one)
    cast down       (4 + w) S            (w + 4) S          (w < 4 only)

against the fused kernel's one forward (2w S) and one backward (3w S) kernel (`fused_path`; at fp32 Megatron has
no fused kernel, and this one softmax pass is what soap's attention op prices already). The difference
(`fallback_cost`: 4 more kernels forward and 4 backward at 16 bits, 2 and 2 at fp32; about 32 S more bytes
forward and 34 S backward at 16 bits) is what the fallback adds to the attention op's price
(`costmodel.simulator.pricing._UnitPricer._softmax_fallback`): each kernel a memory-bound pass
(`costmodel.optimizer_step.memory_pass_time`) plus the device's launch overhead, and each a kernel the host
dispatches (the host-bound floor counts it, `DeviceProfile.host_dispatch_s`); a full recompute runs the forward
ones again. The mask (sq x sk booleans, broadcast over b x np) is left out of the bytes, and so is the memory
of the fp32 copies (saved for backward only inside a recompute window under full recompute).

Scope. Only a stack that runs this attention prices it (`TrainingConfig.megatron_softmax`, set by
`executor.validation.grid.as_run` for the Megatron-DeepSpeed rows): soap's own executor runs SDPA, whose
kernels have no such rule, and the planner's fast estimator (`planner.estimate`) never sees the flag. The rule
is fixed by Megatron's source; nothing in it is fitted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MAX_KEYS = 4096
"""Megatron-DeepSpeed's bound on sk (Megatron-LM of 2021 had 2048, Megatron-Core 16384)."""
THREADS_PER_BLOCK = 128
WARP = 32


def batch_per_block(sk: int) -> int:
    """Rows one block of the fused kernel normalizes (`get_batch_per_block` of scaled_masked_softmax.h)."""
    power = 1 << max(sk - 1, 0).bit_length()
    warp = min(power, WARP)
    rows_per_warp = 2 if power <= 128 else 1
    return (THREADS_PER_BLOCK // warp) * rows_per_warp


def fused_kernel_available(*, micro_batch: int, local_heads: int, sq: int, sk: int, half: bool) -> bool:
    """`FusedScaleMaskSoftmax.is_kernel_available` for a causal mask (module docstring)."""
    attn_batches = micro_batch * local_heads
    return (half and 16 < sk <= MAX_KEYS and sq % 4 == 0 and sk % 4 == 0 and attn_batches % 4 == 0
            and attn_batches % batch_per_block(sk) == 0)


def fused_path(width: int) -> tuple[tuple[float, float], ...]:
    """(forward, backward) bytes per score of the fused kernel at input width `width` bytes."""
    return ((2.0 * width, 3.0 * width),)


def unfused_path(width: int) -> tuple[tuple[float, float], ...]:
    """(forward, backward) bytes per score of each kernel of the unfused path at input width `width` bytes."""
    w = float(width)
    fp32 = ((8.0, 8.0), (8.0, 8.0), (8.0, 12.0))  # scale, mask, softmax
    return fp32 if width >= 4 else ((w + 4, 4 + w), *fp32, (4 + w, w + 4))


@dataclass(frozen=True)
class FallbackCost:
    """What the unfused softmax adds over the fused kernel, per micro-batch and layer on one rank."""

    fwd_s: float
    bwd_s: float
    fwd_kernels: int
    bwd_kernels: int


def fallback_cost(*, scores: float, width: int, pass_time: Callable[[float], float], launch_s: float) -> FallbackCost:
    """The unfused path less the fused kernel over `scores` scores of `width` bytes (module docstring): each
    kernel `pass_time(bytes)` plus `launch_s`."""

    def total(path, phase: int) -> float:
        return sum(pass_time(kernel[phase] * scores) + launch_s for kernel in path)

    unfused, fused = unfused_path(width), fused_path(width)
    extra = len(unfused) - len(fused)
    return FallbackCost(fwd_s=max(0.0, total(unfused, 0) - total(fused, 0)),
                        bwd_s=max(0.0, total(unfused, 1) - total(fused, 1)), fwd_kernels=extra, bwd_kernels=extra)
