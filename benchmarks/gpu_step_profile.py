"""Where one mixed-precision training step's time and memory go on a GPU (the evidence behind the
"One H100" section's errors).

    python -m benchmarks.gpu_step_profile gpt2 32 1024 > FILE      # on a CUDA machine

It runs the step the executor runs for a single-rank bf16 plan: fp32 parameters, `torch.autocast(cuda,
bf16)` around forward and loss, cross-entropy on `logits.float()`, fused AdamW. It prints the median step
time, the peak allocated memory, the bytes saved for backward by dtype (a `saved_tensors_hooks` count)
and torch.profiler's top kernels by CUDA time.
"""

from __future__ import annotations

import collections
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tracer import build_model, resolve_spec


def main() -> None:
    name, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = build_model(resolve_spec(name), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
    saved: collections.Counter[str] = collections.Counter()

    def count(t: torch.Tensor) -> torch.Tensor:
        saved[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
        return t

    def step(hooks: bool = False) -> None:
        pack = count if hooks else (lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids, use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(hooks=True)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(f"{name} batch {batch} x seq {seq}, bf16 autocast, {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"step {sorted(times)[2]:.4f} s (median of 5); peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    print("saved for backward: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sorted(saved.items())))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
