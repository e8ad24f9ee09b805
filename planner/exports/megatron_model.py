"""The architecture half of the Megatron export: the `pretrain_gpt.py` flags that make Megatron build the
model the HF config describes, not its GPT default.

Megatron's defaults are a GPT-2-style decoder: LayerNorm, GeLU MLP without a gate, learned absolute
positions, biases on every linear, tied embeddings, dropout 0.1 and a vocabulary padded to a multiple of
128 x TP. Each family soap knows (`FAMILIES`) says what it changes:
- norm: `--normalization RMSNorm|LayerNorm`, `--norm-epsilon`;
- MLP: `--swiglu` for a gated SiLU MLP (`--ffn-hidden-size` is the gate's width), `--openai-gelu` for GPT-2's
  tanh GeLU;
- attention: `--group-query-attention --num-query-groups`, `--kv-channels` where head_dim is not
  hidden/heads, `--disable-bias-linear` and `--add-qkv-bias` for the biases;
- positions: `--position-embedding-type rope|learned_absolute`, `--rotary-base`, `--rotary-percent`,
  `--use-rope-scaling` (Llama 3.1's rope), `--max-position-embeddings`;
- embeddings: `--untie-embeddings-and-output-weights`, `--make-vocab-size-divisible-by` chosen so the
  padded vocabulary is the HF one where TP allows, the HF tokenizer by name;
- MoE: `--num-experts`, `--moe-router-topk`, `--moe-aux-loss-coeff`.
`model_arguments` writes them; `model_notes` says, as comment lines, what the flags cannot carry.
"""

from __future__ import annotations

from typing import Any

FAMILIES: dict[str, dict[str, Any]] = {
    # norm, gated SiLU MLP, biases (linear, qkv), rope
    "llama": dict(norm="RMSNorm", swiglu=True, bias=False, qkv_bias=False, rope=True),
    "mistral": dict(norm="RMSNorm", swiglu=True, bias=False, qkv_bias=False, rope=True),
    "mixtral": dict(norm="RMSNorm", swiglu=True, bias=False, qkv_bias=False, rope=True),
    "qwen2": dict(norm="RMSNorm", swiglu=True, bias=False, qkv_bias=True, rope=True),
    "gpt2": dict(norm="LayerNorm", swiglu=False, bias=True, qkv_bias=True, rope=False),
}
HUB_TOKENIZERS = {  # the shipped presets' Hub repositories, for `--tokenizer-model`
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B", "llama-3-70b": "meta-llama/Meta-Llama-3-70B",
    "llama-3.1-405b": "meta-llama/Llama-3.1-405B", "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1", "qwen2.5-7b": "Qwen/Qwen2.5-7B", "gpt2": "openai-community/gpt2",
    "gpt2-xl": "openai-community/gpt2-xl",
}


def hf_config(config: dict[str, Any]):
    """The plan's config dict as transformers' config class, so defaults the dict leaves out are filled."""
    from transformers import AutoConfig

    data = dict(config)
    model_type = data.pop("model_type", None)
    if model_type is None:
        return None
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError:  # a model type this transformers does not know
        return None


def _rope(cfg) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None) or {}
    if not params and getattr(cfg, "rope_theta", None):
        params = {"rope_theta": cfg.rope_theta, **(getattr(cfg, "rope_scaling", None) or {})}
    return params


def model_arguments(config: dict[str, Any], *, tp: int, name: str) -> list[str]:
    """Megatron flags for the architecture of `config`, on `tp` tensor-parallel ranks; [] for a family soap
    does not know (`model_notes` says so)."""
    cfg = hf_config(config)
    family = FAMILIES.get(getattr(cfg, "model_type", None))
    if cfg is None or family is None:
        return []
    get = lambda *keys: next((getattr(cfg, k) for k in keys if getattr(cfg, k, None) is not None), None)  # noqa: E731
    hidden, heads = get("hidden_size", "n_embd"), get("num_attention_heads", "n_head")
    head_dim = get("head_dim") or hidden // heads
    args = [f"--normalization {family['norm']}", f"--norm-epsilon {get('rms_norm_eps', 'layer_norm_epsilon')}"]
    if family["swiglu"]:
        args.append("--swiglu")
    elif get("activation_function", "hidden_act") in ("gelu_new", "gelu_pytorch_tanh"):
        args.append("--openai-gelu")
    if head_dim * heads != hidden:
        args.append(f"--kv-channels {head_dim}")
    if not (family["bias"] or getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False)):
        args.append("--disable-bias-linear")
    if family["qkv_bias"] and not family["bias"]:
        args.append("--add-qkv-bias")
    positions = get("max_position_embeddings", "n_positions")
    if family["rope"]:
        rope = _rope(cfg)
        args += ["--position-embedding-type rope", f"--rotary-base {int(rope.get('rope_theta', 10000))}"]
        if rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) != 1.0:
            args.append(f"--rotary-percent {rope.get('partial_rotary_factor', cfg.partial_rotary_factor):g}")
        if rope.get("rope_type") == "llama3":
            args += ["--use-rope-scaling", f"--rope-scaling-factor {rope.get('factor', 8.0):g}"]
    else:
        args.append("--position-embedding-type learned_absolute")
    args.append(f"--max-position-embeddings {positions}")
    if not getattr(cfg, "tie_word_embeddings", True):
        args.append("--untie-embeddings-and-output-weights")
    dropout_attn = get("attention_dropout", "attn_pdrop") or 0.0
    dropout_hidden = get("resid_pdrop", "hidden_dropout") or 0.0
    args += [f"--attention-dropout {dropout_attn:g}", f"--hidden-dropout {dropout_hidden:g}"]
    args.append(f"--make-vocab-size-divisible-by {vocab_divisor(cfg.vocab_size, tp)}")
    tokenizer = HUB_TOKENIZERS.get(name, name)
    args += ["--tokenizer-type HuggingFaceTokenizer", f"--tokenizer-model {tokenizer}"]
    experts = get("num_local_experts", "num_experts")
    if experts:
        args += [f"--num-experts {experts}", f"--moe-router-topk {get('num_experts_per_tok')}",
                 "--moe-router-load-balancing-type aux_loss",
                 f"--moe-aux-loss-coeff {get('router_aux_loss_coef') or 0.0:g}", "--moe-token-dispatcher-type alltoall"]
    args.append(f"--init-method-std {get('initializer_range') or 0.02:g}")
    return args


def vocab_divisor(vocab: int, tp: int) -> int:
    """The largest `--make-vocab-size-divisible-by` (at most Megatron's 128) under which Megatron pads `vocab`
    not at all on `tp` ranks (it pads to a multiple of divisor x tp); 128 where TP forces padding anyway."""
    for divisor in (128, 64, 32, 16, 8, 4, 2, 1):
        if vocab % (divisor * tp) == 0:
            return divisor
    return 128


def padded_vocab(vocab: int, divisor: int, tp: int) -> int:
    """Megatron's `_vocab_size_with_padding`: `vocab` rounded up to a multiple of divisor x tp."""
    multiple = divisor * tp
    return -(-vocab // multiple) * multiple


def model_notes(config: dict[str, Any], *, tp: int, seq_len: int) -> list[str]:
    """Comment lines for what the architecture flags do not carry."""
    cfg = hf_config(config)
    model_type = getattr(cfg, "model_type", config.get("model_type"))
    if cfg is None or model_type not in FAMILIES:
        return [f"# architecture: soap writes Megatron's architecture flags for {', '.join(FAMILIES)} only; "
                f"set norm, activation, positions and biases for model_type {model_type!r} yourself."]
    notes = []
    padded = padded_vocab(cfg.vocab_size, vocab_divisor(cfg.vocab_size, tp), tp)
    if padded != cfg.vocab_size:
        notes.append(f"# vocabulary: Megatron pads {cfg.vocab_size} to {padded} rows on {tp} TP ranks; "
                     "drop the extra rows when converting to HF.")
    window = getattr(cfg, "sliding_window", None)
    if window and seq_len > window:
        notes.append(f"# sliding-window attention ({window} tokens) is not expressed: Megatron attends over all "
                     f"{seq_len} positions.")
    return notes
