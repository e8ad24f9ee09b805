"""On a GPU: the chunked cross-entropy (`executor.cross_entropy`) against `F.cross_entropy(logits.float())`.

    python -m benchmarks.gpu_cross_entropy_check

The loss and the logits' gradient in bf16, fp16 and fp32 logits, with ignored labels, for slice counts that do
and do not divide the tokens, on the fused path (`fused_log_softmax`: one `_log_softmax` kernel reading the
16-bit slice), which CPU tests cannot reach for 16-bit logits. Prints one line per case; exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from executor.cross_entropy import IGNORE, chunked_cross_entropy, fused_log_softmax


def main() -> int:
    bad = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tokens, vocab, chunks in ((37, 61, 3), (4096, 128256, 8), (1000, 32000, 1)):
            torch.manual_seed(0)
            logits = (3 * torch.randn(tokens, vocab, device="cuda")).to(dtype).requires_grad_()
            labels = torch.randint(0, vocab, (tokens,), device="cuda")
            labels[:5] = IGNORE
            ref = logits.detach().clone().requires_grad_()
            expected = F.cross_entropy(ref.float(), labels, ignore_index=IGNORE, reduction="sum")
            (expected * 0.37).backward()
            loss = chunked_cross_entropy(logits, labels, chunks=chunks)
            (loss * 0.37).backward()
            rel = abs(loss.item() - expected.item()) / abs(expected.item())
            grad_err = (logits.grad.float() - ref.grad.float()).abs().max().item()
            tol = 1e-6 if dtype == torch.float32 else 4e-3
            ok = rel < 1e-5 and grad_err <= tol and not logits.grad[:5].any()
            bad += not ok
            print(f"{str(dtype):15s} {tokens:5d} x {vocab:6d} / {chunks}  fused={fused_log_softmax(logits)}  "
                  f"loss rel err {rel:.2e}  grad max err {grad_err:.2e}  {'ok' if ok else 'MISMATCH'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
