"""`megatron`: Megatron-LM / NeMo arguments (parallel sizes, virtual pipeline, sequence parallel, batch,
recompute, precision, distributed optimizer), one per line.

Megatron runs tp x cp x pp x dp with its own TP placements and expert parallelism inside dp x cp. Its
pipeline schedules are 1F1B and interleaved 1F1B (`--num-layers-per-virtual-pipeline-stage`); GPipe
becomes 1F1B and the looped or zero-bubble schedules interleaved 1F1B. The distributed optimizer shards
optimizer state (ZeRO-1; ZeRO-2 becomes ZeRO-1, `--num-distributed-optimizer-instances` keeps a
replicate x shard split); ZeRO-3 runs on `--use-torch-fsdp2` over all data-parallel ranks. There is no
torch.compile switch and no 8-bit or Adafactor optimizer.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from costmodel.plan_rules import executed_pipeline_violation
from planner.exports import layout
from planner.exports.launch import torchrun
from planner.exports.layout import Adjustment
from planner.exports.megatron_model import model_arguments, model_notes
from tracer.api import model_dims

TARGET = "megatron"
SCHEDULE = {"GPipe": "1F1B", "1F1B": "1F1B", "Interleaved1F1B": "Interleaved1F1B", "LoopedBFS": "Interleaved1F1B",
            "InterleavedZeroBubble": "Interleaved1F1B", "ZBVZeroBubble": "Interleaved1F1B"}


def adjust(plan) -> Adjustment:
    adj = layout.start(plan)
    p = adj.parallelism
    if p["pp"] > 1 and SCHEDULE[p["schedule"]] != p["schedule"]:
        new = SCHEDULE[p["schedule"]]
        if executed_pipeline_violation(new, pp=p["pp"], virtual_stages=p["virtual_stages"],
                                       num_microbatches=p["num_microbatches"], grad_accum=p["grad_accum"]):
            new, p["virtual_stages"] = "1F1B", 1
        adj.dropped.append(f"pipeline schedule {p['schedule']} (not in Megatron) -> {new}")
        p["schedule"] = new
    if p["zero"] == 2:
        adj.dropped.append("ZeRO-2 (the distributed optimizer keeps full gradient buffers) -> ZeRO-1")
        p["zero"] = 1
    if p["zero"] == 3 and p["dp_replicate"] > 1:
        layout.shard_all(adj, f"hybrid sharding under ZeRO-3 (dp_replicate={p['dp_replicate']}) -> "
                              f"FSDP2 over all {p['dp']} data-parallel ranks")
    if p["offload_optimizer"] and p["zero"] == 0:
        adj.dropped.append("optimizer offload without the distributed optimizer -> ZeRO-1")
        p["zero"] = 1
    if p["compile"]:
        adj.dropped.append("torch.compile (no Megatron switch) -> eager")
        p["compile"] = False
    layout.optimizer_to(adj, ("adamw", "sgd"), "adamw", target=TARGET)
    layout.cross_entropy_to(adj, "megatron", target=TARGET)
    return adj


def arguments(plan) -> list[str]:
    p = plan.parallelism
    dims = model_dims(SimpleNamespace(**plan.model.config), [])
    args = [f"--tensor-model-parallel-size {p.tp}", f"--pipeline-model-parallel-size {p.pp}",
            f"--context-parallel-size {p.cp}"]
    if p.pp > 1 and p.virtual_stages > 1:
        if dims.num_layers % (p.pp * p.virtual_stages) == 0:
            args.append(f"--num-layers-per-virtual-pipeline-stage {dims.num_layers // (p.pp * p.virtual_stages)}")
        else:
            args.append(f"--virtual-pipeline-model-parallel-size {p.virtual_stages}")
    if p.ep > 1:
        args.append(f"--expert-model-parallel-size {p.ep}")
    if p.sequence_parallel and p.tp > 1:
        args.append("--sequence-parallel")
    args += [f"--micro-batch-size {p.micro_batch}", f"--global-batch-size {plan.global_batch}",
             f"--seq-length {plan.seq_len}"]
    if dims.num_layers and dims.hidden:
        args += [f"--num-layers {dims.num_layers}", f"--hidden-size {dims.hidden}",
                 f"--num-attention-heads {dims.heads}"]
        if dims.ffn:
            args.append(f"--ffn-hidden-size {dims.ffn}")
        if dims.kv_heads and dims.kv_heads != dims.heads:
            args += ["--group-query-attention", f"--num-query-groups {dims.kv_heads}"]
    args += model_arguments(plan.model.config, tp=p.tp, name=plan.model.name)
    if p.recompute == "full":
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    elif p.recompute == "selective":
        args.append("--recompute-granularity selective")
    if p.precision in ("bf16", "fp8"):
        args.append("--bf16")
    elif p.precision == "fp16":
        args.append("--fp16")
    if p.precision == "fp8":
        args += ["--fp8-format hybrid"]
    if p.zero == 3:
        args.append("--use-torch-fsdp2")
    elif p.zero >= 1:
        args.append("--use-distributed-optimizer")
        if p.dp_replicate > 1 and p.dp_shard > 1:
            args.append(f"--num-distributed-optimizer-instances {p.dp_replicate}")
    if p.offload_optimizer:
        args += ["--optimizer-cpu-offload", "--optimizer-offload-fraction 1.0"]
    args.append(f"--optimizer {'sgd' if p.optimizer == 'sgd' else 'adam'}")
    if p.attention == "sdpa":
        args.append("--use-flash-attn")
    return args


def render(plan, path: Path) -> dict[Path, str]:
    header = [f"# Megatron-LM arguments for {plan.model.name} on {plan.cluster.gpus} x {plan.cluster.name}, "
              "written by soap (NeMo: the same sizes under trainer.strategy).",
              f"# launch: {launch(plan, path)}"]
    header += model_notes(plan.model.config, tp=plan.parallelism.tp, seq_len=plan.seq_len)
    return {path: "\n".join(header + arguments(plan)) + "\n"}


def launch(plan, path: Path) -> str:
    return f"{torchrun(plan)} pretrain_gpt.py $(grep -v '^#' {path})"
