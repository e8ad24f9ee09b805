"""PEFT (issue 31): LoRA and QLoRA are planned and priced as they run.

- A LoRA and a QLoRA step, measured by live storages on CPU, hold what soap predicts term by term
  (benchmarks/peft_memory.py; the full table of 8 cases is in docs/benchmarks.md, 2 of them run here).
- The guide's example: a 7B model with a 200M-parameter adapter carries gradients and optimizer state for
  the adapter only.
- llama-3-70b on 8 x A100 80 GB fits with LoRA where full fine-tuning does not, and the why says so.
- The rules: TP/CP/EP, fp8 and compile are refused with adapters, QLoRA also refuses FSDP and pipelines.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodel.peft import nf4_bytes  # noqa: E402
from costmodel.plan_rules import peft_violation  # noqa: E402
from tracer.errors import SoapError  # noqa: E402
from tracer.peft import PeftSpec  # noqa: E402

MEASURED = [("llama", "fp32", "lora"), ("gpt2", "bf16", "qlora")]
"""Each family, precision and method once (CI time); benchmarks/peft_memory.py runs all 8 combinations."""


@pytest.mark.parametrize("family, precision, method", MEASURED, ids=["-".join(c) for c in MEASURED])
def test_a_peft_step_holds_what_soap_predicts_term_by_term(family, precision, method):
    from benchmarks.peft_memory import measure, plan_case, predicted

    report = plan_case(family, precision, method)
    got, want = measure(report.plan), predicted(report)
    assert want["estimate_equals_simulation"]
    for term in ("weights", "grads", "optimizer"):  # the base weights frozen, in their dtype or NF4
        assert want[term] == pytest.approx(got[term], rel=0.01), term
    assert want["step_peak"] == pytest.approx(got["step_peak"], rel=0.05)
    assert got["grads"] * 2 == got["optimizer"]  # adamw's two fp32 moments, for the adapters only


def test_nf4_weights_take_about_4_bits_with_their_double_quantized_statistics():
    n = 4096 * 4096
    assert nf4_bytes(n) == n // 2 + n // 64 + 4 * (n // 64 // 256) + 64 + 1024 + 4
    assert 4.12 < 8 * nf4_bytes(n) / n < 4.14


def test_the_guides_7b_model_with_a_200m_adapter_keeps_optimizer_state_for_the_adapter_only():
    """The one-GPU guide: a 7B model with 200M LoRA parameters needs optimizer state for 0.2B parameters,
    about 2.4 GB (with their gradients), instead of for the whole model."""
    import tracer
    from costmodel.memory import estimate_memory
    from costmodel.profiles import load_cluster
    from costmodel.strategy import TrainingConfig

    graph = tracer.trace("mistral-7b", seq_len=256, peft={"rank": 80}, dtype="bfloat16")
    adapter = graph.params_trainable
    assert 190e6 < adapter < 215e6 and graph.params_total > 7.2e9
    train = TrainingConfig(global_batch=1, seq_len=256, precision="bf16", peft="lora")
    memory = estimate_memory(graph, device=load_cluster("dgx-a100-80g").device, train=train)
    assert memory.optimizer == 8 * adapter and memory.grads == 4 * adapter
    assert memory.optimizer + memory.grads == pytest.approx(2.4e9, rel=0.06)
    # the frozen base: 2 bytes per weight (bf16), the fp32 adapters 4
    assert memory.weights == pytest.approx(2 * (graph.params_total - adapter) + 4 * adapter, rel=0.01)


@pytest.mark.slow
def test_llama_70b_lora_fits_8_a100s_where_full_fine_tuning_does_not():
    """`soap plan llama-3-70b --gpus 8 --cluster dgx-a100-80g --no-offload --peft lora`, the search pinned to
    the plan that command chooses (so the test runs in seconds), and full fine-tuning under the same pins."""
    from planner.api import plan_report

    pins = dict(gpus=8, cluster="dgx-a100-80g", offload=False, seq_len=4096, global_batch=64, dp=8, zero=3,
                micro_batch=1, recompute="full")
    report = plan_report("llama-3-70b", peft="lora", **pins)
    assert report.chosen.peak_memory_bytes <= 80 * 2**30
    assert report.plan.model.peft.method == "lora"
    assert "where full fine-tuning does not" in report.why[0]
    with pytest.raises(SoapError, match="does not fit"):
        plan_report("llama-3-70b", **pins)


def test_tensor_context_and_expert_parallelism_are_refused_with_adapters():
    assert peft_violation(None, tp=8) is None
    assert "tp=2" in peft_violation("lora", tp=2)
    assert "cp=2" in peft_violation("lora", cp=2) and "ep=2" in peft_violation("lora", ep=2)
    assert peft_violation("lora", pp=2, zero=3, offload=True) is None
    assert "pp=2" in peft_violation("qlora", pp=2)
    assert "zero=3" in peft_violation("qlora", zero=3) and "offload" in peft_violation("qlora", offload=True)
    assert "fp8" in peft_violation("lora", precision="fp8") and "compile" in peft_violation("lora", compile=True)
    assert "selective" in peft_violation("qlora", recompute="selective") and not peft_violation("lora", recompute="full")


def test_a_pinned_tp_under_peft_is_one_error_line():
    from planner.api import make_request

    with pytest.raises(SoapError, match="tp=2: soap's executor runs lora"):
        make_request("llama-3-8b", gpus=2, tp=2, peft="lora")
    with pytest.raises(SoapError, match="--peft qlora: zero=3"):
        make_request("llama-3-8b", gpus=2, zero=3, peft="qlora")


def test_bad_lora_settings_are_named():
    with pytest.raises(SoapError, match="--lora-rank"):
        PeftSpec(rank=0)
    with pytest.raises(SoapError, match="--lora-dropout"):
        PeftSpec(dropout=1.5)
    with pytest.raises(SoapError, match="unknown PEFT method"):
        PeftSpec.from_value("prefix-tuning")
    assert PeftSpec.from_value({"method": "qlora", "targets": "q_proj,v_proj"}).targets == ("q_proj", "v_proj")


def test_plan_json_carries_the_peft_settings_and_old_plans_still_load():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from exec_helpers import make_plan

    from planner.plan import plan_from_dict

    plan = make_plan("llama", peft={"method": "lora", "rank": 4, "alpha": 8.0, "targets": ["q_proj"]})
    again = plan_from_dict(__import__("json").loads(plan.to_json()))
    assert again.model.peft_spec() == PeftSpec(rank=4, alpha=8.0, targets=("q_proj",))
    assert again.strategy().train.peft == "lora"
    assert make_plan("llama").model.peft is None
    with pytest.raises(Exception, match="under model.peft"):
        make_plan("llama", tp=2, peft={"method": "lora", "rank": 4, "alpha": 8.0})
    assert math.isfinite(again.seq_len)


def test_a_frozen_linear_computes_its_input_gradient_only_and_the_adapters_add_their_matmuls():
    import tracer
    from costmodel.opcost import backward_kernels, op_time
    from costmodel.profiles import load_cluster
    from tracer.ir import OpKind

    fields = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    from transformers import AutoConfig

    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    full, lora = tracer.trace(config, seq_len=16), tracer.trace(config, seq_len=16, peft={"rank": 4})
    qlora = tracer.trace(config, seq_len=16, peft={"method": "qlora", "rank": 4})
    ops = {op.module_fqn.split(".", 3)[-1]: op for op in lora.ops_of("model.layers") if op.kind is OpKind.MATMUL}
    base = ops["self_attn.q_proj.base_layer"]
    a, b = ops["self_attn.q_proj.lora_A.default"], ops["self_attn.q_proj.lora_B.default"]
    assert not base.params[0].trainable and base.bwd_flops == base.fwd_flops and backward_kernels(base) == 1
    assert a.params[0].trainable and a.params[0].shape == (4, 64) and b.params[0].shape == (64, 4)
    assert not base.saved  # no input kept for a weight gradient (lora_A keeps it)
    # 7 targets per layer: r x (in + out) each
    per_layer = 4 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)
    assert lora.params_trainable == 2 * per_layer and lora.params_total == full.params_total + 2 * per_layer
    assert lora.bwd_flops < full.bwd_flops and lora.activation_bytes < full.activation_bytes
    device = load_cluster("dgx-h100").device
    q_op = next(op for op in qlora.ops if op.module_fqn == base.module_fqn and op.kind is OpKind.MATMUL)
    assert q_op.params[0].dtype == "nf4"
    plain, dequantizing = (op_time(op, device=device, precision="bf16", micro_batch=1, batch_traced=1)
                           for op in (base, q_op))
    assert dequantizing.fwd_s > plain.fwd_s and dequantizing.bwd_s > plain.bwd_s


def test_execute_says_in_one_line_what_a_qlora_plan_lacks(tmp_path, monkeypatch, capsys):
    import importlib.util

    from soap.cli import main

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from exec_helpers import make_plan

    plan_file = tmp_path / "plan.json"
    make_plan("llama", peft={"method": "qlora", "rank": 4, "alpha": 8.0}).save(plan_file)
    assert main(["execute", str(plan_file), "--merge"]) == 2
    assert "--merge" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    assert main(["execute", str(plan_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: this QLoRA plan needs bitsandbytes"), err


def test_qlora_keeps_what_the_model_keeps_in_fp32_and_so_every_adapter_trains():
    """T5's feed-forward casts its input to `wo.weight.dtype`; a 4-bit `wo` (uint8 storage) stopped the gradient
    there, and two DDP ranks refused the step (found by benchmarks/plans_execute.py). QLoRA now leaves `wo` as
    transformers' 4-bit loading does (`_keep_in_fp32_modules`), and every adapter gets a gradient."""
    from types import SimpleNamespace

    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from executor.peft import quantize_base
    from tracer.peft import apply_lora, quantized_modules

    torch.manual_seed(0)
    config = T5Config(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2, vocab_size=96,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = apply_lora(T5ForConditionalGeneration(config), PeftSpec.from_value("qlora"))
    quantized = quantized_modules(model)
    assert quantized and not any(name.endswith(".wo") for name in quantized)
    assert any(name.endswith(".wi") for name in quantized)
    spec = PeftSpec.from_value("qlora")
    quantize_base(model, SimpleNamespace(model=SimpleNamespace(peft_spec=lambda: spec),
                                         parallelism=SimpleNamespace(precision="fp32")))
    ids = torch.randint(1, 96, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    adapters = {name: p.grad for name, p in model.named_parameters() if "lora_B" in name}
    dead = [name for name, grad in adapters.items() if grad is None or not grad.abs().sum() > 0]
    assert adapters and not dead, dead


def test_stacked_experts_get_adapters_but_no_4_bit_base_and_trace_on_meta():
    """transformers 5 stacks an MoE's experts into 3-D parameters and peft's "all-linear" adapts them too (its
    `ParamWrapper`, whose fold turns autocast off: no meta backend, so the trace failed); QLoRA quantizes linears
    only, as bitsandbytes' `Linear4bit` holds."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    import tracer
    from tracer.peft import apply_lora, quantized_modules

    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=96, max_position_embeddings=64, num_local_experts=2,
                  num_experts_per_tok=1)
    with torch.device("meta"):
        plain = MixtralForCausalLM(MixtralConfig(**fields))
        model = apply_lora(MixtralForCausalLM(MixtralConfig(**fields)), PeftSpec.from_value("qlora"))
    quantized = quantized_modules(model)
    assert any(name.endswith("self_attn.q_proj") for name in quantized)
    assert not any("experts" in name for name in quantized)
    assert any("experts" in name for name, p in model.named_parameters() if p.requires_grad)
    graph = tracer.trace(plain, batch=1, seq_len=16, peft="lora")
    assert graph.params_trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert any(op.target == "aten.baddbmm.default" for op in graph.ops)


def test_a_pipeline_stage_holds_an_adapted_module_whole():
    """A stage names the module peft adapted, not its parts: BERT's MLM-head dense, which "all-linear" adapts,
    was listed as `dense.base_layer`, `dense.lora_A.default`, ..., and the stage without it replaced the parts."""
    from tracer.peft import adapted_module

    assert adapted_module("cls.predictions.transform.dense.lora_A.default") == "cls.predictions.transform.dense"
    assert adapted_module("model.layers.0.mlp.experts.base_layer.lora_B.default") == "model.layers.0.mlp.experts"
    assert adapted_module("cls.predictions.decoder") == "cls.predictions.decoder"
