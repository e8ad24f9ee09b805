"""The zoo: 40 Hugging Face architectures from tiny configs, captured by the default front-end chain.

For each: captured (or failing with a one-line reason), parameter count equal to the meta model's,
every parameter used by some op, and FLOPs within 2% (saved activations within 15%) of torch's own
measurement of a real forward+backward on CPU.
"""

from functools import lru_cache

import pytest

import tracer
from tracer.build import build_model
from tracer.errors import SoapError
from tracer.inputs import default_seq_len
from tracer.spec import resolve_spec
from tracer.zoo import ZOO, zoo_config
from tracer_helpers import real_step, without_dropout

SAVED_KNOWN_DEVIATIONS = {
    "bloom": "its GELU is a custom autograd.Function that saves only its input; the trace sees the ops inside",
    "falcon": "on CPU its multi-query SDPA falls back to unfused math, which saves the attention probabilities; "
              "the trace prices a fused kernel",
}

captured: dict[str, str] = {}


@lru_cache(maxsize=None)
def measured_step(model_type: str) -> tuple[int, int]:
    """(FLOPs, saved bytes) of a real CPU step of the zoo model, measured once for both front-end tests."""
    config = without_dropout(zoo_config(model_type))
    spec = resolve_spec(config)
    return real_step(config, spec.task, batch=2, seq_len=_seq_len(config, spec.task))


def _seq_len(config, task: str) -> int:
    return 32 if task != "image-cls" else default_seq_len(config, task)


@pytest.mark.parametrize("model_type", sorted(ZOO))
def test_zoo_model_is_captured_exactly(model_type):
    config = without_dropout(zoo_config(model_type))
    spec = resolve_spec(config)
    seq = _seq_len(config, spec.task)
    try:
        graph = tracer.trace(config, batch=2, seq_len=seq)
    except SoapError as exc:
        captured[model_type] = "failed"
        message = str(exc)
        assert "\n" not in message and message.startswith("could not capture")
        pytest.skip(f"not captured: {message}")
    captured[model_type] = graph.frontend
    assert sum(p.numel() for p in build_model(spec).parameters()) == graph.params_total
    used = {(op.block_id, p.name): p.numel * graph.multiplicity(op) for op in graph.ops for p in op.params}
    assert sum(used.values()) == graph.params_total
    flops, saved = measured_step(model_type)
    assert graph.fwd_flops + graph.bwd_flops == pytest.approx(flops, rel=0.02)
    if model_type not in SAVED_KNOWN_DEVIATIONS:
        assert graph.activation_bytes == pytest.approx(saved, rel=0.15)


@pytest.mark.parametrize("model_type", sorted(ZOO))
def test_dispatch_front_end_agrees_with_export_and_autograd(model_type):
    config = without_dropout(zoo_config(model_type))
    spec = resolve_spec(config)
    seq = _seq_len(config, spec.task)
    exported = tracer.trace(config, batch=2, seq_len=seq, frontend="export")
    dispatched = tracer.trace(config, batch=2, seq_len=seq, frontend="dispatch")
    assert dispatched.frontend == "dispatch" and dispatched.params_total == exported.params_total
    assert dispatched.fwd_flops == exported.fwd_flops and dispatched.bwd_flops == exported.bwd_flops
    assert [b.id for b in dispatched.blocks] == [b.id for b in exported.blocks]
    if model_type not in SAVED_KNOWN_DEVIATIONS:
        # each front-end against autograd's own count (export overcounts codegen, mpt and t5 by 9-14%, where
        # dispatch is within 6%: comparing the two with each other would pin export's error)
        assert dispatched.activation_bytes == pytest.approx(measured_step(model_type)[1], rel=0.15)


def test_zoo_covers_the_required_architectures():
    required = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox",
                "gptj", "bloom", "opt", "falcon", "bert", "roberta", "deberta-v2", "electra", "distilbert", "t5",
                "bart", "vit"}
    assert required <= set(ZOO) and {"qwen2_moe", "qwen3_moe"} & set(ZOO) and len(ZOO) >= 30


def test_zoo_default_chain_captures_at_least_95_percent():
    if len(captured) < len(ZOO):
        pytest.skip("run with the per-model zoo tests")
    ok = [m for m, frontend in captured.items() if frontend != "failed"]
    assert len(ok) >= 0.95 * len(ZOO)
