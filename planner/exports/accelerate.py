"""`accelerate`: the config YAML `accelerate config` writes (FSDP2 plugin, `parallelism_config_*` degrees,
mixed precision, processes and machines), plus the matching `transformers.TrainingArguments` fields.

Accelerate runs DDP, or FSDP2 with a `ParallelismConfig` of dp_replicate x dp_shard x tp x cp. It has no
pipeline or expert parallelism, no Megatron sequence parallelism beside TP, no optimizer-only sharding
(ZeRO-1) and one activation-checkpointing switch (full recompute).

A PEFT plan (`plan.model.peft`) also gets `<stem>.peft.json`: the `peft.LoraConfig` fields (and for QLoRA
the `transformers.BitsAndBytesConfig` fields of NF4 with double quantization) to apply with
`get_peft_model(model, LoraConfig(**...))` before the Trainer, as soap's executor applies them.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from planner.exports import layout
from planner.exports.launch import layer_class, nodes
from planner.exports.layout import Adjustment

TARGET = "accelerate"
CARRIES_PEFT = True
"""The export writes the plan's LoRA settings (`peft_config`); targets without it say so in one line."""
TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM", "seq-cls": "SEQ_CLS"}
MIXED_PRECISION = {"fp32": "no", "tf32": "no", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}
OPTIM = {"adamw": "adamw_torch_fused", "adamw8bit": "adamw_bnb_8bit", "adafactor": "adafactor", "sgd": "sgd"}


def adjust(plan) -> Adjustment:
    adj = layout.start(plan)
    p = adj.parallelism
    layout.drop_expert_parallel(adj, "accelerate has none")
    layout.fold_into_data_parallel(adj, plan.global_batch, ("pp",), why="accelerate has no pipeline")
    if p["sequence_parallel"]:
        adj.dropped.append("sequence parallelism (accelerate's TP keeps norms replicated) -> off")
        p["sequence_parallel"] = False
    layout.fsdp2_layout(adj, target=TARGET)
    if p["recompute"] == "selective":
        adj.dropped.append("selective recompute (FSDP activation checkpointing is per block) -> full")
        p["recompute"] = "full"
    layout.cross_entropy_to(adj, "upcast", target=TARGET)  # the model's own loss (transformers' ForCausalLMLoss)
    return adj


def training_arguments(plan) -> dict:
    """`TrainingArguments(**fields)` for the plan (with pp == 1, as `adjust` leaves it)."""
    p = plan.parallelism
    fields: dict = {
        "output_dir": "outputs",
        "per_device_train_batch_size": p.micro_batch,
        "gradient_accumulation_steps": p.grad_accum,
        "gradient_checkpointing": p.recompute != "none",
        "bf16": p.precision in ("bf16", "fp8"),
        "fp16": p.precision == "fp16",
        "tf32": p.precision == "tf32",
        "optim": OPTIM[p.optimizer],
        "torch_compile": p.compile,
    }
    if _fsdp(plan):
        sharding = "full_shard" if p.zero == 3 else "shard_grad_op"
        if p.dp_replicate > 1:
            sharding = "hybrid_shard" if p.zero == 3 else "hybrid_shard_zero2"
        fields["fsdp"] = f"{sharding} auto_wrap" + (" offload" if p.offload_optimizer else "")
        fields["fsdp_config"] = {"version": 2, "reshard_after_forward": p.zero == 3,
                                 "activation_checkpointing": p.recompute != "none"}
        fields["gradient_checkpointing"] = False  # FSDP checkpoints the blocks itself
        if layer_class(plan):
            fields["fsdp_config"]["transformer_layer_cls_to_wrap"] = [layer_class(plan)]
    return fields


def _fsdp(plan) -> bool:
    """FSDP2 (with the parallelism config) where soap runs FSDP2, and wherever TP or CP is on: accelerate
    composes those only with FSDP2."""
    p = plan.parallelism
    return layout.on_fsdp2(p.model_dump()) or p.tp > 1 or p.cp > 1


def config(plan) -> dict:
    p = plan.parallelism
    world = plan.cluster.gpus
    data: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "FSDP" if _fsdp(plan) else "MULTI_GPU" if world > 1 else "NO",
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": MIXED_PRECISION[p.precision],
        "num_machines": nodes(plan),
        "num_processes": world,
        "rdzv_backend": "static" if nodes(plan) == 1 else "c10d",
        "same_network": True,
        "use_cpu": False,
    }
    if nodes(plan) > 1:
        data.update(main_process_ip="MASTER_ADDR", main_process_port=29500)
    if p.precision == "fp8":
        data["fp8_config"] = {"backend": "AO"}
    if p.compile:
        data["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    if _fsdp(plan):
        fsdp = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": p.zero == 3,
            "fsdp_offload_params": p.offload_optimizer,
            "fsdp_activation_checkpointing": p.recompute != "none",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
        }
        if layer_class(plan):
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = layer_class(plan)
        data["fsdp_config"] = fsdp
        data["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": p.dp_replicate,
            "parallelism_config_dp_shard_size": p.dp_shard,
            "parallelism_config_tp_size": p.tp,
            "parallelism_config_cp_size": p.cp,
        }
    return data


def peft_config(plan) -> dict | None:
    """{"LoraConfig": fields, "BitsAndBytesConfig": fields (QLoRA)} for a PEFT plan, else None."""
    spec = plan.model.peft_spec()
    if spec is None:
        return None
    lora = {"r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": list(spec.targets) or "all-linear", "task_type": TASK_TYPES.get(plan.model.task)}
    out: dict = {"LoraConfig": lora}
    if spec.quantized:
        out["BitsAndBytesConfig"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                     "bnb_4bit_use_double_quant": True,
                                     "bnb_4bit_compute_dtype": {"bf16": "bfloat16", "fp16": "float16"}.get(
                                         plan.parallelism.precision, "float32")}
    return out


def render(plan, path: Path) -> dict[Path, str]:
    args_path = path.with_name(path.stem + ".training_args.json")
    peft_path = path.with_name(path.stem + ".peft.json")
    peft = peft_config(plan)
    header = (f"# accelerate config for {plan.model.name} on {plan.cluster.gpus} x {plan.cluster.name}, written by soap.\n"
              f"# launch: accelerate launch --config_file {path} train.py"
              + (" --machine_rank $NODE_RANK" if nodes(plan) > 1 else "") + "\n"
              f"# TrainingArguments fields: {args_path}\n"
              + (f"# PEFT: model = get_peft_model(model, LoraConfig(**LoraConfig fields of {peft_path}))\n"
                 if peft else ""))
    files = {
        path: header + yaml.safe_dump(config(plan), sort_keys=True),
        args_path: json.dumps(training_arguments(plan), indent=2, sort_keys=True) + "\n",
    }
    if peft:
        files[peft_path] = json.dumps(peft, indent=2, sort_keys=True) + "\n"
    return files


def launch(plan, path: Path) -> str:
    return f"accelerate launch --config_file {path} train.py"
