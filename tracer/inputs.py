"""Example inputs for one training step of each task, so the loss is part of the captured graph.

- causal-lm, masked-lm: input_ids and labels, both [batch, seq_len];
- seq-cls: input_ids [batch, seq_len], labels [batch];
- seq2seq-lm: input_ids, decoder_input_ids and labels, all [batch, seq_len];
- image-cls: pixel_values [batch, channels, image_size, image_size], labels [batch].
`use_cache=False` is passed to forwards that accept it.
"""

from __future__ import annotations

import inspect
from typing import Any

DEFAULT_MAX_SEQ_LEN = 2048
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx", "max_sequence_length")


def default_seq_len(config: Any, task: str) -> int:
    """min(the model's maximum positions, 2048); patches + 1 for vision models; 2048 when unknown."""
    if task == "image-cls":
        return image_tokens(config)
    positions = max_positions(config)
    return min(positions, DEFAULT_MAX_SEQ_LEN) if positions else DEFAULT_MAX_SEQ_LEN


def max_positions(config: Any) -> int | None:
    """The longest sequence the model's config says it takes (`POSITION_KEYS`); None when it says nothing."""
    for key in POSITION_KEYS:
        value = getattr(config, key, None) if config is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def image_tokens(config: Any) -> int:
    size = _as_int(getattr(config, "image_size", 224))
    patch = _as_int(getattr(config, "patch_size", 16))
    return (size // patch) ** 2 + 1


def _as_int(value: Any) -> int:
    return int(value[0]) if isinstance(value, (list, tuple)) else int(value)


def example_inputs(model: Any, task: str, batch: int, seq_len: int, device: Any = "meta") -> dict[str, Any]:
    import torch

    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 2)
    ids = lambda: torch.zeros(batch, seq_len, dtype=torch.long, device=device)  # noqa: E731
    if task == "image-cls":
        size = _as_int(getattr(config, "image_size", 224))
        channels = int(getattr(config, "num_channels", 3))
        inputs = {"pixel_values": torch.zeros(batch, channels, size, size, device=device),
                  "labels": torch.zeros(batch, dtype=torch.long, device=device)}
    elif task == "seq-cls":
        inputs = {"input_ids": ids(), "labels": torch.zeros(batch, dtype=torch.long, device=device)}
    elif task == "seq2seq-lm":
        inputs = {"input_ids": ids(), "decoder_input_ids": ids(), "labels": ids()}
    else:
        inputs = {"input_ids": ids(), "labels": ids()}
    if str(device) != "meta":
        for key in ("input_ids", "decoder_input_ids", "labels"):
            if key in inputs and inputs[key].dim() == 2:
                inputs[key] = torch.randint(0, vocab, inputs[key].shape, device=device)
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs
