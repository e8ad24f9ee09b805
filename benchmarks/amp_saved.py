"""Saved-for-backward bytes of one real forward + loss, split by dtype: what autograd keeps (CUDA autocast
on a GPU, or the tracer's autocast emulation on CPU tensors), for benchmarks/amp_memory.py and the tests.

Every tensor autograd packs is recorded with its dtype; `per_save` sums each save (a tensor saved by two
ops counts twice, a view counts its own size), `by_storage` counts each storage once at its full size
(what memory holds). Parameters and their autocast copies (weights) are reported apart from activations.
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

WEIGHT_PATH = frozenset({"ToCopyBackward0", "TBackward0", "ViewBackward0", "PermuteBackward0",
                         "TransposeBackward0", "ExpandBackward0", "UnsafeViewBackward0"})


@dataclass
class SavedSplit:
    per_save: Counter = field(default_factory=Counter)
    """dtype -> bytes, each save counted (activations)."""
    by_storage: Counter = field(default_factory=Counter)
    """dtype -> bytes, each storage once (activations)."""
    weights: Counter = field(default_factory=Counter)
    """dtype -> bytes of saved parameters and parameter casts, each storage once."""
    shapes: Counter = field(default_factory=Counter)
    """(dtype, numel) -> count over distinct activation storages."""


def _is_weight(t: torch.Tensor) -> bool:
    fn = t.grad_fn
    if fn is None:
        return t.requires_grad
    while type(fn).__name__ in WEIGHT_PATH:
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return type(fn).__name__ == "AccumulateGrad"


def saved_split(model: Any, input_ids: torch.Tensor, *, autocast: Any) -> tuple[SavedSplit, torch.Tensor]:
    """Run `model(input_ids)` and the executor's loss (fp32 logits, summed cross entropy) under `autocast`
    (a context manager) recording what autograd saves; returns the split and the loss."""
    split, seen = SavedSplit(), set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        dtype = str(t.dtype).removeprefix("torch.")
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        weight = _is_weight(t)
        if not weight:
            split.per_save[dtype] += t.numel() * t.element_size()
        if key not in seen and storage.nbytes():
            seen.add(key)
            if weight:
                split.weights[dtype] += storage.nbytes()
            else:
                split.by_storage[dtype] += storage.nbytes()
                split.shapes[(dtype, storage.nbytes() // t.element_size())] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast or nullcontext():
        logits = model(input_ids=input_ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), input_ids.flatten(), reduction="sum")
    return split, loss
