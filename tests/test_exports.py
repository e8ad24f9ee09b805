"""Exports: each format is accepted by the target's own parser, and what a target cannot express is
reported in one line with the nearest plan's simulated step time.

Target parsers run where they are installed (`pip install -e ".[export-check]"`): accelerate's config
loader and `ParallelismConfig`, transformers' `TrainingArguments`, torchtitan's config dataclasses with
its tyro registry, DeepSpeed's `DeepSpeedConfig`. Without them the files are checked against the
targets' documented keys (pinned below from accelerate 1.15, torchtitan 0.3.0, DeepSpeed 0.19).
"""

from __future__ import annotations

import importlib.util
import json
import os
import tomllib
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import soap
from planner.exports import FORMATS, format_module
from planner.plan import load_plan
from soap.cli import main

SMALL_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 2048,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}
PLANS = {
    # runs on every target as it is
    "fsdp": dict(dp=8, zero=3, tp=1, pp=1, cp=1, recompute="full", micro_batch=2),
    # a pipeline and ZeRO-1: accelerate and DeepSpeed fold the pipeline, Megatron has no GPipe
    "pipeline": dict(dp=2, zero=1, tp=2, pp=2, cp=1, schedule="GPipe", micro_batch=1),
    # TP x CP with fp16 and selective recompute
    "tp_cp": dict(dp=2, zero=2, tp=2, pp=1, cp=2, precision="fp16", recompute="selective", micro_batch=1),
}
HAVE = {name: importlib.util.find_spec(name) is not None for name in ("accelerate", "torchtitan", "deepspeed")}

TORCHTITAN_KEYS = {  # torchtitan 0.3.0 config dataclasses, for when torchtitan is not installed
    "training": {"local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "enable_cpu_offload",
                 "disable_cuda_graphs", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq",
                 "gc_debug"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "enable_fsdp_symm_mem", "tensor_parallel_degree", "enable_sequence_parallel", "spmd_backend",
                    "pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                    "context_parallel_degree", "context_parallel_load_balancer", "context_parallel_ptrr_mask_key",
                    "expert_parallel_degree"},
    "compile": {"enable", "enable_async_tensor_parallel", "components", "backend"},
}
DEEPSPEED_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "zero_optimization", "bf16", "fp16", "gradient_clipping", "steps_per_print", "wall_clock_breakdown"}
MEGATRON_FLAGS = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--num-layers-per-virtual-pipeline-stage", "--virtual-pipeline-model-parallel-size", "--expert-model-parallel-size",
    "--sequence-parallel", "--micro-batch-size", "--global-batch-size", "--seq-length", "--num-layers", "--hidden-size",
    "--num-attention-heads", "--ffn-hidden-size", "--group-query-attention", "--num-query-groups",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--bf16", "--fp16", "--fp8-format",
    "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "--use-torch-fsdp2",
    "--optimizer-cpu-offload", "--optimizer-offload-fraction", "--optimizer", "--use-flash-attn",
}


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Variables a launcher sets. accelerate's and DeepSpeed's state objects read them (a LOCAL_RANK left by
an in-process reference run makes accelerate initialize torch.distributed) and may write them; a later
`soap execute` subprocess that inherits RANK and WORLD_SIZE takes itself for one torchrun rank."""


@pytest.fixture(autouse=True)
def _launcher_environment_restored(monkeypatch):
    """Each test sees no launcher variables, and whatever the targets' code writes into os.environ is
    undone afterwards."""
    saved = dict(os.environ)
    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    (root / "config.json").write_text(json.dumps(SMALL_LLAMA))
    out = {}
    for name, pins in PLANS.items():
        plan = soap.plan(str(root), gpus=8, global_batch=32, seq_len=256, **pins)
        plan.save(root / f"{name}.json")
        out[name] = root / f"{name}.json"
    return out


def export(plan_path: Path, fmt: str, capsys) -> tuple[Path, str]:
    path = plan_path.parent / f"{plan_path.stem}.{fmt}.out"
    assert main(["export", str(plan_path), fmt, "-o", str(path)]) == 0
    return path, capsys.readouterr().err


def _exported_plan(plan_path: Path, fmt: str):
    """The plan an export describes: the nearest one the target runs."""
    from planner.exports.nearest import finish, nearest_plan
    from soap.commands.simulate import simulate_plan

    plan = load_plan(plan_path)
    adj = format_module(fmt).adjust(plan)
    if not adj.changed:
        return plan
    graph, _ = simulate_plan(plan)
    finish(adj, plan, graph)
    return nearest_plan(plan, graph, adj)


def dropped_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "cannot express" in line]


@pytest.mark.parametrize("which", sorted(PLANS))
def test_accelerate_config_loads_in_accelerate_and_its_fields_in_training_arguments(plans, which, capsys):
    path, _ = export(plans[which], "accelerate", capsys)
    data = yaml.safe_load(path.read_text())
    fields = json.loads(path.with_name(path.stem + ".training_args.json").read_text())
    plan = load_plan(plans[which])
    assert data["num_processes"] == 8 and "pipeline" not in json.dumps(data)
    if HAVE["accelerate"]:
        from accelerate.commands.config.config_args import load_config_from_file
        from accelerate.parallelism_config import ParallelismConfig

        config = load_config_from_file(str(path))
        assert config.num_processes == 8 and config.mixed_precision == data["mixed_precision"]
        if config.fsdp_config:
            assert config.fsdp_config["fsdp_version"] == 2
            sizes = {k.removeprefix("parallelism_config_"): v for k, v in config.parallelism_config.items()}
            pc = ParallelismConfig(**sizes)
            assert pc.total_size == 8
    batch_ranks = 8 // (plan.parallelism.tp * plan.parallelism.cp)
    assert fields["per_device_train_batch_size"] * fields["gradient_accumulation_steps"] * batch_ranks \
        == plan.global_batch
    if HAVE["accelerate"]:  # TrainingArguments sets up its device through accelerate
        from transformers import TrainingArguments

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
            args = TrainingArguments(**fields, use_cpu=True)
        assert args.per_device_train_batch_size == fields["per_device_train_batch_size"]
        assert args.bf16 == fields["bf16"] and args.fp16 == fields["fp16"]


@pytest.mark.parametrize("which", sorted(PLANS))
def test_torchtitan_toml_is_accepted_by_torchtitans_config_classes(plans, which, capsys):
    path, _ = export(plans[which], "torchtitan", capsys)
    doc = tomllib.loads(path.read_text())
    p = doc["parallelism"]
    world = (p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"] * p["tensor_parallel_degree"]
             * p["context_parallel_degree"] * p["pipeline_parallel_degree"])
    assert world == 8
    dp = p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"]
    assert doc["training"]["global_batch_size"] % (doc["training"]["local_batch_size"] * dp) == 0
    assert doc["activation_checkpoint"]["mode"] in ("none", "selective", "full")
    if not HAVE["torchtitan"]:
        for section, keys in TORCHTITAN_KEYS.items():
            assert set(doc[section]) <= keys, section
        return
    import dataclasses

    import tyro
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.manager import ConfigManager, custom_registry
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, SelectiveAC

    TrainingConfig(**doc["training"]), ParallelismConfig(**p), CompileConfig(**doc["compile"])
    ConfigManager()  # registers torchtitan's tyro rules

    # the sections of torchtitan's Trainer.Config that import without a GPU model registry (triton)
    job_class = dataclasses.make_dataclass("Job", [
        (name, kind, dataclasses.field(default_factory=default)) for name, kind, default in (
            ("training", TrainingConfig, TrainingConfig), ("parallelism", ParallelismConfig, ParallelismConfig),
            ("compile", CompileConfig, CompileConfig),
            ("activation_checkpoint", ActivationCheckpointingConfig, SelectiveAC.Config))
    ], kw_only=True)

    overrides = format_module("torchtitan").cli_overrides(_exported_plan(plans[which], "torchtitan"))
    job = tyro.cli(job_class, args=overrides, registry=custom_registry)
    assert job.parallelism.tensor_parallel_degree == p["tensor_parallel_degree"]
    assert job.training.seq_len == doc["training"]["seq_len"]
    assert (job.activation_checkpoint is None) == (doc["activation_checkpoint"]["mode"] == "none")


@pytest.mark.parametrize("which", sorted(PLANS))
def test_ds_config_is_accepted_by_deepspeeds_config_class(plans, which, capsys, monkeypatch):
    path, _ = export(plans[which], "deepspeed", capsys)
    data = json.loads(path.read_text())
    dp = data["train_batch_size"] // (data["train_micro_batch_size_per_gpu"] * data["gradient_accumulation_steps"])
    assert dp == 8  # a ds_config runs data parallelism over every rank
    assert set(data) <= DEEPSPEED_KEYS
    if not HAVE["deepspeed"]:
        assert data["zero_optimization"]["stage"] in (0, 1, 2, 3)
        return
    import deepspeed.runtime.config as ds_config

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    config = ds_config.DeepSpeedConfig(str(path), mpu=SimpleNamespace(get_data_parallel_world_size=lambda: dp))
    assert config.zero_optimization_stage == data["zero_optimization"]["stage"]
    assert config.train_batch_size == data["train_batch_size"]
    assert config.bfloat16_config.enabled == data["bf16"]["enabled"]
    assert config.float16_config.enabled == data["fp16"]["enabled"]


@pytest.mark.parametrize("which", sorted(PLANS))
def test_megatron_arguments_use_megatrons_flags_and_fill_the_world(plans, which, capsys):
    path, _ = export(plans[which], "megatron", capsys)
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    flags = dict((line.split(" ", 1) + [""])[:2] for line in lines)
    assert set(flags) <= MEGATRON_FLAGS
    plan = load_plan(plans[which])
    model_parallel = int(flags["--tensor-model-parallel-size"]) * int(flags["--pipeline-model-parallel-size"]) \
        * int(flags["--context-parallel-size"])
    dp = 8 // model_parallel
    assert int(flags["--global-batch-size"]) == plan.global_batch
    assert plan.global_batch % (int(flags["--micro-batch-size"]) * dp) == 0
    assert ("--use-distributed-optimizer" in flags or "--use-torch-fsdp2" in flags) == (plan.parallelism.zero >= 1)


def test_a_plan_every_target_runs_exports_without_a_drop_line(plans, capsys):
    for fmt in FORMATS:
        _, err = export(plans["fsdp"], fmt, capsys)
        assert dropped_lines(err) == [], (fmt, err)


@pytest.mark.parametrize("which, fmt, dropped", [
    ("pipeline", "megatron", "pipeline schedule GPipe"), ("pipeline", "accelerate", "pipeline parallelism"),
    ("pipeline", "deepspeed", "tensor parallelism"), ("tp_cp", "torchtitan", "fp16"),
    ("tp_cp", "accelerate", "selective recompute"), ("tp_cp", "megatron", "ZeRO-2"),
])
def test_what_a_target_cannot_express_is_one_line_with_the_nearest_plans_step_time(plans, which, fmt, dropped,
                                                                                   capsys):
    _, err = export(plans[which], fmt, capsys)
    lines = dropped_lines(err)
    assert len(lines) == 1 and dropped in lines[0], err
    assert "s/step simulated vs" in lines[0] and "soap's plan" in lines[0]


def test_per_op_splits_off_the_megatron_default_are_reported_and_reset(plans, tmp_path, capsys):
    data = json.loads(plans["pipeline"].read_text())
    layers = next(b for b in data["blocks"] if b["id"] == "model.layers")
    core = next(o for o in layers["ops"] if o["op"].endswith(":scaled_dot_product_attention"))
    assert core["soap"].get("parameter") == 2  # heads split over tp: the default
    core["soap"] = {k: v for k, v in core["soap"].items() if k != "parameter"} | {"attribute": 2}
    custom = tmp_path / "custom.json"
    custom.write_text(json.dumps(data))
    for fmt in ("torchtitan", "megatron"):
        _, err = export(custom, fmt, capsys)
        lines = dropped_lines(err)
        assert len(lines) == 1 and "per-op splits (1 op off the Megatron default)" in lines[0], err


def test_nearest_plan_is_a_valid_plan_on_the_same_gpus_and_batch(plans):
    from planner.exports.nearest import finish, nearest_plan
    from soap.commands.simulate import simulate_plan

    plan = load_plan(plans["pipeline"])
    graph, _ = simulate_plan(plan)
    for fmt in FORMATS:
        adj = format_module(fmt).adjust(plan)
        finish(adj, plan, graph)
        near = nearest_plan(plan, graph, adj)
        p = near.parallelism
        assert near.cluster.gpus == 8 and near.global_batch == plan.global_batch
        assert p.dp * p.tp * p.pp * p.cp == 8 and near.predicted["step_time_s"] > 0
    assert load_plan(plans["pipeline"]).parallelism.pp == 2  # the original is untouched


def test_plan_export_option_writes_after_the_plan(plans, tmp_path, capsys):
    config = plans["fsdp"].parent
    target = tmp_path / "job.toml"
    code = main(["plan", str(config), "--gpus", "8", "--global-batch", "32", "--seq-len", "256", "--dp", "8",
                 "--zero", "3", "-o", str(tmp_path / "plan.json"), "--export", f"torchtitan={target}",
                 "--export", "deepspeed"])
    assert code == 0
    assert tomllib.loads(target.read_text())["parallelism"]["data_parallel_shard_degree"] == 8
    assert (tmp_path / "ds_config.json").exists()


@pytest.mark.parametrize("argv", [
    ["export", "PLAN", "bogus"],
    ["plan", "CONFIG", "--gpus", "8", "--export", "bogus=x.txt"],
    ["plan", "CONFIG", "--gpus", "8", "--export", "torchtitan="],
])
def test_a_bad_export_format_is_one_error_line_and_exit_2(plans, argv, capsys):
    argv = [str(plans["fsdp"]) if a == "PLAN" else str(plans["fsdp"].parent) if a == "CONFIG" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    assert ("accelerate" in err[0]) if "bogus" in " ".join(argv) else ("PATH" in err[0])
