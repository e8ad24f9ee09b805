"""The Megatron export describes the HF model, not Megatron's GPT default.

Megatron's argument parser lives in Megatron-LM's `megatron/training/arguments.py`, which the PyPI
`megatron-core` wheel does not ship; so `MEGATRON_ARGS` pins the flags soap writes with Megatron's types and
defaults (Megatron-LM core_r0.16), `megatron_model` derives the architecture Megatron builds from them the
way `megatron.training` does, and each test compares one field with the HF config.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

import soap
from planner.exports import format_module
from planner.exports.megatron_model import padded_vocab
from tracer import resolve_spec

MEGATRON_ARGS: dict[str, dict] = {  # flag: argparse keywords, Megatron's defaults
    "--num-layers": dict(type=int), "--hidden-size": dict(type=int), "--ffn-hidden-size": dict(type=int),
    "--num-attention-heads": dict(type=int), "--kv-channels": dict(type=int),
    "--group-query-attention": dict(action="store_true"), "--num-query-groups": dict(type=int, default=1),
    "--normalization": dict(choices=["LayerNorm", "RMSNorm"], default="LayerNorm"),
    "--norm-epsilon": dict(type=float, default=1e-5), "--swiglu": dict(action="store_true"),
    "--openai-gelu": dict(action="store_true"),
    "--disable-bias-linear": dict(action="store_false", dest="add_bias_linear"),
    "--add-qkv-bias": dict(action="store_true"),
    "--position-embedding-type": dict(choices=["learned_absolute", "rope", "mrope", "relative", "none"],
                                      default="learned_absolute"),
    "--rotary-base": dict(type=int, default=10000), "--rotary-percent": dict(type=float, default=1.0),
    "--use-rope-scaling": dict(action="store_true"), "--rope-scaling-factor": dict(type=float, default=8.0),
    "--max-position-embeddings": dict(type=int),
    "--untie-embeddings-and-output-weights": dict(action="store_true"),
    "--attention-dropout": dict(type=float, default=0.1), "--hidden-dropout": dict(type=float, default=0.1),
    "--make-vocab-size-divisible-by": dict(type=int, default=128),
    "--tokenizer-type": dict(type=str), "--tokenizer-model": dict(type=str),
    "--num-experts": dict(type=int), "--moe-router-topk": dict(type=int, default=2),
    "--moe-router-load-balancing-type": dict(type=str, default="aux_loss"),
    "--moe-aux-loss-coeff": dict(type=float, default=0.0), "--moe-token-dispatcher-type": dict(type=str),
    "--init-method-std": dict(type=float, default=0.02),
    # the parallel, batch and training flags (tests/test_exports.py checks their values)
    "--tensor-model-parallel-size": dict(type=int, default=1), "--pipeline-model-parallel-size": dict(type=int),
    "--context-parallel-size": dict(type=int), "--expert-model-parallel-size": dict(type=int),
    "--num-layers-per-virtual-pipeline-stage": dict(type=int), "--virtual-pipeline-model-parallel-size": dict(type=int),
    "--sequence-parallel": dict(action="store_true"), "--micro-batch-size": dict(type=int),
    "--global-batch-size": dict(type=int), "--seq-length": dict(type=int),
    "--recompute-granularity": dict(type=str), "--recompute-method": dict(type=str),
    "--recompute-num-layers": dict(type=int), "--bf16": dict(action="store_true"), "--fp16": dict(action="store_true"),
    "--fp8-format": dict(type=str), "--use-distributed-optimizer": dict(action="store_true"),
    "--num-distributed-optimizer-instances": dict(type=int), "--use-torch-fsdp2": dict(action="store_true"),
    "--optimizer-cpu-offload": dict(action="store_true"), "--optimizer-offload-fraction": dict(type=float),
    "--optimizer": dict(type=str), "--use-flash-attn": dict(action="store_true"),
}
MODELS = ("llama-3-8b", "mistral-7b", "mixtral-8x7b", "gpt2")


def megatron_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False, allow_abbrev=False)
    for flag, kwargs in MEGATRON_ARGS.items():
        parser.add_argument(flag, **kwargs)
    return parser


def megatron_model(args: argparse.Namespace) -> dict:
    """What `pretrain_gpt.py` builds from `args` (megatron.training.arguments' derivations included)."""
    heads = args.num_attention_heads
    activation = "swiglu" if args.swiglu else ("gelu_tanh" if args.openai_gelu else "gelu")
    return {
        "num_layers": args.num_layers, "hidden": args.hidden_size, "heads": heads,
        "ffn": args.ffn_hidden_size or 4 * args.hidden_size,
        "kv_heads": args.num_query_groups if args.group_query_attention else heads,
        "head_dim": args.kv_channels or args.hidden_size // heads,
        "norm": args.normalization, "norm_eps": args.norm_epsilon, "activation": activation,
        "linear_bias": args.add_bias_linear, "qkv_bias": args.add_bias_linear or args.add_qkv_bias,
        "positions": args.position_embedding_type,
        "rope_theta": args.rotary_base if args.position_embedding_type == "rope" else None,
        "max_positions": args.max_position_embeddings or args.seq_length,
        "tied": not args.untie_embeddings_and_output_weights,
        "vocab_rows": padded_vocab(VOCAB[args.tokenizer_model], args.make_vocab_size_divisible_by,
                                   args.tensor_model_parallel_size),
        "attention_dropout": args.attention_dropout, "hidden_dropout": args.hidden_dropout,
        "experts": args.num_experts or 0, "experts_per_token": args.moe_router_topk if args.num_experts else 0,
    }


VOCAB = {  # len() of each preset's tokenizer, which Megatron's HuggingFaceTokenizer reports as its vocabulary
    "meta-llama/Meta-Llama-3-8B": 128256, "mistralai/Mistral-7B-v0.1": 32000, "mistralai/Mixtral-8x7B-v0.1": 32000,
    "openai-community/gpt2": 50257,
}


def hf_model(name: str) -> dict:
    """The same fields, read from the HF config as transformers builds the model."""
    c = resolve_spec(name).config
    if c.model_type == "gpt2":
        return {"num_layers": c.n_layer, "hidden": c.n_embd, "heads": c.n_head, "ffn": c.n_inner or 4 * c.n_embd,
                "kv_heads": c.n_head, "head_dim": c.n_embd // c.n_head, "norm": "LayerNorm",
                "norm_eps": c.layer_norm_epsilon, "activation": "gelu_tanh", "linear_bias": True, "qkv_bias": True,
                "positions": "learned_absolute", "rope_theta": None, "max_positions": c.n_positions,
                "tied": c.tie_word_embeddings, "vocab_rows": c.vocab_size, "attention_dropout": c.attn_pdrop,
                "hidden_dropout": c.resid_pdrop, "experts": 0, "experts_per_token": 0}
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": c.rope_theta}
    return {"num_layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
            "ffn": c.intermediate_size, "kv_heads": c.num_key_value_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            "norm": "RMSNorm", "norm_eps": c.rms_norm_eps,
            "activation": "swiglu" if c.hidden_act == "silu" else c.hidden_act,
            "linear_bias": bool(getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False)),
            "qkv_bias": bool(getattr(c, "attention_bias", False)), "positions": "rope",
            "rope_theta": int(rope["rope_theta"]), "max_positions": c.max_position_embeddings,
            "tied": c.tie_word_embeddings, "vocab_rows": c.vocab_size, "attention_dropout": c.attention_dropout,
            "hidden_dropout": 0.0, "experts": getattr(c, "num_local_experts", 0) or 0,
            "experts_per_token": getattr(c, "num_experts_per_tok", 0) if getattr(c, "num_local_experts", 0) else 0}


FIELDS = ("num_layers", "hidden", "heads", "ffn", "kv_heads", "head_dim", "norm", "norm_eps", "activation",
          "linear_bias", "qkv_bias", "positions", "rope_theta", "max_positions", "tied", "vocab_rows",
          "attention_dropout", "hidden_dropout", "experts", "experts_per_token")


@pytest.fixture(scope="module")
def exported():
    """Each model's Megatron arguments, parsed, for a plain data-parallel plan on 8 GPUs."""
    megatron = format_module("megatron")
    out = {}
    for name in MODELS:
        plan = soap.plan(name, gpus=8, dp=8, zero=1, tp=1, pp=1, cp=1, micro_batch=1, recompute="full",
                         global_batch=8, seq_len=1024, **({"ep": 8} if name == "mixtral-8x7b" else {}))
        text = next(iter(megatron.render(plan, Path("megatron_args.txt")).values()))
        lines = [line for line in text.splitlines() if line and not line.startswith("#")]
        out[name] = megatron_parser().parse_args(shlex.split(" ".join(lines)))
    return out


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("name", MODELS)
def test_megatron_builds_the_hf_architecture(exported, name, field):
    assert megatron_model(exported[name])[field] == hf_model(name)[field]


def test_a_vocabulary_tp_cannot_split_evenly_is_noted_as_padding():
    plan = soap.plan("gpt2", gpus=2, dp=1, tp=2, pp=1, cp=1, micro_batch=1, global_batch=1, seq_len=128)
    text = next(iter(format_module("megatron").render(plan, Path("m.txt")).values()))
    assert "--make-vocab-size-divisible-by 128" in text
    assert "# vocabulary: Megatron pads 50257 to 50432 rows on 2 TP ranks" in text


def test_a_model_family_soap_has_no_flags_for_says_so():
    from planner.exports.megatron_model import model_arguments, model_notes

    config = {"model_type": "bert", "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
              "vocab_size": 100}
    assert model_arguments(config, tp=1, name="x") == []
    assert "model_type 'bert' yourself" in model_notes(config, tp=1, seq_len=128)[0]
