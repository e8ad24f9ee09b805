"""fp8 is priced where it runs (tracer.fp8): the layers torchao's float8 swap converts, nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import tracer
from costmodel.opcost import cast_kernels, compute_peak, fp8_cast_bytes, fp8_cast_kernels, op_time
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
    # compiled casts: forward an amax and a scaled cast of the input (bf16) and the fp32 weight; backward the
    # output gradient's, and the transposed copies of the fp8 input and weight
    q = next(op for op in marked if op.module_fqn.endswith("q_proj"))
    m, k, n = 128, 4096, 4096
    assert fp8_cast_bytes(q, 2 * m * k * n, "fwd", compile=True) == pytest.approx(m * k * 5 + k * n * 9)
    assert fp8_cast_bytes(q, 2 * m * k * n, "bwd", compile=True) == pytest.approx(m * n * 5 + 2 * (m * k + k * n))
    # eager, torchao's ops one by one: 33 bytes an element a cast; backward casts the output gradient twice and
    # the input and weight again (saved in high precision), and copies three fp8 operands into _scaled_mm's layout
    assert fp8_cast_bytes(q, 2 * m * k * n, "fwd", compile=False) == pytest.approx(33 * (m * k + k * n))
    assert fp8_cast_bytes(q, 2 * m * k * n, "bwd", compile=False) == pytest.approx(
        33 * (2 * m * n + k * n + m * k) + 2 * (k * n + m * n + m * k))
    assert len(fp8_cast_kernels(q, 2 * m * k * n, "fwd", compile=False)) == 10 + 9  # to float32: the input only
    assert len(fp8_cast_kernels(q, 2 * m * k * n, "fwd", compile=True)) == 4


def test_transformer_engines_casts_are_one_fused_kernel_an_operand_and_the_weight_once_a_step():
    """NeMo's fp8 runs through Transformer Engine (`TrainingConfig.fp8_casts`): one cast-transpose kernel an operand,
    4 bytes an element, the weight's on a step's first micro-batch only, no transposed copies in backward, and no
    compile factor on TE's own kernels; torchao's compiled casts move more."""
    from costmodel.profiles import load_cluster
    from tracer.errors import SoapError

    graph = tracer.trace("llama-3-8b", batch=1, seq_len=128)
    q = next(op for op in graph.ops if op.attrs.get("fp8_linear") and op.module_fqn.endswith("q_proj"))
    m, k, n = 128, 4096, 4096
    flops = 2 * m * k * n
    te = dict(compile=True, casts="transformer-engine")
    assert cast_kernels(q, flops, "fwd", **te, weight_share=1 / 8) == pytest.approx((4 * m * k, 4 * k * n / 8))
    assert cast_kernels(q, flops, "bwd", **te) == pytest.approx((4 * m * n,))
    assert sum(cast_kernels(q, flops, "fwd", **te)) < fp8_cast_bytes(q, flops, "fwd", compile=True)
    with pytest.raises(SoapError, match="unknown fp8 casts 'te'"):
        cast_kernels(q, flops, "fwd", compile=True, casts="te")
    device = load_cluster("dgx-h100").device

    def forward(**kw):
        return op_time(q, device=device, precision="fp8", micro_batch=1, batch_traced=1, **kw).fwd_s

    te_step = dict(fp8_casts="transformer-engine")
    assert forward(compile=True, microbatches=32, **te_step) < forward(compile=True, microbatches=1, **te_step)
    assert forward(compile=True, microbatches=32) == forward(compile=True, microbatches=1)  # torchao: every one
    # compile does not touch TE's kernels (the GEMM keeps its library kernel either way); it fuses torchao's
    assert forward(compile=True, **te_step) == pytest.approx(forward(compile=False, **te_step), rel=1e-12)
    assert forward(compile=False, **te_step) < forward(compile=False)  # torchao eager: 33 bytes an element a cast


def test_nemo_runs_are_priced_as_megatron_core_runs_them():
    """A NeMo row is priced with Transformer Engine's casts and Megatron-Core's bf16 model (no autocast casts of
    each Linear's input and weight), in bf16 and fp8 alike; soap's own plan keeps torchao's casts and autocast."""
    from costmodel.profiles import load_cluster
    from executor.validation.grid import FP8_CASTS_BY_STACK, StackPlan, as_run
    from executor.validation.run_records import RunRecord
    from planner.api import plan
    from planner.regimes import regime_dtype

    device = load_cluster("dgx-h100").device
    for precision in ("fp8", "bf16"):
        planned = plan("llama-3-8b", gpus=8, cluster="dgx-h100", precision=precision, global_batch=8, seq_len=1024,
                       tp=1, pp=1, dp=8, zero=1)
        record = RunRecord(name="nemo", model="llama-3-8b", gpus=8, seq=1024, micro_batch=1, precision=precision,
                           stack="nemo-te", tokens_per_s_per_gpu=1.0)
        priced = as_run(planned, record)
        assert isinstance(priced, StackPlan)
        train = priced.strategy().train
        assert train.fp8_casts == FP8_CASTS_BY_STACK["nemo-te"] and train.half_model
        assert regime_dtype(priced.strategy().dims, train, device) == "bfloat16"
        own = planned.strategy()
        assert own.train.fp8_casts == "torchao"  # soap's own executor: torchao's float8, autocast over fp32 weights
        assert regime_dtype(own.dims, own.train, device) == "autocast-bfloat16"


def test_fp8_is_slower_than_bf16_eager_and_faster_compiled_and_keeps_no_autocast_copy_of_its_linears(tmp_path):
    """As a lent H100 ran four Llama-3-8B layers (2026-11-26, benchmarks/fp8_h100.py): eager fp8 1.6x slower
    than eager bf16 (torchao's casts op by op), compiled 1.08x faster; and with no 16-bit autocast copy of the
    float8 Linears' weights, whose fp32 master torchao casts straight to fp8."""
    import json

    from planner.api import plan

    config = json.loads((Path(tracer.__file__).parent / "presets" / "llama-3-8b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    pins = dict(gpus=1, cluster="dgx-h100", global_batch=2, seq_len=4096, micro_batch=1, recompute="none")
    step, weights = {}, {}
    for precision in ("bf16", "fp8"):
        for compile in (False, True):
            p = plan(str(tmp_path / "config.json"), precision=precision, compile=compile, **pins)
            step[precision, compile] = p.predicted["step_time_s"]
            weights[precision, compile] = p.predicted["memory_breakdown_gib"][0]["weights"]
    assert step["fp8", False] > step["bf16", False]
    assert step["fp8", True] < step["bf16", True]
    block_linears = 4 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    for compile in (False, True):
        assert (weights["bf16", compile] - weights["fp8", compile]) * 2**30 == pytest.approx(2 * block_linears)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_executor_converts_what_the_tracer_marks(family):
    """The layers `executor.precision.convert_fp8` swaps (its filter over the executor's model, after
    `normalize_for_tp` rewrote GPT-2's Conv1Ds as Linears) are the layers the tracer prices in fp8. The executor
    once converted GPT-2's rewritten Linears, which the trace (Conv1D) priced in bf16: on a lent H200 GPT-2's
    eager fp8 step ran 3.4x slower than bf16 where soap priced them equal."""
    import re
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from exec_helpers import make_plan

    from executor import precision
    from executor.model import build_meta_model

    assert precision.fp8_linear is fp8_linear
    plan = make_plan(family, precision="fp8")
    executed = build_meta_model(plan.model.config, plan.model.task)

    def layer(name: str) -> str:  # the trace prices one instance of each block
        return re.sub(r"\.\d+\.", ".N.", name)

    converted = {layer(name) for name, module in executed.named_modules() if precision.fp8_linear(module, name)}
    graph = tracer.trace(tracer.resolve_spec(executed.config, task=plan.model.task), batch=1, seq_len=16)
    priced = {layer(op.module_fqn) for op in graph.ops if op.attrs.get("fp8_linear")}
    assert converted == priced
    assert bool(converted) == (family == "llama")
