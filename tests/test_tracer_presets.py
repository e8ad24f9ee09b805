"""Every shipped preset resolves, builds on meta, and traces with exact parameter counts."""

import pytest

import tracer
from tracer.build import build_model
from tracer.spec import preset_names, resolve_spec

PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "bert-base-uncased": 109_514_298,  # BertForMaskedLM: BertModel's 109.48M without pooler, plus the MLM head
    "bert-large-uncased": 335_174_458,
    "t5-base": 222_903_552,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
}


def test_every_required_preset_ships():
    assert set(PUBLISHED) <= set(preset_names())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_param_count_equals_meta_model_and_published(name):
    spec = resolve_spec(name)
    meta_count = sum(p.numel() for p in build_model(spec).parameters())
    assert meta_count == PUBLISHED[name]
    graph = tracer.trace(name, seq_len=64)
    assert graph.params_total == meta_count
    assert graph.params_trainable == meta_count


@pytest.mark.parametrize("name", ["llama-3-8b", "mixtral-8x7b", "t5-base"])
def test_graph_params_cover_the_whole_model(name):
    graph = tracer.trace(name, seq_len=64)
    seen: dict[tuple, int] = {}
    for op in graph.ops:
        for p in op.params:
            seen[(op.block_id, p.name)] = p.numel * graph.multiplicity(op)
    assert sum(seen.values()) == graph.params_total


def test_llama_flops_per_token_is_six_n_plus_attention():
    graph = tracer.trace("llama-3-8b", seq_len=2048)
    embedding = 128256 * 4096  # looked up, not multiplied
    dense = 6 * (graph.params_total - embedding)
    attention = (4 + 10) * 2048 * 4096 * 32  # per token and layer: fwd 4*s*hidden, bwd 2.5x that
    per_token = (graph.fwd_flops + graph.bwd_flops) / graph.tokens
    assert per_token == pytest.approx(dense + attention, rel=0.01)


def test_mixtral_counts_only_the_routed_experts():
    graph = tracer.trace("mixtral-8x7b", seq_len=256)
    assert graph.dims.num_experts == 8 and graph.dims.experts_per_token == 2
    expert = 3 * 4096 * 14336
    inactive = 32 * 6 * expert  # 6 of 8 experts per layer are idle for each token
    embedding = 32000 * 4096
    dense_active = 6 * (graph.params_total - inactive - embedding)
    fwd_bwd = (graph.fwd_flops + graph.bwd_flops) / graph.tokens
    attention = (4 + 10) * 256 * 4096 * 32  # fwd 4*s*h + bwd 10*s*h per token and layer
    assert fwd_bwd == pytest.approx(dense_active + attention, rel=0.01)
