"""Tracing one config at a second dtype (the planner traces fp32 and a 16-bit regime) builds only the
truncated model: the full model's facts are reused, and the graph is the one a fresh trace gives."""

import pytest

import tracer.api
import tracer.build
from tracer.errors import SoapError
from tracer.serialize import graph_to_dict
from tracer_helpers import TINY_GPT2, config_dir


@pytest.fixture
def fresh_tracer(monkeypatch):
    monkeypatch.setattr(tracer.api, "_CACHE", {})
    monkeypatch.setattr(tracer.api, "_SKELETONS", {})
    builds = []
    build = tracer.build.build_model
    monkeypatch.setattr(tracer.build, "build_model", lambda *a, **k: builds.append(k.get("num_layers")) or build(*a, **k))
    return builds


def test_second_dtype_reuses_the_full_models_facts(fresh_tracer, tmp_path_factory):
    model = config_dir(tmp_path_factory, "gpt2-8-layers", {**TINY_GPT2, "n_layer": 8})
    tracer.api.trace(model, seq_len=64, dtype="float32")
    assert fresh_tracer == [None, 2]  # the full model, then the traced layers
    second = tracer.api.trace(model, seq_len=64, dtype="bfloat16")
    assert fresh_tracer[2:] == [2]
    tracer.api._CACHE.clear()
    tracer.api._SKELETONS.clear()
    assert graph_to_dict(second) == graph_to_dict(tracer.api.trace(model, seq_len=64, dtype="bfloat16"))


def test_learned_positions_are_still_checked_from_the_reused_facts(fresh_tracer, tmp_path_factory):
    model = config_dir(tmp_path_factory, "gpt2-short", {**TINY_GPT2, "n_positions": 64})
    tracer.api.trace(model, seq_len=64, dtype="float32")
    with pytest.raises(SoapError, match="64 learned positions"):
        tracer.api.trace(model, seq_len=128, dtype="bfloat16")
