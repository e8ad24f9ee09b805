"""The autocast trace: fp32 parameters under an emulation of CUDA autocast's cast policy."""

from __future__ import annotations

from collections import Counter

import pytest

import tracer
from costmodel.memory_activations import activation_bytes
from tracer.ir import OpKind

torch = pytest.importorskip("torch")


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=192, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128)


def _saved_split(graph) -> Counter:
    split: Counter = Counter()
    for op in graph.ops:
        for t in op.saved:
            split[t.dtype] += t.nbytes * graph.multiplicity(op)
    return split


def _block_ops(graph, name):
    return [op for op in graph.ops if op.block_id is not None and name in op.name]


def test_gpt2_autocast_trace_keeps_norms_gelu_and_residual_in_fp32_and_matmul_inputs_in_bf16():
    g = tracer.trace(_gpt2(), batch=2, seq_len=32, dtype="autocast-bfloat16")
    assert all(p.dtype == "float32" for op in g.ops for p in op.params)  # fp32 parameters
    for op in g.ops:
        if op.kind is OpKind.MATMUL and op.block_id is not None:
            assert {t.dtype for t in op.saved} <= {"bfloat16"}, op.name  # the saved cast input
        if op.kind is OpKind.NORM:
            assert {t.dtype for t in op.saved} == {"float32"}, op.name
    pow_op, = _block_ops(g, "act:pow")
    assert [t.dtype for t in pow_op.saved] == ["float32"]  # gelu_new's pow runs (and saves) in fp32
    residual = [op for op in g.ops if op.block_id and op.module_fqn.endswith(".0") and op.name.endswith(":add")]
    assert residual and residual[0].outputs[0].dtype == "float32"  # fp32 + bf16 -> fp32
    casts = [op for op in g.ops if op.target.endswith("_to_copy.default")]
    assert {(c.inputs[0].dtype, c.outputs[0].dtype) for c in casts} >= {("float32", "bfloat16"), ("bfloat16", "float32")}
    loss, = [op for op in g.ops if op.kind is OpKind.LOSS]
    assert loss.saved[0].dtype == "float32"


def test_gpt2_autocast_saved_split_is_mostly_fp32_with_bool_dropout_masks():
    g = tracer.trace(_gpt2(), batch=2, seq_len=32, dtype="autocast-bfloat16")
    split = _saved_split(g)
    floating = split["float32"] + split["bfloat16"]
    # per block and token: fp32 ln inputs (2h) and the GELU chain (12h), bf16 matmul inputs and q/k/v
    # (the measured gpt2 step: 22.0 GiB fp32 to 8.7 GiB bf16 per storage)
    assert 0.6 < split["float32"] / floating < 0.8
    b, s, h, layers = 2, 32, 64, 2
    assert split["bool"] == (2 * layers + 1) * b * s * h  # resid + mlp dropout per block, embedding dropout


def test_llama_autocast_trace_keeps_rmsnorm_in_fp32_and_projections_in_bf16():
    g = tracer.trace(_llama(), batch=2, seq_len=32, dtype="autocast-bfloat16")
    split = _saved_split(g)
    assert split["float32"] > 0 and split["bfloat16"] > 0 and "bool" not in split  # llama has no dropout
    for op in g.ops:
        if op.kind is OpKind.MATMUL and op.block_id is not None:
            assert {t.dtype for t in op.saved} <= {"bfloat16"}, op.name
        if op.kind is OpKind.ATTENTION:
            assert op.inputs[0].dtype == "bfloat16"
    rsqrt = _block_ops(g, "rsqrt")
    assert rsqrt and all(op.outputs[0].dtype == "float32" for op in rsqrt)
    bf16 = tracer.trace(_llama(), batch=2, seq_len=32, dtype="bfloat16")
    assert _saved_split(bf16)["float32"] < split["float32"]  # bf16 parameters: only the upcasts stay fp32


def test_autocast_graph_predicts_more_activation_memory_than_two_bytes_everywhere():
    fp32 = tracer.trace("gpt2", batch=1, seq_len=1024)
    amp = tracer.trace("gpt2", batch=1, seq_len=1024, dtype="autocast-bfloat16")
    kw = dict(micro_batch=32, batch_traced=1, recompute="none", attention="sdpa", precision="bf16",
              cross_entropy="upcast")  # the upcast loss's fp32 logits are among the tensors autocast keeps in fp32
    before, after = activation_bytes(fp32.ops, **kw), activation_bytes(amp.ops, **kw)
    assert after > 1.3 * before
    chunked = {**kw, "cross_entropy": "chunked"}
    assert activation_bytes(amp.ops, **chunked) > 1.1 * activation_bytes(fp32.ops, **chunked)
    assert activation_bytes(amp.ops, **{**kw, "precision": None}) == after  # counted as traced


def test_autocast_regime_is_chosen_by_precision_and_fsdp():
    from costmodel.profiles import load_cluster
    from costmodel.strategy import ParallelDims, TrainingConfig
    from planner.regimes import regime_dtype

    gpu, cpu = load_cluster("dgx-h100").device, load_cluster("local-cpu").device
    train = lambda precision, zero=0: TrainingConfig(global_batch=8, seq_len=128, precision=precision, zero=zero)  # noqa: E731
    assert regime_dtype(ParallelDims(), train("bf16"), gpu) == "autocast-bfloat16"
    assert regime_dtype(ParallelDims(dp_shard=8), train("bf16", zero=3), gpu) == "bfloat16"
    assert regime_dtype(ParallelDims(dp_replicate=8), train("bf16", zero=0), gpu) == "autocast-bfloat16"
    assert regime_dtype(ParallelDims(dp_shard=8), train("fp16", zero=3), gpu) == "autocast-float16"
    assert regime_dtype(ParallelDims(), train("fp32"), gpu) == "float32"
    offloaded = TrainingConfig(global_batch=8, seq_len=128, precision="bf16", offload_optimizer=True)
    assert regime_dtype(ParallelDims(), offloaded, gpu) == "bfloat16"  # offload runs through FSDP2
    assert regime_dtype(ParallelDims(), train("bf16"), cpu) == "float32"  # CPU autocast has other op lists


def test_autocast_dtype_needs_the_dispatch_front_end():
    from tracer.errors import SoapError

    with pytest.raises(SoapError, match="dispatch"):
        tracer.trace(_gpt2(), batch=1, seq_len=16, dtype="autocast-bfloat16", frontend="export")


def test_emulation_casts_weights_once_and_leaves_fp64_alone():
    from tracer.autocast_mode import CudaAutocastEmulation

    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(2, 8)
    mode = CudaAutocastEmulation(torch.bfloat16)
    with mode:
        a = torch.nn.functional.linear(x, w)
        b = torch.nn.functional.linear(x, w)
        d = torch.mm(x.double(), w.double())
        p = torch.pow(a, 2)
        s = torch.softmax(a, -1)
        c = torch.cat([x, a])
    assert a.dtype == b.dtype == torch.bfloat16 and len(mode.weight_casts) == 1
    assert d.dtype == torch.float64
    assert p.dtype == s.dtype == c.dtype == torch.float32


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_autocast_trace_counts_what_autograd_keeps_under_the_emulation(make):
    """The trace's saved bytes per dtype equal, storage for storage, what autograd keeps when the model
    really runs on CPU tensors under the same emulation (dropout off: CPU dropout saves a float mask)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.amp_saved import saved_split
    from tracer.autocast_mode import CudaAutocastEmulation

    config = make()
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    real, _ = saved_split(model, torch.randint(0, 1000, (2, 32)), autocast=CudaAutocastEmulation(torch.bfloat16))
    traced = _saved_split(tracer.trace(config, batch=2, seq_len=32, dtype="autocast-bfloat16"))
    for dtype in ("float32", "bfloat16"):  # up to a few 0-dim scalars autograd keeps (the loss's total weight)
        assert traced[dtype] == pytest.approx(real.by_storage[dtype], abs=64), dtype


def test_regime_fsdp_rule_matches_the_executor():
    from itertools import product
    from types import SimpleNamespace

    from costmodel.strategy import ParallelDims
    from executor.data_parallel import uses_fsdp
    from planner.regimes import runs_fsdp

    for dp, cp, tp, pp, zero, offload in product((1, 2), (1, 2), (1, 2), (1, 2), (0, 1, 2, 3), (False, True)):
        dims = ParallelDims(dp_shard=dp, cp=cp, tp=tp, pp=pp)
        plan = SimpleNamespace(parallelism=SimpleNamespace(dp=dp, cp=cp, tp=tp, pp=pp, zero=zero, offload_optimizer=offload))
        assert runs_fsdp(dims, zero, offload) == uses_fsdp(plan), (dp, cp, tp, pp, zero, offload)
