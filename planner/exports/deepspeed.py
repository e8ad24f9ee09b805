"""`deepspeed`: a ds_config JSON (ZeRO stage, optimizer offload, micro-batch, accumulation, precision).

A ds_config alone runs data parallelism with ZeRO 0-3 over every rank: tensor, context and pipeline
parallelism need model code (Megatron-DeepSpeed's mpu, `PipelineModule`) and expert parallelism
DeepSpeed-MoE layers, so their ranks become data-parallel ranks. ZeRO shards over all data-parallel
ranks (no HSDP-style replicate x shard split), offload needs ZeRO >= 1, and there is no fp8.
Activation checkpointing and torch.compile stay with the training script (as in soap's plan).
"""

from __future__ import annotations

import json
from pathlib import Path

from planner.exports import layout
from planner.exports.launch import nodes, procs_per_node
from planner.exports.layout import Adjustment

TARGET = "deepspeed"


def adjust(plan) -> Adjustment:
    adj = layout.start(plan)
    p = adj.parallelism
    layout.drop_expert_parallel(adj, "DeepSpeed-MoE needs model code")
    layout.fold_into_data_parallel(adj, plan.global_batch, ("tp", "cp", "pp"), why="a ds_config cannot express it")
    if p["zero"] >= 1 and p["dp_replicate"] > 1:
        layout.shard_all(adj, f"hybrid sharding (dp_replicate={p['dp_replicate']} x dp_shard={p['dp_shard']}) "
                              f"-> ZeRO-{p['zero']} over all {p['dp']} ranks")
    if p["offload_optimizer"] and p["zero"] == 0:
        adj.dropped.append("optimizer offload at ZeRO-0 (DeepSpeed offloads from ZeRO-1 up) -> ZeRO-1")
        p["zero"] = 1
    if p["precision"] == "fp8":
        adj.dropped.append("fp8 (no fp8 training in a ds_config) -> bf16")
        p["precision"] = "bf16"
    layout.cross_entropy_to(adj, "upcast", target=TARGET)  # the model's own loss (transformers' ForCausalLMLoss)
    return adj


def config(plan) -> dict:
    p = plan.parallelism
    zero: dict = {"stage": p.zero}
    if p.zero >= 1:
        zero.update(overlap_comm=True, contiguous_gradients=True)
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    data = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": p.micro_batch,
        "gradient_accumulation_steps": p.grad_accum,
        "zero_optimization": zero,
        "bf16": {"enabled": p.precision == "bf16"},
        "fp16": {"enabled": p.precision == "fp16", **({"loss_scale": 0, "initial_scale_power": 16}
                                                       if p.precision == "fp16" else {})},
        "gradient_clipping": 1.0,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }
    return data


def render(plan, path: Path) -> dict[Path, str]:
    return {path: json.dumps(config(plan), indent=2, sort_keys=True) + "\n"}


def launch(plan, path: Path) -> str:
    multi = f"--num_nodes {nodes(plan)} --hostfile hostfile " if nodes(plan) > 1 else ""
    return f"deepspeed {multi}--num_gpus {procs_per_node(plan)} train.py --deepspeed {path}"
