"""Executor memory against the memory model: the model state each rank allocates, per plan, on CPU gloo.

Measured. Every rank runs `executor.train.train_step` for 2 steps of the plan on the model
`executor.api.parallelize` builds, and reads glibc's `mallinfo2` (bytes malloc has handed out: every
tensor on the CPU, whichever thread frees it) before building the model and at an optimizer-step
pre-hook of the last step: after its backward, before its optimizer step, when the activations are
freed and the weights, gradients, optimizer state (from the first step) and gradient buffers are
live. Each plan runs twice in its processes and the second run is reported, so what a process
allocates once (lazy imports, caches, gloo's pairs) is not counted. `allocated` is the difference;
`params`, `grads` and `optimizer` are a census of the storages that the rank's parameters, their
`.grad` and its optimizers' state hold (each storage once: a gradient that is a view of DDP's bucket
counts as a gradient, the bucket adds nothing); `other` = allocated - census: DDP's separate buckets,
the last micro-batch's logits the training loop (or a pipeline's last stage, for each micro-batch)
still holds, the token batch, Python objects.

Predicted. The memory model for the rank's stage (`memory.stage_params` over the stage's layers, as
the simulator takes them, with `costmodel.strategy.shards_vocabulary`; `memory.model_state_bytes`,
`memory.buffer_bytes`): weights + grads + optimizer + buffers, its step peak. After backward the
copies it counts from forward to backward only (FSDP2's gathered parameters, autocast's 16-bit
copies) and FSDP2's per-unit gradient buffers are gone: `model after backward` is the fp32
parameters (their fp32 shard under FSDP2, zero >= 2) + grads + optimizer + buffers (DDP: none), what
the census measures.

    flock -x /tmp/soap-cpu.lock python -m benchmarks.executor_memory [--json] [--case NAME ...]

also prints what the model gives a Nemotron-4-340B-shaped model's first and last pipeline stage at
tp8 x pp8 (bf16, AdamW), with and without the vocabulary-parallel ends.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=8192, max_position_embeddings=64, tie_word_embeddings=False),
    "gpt2": dict(n_embd=64, n_layer=4, n_head=4, vocab_size=8192, n_positions=64, tie_word_embeddings=True),
}
"""Large vocabularies beside small blocks, as a 256k vocabulary beside Nemotron-4-340B's blocks."""
RUN_STEPS, SEQ = 2, 16
CASES: dict[str, tuple[int, str, dict[str, Any]]] = {
    "ddp (zero 0)": (2, "llama", dict(dp_replicate=2, micro_batch=1)),
    "ddp + ZeroRedundancyOptimizer (zero 1)": (2, "llama", dict(dp_shard=2, zero=1, micro_batch=1)),
    "fsdp2 zero 2": (2, "llama", dict(dp_shard=2, zero=2, micro_batch=1)),
    "fsdp2 zero 2 bf16": (2, "llama", dict(dp_shard=2, zero=2, micro_batch=1, precision="bf16")),
    "tp2": (2, "llama", dict(tp=2, micro_batch=1)),
    "tp2 x dp2 zero 1 (fsdp2)": (4, "llama", dict(tp=2, dp_shard=2, zero=1, micro_batch=1)),
    "tp2 x pp2": (4, "llama", dict(tp=2, pp=2, micro_batch=1, num_microbatches=2)),
    "tp2 x pp2 tied": (4, "gpt2", dict(tp=2, pp=2, micro_batch=1, num_microbatches=2)),
}


def measure(plan: Any) -> dict[str, Any]:
    """This rank's allocated bytes after the last step's backward (see the module docstring)."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from executor.api import parallelize
    from executor.data import ScaledTokenLoss, Slicer, TokenSource
    from executor.data_parallel import build_optimizer
    from executor.model import build_meta_model
    from executor.train import train_step

    device = torch.device("cpu")
    p = plan.parallelism
    state: dict[str, Any] = {"armed": False}

    def mark(optimizer: Any, args: Any, kwargs: Any) -> None:
        if state["armed"]:
            state["armed"] = False
            gc.collect()
            state["allocated"] = malloc_allocated() - state["baseline"]
            state["census"] = _census(parallel.parameters(), optimizers)

    gc.collect()
    state["baseline"] = malloc_allocated()
    torch.manual_seed(0)
    loss_fn = ScaledTokenLoss()
    parallel = parallelize(build_meta_model(plan.model.config, plan.model.task), plan, seed=0, loss_fn=loss_fn,
                           device=device)
    optimizers = [build_optimizer(plan, list(part.parameters()), lr=1e-3, mesh=parallel.mesh)
                  for part in parallel.parts]
    source = TokenSource(vocab_size=plan.model.config["vocab_size"], global_batch=plan.global_batch,
                         seq_len=plan.seq_len, task=plan.model.task, seed=0)
    slicer = Slicer(dp_rank=parallel.mesh.dp_rank, per_rank=p.micro_batch * p.num_microbatches,
                    cp_rank=parallel.mesh.cp_rank, cp=p.cp)
    handle = register_optimizer_step_pre_hook(mark)
    try:
        for step in range(RUN_STEPS):
            state["armed"] = step == RUN_STEPS - 1
            train_step(parallel, optimizers, loss_fn, source.batch_for_step(step), slicer, device)
    finally:
        handle.remove()
    census = state["census"]
    return {"rank": dist.get_rank(), "pp_rank": parallel.mesh.pp_rank, "allocated": state["allocated"],
            **census, "other": state["allocated"] - sum(census.values())}


def malloc_allocated() -> int:
    """Bytes the process's malloc has handed out and not taken back (glibc `mallinfo2`: in-use heap
    chunks plus mmap'ed blocks), which is where torch's CPU allocator gets every tensor's memory."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _census(params: list, optimizers: list) -> dict[str, int]:
    """Bytes of the parameters, their gradients and the optimizers' state, each storage once."""
    import torch
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()

    def nbytes(tensors: Any) -> int:
        total = 0
        for t in tensors:
            if t is None or not torch.is_tensor(t):
                continue
            local = t.to_local() if isinstance(t, DTensor) else t
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    states = [getattr(opt, "optim", opt).state for opt in optimizers]
    return {
        "params": nbytes(params),
        "grads": nbytes(p.grad for p in params),
        "optimizer": nbytes(v for s in states for per_param in s.values() for k, v in per_param.items() if k != "step"),
    }


def predicted(plan: Any) -> list[dict[str, float]]:
    """Per pipeline stage: the memory model's weights, grads, optimizer and buffers for one of its ranks
    (`memory.stage_params` over the stage's layers, as the simulator takes them; `memory.model_state_bytes`
    and `memory.buffer_bytes`)."""
    from transformers import AutoConfig

    import tracer
    from costmodel.memory import FSDP_MASTER_BYTES, buffer_bytes, model_state_bytes
    from costmodel.simulator.pricing import stage_param_set
    from costmodel.simulator.stages import layer_sequence
    from costmodel.strategy import runs_on_fsdp2
    from planner.plan import stage_bounds

    p = plan.parallelism
    fields = {k: v for k, v in plan.model.config.items() if k not in ("transformers_version", "architectures")}
    graph = tracer.trace(AutoConfig.for_model(fields.pop("model_type"), **fields), batch=p.micro_batch,
                         seq_len=plan.seq_len)
    layers = layer_sequence(graph)
    bounds = stage_bounds(plan, graph) or (0, len(layers))
    out = []
    for k in range(len(bounds) - 1):
        params = stage_param_set(layers[bounds[k]:bounds[k + 1]], p.tp, p.pp)
        engine = runs_on_fsdp2(dp=p.dp, cp=p.cp, tp=p.tp, pp=p.pp, zero=p.zero, offload=p.offload_optimizer)
        state = model_state_bytes(params.trainable, precision=p.precision, optimizer=p.optimizer, zero=p.zero,
                                  dp_shard=p.dp_shard, offload_optimizer=p.offload_optimizer, frozen=params.frozen,
                                  pipeline=p.pp > 1, fsdp=engine)
        buffers = buffer_bytes(params=params, precision=p.precision, zero=p.zero, dp=p.dp, dp_shard=p.dp_shard,
                               offload=p.offload_optimizer, fsdp=engine)
        fsdp = (p.zero >= 2 or engine) and p.dp_shard > 1
        master = math.ceil(params.trainable * FSDP_MASTER_BYTES / p.dp_shard) if fsdp else 4 * params.trainable
        after_backward = master + state.grads + state.optimizer + (0 if fsdp else buffers)
        out.append({"weights": state.weights, "grads": state.grads, "optimizer": state.optimizer, "buffers": buffers,
                    "master": master, "after_backward": after_backward})
    return out


def _worker(rank: int, world: int, store: str, cases: list[str], out: str, warm_up: bool) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from exec_helpers import make_plan, tiny_config

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    for name in cases:
        _, family, kwargs = CASES[name]
        plan = make_plan(family, config=tiny_config(family, **CONFIGS[family]), seq_len=SEQ, **kwargs)
        if warm_up:  # what a process allocates once (imports, caches, gloo pairs) is not the plan's
            measure(plan)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, measure(plan))
        results[name] = gathered
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def run(cases: list[str] | None = None, *, warm_up: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Measure `cases` (default: all), each world size in one spawned group; rank rows per case. Without
    `warm_up` each plan runs once: the census stays exact, `allocated` also counts one-time allocations."""
    import multiprocessing

    import torch.multiprocessing as mp

    # ranks fork from a server that imported torch and transformers once (as tests/exec_helpers.spawn_cases)
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["exec_helpers", "executor.train", "transformers.models.llama.modeling_llama",
         "transformers.models.gpt2.modeling_gpt2"])
    names = cases or list(CASES)
    results: dict[str, Any] = {}
    for world in sorted({CASES[n][0] for n in names}):
        group = [n for n in names if CASES[n][0] == world]
        out, store = tempfile.mktemp(prefix="soap-mem-"), tempfile.mktemp(prefix="soap-store-")
        mp.start_processes(_worker, args=(world, store, group, out, warm_up), nprocs=world, start_method="forkserver")
        results |= json.loads(Path(out).read_text())
    return {n: results[n] for n in names}


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    from exec_helpers import make_plan, tiny_config

    kib = 1024
    lines = ["| plan | rank (stage) | allocated after backward | params | grads | optimizer | other | "
             "model: weights + grads + optimizer + buffers | model after backward | allocated / model after backward |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, ranks in results.items():
        _, family, kwargs = CASES[name]
        stages = predicted(make_plan(family, config=tiny_config(family, **CONFIGS[family]), seq_len=SEQ, **kwargs))
        for r in ranks:
            m = stages[r["pp_rank"]]
            total = m["weights"] + m["grads"] + m["optimizer"] + m["buffers"]
            lines.append(
                f"| {name} | {r['rank']} ({r['pp_rank']}) | {r['allocated'] / kib:,.0f} | {r['params'] / kib:,.0f} | "
                f"{r['grads'] / kib:,.0f} | {r['optimizer'] / kib:,.0f} | {r['other'] / kib:,.0f} | "
                f"{m['weights'] / kib:,.0f} + {m['grads'] / kib:,.0f} + {m['optimizer'] / kib:,.0f} + "
                f"{m['buffers'] / kib:,.0f} = {total / kib:,.0f} | {m['after_backward'] / kib:,.0f} | "
                f"{r['allocated'] / m['after_backward']:.2f} |")
    return "\n".join(lines) + "\n\n(KiB per rank)"


NEMOTRON = dict(model_type="llama", hidden_size=18432, intermediate_size=49152, num_hidden_layers=96,
                num_attention_heads=96, num_key_value_heads=8, vocab_size=256000, max_position_embeddings=4096,
                tie_word_embeddings=False)
"""Nemotron-4-340B's vocabulary, hidden size, layers and heads on a Llama block: its squared-ReLU MLP has two
matrices of 18432 x 73728, the gated stand-in three of 18432 x 49152, the same parameters."""


def nemotron_table() -> str:
    """The model's weights + grads + optimizer per rank of the first and last of 8 pipeline stages at tp 8
    (bf16, AdamW, no data parallelism), with the token embedding and LM head whole or vocab-parallel."""
    from transformers import AutoConfig

    import tracer
    from costmodel.memory import model_state_bytes
    from costmodel.simulator.pricing import stage_param_set
    from costmodel.simulator.stages import balanced_bounds, layer_sequence

    fields = dict(NEMOTRON)
    graph = tracer.trace(AutoConfig.for_model(fields.pop("model_type"), **fields), batch=1, seq_len=4096)
    layers = layer_sequence(graph)
    bounds = balanced_bounds(layers, 8)
    lines = ["| stage | embedding and head whole (before) | vocab-parallel (after) | difference |", "|---|---|---|---|"]
    for k in (0, 7):
        gib = []
        for vocab_parallel in (False, True):
            params = stage_param_set(layers[bounds[k]:bounds[k + 1]], 8, 8, vocab_parallel=vocab_parallel)
            state = model_state_bytes(params.trainable, precision="bf16", optimizer="adamw", zero=0, dp_shard=1,
                                      offload_optimizer=False)
            gib.append((state.weights + state.grads + state.optimizer) / 2**30)
        lines.append(f"| {k} | {gib[0]:.1f} GiB | {gib[1]:.1f} GiB | {gib[0] - gib[1]:.1f} GiB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the raw per-rank numbers as JSON")
    parser.add_argument("--case", action="append", choices=list(CASES), help="measure only these plans")
    args = parser.parse_args()
    results = run(args.case)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(table(results))
    print("\nThe model for a Nemotron-4-340B-shaped model at tp 8 x pp 8 (bf16, AdamW, per rank):\n")
    print(nemotron_table())


if __name__ == "__main__":
    main()
