"""A zoo of tiny configs, one per Hugging Face architecture, for the zoo test and benchmark.

Each entry is built with `AutoConfig.for_model(model_type, **overrides)`: 2 layers, hidden 64, a
vocabulary of 256, so every model builds and traces in about a second.
"""

from __future__ import annotations

from typing import Any

_DEC = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
_ENC = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
            max_position_embeddings=128)
_MOE = dict(_DEC, num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64)
_BART = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256, max_position_embeddings=128)

ZOO: dict[str, tuple[str, dict[str, Any]]] = {
    # decoders
    "llama": ("decoder", _DEC),
    "mistral": ("decoder", _DEC),
    "mixtral": ("decoder", _MOE),
    "qwen2": ("decoder", _DEC),
    "qwen3": ("decoder", dict(_DEC, head_dim=16)),
    "qwen2_moe": ("decoder", _MOE),
    "qwen3_moe": ("decoder", dict(_MOE, head_dim=16)),
    "gemma": ("decoder", dict(_DEC, head_dim=16)),
    "gemma2": ("decoder", dict(_DEC, head_dim=16)),
    "gemma3_text": ("decoder", dict(_DEC, head_dim=16)),
    "phi3": ("decoder", dict(_DEC, pad_token_id=0)),
    "phi": ("decoder", _DEC),
    "gpt2": ("decoder", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)),
    "gpt_neox": ("decoder", _ENC),
    "gptj": ("decoder", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128, rotary_dim=8)),
    "bloom": ("decoder", dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=256)),
    "opt": ("decoder", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                            max_position_embeddings=128, word_embed_proj_dim=64)),
    "falcon": ("decoder", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)),
    "starcoder2": ("decoder", _DEC),
    "olmo": ("decoder", _DEC),
    "olmo2": ("decoder", _DEC),
    "stablelm": ("decoder", _DEC),
    "cohere": ("decoder", _DEC),
    "granite": ("decoder", _DEC),
    "codegen": ("decoder", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128, rotary_dim=8)),
    "persimmon": ("decoder", _ENC),
    "gpt_bigcode": ("decoder", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)),
    "mpt": ("decoder", dict(d_model=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=128)),
    # encoders
    "bert": ("encoder", _ENC),
    "roberta": ("encoder", dict(_ENC, max_position_embeddings=130)),
    "deberta-v2": ("encoder", _ENC),
    "electra": ("encoder", dict(_ENC, embedding_size=64)),
    "distilbert": ("encoder", dict(dim=64, hidden_dim=128, n_layers=2, n_heads=4, vocab_size=256,
                                   max_position_embeddings=128)),
    "xlm-roberta": ("encoder", dict(_ENC, max_position_embeddings=130)),
    "albert": ("encoder", dict(_ENC, embedding_size=32)),
    # encoder-decoders
    "t5": ("encoder-decoder", dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, vocab_size=256)),
    "bart": ("encoder-decoder", _BART),
    "mbart": ("encoder-decoder", _BART),
    "pegasus": ("encoder-decoder", _BART),
    # vision
    "vit": ("vision", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, num_labels=10)),
}


def zoo_config(model_type: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **ZOO[model_type][1])
