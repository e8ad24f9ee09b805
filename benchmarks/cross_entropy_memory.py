"""The executor's two losses on CPU: peak memory (live storages) and time, against what soap prices.

    python -m benchmarks.cross_entropy_memory [--dry-run]

For [tokens, vocab] logits made by a 16-bit (bf16) or fp32 LM head from [tokens, hidden] states, one forward and
backward of `executor.data.ScaledTokenLoss` with the chunked cross-entropy (`executor.cross_entropy`) and with the
upcast one (`F.cross_entropy(logits.float())`), with the logits dropped after the loss (the executor's loop
without a pipeline) or held (a pipeline stage). Memory: the peak of live tensor storages
(`benchmarks.peft_memory.LiveStorages`) less the head's input and weight gradients, in units of the fp32 logits,
against `costmodel.memory_activations.loss_tensors`. Time: the median of 5 runs of the loss's forward and
backward alone (the head excluded), on this CPU: a check that the chunks cost no pathological overhead, not a
GPU time (the GPU's loss is memory-bound, and both losses make the same passes over the logits). Writes section
`cross-entropy` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SHAPES = ((2048, 32000), (4096, 128256))
"""(tokens, vocab): a Llama-2 vocabulary (one slice) and a Llama-3 one (4 slices)."""
HIDDEN = 64


def measure(tokens: int, vocab: int, dtype: str, loss: str, held: bool, repeats: int = 5, hidden: int = HIDDEN) -> dict:
    """Peak live storages of one loss forward and backward over a head's logits, less the head's input and weight
    gradients, and soap's price of that head and loss, both in fp32-logit units; and the median ms of `repeats`
    runs of the loss alone (tests/test_memory.py measures with `repeats=0`)."""
    import torch

    from benchmarks.peft_memory import LiveStorages
    from costmodel.memory_activations import activation_parts
    from executor.data import ScaledTokenLoss
    from tracer.ir import DimRole, OpKind, OpNode, ParamMeta, TensorMeta

    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    h = torch.randn(1, tokens, hidden, dtype=torch_dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=torch_dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    loss_fn = ScaledTokenLoss(loss)
    live = LiveStorages()
    with live.mode:
        if held:
            logits = h @ w.t()
            out = loss_fn(logits, labels)
        else:
            out = loss_fn(h @ w.t(), labels)
        out.backward()
    measured = live.peak - (h.numel() + w.numel()) * h.element_size()

    S, P = DimRole.SAMPLE, DimRole.PARAMETER
    fp32_logits = TensorMeta((tokens, vocab), "float32", (S, P))
    head_out = TensorMeta((tokens, vocab), dtype, (S, P))
    head = OpNode("head", OpKind.MATMUL, "linear", "head", None, (TensorMeta((tokens, hidden), dtype, (S, DimRole.ATTRIBUTE)),),
                  (head_out,), (ParamMeta("head.weight", (vocab, hidden), dtype),), 0, 0, 0, ())
    loss_op = OpNode("loss", OpKind.LOSS, "cross_entropy", "", None, (fp32_logits,), (TensorMeta((), "float32", ()),), (),
                     0, 0, 0, (fp32_logits,))
    predicted = activation_parts([head, loss_op], micro_batch=1, batch_traced=1, recompute="none", attention="sdpa",
                                 precision="bf16" if dtype == "bfloat16" else "fp32", pipelined=held,
                                 cross_entropy=loss).prologue

    logits = (h @ w.t()).detach().requires_grad_()
    times = [0.0]
    for _ in range(repeats):
        start = time.perf_counter()
        loss_fn(logits, labels).backward()
        times.append(time.perf_counter() - start)
        logits.grad = None
    return dict(measured=measured / fp32_logits.nbytes, predicted=predicted / fp32_logits.nbytes,
                ms=1e3 * statistics.median(times[1:] or times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print, write no docs")
    args = parser.parse_args()
    from benchmarks.report import update_section

    intro = " ".join(__doc__.split("\n\n")[2].split()).removesuffix(
        " Writes section `cross-entropy` of docs/benchmarks.md.")
    lines = [f"`benchmarks/cross_entropy_memory.py`. {intro}", "",
             "| tokens x vocab | head | logits | loss | peak / fp32 logits, measured | priced | loss fwd+bwd ms (CPU) |",
             "|---|---|---|---|---:|---:|---:|"]
    for tokens, vocab in SHAPES:
        for dtype in ("bfloat16", "float32"):
            for held in (False, True):
                for loss in ("upcast", "chunked"):
                    r = measure(tokens, vocab, dtype, loss, held)
                    lines.append(f"| {tokens} x {vocab} | {dtype} | {'held' if held else 'dropped'} | {loss} | "
                                 f"{r['measured']:.3f} | {r['predicted']:.3f} | {r['ms']:.0f} |")
                    print(lines[-1], flush=True)
    text = "\n".join(lines)
    if not args.dry_run:
        update_section("cross-entropy", "The chunked cross-entropy: the loss's memory, measured against its price",
                       text)


if __name__ == "__main__":
    main()
