"""Op cost: the roofline against hand-computed numbers, local shapes, precisions, and monotonicity."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.opcost import kernel_precision, op_time
from costmodel.profiles import DeviceProfile, EfficiencyCurve, FactorCurve, load_device
from tracer.errors import SoapError
from tracer.ir import DimRole, OpKind, OpNode, ParamMeta, TensorMeta

S, A, P, N = DimRole.SAMPLE, DimRole.ATTRIBUTE, DimRole.PARAMETER, DimRole.NONE
B, T, H, F = 4, 256, 1024, 4096


def flat_device(*, peak=100e12, bandwidth=1e12, matmul_eff=0.5, memory_eff=0.8, overhead_s=5e-6, fp8=True):
    peaks = {"fp32": peak / 10, "tf32": peak / 2, "fp16": peak, "bf16": peak}
    if fp8:
        peaks["fp8"] = 2 * peak
    return DeviceProfile(
        name="flat",
        peak_flops=peaks,
        memory_bytes=80 * 2**30,
        memory_bandwidth=bandwidth,
        matmul_efficiency=EfficiencyCurve(((1.0, matmul_eff),)),
        memory_efficiency=EfficiencyCurve(((1.0, memory_eff),)),
        kernel_overhead_s=overhead_s,
        context_bytes=2**30,
        host_bandwidth=50e9,
    )


def linear_op(batch=B):
    x = TensorMeta((batch, T, H), "float32", (S, A, P))
    y = TensorMeta((batch, T, F), "float32", (S, A, P))
    w = ParamMeta("layers.0.mlp.up.weight", (F, H), "float32")
    flops = 2 * batch * T * H * F
    return OpNode("layers.0.mlp.up:linear", OpKind.MATMUL, "aten.linear.default", "layers.0.mlp.up", "layers",
                  (x,), (y,), (w,), flops, 2 * flops, x.nbytes + y.nbytes + 4 * F * H, (x,))


def gelu_op(batch=B):
    y = TensorMeta((batch, T, F), "float32", (S, A, P))
    return OpNode("layers.0.mlp.act:gelu", OpKind.ELEMENTWISE, "aten.gelu.default", "layers.0.mlp.act", "layers",
                  (y,), (y,), (), 8 * y.numel, 16 * y.numel, 2 * y.nbytes, (y,))


def test_large_matmul_is_compute_bound_at_the_precision_peak():
    dev = flat_device()
    cost = op_time(linear_op(), device=dev, precision="bf16", micro_batch=B, batch_traced=B)
    flops = 2 * B * T * H * F
    assert cost.fwd_flops == flops
    assert cost.fwd_s == pytest.approx(flops / (100e12 * 0.5) + 5e-6)
    assert cost.fwd_bound == "compute"
    # backward: two kernels (input and weight gradient), each half the 2x FLOPs
    assert cost.bwd_s == pytest.approx(2 * (flops / (100e12 * 0.5) + 5e-6))


def test_elementwise_is_memory_bound_at_16_bit_under_mixed_precision():
    dev = flat_device()
    op = gelu_op()
    fp32 = op_time(op, device=dev, precision="fp32", micro_batch=B, batch_traced=B)
    bf16 = op_time(op, device=dev, precision="bf16", micro_batch=B, batch_traced=B)
    nbytes = 2 * B * T * F * 4
    assert fp32.bytes_moved == nbytes and fp32.fwd_bound == "memory"
    assert fp32.fwd_s == pytest.approx(nbytes / (1e12 * 0.8) + 5e-6)
    assert bf16.bytes_moved == nbytes / 2
    assert bf16.fwd_s == pytest.approx(nbytes / 2 / (1e12 * 0.8) + 5e-6)
    assert bf16.bwd_s == pytest.approx(nbytes / (1e12 * 0.8) + 5e-6)  # one kernel, 2x bytes


def layer_norm_op(dtype_in, dtype_out, **attrs):
    x = TensorMeta((B, T, H), dtype_in, (S, A, P))
    y = TensorMeta((B, T, H), dtype_out, (S, A, P))
    w = ParamMeta("layers.0.norm.weight", (H,), "float32")
    return OpNode("layers.0.norm:layer_norm", OpKind.NORM, "aten.layer_norm.default", "layers.0.norm", "layers",
                  (x,), (y,), (w,), 8 * x.numel, 16 * x.numel, x.nbytes + y.nbytes, (x,), attrs=attrs)


def test_an_op_autocast_keeps_in_fp32_takes_the_fp32_kernel_factor():
    """A measured profile's `norm/fp16` factor is a 16-bit norm kernel's; autocast's layer norm runs the
    fp32 kernel at fp32 bytes, in an fp16 run as in an fp32 one."""
    factors = {"norm/fp32": FactorCurve(((1.0, 3.0),)), "norm/fp16": FactorCurve(((1.0, 0.5),))}
    dev = dataclasses.replace(flat_device(), kernel_factors=factors)
    autocast_norm = layer_norm_op("float32", "float32", traced_dtype="autocast-float16")
    fp32 = op_time(layer_norm_op("float32", "float32"), device=dev, precision="fp32", micro_batch=B, batch_traced=B)
    kept = op_time(autocast_norm, device=dev, precision="fp16", micro_batch=B, batch_traced=B)
    assert kernel_precision(autocast_norm, "fp16") == "fp32"
    assert (kept.fwd_s, kept.bwd_s, kept.bytes_moved) == pytest.approx((fp32.fwd_s, fp32.bwd_s, fp32.bytes_moved))
    half = op_time(layer_norm_op("float16", "float16"), device=dev, precision="fp16", micro_batch=B, batch_traced=B)
    assert half.fwd_s == pytest.approx(0.5 * half.bytes_moved / (1e12 * 0.8) + 5e-6)
    rescaled = layer_norm_op("float32", "float32")  # an fp32 trace priced at 16 bits: the 16-bit kernel
    assert kernel_precision(rescaled, "fp16") == "fp16"


def test_precisions_use_their_own_peaks_and_fp8_needs_hardware():
    dev = flat_device(overhead_s=0.0)
    marked = dataclasses.replace(linear_op(), attrs={"fp8_linear": True})  # tracer.fp8: a layer torchao converts
    times = {p: op_time(marked, device=dev, precision=p, micro_batch=B, batch_traced=B, compile=True).fwd_s
             for p in ("fp32", "tf32", "bf16", "fp8")}
    assert times["fp32"] == pytest.approx(10 * times["bf16"])
    assert times["tf32"] == pytest.approx(2 * times["bf16"])
    assert times["bf16"] / 2 <= times["fp8"] < times["bf16"]  # half the GEMM, plus the fused casts
    eager = op_time(marked, device=dev, precision="fp8", micro_batch=B, batch_traced=B).fwd_s
    assert eager > times["fp8"]  # torchao's casts op by op (costmodel.opcost.fp8_cast_kernels)
    unmarked = op_time(linear_op(), device=dev, precision="fp8", micro_batch=B, batch_traced=B).fwd_s
    assert unmarked == pytest.approx(op_time(linear_op(), device=dev, precision="bf16", micro_batch=B,
                                             batch_traced=B).fwd_s)  # a GEMM torchao does not convert stays bf16
    with pytest.raises(SoapError, match="no fp8"):
        op_time(linear_op(), device=load_device("a100-sxm-80g"), precision="fp8", micro_batch=B, batch_traced=B)
    with pytest.raises(SoapError, match="no bf16"):
        op_time(linear_op(), device=load_device("v100-sxm2-16g"), precision="bf16", micro_batch=B, batch_traced=B)


def test_fp8_does_not_speed_up_memory_bound_ops():
    dev = flat_device()
    bf16 = op_time(gelu_op(), device=dev, precision="bf16", micro_batch=B, batch_traced=B)
    fp8 = op_time(gelu_op(), device=dev, precision="fp8", micro_batch=B, batch_traced=B)
    assert fp8.fwd_s == bf16.fwd_s


def test_micro_batch_and_splits_shrink_the_local_work():
    dev = flat_device()
    full = op_time(linear_op(), device=dev, precision="bf16", micro_batch=B, batch_traced=B)
    double = op_time(linear_op(), device=dev, precision="bf16", micro_batch=2 * B, batch_traced=B)
    assert double.fwd_flops == 2 * full.fwd_flops
    tp = op_time(linear_op(), device=dev, precision="bf16", micro_batch=B, batch_traced=B, split={"parameter": 4})
    assert tp.fwd_flops == full.fwd_flops / 4
    assert tp.bytes_moved == pytest.approx(full.bytes_moved / 4)
    sp = op_time(gelu_op(), device=dev, precision="bf16", micro_batch=B, batch_traced=B, split={"attribute": 2, "sample": 2})
    base = op_time(gelu_op(), device=dev, precision="bf16", micro_batch=B, batch_traced=B)
    assert sp.fwd_flops == base.fwd_flops / 4 and sp.bytes_moved == pytest.approx(base.bytes_moved / 4)


def test_view_costs_nothing():
    t = TensorMeta((B, T, H), "float32", (S, A, P))
    view = OpNode("x:view", OpKind.VIEW, "aten.view.default", "x", None, (t,), (t,), (), 0, 0, 0, ())
    cost = op_time(view, device=flat_device(), precision="bf16", micro_batch=B, batch_traced=B)
    assert cost.fwd_s == 0 and cost.bwd_s == 0


def test_bad_split_is_refused():
    with pytest.raises(SoapError, match="split role"):
        op_time(linear_op(), device=flat_device(), precision="bf16", micro_batch=1, batch_traced=1, split={"operator": 2})
    with pytest.raises(SoapError, match="unknown precision"):
        op_time(linear_op(), device=flat_device(), precision="int4", micro_batch=1, batch_traced=1)


def test_shipped_h100_prices_a_big_matmul_near_the_measured_rate():
    flops = 2 * 8192**3
    x = TensorMeta((8192, 8192), "float32", (S, P))
    op = OpNode("mm", OpKind.MATMUL, "aten.mm.default", "mm", None, (x, x), (x,), (), flops, 2 * flops, 3 * x.nbytes, (x,))
    cost = op_time(op, device=load_device("h100-sxm"), precision="bf16", micro_batch=1, batch_traced=1)
    achieved = flops / cost.fwd_s
    assert 700e12 < achieved < 810e12  # hardware.md: 798 TF/s measured


factors = st.floats(min_value=1.0, max_value=100.0)


@settings(max_examples=60, deadline=None)
@given(
    compute=factors, bandwidth=factors,
    precision=st.sampled_from(["fp32", "tf32", "bf16", "fp8"]),
    batch=st.integers(1, 64), which=st.sampled_from(["linear", "gelu"]),
)
def test_more_compute_or_bandwidth_never_predicts_a_slower_op(compute, bandwidth, precision, batch, which):
    base = load_device("h100-sxm")
    faster = dataclasses.replace(
        base,
        peak_flops={k: v * compute for k, v in base.peak_flops.items()},
        memory_bandwidth=base.memory_bandwidth * bandwidth,
    )
    op = linear_op(batch) if which == "linear" else gelu_op(batch)
    slow = op_time(op, device=base, precision=precision, micro_batch=batch, batch_traced=batch)
    fast = op_time(op, device=faster, precision=precision, micro_batch=batch, batch_traced=batch)
    assert fast.fwd_s <= slow.fwd_s and fast.bwd_s <= slow.bwd_s


def test_matmul_with_one_gradient_runs_one_backward_kernel():
    op = linear_op()
    frozen = OpNode(op.name, op.kind, op.target, op.module_fqn, op.block_id, op.inputs, op.outputs, op.params,
                    op.fwd_flops, op.fwd_flops, op.bytes_moved, op.saved)
    cost = op_time(frozen, device=flat_device(), precision="bf16", micro_batch=B, batch_traced=B)
    assert cost.bwd_s == pytest.approx(op.fwd_flops / (100e12 * 0.5) + 5e-6)


def test_a_weight_listed_as_input_and_parameter_counts_once():
    x = TensorMeta((B, T, H), "float32", (S, A, P))
    w = TensorMeta((F, H), "float32", (P, P))
    y = TensorMeta((B, T, F), "float32", (S, A, P))
    flops = 2 * B * T * H * F
    op = OpNode("up:linear", OpKind.MATMUL, "aten.linear.default", "up", None, (x, w), (y,),
                (ParamMeta("up.weight", (F, H), "float32"),), flops, 2 * flops, x.nbytes + w.nbytes + y.nbytes, (x,))
    cost = op_time(op, device=flat_device(), precision="fp32", micro_batch=2 * B, batch_traced=B)
    assert cost.bytes_moved == pytest.approx(2 * x.nbytes + w.nbytes + 2 * y.nbytes)


@settings(max_examples=60, deadline=None)
@given(
    device=st.sampled_from(["h100-sxm", "a100-sxm-80g", "l40s", "v100-sxm2-16g"]),
    degree=st.sampled_from([2, 4, 8]), role=st.sampled_from(["sample", "attribute", "parameter"]),
    batch=st.integers(1, 32), which=st.sampled_from(["linear", "gelu"]),
)
def test_splitting_an_op_never_makes_its_local_shard_slower(device, degree, role, batch, which):
    dev = load_device(device)
    op = linear_op(batch) if which == "linear" else gelu_op(batch)
    whole = op_time(op, device=dev, precision="fp16", micro_batch=batch, batch_traced=batch)
    shard = op_time(op, device=dev, precision="fp16", micro_batch=batch, batch_traced=batch, split={role: degree})
    assert shard.fwd_s <= whole.fwd_s and shard.bwd_s <= whole.bwd_s


def lm_head_op(vocab):
    x = TensorMeta((B, T, H), "bfloat16", (S, A, P))
    y = TensorMeta((B, T, vocab), "bfloat16", (S, A, P))
    w = ParamMeta("lm_head.weight", (vocab, H), "bfloat16")
    flops = 2 * B * T * H * vocab
    return OpNode("lm_head:linear", OpKind.MATMUL, "aten.linear.default", "lm_head", None,
                  (x,), (y,), (w,), flops, 2 * flops, x.nbytes + y.nbytes + 2 * vocab * H, (x,))


def test_an_unaligned_gemm_takes_its_measured_factor_and_an_aligned_one_does_not():
    """GPT-2's 50,257-token LM head leaves cuBLAS's aligned kernels (about 6x on an H100, measured): a profile
    with a `matmul-unaligned` factor prices it there; 50,304 tokens (padded to a multiple of 64) stays on the
    matmul factor, and a profile without the unaligned factor falls back to the matmul factor."""
    from costmodel.opcost import unaligned_matmul

    assert unaligned_matmul(lm_head_op(50257)) and not unaligned_matmul(lm_head_op(50304))
    plain = dataclasses.replace(flat_device(), kernel_factors={"matmul/bf16": FactorCurve(((1.0, 1.5),))})
    measured = dataclasses.replace(plain, kernel_factors={**plain.kernel_factors,
                                                          "matmul-unaligned/bf16": FactorCurve(((1.0, 6.0),))})

    def fwd(vocab, device):
        return op_time(lm_head_op(vocab), device=device, precision="bf16", micro_batch=B, batch_traced=B).fwd_s - 5e-6

    assert fwd(50257, measured) / fwd(50257, plain) == pytest.approx(4.0)
    assert fwd(50304, measured) == pytest.approx(fwd(50304, plain))
    assert fwd(50257, plain) / fwd(50304, plain) == pytest.approx(50257 / 50304)


def test_the_default_h100_prices_gpt2s_lm_head_as_measured_and_a_padded_vocabulary_faster(tmp_path):
    """Through the planner: GPT-2 with its vocabulary padded to 50,304 (nanoGPT's fix) plans faster on the
    default H100 than the published 50,257; the H100's LM head GEMMs come out near the 20.3 ms measured each."""
    import json

    from benchmarks.unaligned_gemm import FLOPS, MEASURED_S
    from costmodel.opcost import forward_time
    from planner.api import plan
    from tracer.spec import PRESET_DIR

    device = load_device("h100-sxm-fitted")
    head = lm_head_op(50257)
    assert forward_time(head, FLOPS, 0.0, device=device, precision="bf16")[0] == pytest.approx(
        sum(MEASURED_S) / 3, rel=0.01)
    config = json.loads((PRESET_DIR / "gpt2.json").read_text())
    padded = {**config, "vocab_size": 50304}

    def step(cfg):
        path = tmp_path / f"gpt2-{cfg['vocab_size']}.json"
        path.write_text(json.dumps(cfg))
        return plan(str(path), gpus=1, cluster="dgx-h100", precision="bf16", micro_batch=32, global_batch=32,
                    seq_len=1024).predicted["step_time_s"]

    assert step(padded) < 0.85 * step(config)
