"""The kernels torch's SDPA can dispatch to, timed against each other on one GPU.

    python -m benchmarks.sdpa_backends [--out FILE] [--seqs 2048,8192,32768]
    python -m benchmarks.sdpa_backends --smoke        # a small shape on any machine (the CPU's backends)

Which kernel `F.scaled_dot_product_attention` runs changes with torch's release: soap's own H100 runs (torch 2.11)
traced cuDNN's sm90 flash kernels (`benchmarks/data/h100-2026-11-26*`), where torchtitan's published runs
(torch of December 2024) ran, as we read torch's release notes, torch's own FlashAttention-2. The fit over both
(`benchmarks/own_runs_corpus.py`, variant (c); `executor.validation.external`, `attention/<backend>`) reads the
latter's attention at about 2.3x the former's time, 500 W clocks included. This script measures what the kernels
themselves differ by on the machine it runs on: causal attention of Llama-3-8B's shape (32 heads, the 8 KV heads
repeated as torchtitan and HF's eager path do, head dim 128, bf16), forward and backward, each backend pinned with
`torch.nn.attention.sdpa_kernel`, at each sequence length (batch: 16,384 tokens a call, at least one sequence),
beside torch's own choice (`torch._fused_sdp_choice`). A backend that cannot run a shape (cuDNN on a GPU before
Hopper, the math kernel's s^2 score matrix past `MATH_MAX_SEQ`) is reported as not run.

Nothing here is priced or fitted. Run on a lent H100 (2026-11-27): FlashAttention-2 took 1.65-1.82x cuDNN's time,
1.76x on the geometric mean, which the corpus fit now takes as the measured prior of `attention/flash_attention`
(`executor.validation.external.FLASH_OVER_CUDNN`): with the 8B's rows left out no run states FlashAttention-2, and
the torchtitan rows were predicted at the cuDNN kernels' rate until then.

TFLOP/s count the causal half of the score matrix: forward 2 x 2 x b h s^2 d / 2, backward 2.5x the forward.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
"""`torch.nn.attention.SDPBackend` members, by name."""
HEADS, HEAD_DIM = 32, 128
TOKENS_PER_CALL = 16_384
MATH_MAX_SEQ = 4096
"""The math kernel materializes b x h x s x s scores (and their gradient): 2 GiB in bf16 at 4k for 32 heads."""
SMOKE = dict(heads=4, head_dim=64, seqs=(256,), tokens=512, samples=3)


def measure(seqs: Sequence[int], *, heads: int = HEADS, head_dim: int = HEAD_DIM, tokens: int = TOKENS_PER_CALL,
            samples: int = 7) -> dict:
    """Forward + backward of causal SDPA per backend and sequence length (module docstring)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from costmodel.calibration.microbench import TimingConfig, time_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    timing = TimingConfig(samples=samples, max_case_s=5.0)
    rows = []
    for seq in seqs:
        batch = max(1, tokens // seq)
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)
        chosen = SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True)).name
        flops = 3.5 * 2 * 2 * batch * heads * seq * seq * head_dim / 2
        for name in BACKENDS:
            row = {"seq": seq, "batch": batch, "backend": name, "torch_choice": name == chosen}
            if name == "MATH" and seq > MATH_MAX_SEQ:
                rows.append({**row, "seconds": None, "why": f"the math kernel past seq {MATH_MAX_SEQ}"})
                continue

            def step(backend=getattr(SDPBackend, name)):
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(grad)
                q.grad = k.grad = v.grad = None

            try:
                seconds = time_kernel(step, device, timing)
            except RuntimeError as err:  # no viable kernel for this backend, shape or device
                rows.append({**row, "seconds": None, "why": str(err).splitlines()[0][:160]})
                continue
            rows.append({**row, "seconds": seconds, "tflops": flops / seconds / 1e12})
        del q, k, v, grad
        if device == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "heads": heads,
            "head_dim": head_dim, "rows": rows}


def table(result: dict) -> str:
    """One line per sequence length: each backend's time and its ratio to torch's own choice."""
    lines = [f"{result['device']}, torch {result['torch']}, {result['dtype']}, {result['heads']} heads x "
             f"{result['head_dim']}, causal, forward + backward; ms (TFLOP/s, time over torch's choice):", "",
             "| seq x batch | torch's choice | " + " | ".join(BACKENDS) + " |", "|---|---|" + "---:|" * len(BACKENDS)]
    for seq in dict.fromkeys(r["seq"] for r in result["rows"]):
        rows = {r["backend"]: r for r in result["rows"] if r["seq"] == seq}
        chosen = next(r for r in rows.values() if r["torch_choice"])
        cells = []
        for name in BACKENDS:
            r = rows[name]
            if r["seconds"] is None:
                cells.append("not run")
                continue
            ratio = f", x{r['seconds'] / chosen['seconds']:.2f}" if chosen["seconds"] else ""
            cells.append(f"{r['seconds'] * 1e3:.2f} ({r['tflops']:.3g}{ratio})")
        lines.append(f"| {seq} x {chosen['batch']} | {chosen['backend']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="2048,4096,8192,16384,32768", help="sequence lengths, comma-separated")
    parser.add_argument("--out", help="write the measurements as JSON here")
    parser.add_argument("--smoke", action="store_true", help="a small shape, any machine")
    args = parser.parse_args(argv)
    from benchmarks.report import emit

    if args.smoke:
        result = measure(**SMOKE)
    else:
        result = measure([int(s) for s in args.seqs.split(",")])
    return emit(result, table(result), args.out)


if __name__ == "__main__":
    main()
