"""Mixed precision memory: what a bf16 autocast step saves for backward, measured against the autocast
trace's prediction (tracer/autocast.py), and the plan-level peak it leads to.

    python -m benchmarks.amp_memory --measure-cuda    # on a GPU: amp_saved.py's split as JSON
    python -m benchmarks.amp_memory                   # anywhere: writes the section

Three counts of gpt2 (preset, fp32 parameters) at 32 x 1024 with the executor's loss (cross entropy on
`logits.float()`), by dtype:
- GPU: `torch.autocast(cuda, bf16)` on an H100, autograd's saves counted with saved_tensors_hooks
  (benchmarks/gpu_step_profile.py, the lead's run: each save counted, parameter casts included;
  `--measure-cuda` prints benchmarks/amp_saved.py's finer split of the same step);
- CPU: the same forward on real CPU tensors under the tracer's emulation (`CudaAutocastEmulation`),
  counted by benchmarks/amp_saved.py per save and per storage, at batch 1 and scaled to 32 (every
  activation has the sample dimension). Dropout is off here: CPU dropout saves a float mask where
  CUDA's fused kernel saves a bool one, so the bool masks are the trace's alone;
- trace: the saved tensors of `tracer.trace("gpt2", batch=32, seq_len=1024, dtype="autocast-bfloat16")`,
  each storage once, activations only.
Then `soap plan` on one H100 (dgx-h100 profile) for gpt2 32 x 1024, gpt2-xl 16 x 1024 and bert-large
64 x 512, bf16, with
every candidate priced on the fp32 trace at 2 bytes (before) and on its regime's trace (after).
"""

from __future__ import annotations

import copy
import json
import sys
from collections import Counter

MODEL, BATCH, SEQ = "gpt2", 32, 1024
GIB = 2**30
LEAD_PER_SAVE_GIB = {"float32": 28.14, "bfloat16": 8.71, "bool": 0.59}
"""benchmarks/gpu_step_profile.py gpt2 32 1024 on one H100 (docs/benchmarks.md, "One H100"): each save
counted at its own size, parameters and their bf16 casts included."""
PLANS = (("gpt2", 32, 1024, "48.7 GiB, 0.250 s (mb32)"), ("gpt2-xl", 16, 1024, "out of memory (mb8x2)"),
         ("bert-large-uncased", 64, 512, "49.5 GiB, 0.259 s (mb64)"))
"""(model, global batch, sequence length, what `soap execute` of the before plan measured on one H100: the
lead's runs, torch.cuda.max_memory_allocated and the median step time)."""


def measure_cuda() -> dict:
    import torch

    from benchmarks.amp_saved import saved_split
    from tracer import build_model, resolve_spec

    model = build_model(resolve_spec(MODEL), device="cuda").train()
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), device="cuda")
    split, loss = saved_split(model, ids, autocast=torch.autocast("cuda", dtype=torch.bfloat16))
    loss.backward()
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "per_save": dict(split.per_save),
            "by_storage": dict(split.by_storage), "weights": dict(split.weights)}


def _no_dropout_config():
    from tracer import resolve_spec

    config = copy.deepcopy(resolve_spec(MODEL).config)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return config


def measure_emulated_cpu() -> dict[str, Counter]:
    """Autograd's saves under the emulation on real CPU tensors, batch 1 scaled to BATCH."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.amp_saved import saved_split
    from tracer.autocast_mode import CudaAutocastEmulation

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_no_dropout_config(), attn_implementation="sdpa").train()
    ids = torch.randint(0, model.config.vocab_size, (1, SEQ))
    split, _ = saved_split(model, ids, autocast=CudaAutocastEmulation(torch.bfloat16))
    scale = lambda c: Counter({k: v * BATCH for k, v in c.items()})  # noqa: E731
    return {"per_save": scale(split.per_save), "by_storage": scale(split.by_storage), "weights": split.weights}


def predicted(model, dtype: str) -> Counter:
    import tracer

    graph = tracer.trace(model, batch=BATCH, seq_len=SEQ, dtype=dtype)
    split: Counter = Counter()
    for op in graph.ops:
        for t in op.saved:
            split[t.dtype] += t.nbytes * graph.multiplicity(op)
    return split


def plan_peaks(model: str, batch: int, seq: int) -> tuple[dict, dict]:
    """(before, after): the chosen plan and its predicted peak, on the fp32 trace at 2 bytes and per regime."""
    import tracer
    from planner.api import plan_report

    kw = dict(gpus=1, cluster="dgx-h100", precision="bf16", global_batch=batch, seq_len=seq)
    fp32 = tracer.trace(model, batch=1, seq_len=seq, persistent_cache=True)
    out = []
    for graph in (fp32, None):
        report = plan_report(model, graph=graph, **kw)
        p = report.plan.parallelism
        out.append({"plan": f"mb{p.micro_batch}x{p.grad_accum} recompute {p.recompute}",
                    "peak_gib": report.chosen.peak_memory_bytes / GIB, "step_s": report.chosen.step_time_s})
    return out[0], out[1]


def pinned_xl_peak() -> float:
    """gpt2-xl 16 x 1024 at micro-batch 8 without recompute or offload (the limit lifted so it is chosen)."""
    from planner.api import plan_report

    report = plan_report("gpt2-xl", gpus=1, cluster="dgx-h100", precision="bf16", global_batch=16, seq_len=SEQ,
                         micro_batch=8, recompute="none", mem_limit_gib=1000)
    assert not report.plan.parallelism.offload_optimizer
    return report.chosen.peak_memory_bytes


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def main() -> None:
    if "--measure-cuda" in sys.argv:
        print(json.dumps(measure_cuda(), indent=1))
        return
    from benchmarks.report import update_section

    trace = predicted(MODEL, "autocast-bfloat16")
    trace_no_dropout = predicted(_no_dropout_config(), "autocast-bfloat16")
    fp32 = predicted(MODEL, "float32")
    cpu = measure_emulated_cpu()
    rows = ["| dtype | GPU, per save + weights (measured) | CPU emulation, per save + weights | CPU emulation, "
            "per storage | trace (no dropout) | trace | before: fp32 trace at 2 bytes |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for dtype in ("float32", "bfloat16", "bool"):
        before = fp32.get("float32", 0) / 2 if dtype == "bfloat16" else 0 if dtype == "float32" else fp32.get(dtype, 0)
        rows.append(f"| {dtype} | {LEAD_PER_SAVE_GIB[dtype]:.2f} | {_gib(cpu['per_save'][dtype] + cpu['weights'][dtype])} | "
                    f"{_gib(cpu['by_storage'][dtype])} | {_gib(trace_no_dropout[dtype])} | {_gib(trace[dtype])} | {_gib(before)} |")
    plans = ["| model | global batch x seq | before: plan, predicted peak, step | after: plan, predicted peak, step | "
             "measured |", "| --- | --- | --- | --- | --- |"]
    for model, batch, seq, measured in PLANS:
        before, after = plan_peaks(model, batch, seq)
        plans.append(f"| {model} | {batch} x {seq} | {before['plan']}, {before['peak_gib']:.1f} GiB, {before['step_s']:.3f} s | "
                     f"{after['plan']}, {after['peak_gib']:.1f} GiB, {after['step_s']:.3f} s | {measured} |")
    body = "\n".join([
        f"{MODEL} at {BATCH} x {SEQ}, fp32 parameters under bf16 autocast, loss on fp32 logits: bytes saved for "
        "backward by dtype, in GiB (the count each column makes: benchmarks/amp_memory.py's docstring).", "",
        *rows, "",
        "Per save counts the fp32 log-probabilities twice (log_softmax saves them, nll_loss saves them again: "
        "6.1 GiB), each view at its own size (q, k, v of one fused projection; c_proj's input, a view of "
        "the attention output) and each bf16 weight copy once per use; per storage counts what memory holds. "
        "The CPU emulation's per-save count reproduces the GPU's (dropout masks aside), so the emulation "
        "saves what CUDA autocast saves; the trace's per-storage count reproduces the CPU emulation's, so "
        "the trace accounts for what autograd keeps. The bool column is the dropout masks (CUDA's fused "
        "dropout saves 1 byte per element).", "",
        "Plans on one H100 (`soap plan MODEL --gpus 1 --cluster dgx-h100 --precision bf16`). "
        "Before: today's cost model with every candidate priced on the fp32 trace at 2 bytes (it includes "
        "the loss working set added today; the plans the lead ran this morning were predicted at 20.1 GiB "
        "for gpt2, 61.8 GiB for gpt2-xl and 33.0 GiB for bert-large). After: each candidate on its regime's trace. Measured: the "
        "lead's `soap execute` runs of the before plans.", "",
        *plans, "",
        f"gpt2-xl at the plan that ran out of memory (mb8x2, no recompute, optimizer on the GPU): predicted "
        f"{pinned_xl_peak() / GIB:.1f} GiB, over the 80 GiB of an H100.",
    ])
    update_section("amp-memory", "Mixed precision: saved activations under autocast (gpt2, one GPU)", body)
    print(body)


if __name__ == "__main__":
    main()
