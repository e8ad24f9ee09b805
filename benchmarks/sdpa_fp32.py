"""Which attention kernel a tf32 (fp32-tensor) plan runs on a GPU, and its time: the evidence for pricing it.

    python -m benchmarks.sdpa_fp32 --json OUT.json          # on a CUDA machine

A tf32 plan keeps its activations in fp32, and torch's SDPA has neither FlashAttention nor cuDNN for fp32 queries; HF's
Llama passes a boolean mask there. This times SDPA forward and backward at Llama 3.2 1B's attention (32 heads of 64,
K/V repeated to the query heads) at 512-4,096 tokens, fp32 with TF32 matmuls on, with the causal boolean mask and with
`is_causal`, under torch's own choice and each backend forced (math, memory-efficient); bf16 `is_causal` as the
reference. Each case also records the CUDA kernels of one profiled call (which backend torch picked) and the peak
memory above its inputs. The FLOPs are the causal square's useful work (`4 * b * h * s^2 * d / 2` forward, 2.5x that
for forward and backward), as the cost model counts them.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

BACKENDS = {"default": None, "math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def run_case(batch: int, heads: int, seq: int, dim: int, dtype: torch.dtype, masked: bool, backend: str) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.ones(seq, seq, device="cuda", dtype=torch.bool).tril().expand(batch, 1, seq, seq) if masked else None
    grad = torch.randn(batch, heads, seq, dim, device="cuda", dtype=dtype)

    def call() -> None:
        ctx = sdpa_kernel(BACKENDS[backend]) if BACKENDS[backend] is not None else torch.autocast("cuda", enabled=False)
        with ctx:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    try:
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() - base
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels: dict[str, float] = {}
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
                kernels[e.key[:90]] = round(e.device_time_total, 1)
    except RuntimeError as e:  # a forced backend that cannot run this case
        return {"error": str(e).splitlines()[0][:200]}
    finally:
        del q, k, v, grad
        torch.cuda.empty_cache()
    flops = 4 * batch * heads * seq * seq * dim / 2 * 3.5
    ms = sorted(times)[2] * 1e3
    return {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "fwd_bwd_flops": flops,
            "peak_above_inputs_gib": round(peak / 2**30, 3),
            "kernels_us": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:8])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the cases here")
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    rows = []
    for seq in (512, 1024, 2048, 4096):
        for dtype, masked, backend in ((torch.float32, True, "default"), (torch.float32, True, "math"),
                                       (torch.float32, True, "efficient"), (torch.float32, False, "default"),
                                       (torch.bfloat16, False, "default")):
            row = {"seq": seq, "batch": args.batch, "heads": 32, "head_dim": 64,
                   "dtype": str(dtype).removeprefix("torch."), "mask": "bool" if masked else "is_causal",
                   "backend": backend, **run_case(args.batch, 32, seq, 64, dtype, masked, backend)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels_us"}), flush=True)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
