"""CUDA autocast, emulated while tracing on meta, so a mixed-precision run's graph carries its real dtypes.

A bf16/fp16 run that is not FSDP keeps fp32 parameters and runs forward and loss under
`torch.autocast("cuda")` (executor/precision.py). Its tensors are not "all 16-bit": autocast casts the
inputs of a few ops and leaves everything else to ordinary type promotion. torch.autocast does nothing
on meta tensors, and CPU autocast has other op lists (layer_norm stays bf16 there), so the tracer
applies CUDA's policy itself, per op, from the lists in aten/src/ATen/autocast_mode.cpp (torch 2.x):

    lower precision   matmuls, convolutions, linear, SDPA: every floating input (not fp64) is cast to
                      the low dtype, so the op computes, returns and saves 16-bit tensors
    fp32              pow, exp, log, rsqrt, softplus, layer/group norm, the losses, logsumexp, ...:
                      16-bit inputs are cast up to fp32; the op returns and saves fp32
    fp32 output       softmax, log_softmax, sum, prod, cumsum, cumprod, vector/matrix norms: when the
                      first input is floating and no dtype is given, they compute in and return fp32
    promote           cat, stack, addcmul, addcdiv, index_put, scatter_add, ...: inputs are cast to
                      the widest floating dtype among them
    everything else   runs at its inputs' dtypes: fp32 + bf16 -> fp32, so the residual stream that
                      starts at an fp32 embedding stays fp32 through every block

The casts are real ops in the graph (`aten._to_copy`): they move bytes, and what a lower-precision op
saves for backward is its cast input (gpt2's MLP saves the 16-bit cast of its fp32 GELU output).
Parameters are cast once per forward (autocast's weight cache): the cast is parameter-derived, so the
graph counts it as a weight, not as an activation.

`autocast_mode.CudaAutocastEmulation` is a TorchFunctionMode; `emulate_cuda_autocast(model, dtype)`
pushes it when the model's forward starts, above the capture front-end's own function mode, so the
casts it issues are captured like the model's ops and every op receives the tensors a CUDA autocast
run gives it. Only the dispatch front-end runs the forward eagerly enough for that (`TRACE_FRONTEND`).
The policy is applied per torch function, where CUDA applies it per ATen op: a function that is on no
list but decomposes in C++ into listed ops (none in the supported models; F.cross_entropy is listed
here for that reason) would keep its inputs' dtypes. Checked: on gpt2 32 x 1024 the emulation run on
real CPU tensors saves what an H100 saved under torch.autocast, to 0.01 GiB per dtype
(docs/benchmarks.md, amp-memory; tests/test_autocast_gpu.py compares op by op on a GPU).

`trace_dtype_for(precision, fsdp)` names the trace regime of a plan the way executor/precision.py
runs it: fp32/tf32 on the fp32 trace, bf16 under FSDP (MixedPrecisionPolicy, bf16 parameters, no
autocast) on the bf16 trace, bf16 otherwise and fp16 always (fp16 keeps autocast and a grad scaler,
FSDP or not) on the autocast trace; fp8 runs the bf16 regime around float8 Linear layers, so it takes
bf16's trace.
"""

from __future__ import annotations

from dataclasses import replace

from tracer.ir import OpGraph

AUTOCAST_DTYPES = {"autocast-bfloat16": "bfloat16", "autocast-float16": "float16"}
"""Trace dtype names of the autocast regimes -> the autocast (lower precision) dtype."""
TRACE_FRONTEND = "dispatch"

LOWER_PRECISION = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "_convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__", "__rmatmul__",
    "einsum", "mm", "mv", "vecdot", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "multi_dot", "linalg_multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
})
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "native_layer_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "interpolate", "upsample", "norm",
    # a composite whose parts (log_softmax, nll_loss) both compute in fp32: same dtypes as casting its input
    "cross_entropy",
})
FP32_OUTPUT = frozenset({"softmax", "log_softmax", "sum", "prod", "cumsum", "cumprod", "vector_norm",
                         "linalg_vector_norm", "matrix_norm", "linalg_matrix_norm"})
PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
                     "index_put", "tensordot", "scatter_add", "cat", "concat", "concatenate", "stack"})


def trace_dtype_for(precision: str, fsdp: bool) -> str:
    """The trace dtype whose graph carries a run's dtypes (see the module docstring)."""
    if precision in ("bf16", "fp8"):  # fp8 runs the bf16 regime around float8 Linears (executor.precision)
        return "bfloat16" if fsdp else "autocast-bfloat16"
    if precision == "fp16":
        return "autocast-float16"
    return "float32"


def is_autocast(dtype_name: str) -> bool:
    return dtype_name in AUTOCAST_DTYPES


def mark_traced_dtype(graph: OpGraph, dtype_name: str) -> OpGraph:
    """Tag every op of a graph traced at a 16-bit regime with `attrs["traced_dtype"]`: its tensors carry
    the run's real dtypes, so the cost model counts an all-fp32 op (a norm, an upcast GELU) at 4 bytes
    instead of rescaling it to the run's 16 bits."""
    if dtype_name == "float32":
        return graph
    ops = tuple(replace(op, attrs={**op.attrs, "traced_dtype": dtype_name}) for op in graph.ops)
    return replace(graph, ops=ops)
