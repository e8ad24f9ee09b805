"""Where one mixed-precision training step's time and memory go on a GPU (the evidence behind the
"One H100" section's errors).

    python -m benchmarks.gpu_step_profile gpt2 32 1024 > FILE      # on a CUDA machine
    python -m benchmarks.gpu_step_profile benchmarks/configs/llama-3-8b-4l.json 1 8192 --compile --json OUT.json
    python -m benchmarks.gpu_step_profile llama-3.2-1b 4 2048 --micro-batches 4 --precision tf32 --json OUT.json

It runs the step the executor runs for a single-rank bf16 plan: fp32 parameters, `torch.autocast(cuda,
bf16)` around forward and loss, cross-entropy on `logits.float()`, fused AdamW (`--precision tf32`: no autocast,
fp32 tensors with TF32 matmuls on, as `executor.precision` runs a tf32 plan). It prints the median step
time, the peak allocated memory, the bytes saved for backward by dtype (a `saved_tensors_hooks` count)
and torch.profiler's top kernels by CUDA time. `--compile` compiles each block in place as the executor does
(`executor.api.compile_blocks`); `--micro-batches N` accumulates N forward and backward passes into each optimizer
step. `--json` also writes every CUDA kernel of one profiled step (name, microseconds,
calls) with their sum per group (`costmodel.calibration.step_factor.kernel_groups`), the form
`benchmarks.h100_measured` reads (benchmarks/data/h100-2026-11-26/step-profile-8b4l.json is one, eager).
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tracer import build_model, resolve_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", help="preset name or config.json path")
    parser.add_argument("batch", type=int)
    parser.add_argument("seq", type=int)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block, as the executor does")
    parser.add_argument("--json", help="write every kernel of one profiled step and their groups here")
    parser.add_argument("--fp8", action="store_true",
                        help="swap the blocks' Linears for torchao's float8 ones first, as the executor's fp8 plans do")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="forward and backward passes per optimizer step (gradient accumulation)")
    parser.add_argument("--precision", choices=("bf16", "tf32"), default="bf16",
                        help="bf16 autocast (default), or fp32 tensors with TF32 matmuls")
    args = parser.parse_args()
    tf32 = args.precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    name, batch, seq, micro = args.model, args.batch, args.seq, args.micro_batches
    model = build_model(resolve_spec(name), device="cuda")
    if args.fp8:  # before compile, as `executor.api` converts before it compiles
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from tracer.fp8 import fp8_linear

        convert_to_float8_training(model, module_filter_fn=fp8_linear, config=Float8LinearConfig())
    if args.compile:
        from executor.tensor_parallel import all_blocks

        for block in all_blocks(model):
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
    saved: collections.Counter[str] = collections.Counter()

    def count(t: torch.Tensor) -> torch.Tensor:
        saved[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
        return t

    def step(hooks: bool = False) -> None:
        pack = count if hooks else (lambda t: t)
        for _ in range(micro):
            with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                  torch.autocast("cuda", dtype=torch.bfloat16, enabled=not tf32)):
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
    print(f"{name} batch {batch} x seq {seq} x {micro} micro-batches, {'tf32' if tf32 else 'bf16 autocast'}"
          f"{', float8 Linears' if args.fp8 else ''}"
          f"{', compiled blocks' if args.compile else ''}, "
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"step {sorted(times)[2]:.4f} s (median of 5); peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    print("saved for backward: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sorted(saved.items())))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    if args.json:
        from costmodel.calibration.step_factor import cuda_kernels, kernel_groups

        kernels = cuda_kernels(prof)
        us: collections.Counter[str] = collections.Counter()
        calls = collections.Counter(kernel for kernel, _ in kernels)
        for kernel, seconds in kernels:
            us[kernel] += seconds * 1e6
        groups = kernel_groups(kernels)
        with open(args.json, "w") as out:
            json.dump({"model": name, "batch": batch, "seq": seq, "micro_batches": micro, "compile": args.compile,
                       "fp8": args.fp8, "precision": args.precision,
                       "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "step_s": sorted(times)[2], "groups_s": groups, "kernel_total_us": sum(us.values()),
                       "kernels_us": [[n, round(t, 1), calls[n]] for n, t in us.most_common()]}, out, indent=1)


if __name__ == "__main__":
    main()
