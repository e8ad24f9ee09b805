"""Tiny models and hand-built plans for the executor tests (the planner is not needed to run a plan)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from planner.plan import SCHEMA_VERSION, Plan, config_hash, plan_from_dict

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=96, max_position_embeddings=64,
                  tie_word_embeddings=False),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=4, n_head=4, vocab_size=96, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0,
                 eos_token_id=0),
    "bert": dict(model_type="bert", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=96, max_position_embeddings=64,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    # MoE: 4 experts, top-2, no router jitter (the router must be deterministic to compare layouts)
    "mixtral": dict(model_type="mixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=96, max_position_embeddings=64,
                    num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, tie_word_embeddings=False),
    # a shared expert (a dense MLP beside the routed ones, gated by its own sigmoid) in every layer
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
    # DeepSeek-V3 style: a dense first layer, then routed experts with a score-correction bias (a buffer
    # beside the router's weight) and a shared expert; multi-head latent attention
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                        vocab_size=96, max_position_embeddings=64, q_lora_rank=None, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, tie_word_embeddings=False),
}
TASKS = {"llama": "causal-lm", "gpt2": "causal-lm", "bert": "masked-lm", "mixtral": "causal-lm",
         "qwen2_moe": "causal-lm", "deepseek_v3": "causal-lm"}

TP_PLANS: dict[str, dict[str, str]] = {
    "llama": {"input_layernorm": "sequence", "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
              "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise", "post_attention_layernorm": "sequence",
              "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"},
    "gpt2": {"ln_1": "sequence", "attn.c_attn": "colwise", "attn.c_proj": "rowwise", "ln_2": "sequence",
             "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"},
    "bert": {"attention.self.query": "colwise", "attention.self.key": "colwise",
             "attention.self.value": "colwise", "attention.output.dense": "rowwise",
             "intermediate.dense": "colwise", "output.dense": "rowwise"},
    # attention only: with ep > 1 the routed experts are sharded by expert, not by TP
    "mixtral": {"input_layernorm": "sequence", "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise", "post_attention_layernorm": "sequence"},
    "qwen2_moe": {"input_layernorm": "sequence", "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                  "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise", "post_attention_layernorm": "sequence",
                  "mlp.shared_expert.gate_proj": "colwise", "mlp.shared_expert.up_proj": "colwise",
                  "mlp.shared_expert.down_proj": "rowwise"},
}
PROLOGUE = {"llama": ["model.embed_tokens"], "mixtral": ["model.embed_tokens"], "qwen2_moe": ["model.embed_tokens"],
            "deepseek_v3": ["model.embed_tokens"],
            "gpt2": ["transformer.wte", "transformer.wpe", "transformer.drop"],
            "bert": ["bert.embeddings.word_embeddings", "bert.embeddings.token_type_embeddings",
                     "bert.embeddings.position_embeddings", "bert.embeddings.LayerNorm"]}
EPILOGUE = {"llama": ["model.norm", "lm_head"], "mixtral": ["model.norm", "lm_head"],
            "deepseek_v3": ["model.norm", "lm_head"],
            "qwen2_moe": ["model.norm", "lm_head"], "gpt2": ["transformer.ln_f", "lm_head"],
            "bert": ["cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm", "cls.predictions.decoder"]}
"""As `soap plan` names them (BERT's `cls.predictions` itself, which holds the head's bias, is named by no stage)."""
LAYERS = {"llama": "model.layers", "mixtral": "model.layers", "qwen2_moe": "model.layers",
          "deepseek_v3": "model.layers", "gpt2": "transformer.h",
          "bert": "bert.encoder.layer"}


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    """The full HF config dict of a tiny model of `family`, as plan.json stores it."""
    from transformers import AutoConfig

    fields = {**TINY_CONFIGS[family], **overrides}
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields).to_dict()


def make_plan(family: str, *, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, pp: int = 1, cp: int = 1,
              zero: int = 0, sequence_parallel: bool = False, micro_batch: int = 2, num_microbatches: int = 1,
              grad_accum: int | None = None, schedule: str = "1F1B", virtual_stages: int = 1,
              recompute: str = "none", precision: str = "fp32", optimizer: str = "adamw", seq_len: int = 16,
              config: dict[str, Any] | None = None, predicted: dict[str, Any] | None = None,
              tp_plan: dict[str, str] | None = None, peft: dict[str, Any] | None = None,
              cross_entropy: str = "chunked", **parallelism: Any) -> Plan:
    """A valid Plan for a tiny model, built directly (no search); `parallelism` sets further plan fields
    (offload_optimizer, compile, ...); `peft` is plan.json's model.peft (method, rank, alpha, targets, dropout);
    `cross_entropy` the loss, chunked as the planner writes it."""
    config = config or tiny_config(family)
    dp = dp_replicate * dp_shard
    world = pp * dp * cp * tp
    if grad_accum is None:
        grad_accum = num_microbatches if pp == 1 else 1
    data = {
        "schema_version": SCHEMA_VERSION,
        "model": {"name": f"tiny-{family}", "source": "file", "task": TASKS[family], "config": config,
                  "config_hash": config_hash(config), **({"peft": peft} if peft else {})},
        "cluster": {"name": "local-cpu", "gpus": world, "gpus_per_node": world, "profile": {}},
        "global_batch": dp * micro_batch * num_microbatches,
        "seq_len": seq_len,
        "mesh": {"names": ["pp", "dp_replicate", "dp_shard", "cp", "tp"],
                 "degrees": [pp, dp_replicate, dp_shard, cp, tp]},
        "parallelism": {
            "dp": dp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "zero": zero, "tp": tp, "pp": pp,
            "cp": cp, "sequence_parallel": sequence_parallel, "micro_batch": micro_batch,
            "grad_accum": grad_accum, "num_microbatches": num_microbatches, "schedule": schedule,
            "virtual_stages": virtual_stages, "recompute": recompute, "precision": precision,
            "optimizer": optimizer, "cross_entropy": cross_entropy, **parallelism,
        },
        "tp_plan": (tp_plan or TP_PLANS[family]) if tp > 1 else {},
        "stages": _stages(family, config, pp * virtual_stages, pp, schedule) if pp > 1 else [],
        "predicted": predicted or {},
    }
    return plan_from_dict(data)


def _stages(family: str, config: dict[str, Any], num_stages: int, pp: int, schedule: str) -> list[dict[str, Any]]:
    from costmodel.schedule import stage_to_rank

    ranks = stage_to_rank(schedule, pp, num_stages // pp)
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    per = layers // num_stages
    stages = []
    for s in range(num_stages):
        modules = [f"{LAYERS[family]}.{i}" for i in range(s * per, (s + 1) * per)]
        if s == 0:
            modules = PROLOGUE[family] + modules
        if s == num_stages - 1:
            modules += EPILOGUE[family]
        stages.append({"index": s, "rank": ranks[s], "modules": modules})
    return stages


def init_single_process_group() -> str:
    """A 1-rank gloo process group in this process (for single-process reference runs)."""
    import torch.distributed as dist

    store = tempfile.mktemp(prefix="soap-pg-")
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return store


def spawn_cases(world: int, payload: list[dict[str, Any]]) -> dict[str, Any]:
    """Run `payload` (see `run_cases`) on `world` fresh ranks; returns rank 0's `{name: losses or error}`.

    Ranks are forked from a forkserver that imported torch, transformers and the executor once, so a
    group of 8 ranks pays for one import instead of 8 (on 2 cores that is most of the start-up)."""
    import json
    import multiprocessing

    import torch.multiprocessing as mp

    # takes effect when this process first starts its forkserver; a server started earlier still works,
    # each rank then imports what it needs itself
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["exec_helpers", "executor.train", "transformers.models.llama.modeling_llama",
         "transformers.models.gpt2.modeling_gpt2", "transformers.models.bert.modeling_bert"])
    out, store = tempfile.mktemp(prefix="soap-out-"), tempfile.mktemp(prefix="soap-store-")
    mp.start_processes(run_cases, args=(world, store, payload, out), nprocs=world, start_method="forkserver")
    with open(out) as f:
        return json.load(f)


def run_cases(rank: int, world: int, store: str, cases: list[dict[str, Any]], out: str) -> None:
    """Spawned worker: run every case's plan on this rank; rank 0 writes `{name: losses or error}` to `out`."""
    import datetime
    import json
    import traceback

    import torch
    import torch.distributed as dist

    from executor.train import RunConfig, train

    os.environ["LOCAL_RANK"] = str(rank)
    # one thread per rank, as soap's launcher gives several ranks on a host. The forkserver's torch read
    # OMP_NUM_THREADS when the server started, whoever started it (this helper, the launcher, a benchmark):
    # with none set, 4 ranks on 2 cores ran 2 threads each, 10 4-rank layouts in 105 s instead of 31 s
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results: dict[str, Any] = {}
    for case in cases:
        if os.environ.get("SOAP_TEST_VERBOSE"):
            print(f"rank {rank}: {case['name']}", flush=True)
        try:
            plan = make_plan(case["family"], **case["plan"])
            if case.get("record_pipeline_order"):
                results[case["name"]] = _pipeline_order(plan, RunConfig(progress=False, **case.get("run", {})))
            elif case.get("inspect_vocab_parallel"):
                results[case["name"]] = _vocab_parallel_layout(plan)
            elif case.get("inspect_experts"):
                results[case["name"]] = _expert_layout(plan)
            elif case.get("count_block_collectives"):
                results[case["name"]] = _block_collectives(plan, RunConfig(progress=False, **case.get("run", {})))
            else:
                results[case["name"]] = train(plan, RunConfig(progress=False, **case.get("run", {}))).losses
        except Exception as exc:  # noqa: BLE001 - reported to the parent test, which fails on it
            results[case["name"]] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
            if os.environ.get("SOAP_TEST_VERBOSE"):
                print(f"rank {rank}: {traceback.format_exc()}", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _block_collectives(plan: Plan, run: Any) -> dict[str, dict[str, dict[str, int]]]:
    """Collectives issued inside each block module during training, by phase, from CommDebugMode."""
    import re

    from torch.distributed.tensor.debug import CommDebugMode

    from executor.train import train

    with CommDebugMode() as mode:
        train(plan, run)
    out: dict[str, Any] = {"total": {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}}
    for module, phases in mode.comm_module_counts.items():
        if re.search(r"\.(layers|h|layer)\.\d+$", module):
            out[module] = {phase: {str(op).split(".")[-1]: n for op, n in counts.items()}
                           for phase, counts in phases.items() if phase in ("forward", "backward")}
    return out


def _expert_layout(plan: Plan) -> dict[str, Any]:
    """How expert parallelism placed the first MoE layer's experts on this rank, gathered from every rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from executor.api import parallelize
    from executor.model import build_meta_model

    parallel = parallelize(build_meta_model(plan.model.config, plan.model.task), plan, seed=0,
                           device=torch.device("cpu"))
    fqn, experts = next((n, m) for n, m in parallel.model.named_modules() if n.endswith("mlp.experts"))
    weight = experts.gate_up_proj
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    mine = {"module": fqn, "num_experts": experts.num_experts, "global_shape": list(weight.shape),
            "local_shape": list(local.shape), "checksum": float(local.double().sum())}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {"ranks": gathered}


def _vocab_parallel_layout(plan: Plan) -> dict[str, Any]:
    """How TP placed the embeddings and the LM head, what the logits are, and one forward/backward's loss
    and embedding / head gradients against an unsharded copy of the model built from the same seed."""
    import copy

    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from executor.api import parallelize
    from executor.data import TokenSource
    from executor.model import build_meta_model, materialize, tied_aliases

    cpu = torch.device("cpu")
    parallel = parallelize(build_meta_model(plan.model.config, plan.model.task), plan, seed=0, device=cpu)
    reference = build_meta_model(plan.model.config, plan.model.task)
    materialize(reference, copy.deepcopy(reference), cpu, seed=0)
    model = parallel.model
    batch = TokenSource(vocab_size=reference.config.vocab_size, global_batch=plan.global_batch, seq_len=plan.seq_len,
                        task=plan.model.task, seed=0).batch_for_step(0)
    with parallel.loss_parallel():
        logits = model(input_ids=batch.input_ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten())
        loss.backward()
    ref_loss = F.cross_entropy(reference(input_ids=batch.input_ids, use_cache=False).logits.flatten(0, 1),
                               batch.labels.flatten())
    ref_loss.backward()

    def placements(t: Any) -> list[str] | str:
        return [str(p) for p in t.placements] if isinstance(t, DTensor) else "plain"

    def grad_error(module: Any, ref_module: Any) -> float:
        grad = module.weight.grad
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        return float((full - ref_module.weight.grad).abs().max())

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    others = [name for name, module in model.named_modules()
              if isinstance(module, torch.nn.Embedding) and module is not embed]
    return {
        "embedding": placements(embed.weight), "head": placements(head.weight), "logits": placements(logits),
        "logits_local_vocab": logits.to_local().shape[-1] if isinstance(logits, DTensor) else logits.shape[-1],
        "other_embeddings": {name: placements(model.get_submodule(name).weight) for name in others},
        "tied": head.weight is embed.weight,
        "aliases": tied_aliases(model) == tied_aliases(reference),
        "parameters": len(list(model.parameters())), "reference_parameters": len(list(reference.parameters())),
        "loss_error": abs(float(loss.detach().full_tensor()) - float(ref_loss)),
        "embedding_grad_error": grad_error(embed, reference.get_input_embeddings()),
        "head_grad_error": grad_error(head, reference.get_output_embeddings()),
    }


def _pipeline_order(plan: Plan, run: Any) -> list[list[str]]:
    """Per pipeline rank, the compute actions the stages ran (`1F0`, `0B2`, ...) in the last step."""
    import torch
    import torch.distributed as dist
    from torch.nn.modules.module import register_module_forward_hook

    from executor.train import train

    order: list[str] = []
    forwards: dict[int, int] = {}

    def record(module: Any, args: Any, output: Any) -> None:
        stage = getattr(module, "soap_stage_index", None)
        out = output.logits if hasattr(output, "logits") else output
        if stage is None or not isinstance(out, torch.Tensor) or out.device.type == "meta":
            return  # not a stage, or the stage's shape inference
        mb = forwards.get(stage, 0)
        forwards[stage] = mb + 1
        order.append(f"{stage}F{mb}")
        if out.requires_grad:
            out.register_hook(lambda grad: order.append(f"{stage}B{mb}"))

    handle = register_module_forward_hook(record)
    try:
        train(plan, run)
    finally:
        handle.remove()
    # the last step only: the first one also runs the stages' shape inference
    p = plan.parallelism
    actions_per_step = 2 * p.virtual_stages * p.num_microbatches
    last, renumber = order[-actions_per_step:], {}
    for action in last:  # micro-batches numbered within the step, in each stage's forward order
        if "F" in action:
            stage = action.split("F")[0]
            renumber[action] = f"{stage}F{sum(1 for k in renumber if k.startswith(stage + 'F'))}"
    last = [renumber.get(a) or renumber[a.replace("B", "F")].replace("F", "B") for a in last]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, last)
    return gathered
