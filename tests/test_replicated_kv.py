"""More TP ranks than KV heads (GQA): priced as the executor runs it (issue 26).

`executor.tensor_parallel.replicate_kv_heads` keeps the K and V projections whole on every TP rank, computes
one KV head per rank and all-reduces their weight gradients over TP; the cost model reads the same from the
graph (`costmodel.placement.replicated_kv_projections`): not sharded in memory, compute split by the KV
heads, one gradient all-reduce per projection. tests/test_plans_execute.py trains such a plan (tp4 over
2 KV heads) against one process.
"""

from __future__ import annotations

import json

import pytest

from costmodel.memory import parameter_degrees
from costmodel.placement import ActivationShape, block_placements, replicated_kv_projections
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig

TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    from tracer.api import trace

    path = tmp_path_factory.mktemp("kv") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return trace(str(path), seq_len=32)


def _kv_ops(graph):
    return {op.name for op in graph.ops if op.module_fqn.endswith((".k_proj", ".v_proj"))}


def test_the_k_and_v_projections_are_found_only_when_tp_exceeds_the_kv_heads(graph):
    assert replicated_kv_projections(graph.ops, 2) == {}
    found = replicated_kv_projections(graph.ops, 4)
    assert set(found) == _kv_ops(graph) and set(found.values()) == {2}


def test_replicated_projections_hold_whole_weights_and_compute_one_head_per_rank(graph):
    degrees = parameter_degrees(graph.ops, tensor_parallel=4)
    for op in graph.ops:
        if op.module_fqn.endswith((".k_proj", ".v_proj")):
            assert degrees[op.params[0].name] == 1
        elif op.module_fqn.endswith(".q_proj"):
            assert degrees[op.params[0].name] == 4
    strategy = Strategy(dims=ParallelDims(tp=4), train=TrainingConfig(global_batch=1, seq_len=32))
    shape = ActivationShape(micro_batch=1, seq_len=32, hidden=64, itemsize=4, kv_heads=2, head_dim=16)
    block = [op for op in graph.ops if op.block_id is not None and op.module_fqn.startswith("model.layers.0.")]
    for placed in block_placements(block, strategy, shape):
        if placed.op.module_fqn.endswith((".k_proj", ".v_proj")):
            assert placed.split.parameter == 2
            grads = [c for c in placed.collectives if c.phase == "bwd" and c.kind == "all_reduce" and "K/V" in c.reason]
            assert [c.nbytes for c in grads] == [placed.op.params[0].numel * 4]
