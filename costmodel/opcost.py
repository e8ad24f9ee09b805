"""Op cost: the time of one OpGraph op on its local shard, forward and backward.

Model (a roofline per kernel, with the device profile's efficiency curves):

    t_kernel(F, B) = k[class/prec](x) * max( F / (P[prec] * e_mm(F)),  B / (W * e_mem(B)) ) + t_launch

- F: the kernel's FLOPs on the local shard; B: the bytes it reads and writes.
- P[prec]: peak FLOP/s at the op's precision (`compute_peak`): matmuls and the attention core use the
  run's precision (fp32, tf32, fp16, bf16, or fp8 for matmuls only; fp8 on a device without it is a
  SoapError) times the profile's `dtype_efficiency` (GPU profiles price fp8 matmuls at 0.75 of the fp8
  peak, 1.5x bf16, after published end-to-end fp8 training speedups); other ops run on the fp32
  (non-tensor-core) rate. e_mm: `matmul_efficiency` at F for
  matmuls and attention, 1 for the rest (their FLOPs are never the bound in practice).
- W: memory bandwidth; e_mem: `memory_efficiency` at B. t_launch: `kernel_overhead_s`.
- k: the device's `kernel_factors` for the op's class (`kernel_class`: matmul, attention, arithmetic,
  tanh, transcendental, softmax, norm, dropout, from its kind and ATen target) at the precision the op
  computes in (`kernel_precision`: the run's, except fp32 for an op a 16-bit trace keeps in fp32, such
  as autocast's layer norms, losses and upcasts, whose kernels are the fp32 ones), at x = F for matmul
  and attention and x = B for the rest; 1 where the profile has none (most GPU profiles).
  It is how a profile says, as data, that a CPU's tanh or softmax costs several adds at the same bytes.
- Forward (`forward_time`): one kernel with the op's `fwd_flops` and `bytes_moved`.
- Backward (`backward_time`): `bwd_flops` and twice the forward bytes (gradients are read and written
  besides the saved inputs). A matmul's backward is two kernels (input and weight gradient), each with
  half the FLOPs and half the bytes, when both gradients are needed (`backward_kernels`); every other
  op's is one kernel. An op without backward FLOPs,
  saved tensors or parameters (a view, an index computation) has no backward kernel.
- Views with no FLOPs and no bytes cost nothing (no kernel).
- fp8: a layer the tracer marks (`tracer.fp8`) adds torchao's float8 casts to its GEMMs (`fp8_cast_kernels`):
  eager, its ops one by one (33 bytes an element a cast, 9-10 kernels, the backward casting its saved
  high-precision operands again), compiled, an amax and a fused scaled cast (2 s + 1 bytes, 2 kernels).
  On a lent H100 (2026-11-26) four Llama-3-8B layers ran 1.61x slower in eager fp8 than in bf16, 1.08x faster
  compiled (`benchmarks/fp8_h100.py`); the cast kernels count against the simulator's host floor.
  Another stack's fp8 (`TrainingConfig.fp8_casts`, set only to price a published run as it ran): Transformer
  Engine's (`FP8_CASTS`'s "transformer-engine") casts each GEMM input with one fused kernel that writes the
  row-major and the transposed fp8 copies and records the amax (read 2, write 1 + 1 bytes an element; delayed
  scaling takes the scale from the amax history, so no reduction pass precedes the cast), the output gradient
  likewise in backward, and needs no transposed copies there (they were written with the cast); the weight's
  cast (bf16 parameters) runs on a step's first micro-batch only (`is_first_microbatch`), priced as that
  share of each micro-batch (`te_cast_kernels`). Its kernels are TE's own: torch.compile does not touch them.
- Context parallelism: a causal attention core split over the sequence runs as the layout's kernels
  (`costmodel.context_attention`): soap's executor's two a rank, a square causal one and a lower-right one at the
  device's `attention-lower-right` factor (FlashAttention-2 against the calibrated kernel, by FLOPs); another
  stack's ring (`TrainingConfig.cp_attention`), one kernel of the op's FLOPs.
- The loss: the trace records `F.cross_entropy(logits.float())` (the upcast, log-softmax and negative
  log-likelihood). The executor's chunked cross-entropy (`executor.cross_entropy`) makes the same passes over
  the logits a slice of tokens at a time (one per 512 MiB of fp32 logits, 1 to 8: `cross_entropy_slices`), in
  more kernels: each one more takes t_launch on the loss op's forward (`loss_launches`: 6 a slice and 10 once
  more; 58 at 8 slices, 0.4 ms a micro-batch at the measured H100's 6.8 us), and counts against the
  simulator's host floor. The planner's estimate leaves them out (it stays below the simulation). Measured on
  one H100: the chunked step within +0.1% (16k tokens of Llama-3-8B layers) and +2.3% (Llama 3.2 1B) of the
  upcast one's. Vocabulary-parallel logits take an in-place path with more passes, priced as bytes
  (`VOCAB_PARALLEL_LOSS_EXTRA_BYTES`).

torch.compile (`compile=True`, the strategy's `TrainingConfig.compile`): each kernel's time, launch
included, is multiplied by the device's `compile_factors[class/pass]` at the same x (pass `fwd` or
`bwd`; `compile_factor`):

    t_compiled = c[class/pass](x) * t_kernel

The factor is a measured ratio of whole chains, compiled over eager (`costmodel.calibration.microbench_compile`):
Inductor fuses an elementwise op into its neighbours, so the memory passes and the launches it saves are
both inside the ratio, charged to the op's class; matmul and attention keep their library kernels. A
profile without a factor for a class prices compile as no change (1). Compile's one-time compilation is not
part of the step time. Only the ops of the repeated blocks take the factor (`op.block_id` set): soap's executor
compiles each block (`executor.api.compile_blocks`), as torchtitan does, and runs the embedding, the final norm,
the LM head and the loss eagerly. On a lent H100 (2026-11-26) a step of four Llama-3-8B layers at 8,192 tokens
spent 24 ms of its 62 ms of memory-bound kernels outside the blocks (the loss's fp32 log-softmax, the logits'
and the LM head's casts), compiled or not, while the blocks' fell from 38 to 11 ms.

Local shapes (`local_scale`): the graph was traced at `batch_traced` samples. A tensor's bytes scale by
micro_batch / batch_traced if it has a SAMPLE dimension, and by 1/d for each role r in `split` with
degree d that one of its dimensions carries (once per role, not per dimension: a [b, h, s, s] score
tensor under context parallelism shrinks by cp, not cp^2). An op's FLOPs scale by the same factors over
the roles present in any of its tensors (the op's iteration space is partitioned d ways along that role).
Parameters shrink only by the "parameter" degree (tensor parallelism shards weights).

Byte width: under fp16/bf16/fp8 floating-point activations are 16-bit, so the bytes of an op traced in
fp32 are rescaled to 2 bytes per floating-point element (`activation_itemsize`); fp32/tf32 keep 4. An
op traced with 16-bit tensors, or any op of a graph traced at a 16-bit regime (`attrs["traced_dtype"]`:
bf16 parameters, or fp32 parameters under autocast, whose fp32 norms and upcasts stay fp32), keeps its
traced dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from costmodel.context_attention import LOWER_RIGHT_CLASS, pieces
from costmodel.math_attention import math_core_time, runs_math_path
from costmodel.optimizer_step import memory_pass_time
from costmodel.profiles import UNALIGNED_MATMUL, DeviceProfile
from costmodel.strategy import FP8_CASTS
from tracer.errors import SoapError
from tracer.ir import DTYPE_BYTES, DimRole, OpKind, OpNode, TensorMeta, split_roles
from tracer.peft import QLORA_BASE_DTYPE

MATMUL_LIKE = frozenset({OpKind.MATMUL, OpKind.ATTENTION})
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
LOW_PRECISION_DTYPES = frozenset({"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8")
TE_CAST_BYTES = 4
"""Bytes an element of Transformer Engine's fused cast-transpose: read 2 (bf16), write 1 (fp8) and 1 (its transpose)."""


@dataclass(frozen=True)
class OpCost:
    fwd_s: float
    bwd_s: float
    fwd_flops: float
    bwd_flops: float
    bytes_moved: float
    """Local forward bytes."""
    fwd_bound: str = "none"
    """What limits the forward kernel: `compute`, `memory` or `none` (no kernel)."""


CROSS_ENTROPY_SLICE_BYTES = 512 * 2**20
"""The chunked cross-entropy (`executor.cross_entropy`) cuts the logits into slices of tokens of about this
many fp32 bytes each (`cross_entropy_slices`)..."""
CROSS_ENTROPY_MAX_SLICES = 8
"""... and at most this many: its peak holds one slice's fp32 copy beside the logits and their gradient."""
CHUNKED_LOSS_KERNELS = (6, 16)
"""Kernels the chunked cross-entropy launches: per token slice (the upcast copy, torch's log-softmax, the
target's gather, exp, the one-hot's scatter, the gradient's masked write; 5 with fp32 logits, not copied), and
once (the labels' masks, the sum, backward's scaling). Counted on CPU dispatch by tests/test_cross_entropy.py."""
VOCAB_PARALLEL_LOSS_KERNELS = (12, 15)
"""The same where the vocabulary is sharded (its in-place path: max, shift, exp, sum, divide, log and the
all-reduced max copied back, each its own kernel). Those a slice counted likewise, over a one-rank group."""
VOCAB_PARALLEL_LOSS_EXTRA_BYTES = 10
"""Bytes per local logit element the vocabulary-parallel path moves beyond the traced upcast loss's passes:
its in-place softmax reads and writes the fp32 slice five times where the log-softmax kernel reads it twice
and writes it once (48 bytes over the loss, forward and backward, against 38). Priced as memory-bound time on
the loss op (`op_time`). On one H100 the in-place path without sharding (56 bytes, before 2026-11-26) ran
+17 ms a step on 2.1e9 logits (16k tokens of Llama 3) and +30 ms on 4 x 1.05e9 (Llama 3.2 1B) over the upcast
loss: 2.2-2.5 TB/s for its 18 bytes more; the log-softmax path ran within 0.1% and 2.3% of it."""
UPCAST_LOSS_KERNELS = 6
"""Kernels `F.cross_entropy(logits.float())` launches, forward and backward (the upcast, log-softmax and
negative log-likelihood and their backwards): the ones the trace's loss ops are priced as."""


def cross_entropy_slices(fp32_bytes: float, tokens: int | None = None) -> int:
    """Token slices of the chunked cross-entropy over logits of `fp32_bytes` in fp32 (the rank's shard):
    one per `CROSS_ENTROPY_SLICE_BYTES`, 1 to `CROSS_ENTROPY_MAX_SLICES`, at most one per token. Small logits
    take one slice (few kernels where the loss is launch-bound), large ones up to 8 (a small fp32 copy)."""
    n = min(CROSS_ENTROPY_MAX_SLICES, max(1, -(-int(fp32_bytes) // CROSS_ENTROPY_SLICE_BYTES)))
    return n if tokens is None else max(1, min(n, tokens))


def loss_fp32_bytes(op: OpNode, *, micro_batch: int, batch_traced: int, split: Mapping[str, int] | None) -> float:
    """A loss op's floating-point inputs (the logits) at fp32 on the local shard: what the chunked
    cross-entropy slices."""
    scale = micro_batch / batch_traced
    return sum(t.numel * 4 * local_scale(t, sample_scale=scale, split=dict(split or {}))
               for t in op.inputs if t.dtype in FLOAT_DTYPES)


def extra_loss_kernels(cross_entropy: str, slices: int, vocab_parallel: bool = False) -> int:
    """Kernels the run's loss launches beyond those its traced ops are priced as (the upcast loss's): the
    chunked one's, in `slices` (`cross_entropy_slices`), each a launch more (`op_time`); another stack's, none."""
    if cross_entropy != "chunked":
        return 0
    per_slice, once = VOCAB_PARALLEL_LOSS_KERNELS if vocab_parallel else CHUNKED_LOSS_KERNELS
    return per_slice * slices + once - UPCAST_LOSS_KERNELS


def loss_slices(op: OpNode, *, micro_batch: int, batch_traced: int, split: Mapping[str, int] | None) -> int:
    """The chunked cross-entropy's slices over a loss op's logits on the local shard (`cross_entropy_slices`
    of `loss_fp32_bytes`, at most one per token): what its kernels (`loss_launches`) and its memory
    (`costmodel.memory_activations.loss_tensors`) are priced at."""
    fp32 = loss_fp32_bytes(op, micro_batch=micro_batch, batch_traced=batch_traced, split=split)
    tokens = int(op.inputs[0].numel // max(op.inputs[0].shape[-1], 1) * micro_batch / batch_traced)
    return cross_entropy_slices(fp32, tokens)


def loss_launches(op: OpNode, cross_entropy: str, *, micro_batch: int, batch_traced: int,
                  split: Mapping[str, int] | None) -> int:
    """`extra_loss_kernels` of a loss op on its local shard (0 for any other op)."""
    if op.kind is not OpKind.LOSS or cross_entropy != "chunked":
        return 0
    slices = loss_slices(op, micro_batch=micro_batch, batch_traced=batch_traced, split=split)
    return extra_loss_kernels(cross_entropy, slices, vocab_parallel=int(dict(split or {}).get("parameter", 1)) > 1)


def activation_itemsize(precision: str) -> int:
    """Bytes per floating-point activation element at `precision` (autocast keeps 16-bit activations)."""
    if precision not in PRECISIONS:
        raise SoapError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return 4 if precision in ("fp32", "tf32") else 2


def local_scale(t: TensorMeta, *, sample_scale: float, split: Mapping[str, int]) -> float:
    """Factor from the traced tensor's size to its local size on one rank (see the module docstring)."""
    factor = 1.0
    present = split_roles(t.roles)
    if DimRole.SAMPLE in present:
        factor *= sample_scale
    for role, degree in split.items():
        if DimRole(role) in present:
            factor /= degree
    return factor


def _check_split(split: Mapping[str, int] | None) -> dict[str, int]:
    split = dict(split or {})
    for role, degree in split.items():
        if role not in ("sample", "attribute", "parameter"):
            raise SoapError(f"unknown split role {role!r}; use sample, attribute or parameter")
        if not isinstance(degree, int) or degree < 1:
            raise SoapError(f"split degree for {role} must be a positive integer, got {degree!r}")
    return split


def _element_bytes(dtype: str, float_width: int) -> int:
    """Floating-point tensors take the precision's activation width (0: keep the traced dtype); others
    keep their dtype's size."""
    return float_width if float_width and dtype in FLOAT_DTYPES else DTYPE_BYTES.get(dtype, 4)


def local_work(
    op: OpNode, *, precision: str, micro_batch: int, batch_traced: int, split: Mapping[str, int] | None = None
) -> tuple[float, float, float]:
    """(forward FLOPs, backward FLOPs, forward bytes) of `op` on one rank's shard."""
    if micro_batch < 1 or batch_traced < 1:
        raise SoapError(f"micro_batch ({micro_batch}) and batch_traced ({batch_traced}) must be positive")
    split = _check_split(split)
    sample_scale = micro_batch / batch_traced
    tensors = (*op.inputs, *op.outputs)
    roles = split_roles(r for t in tensors for r in t.roles)
    flop_scale = sample_scale if DimRole.SAMPLE in roles else 1.0
    for role, degree in split.items():
        if DimRole(role) in roles:
            flop_scale /= degree
    width = activation_itemsize(precision)
    if width < 4 and (op.attrs.get("traced_dtype") or any(t.dtype in LOW_PRECISION_DTYPES for t in tensors)):
        width = 0  # traced at low precision (tracer.autocast.mark_traced_dtype): the tensors carry their real dtypes
    # A weight the op reads usually appears among its inputs too; count the others once, as parameters.
    input_shapes = {t.shape for t in op.inputs} | {t.shape[::-1] for t in op.inputs}
    extra_params = [p for p in op.params if p.shape not in input_shapes]
    traced = sum(t.nbytes for t in tensors) + sum(p.numel * DTYPE_BYTES.get(p.dtype, 4) for p in extra_params)
    local = sum(
        t.numel * _element_bytes(t.dtype, width) * local_scale(t, sample_scale=sample_scale, split=split)
        for t in tensors
    )
    local += sum(p.numel * _element_bytes(p.dtype, width) / split.get("parameter", 1) for p in extra_params)
    # op.bytes_moved is the tracer's forward byte count; rescale it by how the tensors it counts shrink.
    byte_scale = local / traced if traced else 0.0
    return op.fwd_flops * flop_scale, op.bwd_flops * flop_scale, op.bytes_moved * byte_scale


def compute_peak(op: OpNode, device: DeviceProfile, precision: str) -> float:
    """Peak FLOP/s that bounds `op`: the precision's tensor-core rate for matmuls and attention (fp8 for
    matmuls only; attention runs at bf16 under fp8), the fp32 rate for everything else."""
    if precision not in PRECISIONS:
        raise SoapError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "fp8" and not device.supports_fp8:
        raise SoapError(f"device {device.name} has no fp8 tensor cores; use bf16 (fp8 needs Ada or Hopper)")
    if op.kind not in MATMUL_LIKE:
        return device.effective_peak("fp32")
    if precision == "fp8" and not op.attrs.get("fp8_linear"):
        precision = "bf16"  # only the layers tracer.fp8 marks run in fp8; attention, LM head, Conv1D stay bf16
    return device.effective_peak(precision)


TRANSCENDENTAL_TARGETS = frozenset({
    "gelu", "silu", "exp", "erf", "sigmoid", "log", "rsqrt", "sqrt", "sin", "cos", "softplus",
    "gelu_backward", "silu_backward", "tanh_backward", "sigmoid_backward",
})
"""Elementwise targets bound by vector math, not bytes (`pow` is not: a scalar power is a few multiplies)."""
TANH_TARGETS = frozenset({"tanh"})
"""tanh has its own class: on a CPU it costs several times a silu or an erf-gelu at the same bytes
(gpt2's gelu_new is mostly tanh), so one transcendental curve cannot price both."""
SOFTMAX_TARGETS = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_softmax_backward_data"})
DROPOUT_TARGETS = frozenset({"dropout", "native_dropout", "native_dropout_backward"})


def kernel_class(op: OpNode) -> str:
    """The op's key into a device's `kernel_factors`: its kind for matmul, attention, norm and softmax;
    for elementwise ops the ATen target's family (tanh, transcendental, dropout, else arithmetic)."""
    if op.kind is OpKind.MATMUL:
        return "matmul"
    if op.kind is OpKind.ATTENTION:
        return "attention"
    if op.kind is OpKind.NORM:
        return "norm"
    name = op.target.split(".")[1] if op.target.startswith("aten.") else op.target
    if op.kind is OpKind.SOFTMAX or name in SOFTMAX_TARGETS:
        return "softmax"
    if name in TANH_TARGETS:
        return "tanh"
    if name in TRANSCENDENTAL_TARGETS:
        return "transcendental"
    if name in DROPOUT_TARGETS:
        return "dropout"
    return "arithmetic"


def kernel_precision(op: OpNode, precision: str) -> str:
    """The precision key of the kernel `op` runs in a `precision` run: fp32 when the run is 16-bit but the
    op's floating outputs, as traced in the run's regime, are all fp32 (autocast keeps layer norms and
    losses in fp32; a bf16 model upcasts before its norms); the run's precision otherwise. An op of an
    fp32 trace rescaled to 16 bits (no traced dtypes) runs at the run's precision."""
    if activation_itemsize(precision) == 4:
        return precision
    if precision == "fp8" and op.kind in MATMUL_LIKE and not op.attrs.get("fp8_linear"):
        return "bf16"  # a GEMM torchao does not convert (tracer.fp8) is a bf16 kernel
    traced_low = op.attrs.get("traced_dtype") or any(
        t.dtype in LOW_PRECISION_DTYPES for t in (*op.inputs, *op.outputs))
    floating = [t.dtype for t in op.outputs if t.dtype in FLOAT_DTYPES]
    if traced_low and floating and all(d == "float32" for d in floating):
        return "fp32"
    return precision


ALIGNMENT_ELEMENTS = 8
"""A GEMM runs on the tensor-core kernels its size would have only when every dimension is a multiple of
this many elements (16 bytes of a 16-bit type; cuBLAS's alignment rule for its fast paths)."""


def unaligned_matmul(op: OpNode) -> bool:
    """A matmul with a dimension that is not a multiple of `ALIGNMENT_ELEMENTS`: the last dimension of an
    operand or of the output, or either dimension of its 2-D weight (GPT-2's 50,257-token or BERT's 30,522-token
    LM head). Its forward and both backward GEMMs have that dimension as a leading one. Read off the traced
    (unsplit) shapes."""
    if op.kind is not OpKind.MATMUL:
        return False
    dims = {t.shape[-1] for t in (*op.inputs, *op.outputs) if len(t.shape) >= 2}
    dims |= {d for p in op.params if len(p.shape) == 2 for d in p.shape}
    return any(d % ALIGNMENT_ELEMENTS for d in dims)


def kernel_factor(op: OpNode, device: DeviceProfile, precision: str, flops: float, nbytes: float) -> float:
    """The device's time factor for `op`'s class at the precision it computes in (1 where the profile has
    none). An unaligned matmul (`unaligned_matmul`) takes the `matmul-unaligned` factor where the profile
    measured one (on an H100, cuBLAS runs GPT-2's LM head on sm75-era kernels at about a sixth of an aligned
    GEMM's rate), else the matmul factor."""
    prec = kernel_precision(op, precision)
    curve = device.kernel_factors.get(f"{kernel_class(op)}/{prec}")
    if unaligned_matmul(op):
        curve = device.kernel_factors.get(f"{UNALIGNED_MATMUL}/{prec}", curve)
    if curve is None:
        return 1.0
    return curve.at(flops if op.kind in MATMUL_LIKE else nbytes)


def compile_factor(op: OpNode, device: DeviceProfile, direction: str, flops: float, nbytes: float) -> float:
    """The device's torch.compile time factor for `op`'s class in `direction` (`fwd` or `bwd`), at the
    kernel's FLOPs (matmul, attention) or bytes (the rest); 1 where the profile has none."""
    curve = device.compile_factors.get(f"{kernel_class(op)}/{direction}")
    if curve is None:
        return 1.0
    return curve.at(flops if op.kind in MATMUL_LIKE else nbytes)


def kernel_time(flops: float, nbytes: float, *, peak: float, matmul: bool, device: DeviceProfile,
                factor: float = 1.0) -> tuple[float, str]:
    """Roofline time of one kernel, times the class `factor`, plus launch overhead; and its bound."""
    if flops <= 0 and nbytes <= 0:
        return 0.0, "none"
    compute = flops / (peak * device.matmul_efficiency.at(flops)) if matmul and flops > 0 else flops / peak
    memory = nbytes / (device.memory_bandwidth * device.memory_efficiency.at(nbytes)) if nbytes > 0 else 0.0
    return factor * max(compute, memory) + device.kernel_overhead_s, "compute" if compute >= memory else "memory"


FP8_EAGER_SCALE_KERNELS = 4
"""An eager amax-to-scale (`torchao.float8.float8_utils.amax_to_scale`): to float64, clamp, divide, to float32,
each a one-element kernel."""


def _fp8_gemm(op: OpNode, flops: float) -> tuple[float, int, int, int] | None:
    """(m, k, n, the weight's bytes per element) of a float8 Linear's [m, k] x [k, n] GEMM of `flops`, or None
    (no 2-D weight, no work)."""
    weight = next((p for p in op.params if len(p.shape) == 2), None)
    if weight is None or flops <= 0:
        return None
    n, k = weight.shape  # nn.Linear stores [out, in]
    return flops / (2 * k * n), k, n, 4 if weight.dtype == "float32" else 2


def fp8_cast_operands(op: OpNode, flops: float, direction: str, *, compile: bool) -> tuple[tuple[float, int], ...]:
    """(elements, bytes per element of the high-precision source) of each operand torchao's float8 Linear casts
    to fp8 around one GEMM of `flops` (`tracer.fp8`), in `direction` fwd or bwd, for an [m, k] x [k, n] GEMM
    (flops = 2mkn; k and n read off the weight, so under TP the unsplit count scaled by the local FLOPs).
    Forward (`matmul_with_hp_or_float8_args.forward`): the input (m k, bf16) and the weight (k n, its parameter
    bytes: the fp32 master, cast without an autocast copy). It saves both in high precision, so eagerly the
    backward casts again: the output gradient twice (m n, for the input gradient and for the weight gradient),
    the weight and the input. Compiled, the output gradient once: its two tensor-wise casts share one amax and
    scale, which Inductor computes once, and the partitioner keeps the forward's fp8 operands rather than
    recomputing their casts (priced as fused before the fp8 rows of the corpus were fitted, and left so)."""
    return tuple((elements, s) for elements, s, _ in _cast_operands(op, flops, direction, compile=compile))


def _cast_operands(op: OpNode, flops: float, direction: str, *, compile: bool) -> tuple[tuple[float, int, bool], ...]:
    """`fp8_cast_operands`, each with whether it is the weight."""
    gemm = _fp8_gemm(op, flops)
    if gemm is None:
        return ()
    m, k, n, w_bytes = gemm
    if direction == "fwd":
        return (m * k, 2, False), (k * n, w_bytes, True)
    grad = (m * n, 2, False)
    return (grad,) if compile else (grad, grad, (k * n, w_bytes, True), (m * k, 2, False))


def fp8_transposed(op: OpNode, flops: float, direction: str, *, compile: bool) -> tuple[float, ...]:
    """Elements of the fp8 operands `torch._scaled_mm` gets in the wrong layout (it takes a row-major first and a
    column-major second operand; torchao's `preprocess_addmm` copies the others): none forward; backward the
    weight (for the input gradient), and the output gradient and the input (for the weight gradient). Compiled,
    the output gradient's cast writes its transposed layout too (`fp8_cast_operands`), so two copies."""
    return tuple(elements for elements, _ in _transposed(op, flops, direction, compile=compile))


def _transposed(op: OpNode, flops: float, direction: str, *, compile: bool) -> tuple[tuple[float, bool], ...]:
    """`fp8_transposed`, each with whether it is the weight."""
    gemm = _fp8_gemm(op, flops)
    if direction == "fwd" or gemm is None:
        return ()
    m, k, n, _ = gemm
    return ((k * n, True), (m * k, False)) if compile else ((k * n, True), (m * n, False), (m * k, False))


def fp8_cast_kernels(op: OpNode, flops: float, direction: str, *, compile: bool) -> tuple[float, ...]:
    """The bytes each kernel of the float8 casts around one GEMM moves (`fp8_cast_operands`, `fp8_transposed`).
    A cast of e elements from s-byte elements, dynamic tensor-wise scaling (`hp_tensor_to_float8_dynamic`):
    - eager, op by op: abs (read s, write s), max (read s), the scale (`FP8_EAGER_SCALE_KERNELS`), to float32
      unless s is 4 (read s, write 4), multiply by the scale (read 4, write 4), clamp (read 4, write 4), to fp8
      (read 4, write 1): 9 or 10 kernels, 4 s + 25 bytes an element (33 from bf16 and from fp32 alike);
    - compiled: an amax reduction (read s) and a scaled cast (read s, write 1): 2 kernels, 2 s + 1 bytes an
      element; the activations' are then scaled by the device's compile factor (`_cast_time`).
    Each transposed copy reads and writes 1 byte an element."""
    return tuple(nbytes for nbytes, _ in _torchao_cast_kernels(op, flops, direction, compile=compile))


def _torchao_cast_kernels(op: OpNode, flops: float, direction: str, *,
                          compile: bool) -> tuple[tuple[float, bool], ...]:
    """`fp8_cast_kernels`, each with whether it casts or copies an activation (the input or the output gradient)
    rather than the weight."""
    kernels: list[tuple[float, bool]] = []
    for elements, s, weight in _cast_operands(op, flops, direction, compile=compile):
        activation = not weight
        if compile:
            kernels += [(elements * s, activation), (elements * (s + 1), activation)]
        else:
            kernels += [(nbytes, activation) for nbytes in (
                elements * 2 * s, elements * s, *[8.0] * FP8_EAGER_SCALE_KERNELS,
                *([elements * (s + 4)] if s != 4 else []), elements * 8, elements * 8, elements * 5)]
    kernels += [(2 * elements, not weight) for elements, weight in _transposed(op, flops, direction, compile=compile)]
    return tuple(kernels)


def te_cast_kernels(op: OpNode, flops: float, direction: str, *, weight_share: float) -> tuple[float, ...]:
    """The bytes each of Transformer Engine's cast kernels around one [m, k] x [k, n] GEMM of `flops` moves (module
    docstring): forward the input's cast-transpose (m k elements) and the weight's (k n, on `weight_share` of the
    micro-batches: 1 / the step's micro-batches), backward the output gradient's (m n); `TE_CAST_BYTES` an
    element each."""
    gemm = _fp8_gemm(op, flops)
    if gemm is None:
        return ()
    m, k, n, _ = gemm
    if direction == "fwd":
        return TE_CAST_BYTES * m * k, TE_CAST_BYTES * k * n * weight_share
    return (TE_CAST_BYTES * m * n,)


def cast_kernels(op: OpNode, flops: float, direction: str, *, compile: bool, casts: str = "torchao",
                 weight_share: float = 1.0) -> tuple[float, ...]:
    """The bytes of each kernel of `casts`'s float8 casts around one GEMM (`fp8_cast_kernels`, `te_cast_kernels`)."""
    if casts not in FP8_CASTS:
        raise SoapError(f"unknown fp8 casts {casts!r}; choose one of {', '.join(FP8_CASTS)}")
    if casts == "transformer-engine":
        return te_cast_kernels(op, flops, direction, weight_share=weight_share)
    return fp8_cast_kernels(op, flops, direction, compile=compile)


def fp8_cast_bytes(op: OpNode, flops: float, direction: str, *, compile: bool) -> float:
    """The bytes the float8 casts around one GEMM move (`fp8_cast_kernels`)."""
    return sum(fp8_cast_kernels(op, flops, direction, compile=compile))


def fp8_cast_launches(op: OpNode, direction: str, *, precision: str, compile: bool, casts: str = "torchao") -> int:
    """Kernels the float8 casts add to `op`'s forward or backward (0 unless `op` runs as a float8 Linear):
    what the simulator's host floor counts beside the GEMMs."""
    if precision != "fp8" or not op.attrs.get("fp8_linear"):
        return 0
    return len(cast_kernels(op, max(op.fwd_flops, 1.0), direction, compile=compile, casts=casts))


FP8_WEIGHT_CAST_CLASS = "fp8-weight-cast"
"""A kernel-factor class no shipped profile has: the factor torchao's casts of the weights read before
`arithmetic`'s, which a fit's variant sets to tell their share of a step from the other memory-bound kernels'
(`executor.validation.external.step_terms`)."""


def _cast_time(op: OpNode, flops: float, direction: str, device: DeviceProfile, compile: bool,
               casts: str = "torchao", weight_share: float = 1.0) -> float:
    """The float8 casts around one GEMM (`cast_kernels`), each kernel priced as a bf16 elementwise one
    (the device's `arithmetic/bf16` factor, so a fit of the memory-bound classes scales them too). Compiled,
    torchao's casts of the activations (the input, the output gradient) take the device's `arithmetic/fwd`
    compile factor at the kernel's bytes: Inductor fuses them into their neighbours (the norm and the
    activation function write fp8 beside bf16). The weights' casts (fp32 to fp8, an amax each) are counted as
    the fused kernels they run as and take no factor. Measured on an H100 (`benchmarks/fp8_casts.py`): the casts
    of four Llama-3-8B layers and of Llama 3.2 1B took 1.8x and 1.5x this price on `h100-x1-measured`, where the
    factor on every cast priced them 4.2x and 2.4x short and none 1.1x and 1.9x over. Transformer Engine's
    kernels are its own, compiled or not."""
    arithmetic = device.kernel_factors.get("arithmetic/bf16")
    fused = device.compile_factors.get("arithmetic/fwd") if compile and casts == "torchao" else None
    kernels: tuple[tuple[float, bool | None], ...]  # (bytes, an activation's: torchao's casts; None: TE's)
    if casts == "torchao":
        kernels = _torchao_cast_kernels(op, flops, direction, compile=compile)
    else:
        kernels = tuple((nbytes, None) for nbytes in cast_kernels(op, flops, direction, compile=compile, casts=casts,
                                                                weight_share=weight_share))
    weights = device.kernel_factors.get(f"{FP8_WEIGHT_CAST_CLASS}/bf16") or arithmetic
    total = 0.0
    for nbytes, activation in kernels:
        factor = weights if activation is False else arithmetic
        t, _ = kernel_time(0.0, nbytes, peak=device.effective_peak("fp32"), matmul=False, device=device,
                           factor=factor.at(nbytes) if factor is not None else 1.0)
        total += t * (fused.at(nbytes) if fused is not None and activation else 1.0)
    return total


def forward_time(op: OpNode, flops: float, nbytes: float, *, device: DeviceProfile, precision: str,
                 compile: bool = False, casts: str = "torchao", weight_share: float = 1.0) -> tuple[float, str]:
    peak = compute_peak(op, device, precision)
    factor = kernel_factor(op, device, precision, flops, nbytes)
    t, bound = kernel_time(flops, nbytes, peak=peak, matmul=op.kind in MATMUL_LIKE, device=device, factor=factor)
    if compile and t > 0:
        t *= compile_factor(op, device, "fwd", flops, nbytes)
    if precision == "fp8" and op.attrs.get("fp8_linear"):
        t += _cast_time(op, flops, "fwd", device, compile, casts, weight_share)
    return t, bound


def _all_gather_attention(op: OpNode, fwd_flops: float, bwd_flops: float, nbytes: float, cp: int, *,
                          device: DeviceProfile, precision: str, compile: bool) -> tuple[float, float, str]:
    """(forward, backward, forward bound) of a causal attention core under soap's executor's context parallelism:
    rank 0's two kernels, the lower-right one at the device's `attention-lower-right` factor
    (`costmodel.context_attention.pieces`)."""
    fwd_s = bwd_s = 0.0
    bound = "none"
    lower_right = device.kernel_factors.get(f"{LOWER_RIGHT_CLASS}/{kernel_precision(op, precision)}")
    for flops, piece_bytes, rectangular in pieces(fwd_flops, nbytes, cp):
        factor = lower_right.at(flops) if rectangular and lower_right is not None else 1.0
        t, piece_bound = forward_time(op, flops, piece_bytes, device=device, precision=precision, compile=compile)
        fwd_s += factor * t
        bound = piece_bound if rectangular else bound
        share = flops / fwd_flops if fwd_flops > 0 else 0.0
        bwd_s += factor * backward_time(op, bwd_flops * share, piece_bytes, device=device, precision=precision,
                                        compile=compile)
    return fwd_s, bwd_s, bound


def _math_gemm(op: OpNode, device: DeviceProfile, precision: str):
    """One batched GEMM of an attention core's math path: a roofline kernel at the precision's matmul peak,
    efficiency and `matmul` factor (`costmodel.math_attention`)."""
    peak = compute_peak(op, device, precision)
    curve = device.kernel_factors.get(f"matmul/{kernel_precision(op, precision)}")

    def gemm(flops: float, nbytes: float) -> float:
        factor = curve.at(flops) if curve is not None else 1.0
        return kernel_time(flops, nbytes, peak=peak, matmul=True, device=device, factor=factor)[0]

    return gemm


def has_backward(op: OpNode) -> bool:
    return op.bwd_flops > 0 or bool(op.saved) or bool(op.params)


def backward_kernels(op: OpNode) -> int:
    """A matmul whose inputs both need gradients runs two backward kernels (input and weight gradient,
    backward FLOPs about twice the forward's); one with a single gradient (a frozen weight, or the
    first layer's input) runs one. Every other op runs one."""
    if op.kind is OpKind.MATMUL and op.bwd_flops > 1.5 * op.fwd_flops:
        return 2
    return 1


def backward_time(op: OpNode, flops: float, fwd_bytes: float, *, device: DeviceProfile, precision: str,
                  compile: bool = False, casts: str = "torchao") -> float:
    if not has_backward(op):
        return 0.0
    peak = compute_peak(op, device, precision)
    kernels = backward_kernels(op)
    flops, nbytes = flops / kernels, 2 * fwd_bytes / kernels
    factor = kernel_factor(op, device, precision, flops, nbytes)
    t, _ = kernel_time(flops, nbytes, peak=peak, matmul=op.kind in MATMUL_LIKE, device=device, factor=factor)
    if compile:
        t *= compile_factor(op, device, "bwd", flops, nbytes)
    cast = _cast_time(op, op.fwd_flops * flops * kernels / max(op.bwd_flops, 1), "bwd", device, compile, casts) \
        if precision == "fp8" and op.attrs.get("fp8_linear") else 0.0
    return kernels * t + cast


def op_time(
    op: OpNode,
    *,
    device: DeviceProfile,
    precision: str,
    micro_batch: int,
    batch_traced: int,
    split: Mapping[str, int] | None = None,
    compile: bool = False,
    cross_entropy: str = "upcast",
    fp8_casts: str = "torchao",
    microbatches: int = 1,
    cp_attention: str = "all-gather",
    math_attention: bool | None = None,
) -> OpCost:
    """Time of `op` for a micro-batch of `micro_batch` samples (the graph was traced at `batch_traced`),
    under torch.compile when `compile` and `op` is in a block (the device's `compile_factors`, see the module
    docstring). A loss op under the run's `cross_entropy` takes a launch overhead more for each kernel that
    loss launches beyond the traced (upcast) one's (`extra_loss_kernels`): its passes over the logits are
    the same, but for the vocabulary-parallel path's (`VOCAB_PARALLEL_LOSS_EXTRA_BYTES`). An fp8 op takes
    `fp8_casts`'s casts (`FP8_CASTS`); Transformer Engine's weight cast a step's `microbatches` share. A causal
    attention core split over the sequence (context parallelism) runs as `cp_attention`'s kernels
    (`costmodel.context_attention`); one on a GPU at fp32 or tf32 as SDPA's math path (`costmodel.math_attention`;
    `math_attention` overrides that rule: `soap calibrate` times SDPA's own choice on a causal call).

    `split` gives the SOAP degree per dimension role ("sample", "attribute", "parameter"); each tensor
    of the op that has a dimension with that role is divided by the degree (once per role), so the
    local work shrinks (see the module docstring).
    """
    fwd_flops, bwd_flops, nbytes = local_work(
        op, precision=precision, micro_batch=micro_batch, batch_traced=batch_traced, split=split
    )
    compile = compile and op.block_id is not None  # the executor compiles the blocks only
    cp = int(dict(split or {}).get("attribute", 1)) if cp_attention == "all-gather" and op.attrs.get("causal") else 1
    math = runs_math_path(device, precision) if math_attention is None else math_attention
    if op.kind is OpKind.ATTENTION and cp > 1:
        fwd_s, bwd_s, bound = _all_gather_attention(op, fwd_flops, bwd_flops, nbytes, cp, device=device,
                                                    precision=precision, compile=compile)
    elif op.kind is OpKind.ATTENTION and math:
        fwd_s, bwd_s = math_core_time(op.inputs[0].shape[-1], fwd_flops, bwd_flops,
                                      gemm_time=_math_gemm(op, device, precision),
                                      pass_time=lambda b: memory_pass_time(device, b) + device.kernel_overhead_s)
        bound = "memory"
    else:
        fwd_s, bound = forward_time(op, fwd_flops, nbytes, device=device, precision=precision, compile=compile,
                                    casts=fp8_casts, weight_share=1 / microbatches)
        bwd_s = backward_time(op, bwd_flops, nbytes, device=device, precision=precision, compile=compile,
                              casts=fp8_casts)
    fwd_s += loss_launches(op, cross_entropy, micro_batch=micro_batch, batch_traced=batch_traced,
                           split=split) * device.kernel_overhead_s
    if op.kind is OpKind.LOSS and cross_entropy == "chunked" and int(dict(split or {}).get("parameter", 1)) > 1:
        extra = VOCAB_PARALLEL_LOSS_EXTRA_BYTES * loss_fp32_bytes(op, micro_batch=micro_batch,
                                                                  batch_traced=batch_traced, split=split) / 4
        fwd_s += forward_time(op, 0.0, extra, device=device, precision=precision)[0] - device.kernel_overhead_s
    if any(p.dtype == QLORA_BASE_DTYPE for p in op.params):
        from costmodel.peft import dequantize_time  # it reads this module's widths

        dequantize_fwd, dequantize_bwd = dequantize_time(op, device=device, precision=precision)
        fwd_s, bwd_s = fwd_s + dequantize_fwd, bwd_s + dequantize_bwd
    return OpCost(fwd_s=fwd_s, bwd_s=bwd_s, fwd_flops=fwd_flops, bwd_flops=bwd_flops, bytes_moved=nbytes, fwd_bound=bound)
