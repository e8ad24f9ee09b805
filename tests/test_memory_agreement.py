"""One memory model: the planner's estimate equals the simulator's peak for every candidate family.

The search prunes by the estimate and reports the simulation; if the two disagreed, the search would
drop plans that fit (the 60% gap of llama-3-8b at seq 8192, mb 2) or simulate plans that cannot. So
for tiny models of each family, every mesh the search enumerates and a deterministic sample of its
training configurations (precision, micro-batching, schedule, recompute, ZeRO, offload), the
estimate's peak and every term of it equal the simulation's worst rank, as the pricer runs it.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from functools import partial

import pytest

from costmodel.profiles import load_cluster
from planner.api import make_request
from planner.estimate import Estimator
from planner.pricing import Pricer
from planner.regimes import RegimeEstimator
from planner.search import Candidate
from planner.space import mesh_choices, training_choices
from planner.units import model_units

FAMILIES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 256, "tie_word_embeddings": False},
    "gpt2-tied": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 4,
                  "vocab_size": 256, "n_positions": 256},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 256},
    "bert": {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256},
}
CASES = [  # (family, gpus, global batch, pins): pins steer the sample to the dimensions worth crossing
    ("llama", 8, 16, {}),
    ("llama", 8, 16, {"pp": 2}),
    ("llama", 4, 16, {"pp": 2, "schedule": "Interleaved1F1B"}),
    ("llama", 8, 32, {"pp": 4}),
    ("llama", 8, 16, {"cp": 2}),
    ("gpt2-tied", 4, 16, {}),
    ("gpt2-tied", 4, 16, {"pp": 2, "schedule": "GPipe"}),
    ("mixtral", 8, 16, {}),
    ("mixtral", 8, 16, {"pp": 2}),
    ("bert", 4, 16, {}),
    ("llama", 4, 16, {"peft": "lora"}),  # frozen base weights, fp32 adapters without autocast
    ("llama", 4, 16, {"pp": 2, "peft": "lora"}),
    ("gpt2-tied", 4, 16, {"peft": "qlora"}),  # NF4 base weights and their dequantized copy
]
PER_CASE = 60
SEQ = 64


def _pairs(family, gpus, global_batch, pins, tmp_path, cluster="dgx-h100"):
    (tmp_path / "config.json").write_text(json.dumps(FAMILIES[family]))
    req = make_request(str(tmp_path), gpus=gpus, global_batch=global_batch, seq_len=SEQ, mem_limit_gib=1e6,
                       precision="auto", cluster=cluster, **pins)
    graph = req.model.trace(task=None, seq_len=SEQ)
    req = replace(req, space=replace(req.space, dims=graph.dims))
    estimator = RegimeEstimator(graph, Estimator(graph, req.cluster, model_units(graph)),
                                partial(req.model.trace, task=None, seq_len=SEQ))
    pricer = Pricer(req, graph, estimator)
    meshes = mesh_choices(req.space)
    per_mesh = max(1, PER_CASE // max(1, len(meshes)))
    for mesh in meshes:
        configs = list(training_choices(req.space, mesh))
        step = max(1, len(configs) // per_mesh)
        for train in itertools.islice(configs, 0, None, step):
            candidate = Candidate(mesh=mesh, train=train, estimate=estimator.estimate(mesh, train))
            yield candidate, pricer(candidate)


@pytest.mark.parametrize("family, gpus, global_batch, pins", CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])
def test_the_estimate_is_the_simulated_peak_term_by_term(family, gpus, global_batch, pins, tmp_path):
    seen = 0
    for candidate, priced in _pairs(family, gpus, global_batch, pins, tmp_path):
        seen += 1
        estimated = candidate.estimate.memory
        if priced.candidate.op_splits:  # the split search re-places ops: the estimate prices the Megatron default
            continue
        simulated = max((m.at_peak for m in priced.result.memory), key=lambda b: b.total)
        label = f"{candidate.mesh.dims} {candidate.train}"
        assert estimated.total == pytest.approx(simulated.total, rel=1e-9, abs=16), label
        for term in ("weights", "grads", "optimizer", "activations", "buffers", "workspace", "host"):
            assert getattr(estimated, term) == pytest.approx(getattr(simulated, term), rel=1e-9, abs=16), (term, label)
    assert seen >= 10


def test_the_simulated_timeline_reaches_the_peak_the_schedule_rule_gives(tmp_path):
    """The simulator's activation events (drawn as memory over time) peak where
    `costmodel.memory_schedule.rank_activation_peaks` says, for every schedule."""
    checked = 0
    for pins in ({"pp": 2, "schedule": "1F1B"}, {"pp": 2, "schedule": "GPipe"}, {"pp": 2, "schedule": "Interleaved1F1B"},
                 {}):
        for _, priced in itertools.islice(_pairs("llama", 4, 16, pins, tmp_path), 0, 12):
            for rank in priced.result.memory:
                b = rank.at_peak
                constant = b.weights + b.grads + b.optimizer + b.buffers + b.workspace
                assert max(total for _, total in rank.timeline) == pytest.approx(constant + b.activations, abs=16)
                checked += 1
    assert checked >= 20


def test_a_fitted_allocator_reserve_is_predicted_alike_on_the_reserved_peak(tmp_path):
    """With `allocator_reserve_fraction` fitted, both predict reserved memory: the tensors' bytes grow by
    the fraction, in the workspace term, and the rank that holds the loss by its largest fp32 transient too
    (`costmodel.memory_activations.loss_transient`); estimate and simulation still agree."""
    cluster = load_cluster("dgx-h100")
    reserving = replace(cluster, device=replace(cluster.device, allocator_reserve_fraction=0.25))
    pairs = list(itertools.islice(_pairs("llama", 4, 16, {"pp": 2}, tmp_path, cluster=reserving), 0, 8))
    plain = list(itertools.islice(_pairs("llama", 4, 16, {"pp": 2}, tmp_path, cluster=cluster), 0, 8))
    for (candidate, priced), (_, base) in zip(pairs, plain):
        estimated = candidate.estimate.memory
        simulated = max((m.at_peak for m in priced.result.memory), key=lambda b: b.total)
        assert estimated.total == pytest.approx(simulated.total, rel=1e-9)
        extra = [r.at_peak.total - b.at_peak.total - 0.25 * (b.at_peak.total - b.at_peak.workspace)
                 for r, b in zip(priced.result.memory, base.result.memory)]
        assert extra[0] == pytest.approx(0, abs=16)  # the first stage holds no loss
        assert extra[-1] > 0  # the last holds the loss: its size is tests/test_allocator_reserve.py's
