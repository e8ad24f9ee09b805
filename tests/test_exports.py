"""Exports: each format is accepted by the target's own parser, and what a target cannot express is
reported in one line with the nearest plan's simulated step time.

Target parsers run where they are installed (`pip install -e ".[export-check]"`): accelerate's config
loader and `ParallelismConfig`, transformers' `TrainingArguments`, DeepSpeed's `DeepSpeedConfig`, and
torchtitan's two `ConfigManager`s: 0.2's reads the TOML (`--job.config_file`), 0.3's parses the header's
command-line overrides. torchtitan installs outside the environment (see TORCHTITAN_HOME). Without them the
files are checked against the targets' documented keys (pinned below from accelerate 1.15, torchtitan 0.2.2
and 0.3.0, DeepSpeed 0.19).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shlex
import subprocess
import sys
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
    # runs on every target but Megatron as it is: planned for transformers' and torchtitan's loss
    "fsdp": dict(dp=8, zero=3, tp=1, pp=1, cp=1, recompute="full", micro_batch=2, cross_entropy="upcast"),
    # a pipeline and ZeRO-1: accelerate and DeepSpeed fold the pipeline, Megatron has no GPipe
    "pipeline": dict(dp=2, zero=1, tp=2, pp=2, cp=1, schedule="GPipe", micro_batch=1),
    # TP x CP with fp16 and selective recompute
    "tp_cp": dict(dp=2, zero=2, tp=2, pp=1, cp=2, precision="fp16", recompute="selective", micro_batch=1),
}
HAVE = {name: importlib.util.find_spec(name) is not None for name in ("accelerate", "deepspeed")}

TORCHTITAN_PLANS = {
    **PLANS,
    # fp8 converter, torch.compile, CPU offload
    "fp8": dict(dp=4, zero=3, tp=2, pp=1, cp=1, precision="fp8", micro_batch=1, compile=True, offload=True),
    # two stages per rank (stage lists), fp32
    "interleaved": dict(dp=4, zero=3, tp=1, pp=2, cp=1, schedule="Interleaved1F1B", virtual_stages=2, micro_batch=1,
                        precision="fp32"),
}
TORCHTITAN_HOME = Path(os.environ.get("SOAP_TORCHTITAN_HOME") or Path.home() / ".cache" / "soap" / "torchtitan")
"""Where .ci/run puts torchtitan 0.3.0 and 0.2.2 (`pip install --no-deps --target HOME/VERSION`): neither installs
into this environment. 0.3.0 pins datasets<4.8 (its dependencies would downgrade datasets, fsspec and
huggingface_hub and add wandb, tensorboard and torchdata); the two releases share the package name; and each
imports triton (0.2's package __init__, 0.3's model registry), a 286 MB GPU compiler. Their config code needs
only torch and tyro."""

TORCHTITAN_TOML_KEYS = {  # torchtitan 0.2.2's JobConfig: the sections soap writes, for when torchtitan 0.2 is absent
    "job": {"config_file", "dump_folder", "description", "print_config", "save_config_file", "custom_config_module"},
    "training": {"dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps",
                 "enable_cpu_offload", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq",
                 "gc_debug", "dataloader"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel",
                    "pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_expert_parallel_overlap", "context_parallel_degree",
                    "context_parallel_load_balancer", "context_parallel_rotate_method", "expert_parallel_degree",
                    "expert_tensor_parallel_degree", "expert_parallel_comm_backend"},
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
                              "early_stop", "memory_budget", "visualize_memory_budget_pareto", "preserve_rng_state",
                              "determinism_check", "debug"},
    "compile": {"enable", "components", "backend"},
    "optimizer": {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation", "early_step_in_backward"},
    "model": {"name", "flavor", "hf_assets_path", "tokenizer_path", "converters", "print_after_conversion"},
    "quantize.linear.float8": {"enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp",
                               "recipe_name", "filter_fqns", "emulate"},
}
TORCHTITAN_03_FIELDS = {  # torchtitan 0.3.0's config dataclasses, for when torchtitan 0.3 is absent
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
    "activation_checkpoint": {"none", "selective", "full", "memory-budget"},  # its subcommands
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
    # the architecture (tests/test_export_megatron_model.py checks it against the HF config)
    "--normalization", "--norm-epsilon", "--swiglu", "--openai-gelu", "--kv-channels", "--disable-bias-linear",
    "--add-qkv-bias", "--position-embedding-type", "--rotary-base", "--rotary-percent", "--use-rope-scaling",
    "--rope-scaling-factor", "--max-position-embeddings", "--untie-embeddings-and-output-weights",
    "--attention-dropout", "--hidden-dropout", "--make-vocab-size-divisible-by", "--tokenizer-type",
    "--tokenizer-model", "--num-experts", "--moe-router-topk", "--moe-router-load-balancing-type",
    "--moe-aux-loss-coeff", "--moe-token-dispatcher-type", "--init-method-std",
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
        plan = soap.plan(str(root), gpus=8, global_batch=32, seq_len=256, cluster="dgx-h100-datasheet", **pins)
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


READ_WITH_TORCHTITAN_0_2 = r"""
import dataclasses, json, sys, types
# torchtitan 0.2's package __init__ imports its MoE triton kernels (to register the float8 converter); its
# config package (job_config.py, manager.py) needs torch and tyro only, so it runs, unchanged, under a bare
# package module.
package = types.ModuleType("torchtitan")
package.__path__ = [sys.argv[1] + "/torchtitan"]
sys.modules["torchtitan"] = package
from torchtitan.config import ConfigManager
read = {path: dataclasses.asdict(ConfigManager().parse_args(["--job.config_file", path])) for path in sys.argv[2:]}
print("\n" + json.dumps(read))
"""


def _installed_torchtitan() -> str:
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _torchtitan_0_2_root() -> Path | None:
    """The folder holding torchtitan 0.2's package: an installed 0.2, else .ci/run's copy."""
    if _installed_torchtitan().startswith("0.2."):
        return Path(importlib.util.find_spec("torchtitan").origin).parent.parent
    folder = TORCHTITAN_HOME / "0.2.2"
    return folder if (folder / "torchtitan" / "config" / "manager.py").is_file() else None


def _torchtitan_0_3(monkeypatch) -> bool:
    """Whether torchtitan 0.3's config package imports: an installed 0.3, else .ci/run's copy (put on the path)."""
    if _installed_torchtitan().startswith("0.3."):
        return True
    folder = TORCHTITAN_HOME / "0.3.0"
    if not (folder / "torchtitan" / "config" / "manager.py").is_file() or importlib.util.find_spec("tyro") is None:
        return False
    monkeypatch.syspath_prepend(str(folder))
    return True


@pytest.fixture(scope="module")
def torchtitan_exports(plans):
    """name -> (torchtitan TOML, the plan it describes) for TORCHTITAN_PLANS."""
    root = plans["fsdp"].parent
    out = {}
    for name, pins in TORCHTITAN_PLANS.items():
        plan_path = plans.get(name)
        if plan_path is None:
            plan_path = root / f"{name}.json"
            soap.plan(str(root), gpus=8, global_batch=32, seq_len=256, **pins).save(plan_path)
        toml = root / f"{name}.torchtitan.toml"
        assert main(["export", str(plan_path), "torchtitan", "-o", str(toml)]) == 0
        out[name] = (toml, _exported_plan(plan_path, "torchtitan"))
    return out


@pytest.fixture(scope="module")
def read_by_torchtitan_0_2(torchtitan_exports):
    """name -> torchtitan 0.2's JobConfig (as a dict) read from the TOML by its ConfigManager, in one subprocess;
    None without torchtitan 0.2 (or tyro)."""
    root = _torchtitan_0_2_root()
    if root is None or importlib.util.find_spec("tyro") is None:
        return None
    paths = {str(toml): name for name, (toml, _) in torchtitan_exports.items()}
    run = subprocess.run([sys.executable, "-c", READ_WITH_TORCHTITAN_0_2, str(root), *paths],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return {paths[path]: config for path, config in json.loads(run.stdout.splitlines()[-1]).items()}


def _header_overrides(toml: Path) -> list[str]:
    lines = toml.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "add these overrides:" in line)
    return shlex.split(lines[at + 1].removeprefix("#"))


@pytest.mark.parametrize("which", sorted(TORCHTITAN_PLANS))
def test_torchtitan_toml_uses_torchtitan_0_2s_job_config_names(torchtitan_exports, which):
    toml, plan = torchtitan_exports[which]
    doc = tomllib.loads(toml.read_text())
    p = doc["parallelism"]
    world = (p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"] * p["tensor_parallel_degree"]
             * p["context_parallel_degree"] * p["pipeline_parallel_degree"])
    assert world == 8
    dp = p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"]
    assert doc["training"]["global_batch_size"] == doc["training"]["local_batch_size"] * dp * plan.parallelism.grad_accum
    assert doc["activation_checkpoint"]["mode"] in ("none", "selective", "full")
    float8 = doc.pop("quantize", {}).get("linear", {}).get("float8")
    if float8 is not None:
        doc["quantize.linear.float8"] = float8
    assert set(doc) <= set(TORCHTITAN_TOML_KEYS)
    for section, keys in doc.items():
        assert set(keys) <= TORCHTITAN_TOML_KEYS[section], section


@pytest.mark.parametrize("which", sorted(TORCHTITAN_PLANS))
def test_torchtitan_overrides_use_torchtitan_0_3s_field_names(torchtitan_exports, which):
    toml, plan = torchtitan_exports[which]
    args = _header_overrides(toml)
    flags = [a.removeprefix("--").split(".", 1) for a in args if a.startswith("--")]
    for section, key in flags:
        assert key.removeprefix("no-") in TORCHTITAN_03_FIELDS[section], (section, key)
    assert args[-1].split(":") == ["activation_checkpoint", args[-1].split(":")[1]]
    assert args[-1].split(":")[1] in TORCHTITAN_03_FIELDS["activation_checkpoint"]
    p = plan.parallelism
    # 0.3.0's Trainer.Config refuses its default CUDA graphs beside a pipeline (and beside EP's token dispatch)
    assert ("--training.disable_cuda_graphs" in args) == (p.pp > 1 or p.ep > 1)
    local = int(args[args.index("--training.local_batch_size") + 1])
    assert local % p.micro_batch == 0


def _assert_torchtitan_read_the_plan(training, parallelism, compile_enable, plan):
    """What both torchtitan releases read: the plan's mesh, schedule, batch, sequence, precision, compile."""
    p = plan.parallelism
    assert training["global_batch_size"] == plan.global_batch and training["seq_len"] == plan.seq_len
    dp = parallelism["data_parallel_replicate_degree"] * parallelism["data_parallel_shard_degree"]
    assert dp == p.dp_replicate * p.dp_shard
    assert training["global_batch_size"] == training["local_batch_size"] * dp * p.grad_accum
    assert training["mixed_precision_param"] == ("float32" if p.precision in ("fp32", "tf32") else "bfloat16")
    assert training["enable_cpu_offload"] == p.offload_optimizer
    assert (parallelism["tensor_parallel_degree"], parallelism["context_parallel_degree"],
            parallelism["pipeline_parallel_degree"], parallelism["expert_parallel_degree"]) == (p.tp, p.cp, p.pp, p.ep)
    assert parallelism["pipeline_parallel_schedule"] == p.schedule
    assert parallelism["pipeline_parallel_microbatch_size"] == p.micro_batch
    # ZeRO-3 reshards after forward, ZeRO-1/2 run as FSDP2 without resharding, ZeRO-0 is DDP (replicate only)
    assert parallelism["fsdp_reshard_after_forward"] == {3: "always", 0: "default"}.get(p.zero, "never")
    assert (parallelism["data_parallel_shard_degree"] == 1) >= (p.zero == 0)
    assert compile_enable == p.compile


@pytest.mark.parametrize("which", sorted(TORCHTITAN_PLANS))
def test_torchtitan_toml_is_read_by_torchtitan_0_2s_config_manager(torchtitan_exports, read_by_torchtitan_0_2,
                                                                   which):
    if read_by_torchtitan_0_2 is None:
        pytest.skip(f"torchtitan 0.2 not in the environment nor in {TORCHTITAN_HOME / '0.2.2'} (see .ci/run), "
                    "or tyro missing")
    config, (toml, plan) = read_by_torchtitan_0_2[which], torchtitan_exports[which]
    p = plan.parallelism
    assert config["job"]["config_file"] == str(toml)
    _assert_torchtitan_read_the_plan(config["training"], config["parallelism"], config["compile"]["enable"], plan)
    stages = config["parallelism"]["module_fqns_per_model_part"]
    assert (stages is not None) == (p.pp > 1)
    if stages is not None:
        assert len(stages) == p.pp * p.virtual_stages and stages[0][0] == "tok_embeddings" and stages[-1][-1] == "output"
    assert config["activation_checkpoint"]["mode"] == p.recompute
    assert config["optimizer"]["name"] == "AdamW"
    assert config["model"]["converters"] == (["quantize.linear.float8"] if p.precision == "fp8" else [])
    if p.precision == "fp8":
        assert config["quantize"]["linear"]["float8"]["enable_fsdp_float8_all_gather"] == (p.zero == 3)
        source = (_torchtitan_0_2_root() / "torchtitan/components/quantization/float8.py").read_text()
        assert 'register_model_converter(Float8LinearConverter, "quantize.linear.float8")' in source


@pytest.mark.parametrize("which", sorted(TORCHTITAN_PLANS))
def test_torchtitan_overrides_parse_in_torchtitan_0_3s_config_manager(torchtitan_exports, which, monkeypatch):
    if not _torchtitan_0_3(monkeypatch):
        pytest.skip(f"torchtitan 0.3 not in the environment nor in {TORCHTITAN_HOME / '0.3.0'} (see .ci/run), "
                    "or tyro missing")
    from torchtitan.config import CompileConfig, ConfigManager, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, FullAC, SelectiveAC

    # The sections of 0.3's Trainer.Config that the overrides set: Trainer.Config itself comes with the model
    # registry (`--module/--config`), which imports triton.
    job = dataclasses.make_dataclass("Job", [
        ("hf_assets_path", str, dataclasses.field(default=".")),
        *((name, kind, dataclasses.field(default_factory=default)) for name, kind, default in (
            ("training", TrainingConfig, TrainingConfig), ("parallelism", ParallelismConfig, ParallelismConfig),
            ("compile", CompileConfig, CompileConfig),
            ("activation_checkpoint", ActivationCheckpointingConfig, SelectiveAC.Config))),
    ], kw_only=True)

    class ModelFreeConfigManager(ConfigManager):
        def _load_config(self, args):  # in place of the config_registry function --module/--config name
            return job(), args

    toml, plan = torchtitan_exports[which]
    config = ModelFreeConfigManager().parse_args(_header_overrides(toml))
    p = plan.parallelism
    training, parallelism = dataclasses.asdict(config.training), dataclasses.asdict(config.parallelism)
    _assert_torchtitan_read_the_plan(training, parallelism, config.compile.enable, plan)
    assert parallelism["enable_sequence_parallel"] == p.sequence_parallel
    assert training["disable_cuda_graphs"] == (p.pp > 1 or p.ep > 1)
    assert type(config.activation_checkpoint) is {"none": type(None), "full": FullAC.Config,
                                                  "selective": SelectiveAC.Config}[p.recompute]
    # the header and the TOML agree wherever both set a field
    doc = tomllib.loads(toml.read_text())
    for section, values in (("training", training), ("parallelism", parallelism),
                            ("compile", dataclasses.asdict(config.compile))):
        for key, value in doc[section].items():
            if key != "module_fqns_per_model_part":
                assert values[key] == value, (section, key)


def test_tp_without_sequence_parallelism_is_an_override_and_a_comment_for_torchtitan_0_2(plans, tmp_path, capsys):
    data = json.loads(plans["tp_cp"].read_text())
    data["parallelism"]["sequence_parallel"] = False  # planner plans run it whenever tp > 1; a hand-edited one may not
    custom = tmp_path / "no_sp.json"
    custom.write_text(json.dumps(data))
    path, _ = export(custom, "torchtitan", capsys)
    text = path.read_text()
    assert "--parallelism.no-enable_sequence_parallel" in _header_overrides(path)
    assert "# sequence parallelism is off in this plan: torchtitan <= 0.2 always runs it with TP." in text
    assert "enable_sequence_parallel" not in tomllib.loads(text)["parallelism"]


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
        if fmt == "megatron":  # its own vocab-parallel cross-entropy holds 2x the fp32 logits, not 3x
            line, = dropped_lines(err)
            assert "cannot express: cross_entropy on an fp32 copy" in line and "megatron's the vocab-parallel" in line
        else:
            assert dropped_lines(err) == [], (fmt, err)


def test_soaps_chunked_loss_is_priced_as_the_targets_loss_in_the_nearest_plan(plans, tmp_path, capsys):
    """A plan with the executor's chunked cross-entropy exports to torchtitan, whose loss upcasts the logits:
    one line says so, and the nearest plan's peak holds the larger loss."""
    data = json.loads(plans["fsdp"].read_text())
    data["parallelism"]["cross_entropy"] = "chunked"
    chunked = tmp_path / "chunked.json"
    chunked.write_text(json.dumps(data))
    _, err = export(chunked, "torchtitan", capsys)
    line, = dropped_lines(err)
    assert "the chunked cross-entropy (1.25-3x the fp32 logits at its peak) (not in torchtitan)" in line
    from soap.commands.simulate import simulate_plan

    near = _exported_plan(chunked, "torchtitan")
    assert near.parallelism.cross_entropy == "upcast"
    upcast_peak = load_plan(plans["fsdp"]).predicted["peak_memory_gib"]
    assert near.predicted["peak_memory_gib"] == pytest.approx(upcast_peak, rel=1e-6)
    assert simulate_plan(load_plan(chunked))[1].peak_memory_bytes / 2**30 < upcast_peak


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


@pytest.fixture(scope="module")
def llama_pipeline_plan(tmp_path_factory):
    """The README's plan shape (llama-3-8b on 8 H100s, a 2-stage pipeline): folding the pipeline into
    data parallelism at ZeRO-1 needs more than 80 GiB."""
    path = tmp_path_factory.mktemp("fit") / "plan.json"
    soap.plan("llama-3-8b", gpus=8, dp=4, zero=1, tp=1, pp=2, cp=1, micro_batch=1, recompute="full",
              global_batch=64, seq_len=8192).save(path)
    return path


def test_a_nearest_plan_that_outgrows_the_device_gets_zero3_before_it_is_written(llama_pipeline_plan, capsys):
    path, err = export(llama_pipeline_plan, "deepspeed", capsys)
    line, = dropped_lines(err)
    assert "to fit the device: ZeRO-3" in line and "over the" not in line, err
    assert json.loads(path.read_text())["zero_optimization"]["stage"] == 3


def test_a_nearest_plan_that_cannot_fit_is_refused_in_one_line(llama_pipeline_plan, capsys, monkeypatch):
    import soap.commands.export as export_command

    monkeypatch.setattr(export_command, "MEMORY_STEPS", ())
    out = llama_pipeline_plan.parent / "refused.json"
    assert main(["export", str(llama_pipeline_plan), "deepspeed", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: deepspeed cannot run this plan in 80 GiB per GPU"), err
    assert "nothing written" in err[0] and not out.exists()
