"""Training data and the loss normalization that makes every layout compute the same gradients.

Data. Step `t` has one *global batch* of `global_batch` sequences of `seq_len` tokens, identical for every
layout: synthetic tokens drawn from `torch.Generator().manual_seed(seed + 1_000_003 * t)`, or windows
of a token file (`--data`: a `.npy` of integer ids, or a `.bin` of uint16 ids as nanoGPT writes them;
sample i of step t starts at token `(t * global_batch + i) * (seq_len + 1)` modulo the file length).
causal-lm: labels are the next tokens. masked-lm: 15% of positions (from the same generator) are
replaced by the mask id and are the only labelled ones.

Slicing. Data-parallel rank d takes sequences [d*B, (d+1)*B) with B = micro_batch * num_microbatches,
then micro-batch k takes [k*m, (k+1)*m); context-parallel rank c takes tokens [c*S/cp, (c+1)*S/cp)
with position ids offset by c*S/cp.

Loss. With N labelled tokens in the global batch and R = dp*cp ranks averaging gradients, each
micro-batch's loss is `sum_CE(local tokens) * R / N`. Gradients are summed over micro-batches (and
pipeline micro-batches, `scale_grads=False`) and averaged over the R ranks, which gives exactly the
gradient of the global mean `sum_CE(all) / N`, whatever the layout. The reported loss is the sum of
the unscaled local sums, all-reduced over the R ranks, divided by N.

Under tensor parallelism with the whole model on the rank, the logits are a DTensor sharded on the
vocabulary and the cross-entropy is torch's vocab-parallel one (`loss_parallel()`, entered by the
training step around the loss and its backward); its sum is the same on every TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tracer.errors import SoapError

IGNORE = -100
MASK_FRACTION = 0.15


@dataclass(frozen=True)
class GlobalBatch:
    input_ids: torch.Tensor
    """(global_batch, seq_len) token ids."""
    labels: torch.Tensor
    """(global_batch, seq_len) target ids, IGNORE where unlabelled."""

    @property
    def num_labels(self) -> int:
        return int((self.labels != IGNORE).sum())


class TokenSource:
    """Global batches for each step, from the seed or a token file."""

    def __init__(self, *, vocab_size: int, global_batch: int, seq_len: int, task: str, seed: int,
                 data_file: str | None = None, mask_token_id: int | None = None) -> None:
        self.vocab, self.batch, self.seq, self.task, self.seed = vocab_size, global_batch, seq_len, task, seed
        self.mask_id = mask_token_id if mask_token_id is not None else min(103, vocab_size - 1)
        self.tokens = _load_tokens(data_file, vocab_size, seq_len) if data_file else None

    def batch_for_step(self, step: int) -> GlobalBatch:
        gen = torch.Generator().manual_seed(self.seed + 1_000_003 * step)
        if self.tokens is None:
            window = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=gen)
        else:
            span = self.seq + 1
            usable = len(self.tokens) - span
            starts = [((step * self.batch + i) * span) % (usable + 1) for i in range(self.batch)]
            window = torch.from_numpy(np.stack([self.tokens[s:s + span] for s in starts]).astype(np.int64))
        if self.task == "causal-lm":
            return GlobalBatch(window[:, :-1].contiguous(), window[:, 1:].contiguous())
        ids = window[:, :-1].clone()
        masked = torch.rand(ids.shape, generator=gen) < MASK_FRACTION
        masked[:, 0] |= ~masked.any(dim=1)  # at least one label per sequence
        labels = torch.where(masked, ids, torch.full_like(ids, IGNORE))
        ids[masked] = self.mask_id
        return GlobalBatch(ids, labels)


def _load_tokens(path: str, vocab: int, seq_len: int) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise SoapError(f"--data {path}: no such file; pass a .npy or .bin (uint16) file of token ids")
    if p.suffix == ".npy":
        tokens = np.load(p, mmap_mode="r")
    elif p.suffix == ".bin":
        tokens = np.memmap(p, dtype=np.uint16, mode="r")
    else:
        raise SoapError(f"--data {path}: unknown format; use .npy (integer ids) or .bin (uint16 ids)")
    if tokens.ndim != 1:
        tokens = tokens.reshape(-1)
    if not np.issubdtype(tokens.dtype, np.integer):
        raise SoapError(f"--data {path}: holds {tokens.dtype}, not integer token ids")
    if len(tokens) < seq_len + 1:
        raise SoapError(f"--data {path}: {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}")
    if int(tokens.max()) >= vocab:
        raise SoapError(f"--data {path}: token id {int(tokens.max())} >= the model's vocab size {vocab}")
    return tokens


@dataclass(frozen=True)
class Slicer:
    """This rank's share of a global batch (see the module docstring)."""

    dp_rank: int
    per_rank: int
    cp_rank: int
    cp: int

    def local(self, t: torch.Tensor) -> torch.Tensor:
        rows = t[self.dp_rank * self.per_rank:(self.dp_rank + 1) * self.per_rank]
        s = t.shape[1] // self.cp
        return rows[:, self.cp_rank * s:(self.cp_rank + 1) * s]

    def position_ids(self, seq_len: int, device: torch.device) -> torch.Tensor:
        s = seq_len // self.cp
        return (torch.arange(s, device=device) + self.cp_rank * s).unsqueeze(0)


class ScaledTokenLoss:
    """`sum_CE * factor`, with `factor = R / N` set for each step (see the module docstring)."""

    def __init__(self) -> None:
        self.factor = 1.0
        self.unscaled_sum = torch.zeros(())

    def set_step(self, *, num_labels: int, ranks_averaging: int) -> None:
        self.factor = ranks_averaging / num_labels
        self.unscaled_sum = torch.zeros(())

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The scaled loss of one micro-batch. Vocab-sharded DTensor logits (tp > 1, `costmodel.strategy.shards_vocabulary`) need the call
        and its backward inside `loss_parallel()`; the loss then comes back as a plain tensor, the same on
        every TP rank."""
        total = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        if isinstance(total, DTensor):  # replicated over tp: every rank's local value is the whole sum
            total = total.full_tensor()
        # stays on the device: a copy to the host here would wait for the GPU once per micro-batch
        self.unscaled_sum = self.unscaled_sum + total.detach()
        return total * self.factor
