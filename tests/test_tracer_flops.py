"""FLOPs and saved activations against torch's own measurements of a real tiny step on CPU."""

import pytest

import tracer
from tracer_helpers import TINY, real_step, tiny_config

CASES = {
    "llama": ("causal-lm", TINY),
    "gpt2": ("causal-lm", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=256, n_positions=128, attn_pdrop=0.0,
                               resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "bert": ("masked-lm", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                               vocab_size=256, max_position_embeddings=128, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def measured(request):
    task, overrides = CASES[request.param]
    config = tiny_config(request.param, **overrides)
    flops, saved = real_step(config, task, batch=2, seq_len=32)
    return config, task, flops, saved


@pytest.mark.parametrize("frontend", ["export", "dispatch"])
def test_forward_plus_backward_flops_match_flop_counter(measured, frontend):
    config, task, flops, _ = measured
    graph = tracer.trace(config, task=task, batch=2, seq_len=32, frontend=frontend)
    assert graph.frontend == frontend
    assert graph.fwd_flops + graph.bwd_flops == pytest.approx(flops, rel=0.02)


@pytest.mark.parametrize("frontend", ["export", "dispatch"])
def test_saved_activation_bytes_match_saved_tensor_hooks(measured, frontend):
    config, task, _, saved = measured
    graph = tracer.trace(config, task=task, batch=2, seq_len=32, frontend=frontend)
    assert graph.activation_bytes == pytest.approx(saved, rel=0.10)
