"""Context parallelism: the sequence is split over the cp ranks; attention all-gathers K and V.

Each cp rank holds a contiguous chunk of S/cp tokens of every sequence (inputs, labels and position
ids, see `executor.data`). Every op but attention is token-local. Attention is replaced (through HF's
`AttentionInterface`, as implementation `soap_cp`) by one that all-gathers K and V over the cp group
(backward: reduce-scatter of their gradients), then attends the local queries to all keys with the
causal mask shifted by the chunk's offset (`cp_rank * S/cp`): query i may see key j iff
j <= offset + i. Encoders attend to everything. This runs on CPU (gloo) and GPU alike; torch's
experimental `context_parallel` (ring attention on CUDA SDPA) is not used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_gather_tensor_autograd
from torch.distributed.device_mesh import DeviceMesh

CP_ATTENTION = "soap_cp"


def _cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    """(B, H, S_local, D) queries against all-gathered (B, Hkv, S, D) keys/values -> (B, S_local, H, D)."""
    group = module.soap_cp_group
    rank, size = group.get_local_rank(), group.size()
    key = all_gather_tensor_autograd(key.contiguous(), gather_dim=2, group=group)
    value = all_gather_tensor_autograd(value.contiguous(), gather_dim=2, group=group)
    local = query.shape[2]
    mask = None
    if getattr(module, "is_causal", False):
        q_pos = torch.arange(local, device=query.device) + rank * local
        k_pos = torch.arange(local * size, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
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
