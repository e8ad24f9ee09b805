"""fp8 is priced where it runs (tracer.fp8): the layers torchao's float8 swap converts, nothing else."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import tracer
from costmodel.opcost import compute_peak, fp8_cast_bytes
from costmodel.profiles import load_device
from tracer.fp8 import fp8_linear, fp8_linear_names
from tracer.ir import OpKind


def _tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256))


def test_the_eligible_layers_are_the_blocks_linears_not_the_head():
    names = fp8_linear_names(_tiny_llama())
    assert "lm_head" not in names and "model.layers.0.self_attn.q_proj" in names
    assert {n.rsplit(".", 1)[1] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}
    assert not fp8_linear(torch.nn.Linear(64, 8), "router")  # 8 out features: _scaled_mm needs multiples of 16


def test_gpt2_has_no_fp8_layer_and_costs_what_bf16_costs():
    """GPT-2's projections are Conv1D modules, which torchao does not convert: an fp8 plan of GPT-2 runs bf16."""
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=256))
    assert fp8_linear_names(model) == frozenset()
    from planner.api import plan

    fp8 = plan("gpt2", gpus=1, cluster="dgx-h100", precision="fp8", global_batch=8, seq_len=512)
    bf16 = plan("gpt2", gpus=1, cluster="dgx-h100", precision="bf16", global_batch=8, seq_len=512,
                micro_batch=fp8.parallelism.micro_batch, recompute=fp8.parallelism.recompute)
    assert fp8.predicted["step_time_s"] == pytest.approx(bf16.predicted["step_time_s"], rel=1e-9)


def test_traced_fp8_ops_run_at_the_fp8_rate_with_their_casts():
    graph = tracer.trace("llama-3-8b", batch=1, seq_len=128)
    h100 = load_device("h100-sxm")
    matmuls = [op for op in graph.ops if op.kind is OpKind.MATMUL]
    marked = [op for op in matmuls if op.attrs.get("fp8_linear")]
    head = [op for op in matmuls if "lm_head" in op.module_fqn]
    assert len(marked) == 7 and head and not head[0].attrs.get("fp8_linear")
    assert compute_peak(marked[0], h100, "fp8") == h100.effective_peak("fp8")
    assert compute_peak(head[0], h100, "fp8") == h100.effective_peak("bf16")
    attention = next(op for op in graph.ops if op.kind is OpKind.ATTENTION)
    assert compute_peak(attention, h100, "fp8") == h100.effective_peak("bf16")
    # casts: forward reads and writes the input and the weight, backward the output gradient and transposes
    q = next(op for op in marked if op.module_fqn.endswith("q_proj"))
    m, k, n = 128, 4096, 4096
    assert fp8_cast_bytes(q, 2 * m * k * n, "fwd") == pytest.approx(m * k * 5 + k * n * 9)
    assert fp8_cast_bytes(q, 2 * m * k * n, "bwd") == pytest.approx(m * n * 5 + 2 * (m * k + k * n))


def test_executor_converts_what_the_tracer_marks():
    from executor import precision

    assert precision.fp8_linear is fp8_linear
