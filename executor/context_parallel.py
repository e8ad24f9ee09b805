"""Context parallelism: the sequence is split over the cp ranks; attention all-gathers K and V.

Each cp rank holds two of the sequence's 2*cp chunks of c = S/(2*cp) tokens, chunk r and chunk 2*cp-1-r
(inputs, labels and position ids, `executor.data.cp_chunks`). Every op but attention is token-local. Attention
is replaced (through HF's `AttentionInterface`, as implementation `soap_cp`) by one that all-gathers K and V over
the cp group (backward: reduce-scatter of their gradients) and puts their chunks back in sequence order. Under a
causal mask each local chunk, its queries at positions [a, a + c), then attends to the keys [0, a + c) only, the
mask aligned to the lower right (`torch.nn.attention.bias.causal_lower_right`: query i sees keys j <= a + i):

    rank r's work = c^2 (r + 1/2) + c^2 (2 cp - 1 - r + 1/2) = 2 cp c^2 = (S^2 / 2) / cp,

the same on every rank, 1/cp of the whole causal attention. The lower-right kernel skips the blocks above the
diagonal (CUDA dispatches it to FlashAttention-2, or to the memory-efficient kernel where that cannot run; CPU
materializes the mask). Encoders attend to every key, one call. This runs on CPU (gloo) and GPU alike; torch's
experimental `context_parallel` (ring attention on CUDA SDPA) is not used.

Until 2026-11-27 each rank held one contiguous chunk and attended to all S keys under a boolean mask: on a lent H100
(`benchmarks/cp_attention.py`) that kernel took 3.5-4.3x the whole causal attention's time over cp (the masked
blocks computed, the mask read), the last rank's lower-right kernel alone 2.7-3.5x, this layout 1.7-2.0x at
32k-131k tokens and 2.2-6.7x at 4k-16k (its second chunk runs FlashAttention-2, 1.76x the time of the cuDNN kernel
torch picks for whole causal attention, and slower still on small kernels; priced so, `costmodel.context_attention`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right

CP_ATTENTION = "soap_cp"
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
"""The differentiable all-gather: torch 2.13 renamed it (the old name warns on every call); older torch has only
the old name."""


def _in_sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """(B, H, S, D) all-gathered in rank order (rank r's chunks r and 2cp-1-r) -> the sequence's order."""
    b, h, s, d = gathered.shape
    slot = [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]  # chunk j's place in the gather
    chunks = gathered.view(b, h, 2 * cp, s // (2 * cp), d)
    return chunks[:, :, slot].reshape(b, h, s, d)


def _as_autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in the autocast dtype where autocast is on: what SDPA's autocast rule does to its inputs, which a
    `CausalBias` mask skips (its `__torch_function__` dispatches before autocast and wants one dtype; under fp8 the
    projections can reach it in fp32 and bf16 mixed)."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


def cp_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, rank: int, cp: int, causal: bool,
                 dropout: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """Rank `rank`'s (B, H, S/cp, D) queries (its chunks, `executor.data.cp_chunks`) against the whole sequence's
    (B, Hkv, S, D) keys and values in sequence order -> (B, H, S/cp, D); see the module docstring."""
    gqa = key.shape[1] != query.shape[1]
    if not causal:
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scale, enable_gqa=gqa)
    query, key, value = _as_autocast(query, key, value)
    chunk, outs = key.shape[2] // (2 * cp), []
    for index, start in enumerate((rank * chunk, (2 * cp - 1 - rank) * chunk)):
        stop = start + chunk
        outs.append(F.scaled_dot_product_attention(
            query[:, :, index * chunk:(index + 1) * chunk], key[:, :, :stop], value[:, :, :stop],
            attn_mask=causal_lower_right(chunk, stop), dropout_p=dropout, scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def _cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    """HF's attention interface: gather K/V over the cp group, then `cp_attention` -> (B, S_local, H, D)."""
    group = module.soap_cp_group
    cp = group.size()
    key = _in_sequence_order(_all_gather(key.contiguous(), gather_dim=2, group=group), cp)
    value = _in_sequence_order(_all_gather(value.contiguous(), gather_dim=2, group=group), cp)
    out = cp_attention(query, key, value, rank=group.get_local_rank(), cp=cp,
                       causal=bool(getattr(module, "is_causal", False)),
                       dropout=dropout if module.training else 0.0, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def register_cp_attention() -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, _cp_attention)
    AttentionMaskInterface.register(CP_ATTENTION, _no_mask)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Route every attention module of `model` through the all-gather-K/V attention on `cp_mesh`."""
    register_cp_attention()
    model.config._attn_implementation = CP_ATTENTION
    for module in model.modules():
        if getattr(module, "config", None) is not None and hasattr(module, "is_causal"):
            module.soap_cp_group = cp_mesh
