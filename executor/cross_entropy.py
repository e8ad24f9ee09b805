"""Chunked cross-entropy: the token loss and its gradient in one pass, a slice of tokens at a time.

The loss of a language model is the largest working set of its step: [tokens, vocab] logits, 131k columns
for Llama 3. `F.cross_entropy(logits.float())`, as Hugging Face and torchtitan compute it, upcasts a copy,
saves its fp32 log-probabilities for backward, and then creates the gradients of the log-probabilities and
of the logits (both fp32) while they are live: 3 x the fp32 logits at the peak (3.5 x under a pipeline,
whose schedule holds the 16-bit logits too; `tests/test_memory.py`). On one H100 the 16k-token step of
Llama-3-8B layers held 23.5 GiB there of its 50.5 GiB peak (docs/benchmarks.md).

This loss (`ChunkedCrossEntropy`, the executor's default, `TrainingConfig.cross_entropy` "chunked") keeps
the logits at the width the head produced them (W bytes per element, 2 in a 16-bit run) and computes, for
each of n slices of the tokens in turn (`costmodel.opcost.cross_entropy_slices`: one per 512 MiB of fp32 logits,
1 to 8), in fp32 on the slice x (row i, target t_i, valid v_i: the label is not the ignore index):

    log p_ij = x_ij - lse_i,   lse_i = m_i + log sum_j exp(x_ij - m_i),   m_i = max_j x_ij
    loss = - sum_i v_i log p_i,t_i
    d loss / d x_ij = v_i (p_ij - [j = t_i])

with torch's log-softmax kernel (one kernel: the max, the sum and the write), then exp in place, the one-hot
subtracted, and the gradient written, masked, into a buffer at the logits' width. Backward multiplies the
buffer by the incoming gradient in place and returns it: nothing is recomputed. Per logit element, forward and
backward, it moves the bytes the upcast loss moves (the copy to fp32, the log-softmax, one fp32 pass for its
backward and the cast back): on one H100 its step ran within +0.1% (16k tokens of Llama-3-8B layers) and +2.3%
(Llama 3.2 1B, 8k tokens a micro-batch) of the upcast one's (docs/benchmarks.md), where the first version
(max, shift, exp, sum and divide in place, then mask and copy) moved 56 bytes to the upcast loss's ~38 and ran
+4% and +5%. Live at the peak: the logits (W), the gradient buffer (W) and, while the log-softmax reads a
16-bit slice's fp32 copy, two fp32 slices (4 / n each): in fp32-logit units at 8 slices 2 x 2/4 + 2/8 = 1.25
in a 16-bit run, against 3.0; with fp32 logits (not copied) 2.125 against 3.0 (4.0 pipelined). Small logits
take one slice: its 6 kernels a slice (16 once) launch-bound there, where memory is not short. The math is the
one of Liger-Kernel's fused cross-entropy and Megatron's vocab-parallel one (the gradient made in the
forward); the slices are torchtune's chunked output loss. `costmodel.memory_activations.loss_tensors` prices it.

Vocabulary-parallel logits (a DTensor sharded on the last dimension over the tensor-parallel group,
`executor.tensor_parallel`): each rank holds columns [o, o + V_r) of the vocabulary, and a log-softmax over
them is not the whole row's. On a copy of the slice, in place, one fp32 slice live (48 bytes a logit element,
`costmodel.opcost.VOCAB_PARALLEL_LOSS_EXTRA_BYTES`), the rank computes its local m_i, all-reduces the max,
its local sum of exp(x_ij - m_i), all-reduced, per slice, and once the target logit x_i,t_i where the rank
holds t_i (0 elsewhere), all-reduced: 2n + 1 all-reduces of [tokens / n] fp32 (functional collectives, as
torch's `loss_parallel` issues them; `costmodel.placement` prices them). The loss is then whole on every rank
and the gradient is the rank's columns; it goes back through `DTensor.to_local`, sharded as the logits were.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Shard

from costmodel.opcost import cross_entropy_slices
from costmodel.strategy import EXECUTED_CROSS_ENTROPY
from tracer.errors import SoapError

IGNORE = -100


def check_cross_entropy(name: str) -> None:
    """Refuse a cross-entropy the executor does not compute (`costmodel.strategy.EXECUTED_CROSS_ENTROPY`)."""
    if name not in EXECUTED_CROSS_ENTROPY:
        raise SoapError(f"cross_entropy {name!r} is priced for another stack (an export's nearest plan), not "
                        f"executed; soap executes {' or '.join(EXECUTED_CROSS_ENTROPY)}: set "
                        "parallelism.cross_entropy to one")


def _columns(logits: DTensor) -> tuple[int, Any]:
    """(first vocabulary column of this rank's shard, the process group) of vocab-sharded DTensor logits."""
    placements = logits.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim not in (-1, logits.ndim - 1):
        raise ValueError(f"chunked cross-entropy needs logits replicated or sharded on the vocabulary, not {placements}")
    mesh = logits.device_mesh
    vocab, ranks, rank = logits.shape[-1], mesh.size(), mesh.get_local_rank()
    width = -(-vocab // ranks)  # Shard's torch.chunk layout: ceil(V / n) columns per rank, the last ones fewer
    return min(rank * width, vocab), mesh.get_group()


def _all_reduce(t: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    out = funcol.all_reduce(t, op, group)
    return out.wait() if hasattr(out, "wait") else out


class ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over labelled tokens of the cross-entropy of `logits` [tokens, V_r] (fp32 result); see the module
    docstring. `offset` is the first vocabulary column `logits` holds and `group` the process group over
    which the vocabulary is sharded (None: the whole vocabulary)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, offset: int, group: Any,
                chunks: int) -> torch.Tensor:
        tokens, columns = logits.shape
        f32 = dict(dtype=torch.float32, device=logits.device)
        # per token, once: labelled, target held here, its local column (0 where not), -1 at it, 0/1 to keep
        valid = labels != IGNORE
        local = valid & (labels >= offset) & (labels < offset + columns)
        index = ((labels - offset) * local).unsqueeze(-1)
        minus = local.to(torch.float32).neg_().unsqueeze(-1)
        keep = valid.to(torch.float32).unsqueeze(-1)
        grad = torch.empty_like(logits)
        lse = torch.zeros(tokens, **f32) if group is None else torch.empty(tokens, **f32)  # log p: lse 0
        picked = torch.empty(tokens, **f32)
        step = -(-tokens // chunks)
        for lo in range(0, tokens, step):
            rows = slice(lo, min(lo + step, tokens))
            if group is None:  # torch's log-softmax kernel, out of place (fp32 logits are not copied)
                x = torch.log_softmax(logits[rows].float(), -1)
                torch.gather(x, -1, index[rows], out=picked[rows].unsqueeze(-1))  # log p at the target
                x.exp_()  # the softmax
            else:  # the vocabulary sharded: the row's max and sum all-reduced
                x = logits[rows].to(torch.float32, copy=True)
                torch.gather(x, -1, index[rows], out=picked[rows].unsqueeze(-1))
                m = torch.amax(x, dim=-1, out=lse[rows])
                m.copy_(_all_reduce(m, "max", group))
                x.sub_(m.unsqueeze(-1)).exp_()
                s = _all_reduce(x.sum(dim=-1), "sum", group)
                x.div_(s.unsqueeze(-1))  # the softmax
                m.add_(s.log_())  # lse
            x.scatter_add_(-1, index[rows], minus[rows])
            torch.mul(x, keep[rows], out=grad[rows])  # ignored tokens zeroed, written at the logits' width
            del x
        picked.mul_(local)
        if group is not None:
            picked = _all_reduce(picked, "sum", group)
        ctx.grad = grad
        return ((lse - picked) * keep.squeeze(-1)).sum()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad, ctx.grad = ctx.grad, None  # one backward: the buffer becomes the logits' gradient
        return grad.mul_(grad_output), None, None, None, None


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, chunks: int | None = None) -> torch.Tensor:
    """Summed token cross-entropy of `logits` [..., vocab] against `labels` [...] (IGNORE unlabelled), fp32,
    a plain tensor; `logits` may be a DTensor sharded on the vocabulary (module docstring). `chunks`: the
    token slices (default `costmodel.opcost.cross_entropy_slices` of the local logits' fp32 bytes)."""
    offset, group = 0, None
    if isinstance(logits, DTensor):
        if all(p.is_replicate() for p in logits.placements):
            logits = logits.to_local()
        else:
            offset, group = _columns(logits)
            logits = logits.to_local()
    flat, targets = logits.flatten(0, -2), labels.flatten().to(logits.device)
    if flat.device.type == "meta":  # a pipeline stage's shape inference
        return flat.float().sum() * 0
    tokens = flat.shape[0]
    chunks = cross_entropy_slices(flat.numel() * 4, tokens) if chunks is None else max(1, min(chunks, tokens))
    return ChunkedCrossEntropy.apply(flat, targets, offset, group, chunks)
