"""What an offloaded optimizer's host work costs: torch's AdamW on fp32 tensors in host memory, foreach against fused,
SGD (momentum 0.9, as the executor runs it) foreach and fused, Adafactor foreach (it has no fused kernel), the gradient
accumulation FSDP2's CPUOffloadPolicy does there, and the host's copy bandwidth.

    python -m benchmarks.host_adamw --elements 1.24e9 --json OUT.json     # on the GPU machine's host
    python -m benchmarks.host_adamw --elements 1e8 --json benchmarks/data/local-cpu-2026-11-28/host-optimizers.json

Only AdamW ran on the lent H200's host (2026-11-28b); SGD and Adafactor were added afterwards and timed on the
CPU machine, whose AdamW foreach/fused ratio checks that a ratio measured there carries to another host.

The tensors are Llama 3.2 1B's sizes in spirit: `--elements` fp32 parameters in 8.4M-element tensors (2,048 x 4,096),
each with a gradient and AdamW's two moments, as FSDP2 keeps them on the host under offload. Each line is the median of
`--repeats` after one warm-up: the step's time, its elements per second and the bytes per second it would be at
28 bytes an element (read parameter, gradient and two moments, write parameter and two moments: one pass). A pass
over the same bytes by `copy_` is the host's memory bandwidth as torch sees it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

TENSOR = 2048 * 4096
ADAMW_BYTES = 28
SGD_BYTES = 20
"""Read parameter, gradient and momentum, write parameter and momentum."""
ADAFACTOR_BYTES = 12
"""Read parameter and gradient, write parameter (its factored statistics are a few bytes a row and column)."""


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--elements", type=float, default=1.24e9)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    count = max(1, round(args.elements / TENSOR))
    n = count * TENSOR
    params = [torch.nn.Parameter(torch.randn(TENSOR) * 0.02) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(TENSOR) * 1e-3
    rows: dict[str, dict] = {}

    def record(name: str, seconds: float, nbytes: float) -> None:
        rows[name] = {"s": round(seconds, 4), "elements_per_s": n / seconds,
                      "gb_per_s": round(nbytes / seconds / 1e9, 2)}
        print(f"{name:28s} {seconds * 1e3:9.1f} ms  {nbytes / seconds / 1e9:7.2f} GB/s", flush=True)

    for mode in ("fused", "foreach"):
        opt = torch.optim.AdamW(params, lr=1e-4, **{mode: True})
        record(f"adamw {mode}", timed(opt.step, args.repeats), n * ADAMW_BYTES)
        del opt
    for mode in ("fused", "foreach"):
        opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9, **{mode: True})
        record(f"sgd {mode}", timed(opt.step, args.repeats), n * SGD_BYTES)
        del opt
    opt = torch.optim.Adafactor(params, lr=1e-4, foreach=True)
    record("adafactor foreach", timed(opt.step, args.repeats), n * ADAFACTOR_BYTES)
    del opt
    grads = [torch.randn(TENSOR) for _ in range(count)]
    record("grad accumulation (foreach add)", timed(lambda: torch._foreach_add_([p.grad for p in params], grads),
                                                     args.repeats), n * 12)
    src, dst = torch.empty(n // 4), torch.empty(n // 4)
    record("copy_", timed(lambda: dst.copy_(src), args.repeats), n // 4 * 8)
    out = {"elements": n, "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
