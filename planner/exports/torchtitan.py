"""`torchtitan`: a job TOML for torchtitan <= 0.2 (`--job.config_file`), in its `JobConfig` section and
field names ([job], [training], [parallelism], [activation_checkpoint], [compile], [optimizer], float8 as
[model] converters + [quantize.linear.float8]), plus the same settings as torchtitan 0.3 command-line
overrides in the file's header.

torchtitan 0.3 reads no TOML: it builds its job in Python (`--module M --config C`) and takes overrides in its
config dataclasses' names (`torchtitan.config.TrainingConfig`, `ParallelismConfig`, `CompileConfig`, the
activation-checkpoint policy as a subcommand). The two differ where the header's overrides carry 0.3-only
fields: `enable_sequence_parallel` (0.2 always runs sequence parallelism under TP and rejects the key) and
`disable_cuda_graphs` (0.3 captures CUDA graphs by default and refuses them with pipeline or expert
parallelism). Both parsers check these outputs in tests/test_exports.py.
torchtitan runs every soap mesh (HSDP x TP x CP x PP, EP borrowed from dp_shard x cp) and every
torch.distributed.pipelining schedule. It has no fp16 (bf16 or fp32 only), no optimizer-only sharding
(ZeRO-1) and only AdamW among soap's optimizers; its TP applies the Megatron placements.
"""

from __future__ import annotations

import re
from pathlib import Path

from planner.exports import layout
from planner.exports.launch import torchrun
from planner.exports.layout import Adjustment

TARGET = "torchtitan"


def adjust(plan) -> Adjustment:
    adj = layout.start(plan)
    p = adj.parallelism
    layout.fsdp2_layout(adj, target=TARGET)
    if p["precision"] == "fp16":
        adj.dropped.append("fp16 (torchtitan trains in bf16 or fp32) -> bf16")
        p["precision"] = "bf16"
    layout.optimizer_to(adj, ("adamw",), "adamw", target=TARGET)
    layout.cross_entropy_to(adj, "upcast", target=TARGET)
    return adj


def _fqn(module: str) -> str | None:
    """An HF Llama-family module name in torchtitan's model (None where there is no counterpart)."""
    for pattern, repl in ((r"model\.embed_tokens", "tok_embeddings"), (r"model\.layers\.(\d+)", r"layers.\1"),
                          (r"model\.norm", "norm"), (r"lm_head", "output")):
        if re.fullmatch(pattern, module):
            return re.sub(pattern, repl, module)
    return None


def stage_modules(plan) -> list[list[str]] | None:
    """The plan's pipeline stages as torchtitan's `module_fqns_per_model_part` (Llama-family names)."""
    parts = [[_fqn(m) for m in s.modules if not m.endswith("rotary_emb")] for s in plan.stages]
    if not parts or any(None in part or not part for part in parts):
        return None
    return parts  # type: ignore[return-value]


def sections(plan) -> dict[str, dict]:
    """The TOML's sections, in torchtitan 0.2's `JobConfig` names (every key also a 0.3 field where 0.3 has
    the section, except [job], [optimizer], [model] and [quantize...], which 0.3 sets in Python)."""
    p = plan.parallelism
    dp = p.dp_replicate * p.dp_shard
    fsdp = layout.on_fsdp2(p.model_dump()) or p.zero >= 2
    replicate, shard = (p.dp_replicate, p.dp_shard) if fsdp else (dp, 1)
    parallelism = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "fsdp_reshard_after_forward": "always" if p.zero == 3 else "never" if fsdp else "default",
        "tensor_parallel_degree": p.tp,
        "context_parallel_degree": p.cp,
        "pipeline_parallel_degree": p.pp,
        "pipeline_parallel_schedule": p.schedule,
        "pipeline_parallel_microbatch_size": p.micro_batch,
        "expert_parallel_degree": p.ep,
    }
    if p.pp > 1:
        parts = stage_modules(plan)
        if parts is not None:
            parallelism["module_fqns_per_model_part"] = parts
    training = {
        "local_batch_size": p.micro_batch * (p.num_microbatches // p.grad_accum),
        "global_batch_size": plan.global_batch,
        "seq_len": plan.seq_len,
        "mixed_precision_param": "float32" if p.precision in ("fp32", "tf32") else "bfloat16",
        "enable_cpu_offload": p.offload_optimizer,
    }
    out = {
        "training": training,
        "parallelism": parallelism,
        "activation_checkpoint": {"mode": p.recompute, **({"selective_ac_option": "op"} if p.recompute == "selective" else {})},
        "compile": {"enable": p.compile, "components": ["model", "loss"]},
        "optimizer": {"name": "AdamW"},
    }
    if p.precision == "fp8":
        out["model"] = {"converters": ["quantize.linear.float8"]}
        out["quantize.linear.float8"] = {"enable_fsdp_float8_all_gather": fsdp, "precompute_float8_dynamic_scale_for_fsdp": fsdp}
    return out


def cli_overrides(plan) -> list[str]:
    """The [training], [parallelism] and [compile] settings as torchtitan 0.3 command-line arguments, with
    0.3's own fields (sequence parallelism, CUDA graphs off where 0.3 refuses them), and the
    activation-checkpoint policy as its subcommand."""
    p = plan.parallelism
    s = sections(plan)
    if p.pp > 1 or p.ep > 1:
        s["training"]["disable_cuda_graphs"] = True
    s["parallelism"]["enable_sequence_parallel"] = p.sequence_parallel
    args = []
    for section in ("training", "parallelism", "compile"):
        for key, value in s[section].items():
            flag = f"--{section}.{key}"
            if isinstance(value, bool):
                args.append(flag if value else f"--{section}.no-{key}")
            elif isinstance(value, list):
                if value and isinstance(value[0], list):
                    continue  # stage FQN lists go through the TOML / Python config, not the command line
                args += [flag, ",".join(value)]
            else:
                args += [flag, str(value)]
    args.append(f"activation_checkpoint:{s['activation_checkpoint']['mode']}")
    return args


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(plan, path: Path) -> dict[Path, str]:
    p = plan.parallelism
    lines = [
        f"# torchtitan job config for {plan.model.name} on {plan.cluster.gpus} x {plan.cluster.name}, written by soap.",
        f"# launch (torchtitan <= 0.2): {launch(plan, path)}",
        "# torchtitan >= 0.3 reads no TOML: pick the model with --module/--config and add these overrides:",
        "#   " + " ".join(cli_overrides(plan)),
    ]
    if p.precision == "fp8":
        lines.append("# torchtitan >= 0.3: fp8 is a model converter (Float8LinearConverter) in the Python config.")
    if p.tp > 1 and not p.sequence_parallel:
        lines.append("# sequence parallelism is off in this plan: torchtitan <= 0.2 always runs it with TP.")
    lines += ["", "[job]", f"description = {_toml_value(f'{plan.model.name}: soap plan')}"]
    for section, values in sections(plan).items():
        lines += ["", f"[{section}]"] + [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return {path: "\n".join(lines) + "\n"}


def launch(plan, path: Path) -> str:
    return f"{torchrun(plan)} -m torchtitan.train --job.config_file {path}"
