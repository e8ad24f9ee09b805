"""Per-op rules: kind, forward/backward FLOPs, tensors saved for backward, bytes moved.

FLOPs follow `torch.utils.flop_counter`'s convention: only matmul-like work is counted (mm, addmm,
bmm, baddbmm, convolution, SDPA), each multiply-add as 2 FLOPs; elementwise, norm and softmax ops have
0 FLOPs and are priced by their bytes. Forward FLOPs use flop_counter's registered formula for the op
where one exists (`aten.linear`, `aten.matmul`, `aten.einsum`, `aten.conv*d` are computed here the same
way). Backward FLOPs, per rule:
- a contraction `out = a @ b` costs its forward FLOPs once for grad(a) if `a` needs grad and once for
  grad(b) if `b` needs grad (linear, mm, bmm, addmm, baddbmm, matmul, einsum, convolution);
- SDPA costs flop_counter's `sdpa_backward_flop_count` (recomputed scores plus four matmuls);
- every other op costs 0.
tests/test_tracer_flops.py checks the sum against FlopCounterMode on a real CPU forward+backward.

Saved tensors follow the autograd formulas (torch's derivatives.yaml), for ops whose output needs grad:
- contractions save each operand the *other* operand's gradient needs (a linear saves its input when
  the weight trains; parameters themselves are not activations and are left out);
- mul saves the other factor of each operand that needs grad; div saves the divisor (and the dividend
  when the divisor needs grad); pow saves its base;
- activations: silu, gelu, sigmoid-free ones save their input; relu, tanh, sigmoid, exp, rsqrt, sqrt
  and softmax/log_softmax save their output;
- layer norm saves input, mean and rstd; RMS norm saves input and rstd;
- SDPA saves q, k, v, out and logsumexp (fp32, one per query row); a mask it is given as well;
- dropout saves a bool mask (as CUDA's fused kernel does); cross entropy saves its log-probabilities
  and the targets; embedding and index ops save their integer indices;
- views, adds, casts, cat, copies and everything else save nothing.
A tensor saved by several ops counts once (see graph.py), views count as their base, and tensors
derived only from parameters (e.g. gathered expert weights) are not activations.

Bytes moved: for an embedding, the indices plus the rows read and written; 0 for views and aliases,
except that `contiguous`/`reshape` of a non-contiguous tensor (as after a transpose) is a copy (kind
COPY); for every other op, the bytes of each tensor input plus each output (parameter-derived inputs
capped at their parameters' size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tracer.capture import RawOp, Value
from tracer.ir import OpKind

KIND_BY_NAME: dict[str, OpKind] = {}


def _register(kind: OpKind, names: str) -> None:
    for n in names.split():
        KIND_BY_NAME[n] = kind


_register(OpKind.MATMUL, "mm addmm bmm baddbmm matmul linear einsum _grouped_mm addbmm convolution _convolution "
          "conv1d conv2d conv3d conv_transpose1d conv_transpose2d")
_register(OpKind.ATTENTION, "scaled_dot_product_attention _scaled_dot_product_flash_attention "
          "_scaled_dot_product_efficient_attention _scaled_dot_product_flash_attention_for_cpu "
          "_scaled_dot_product_cudnn_attention _scaled_dot_product_attention_math flex_attention")
_register(OpKind.NORM, "layer_norm native_layer_norm rms_norm _fused_rms_norm group_norm native_group_norm "
          "batch_norm native_batch_norm _native_batch_norm_legit instance_norm")
_register(OpKind.SOFTMAX, "softmax _softmax log_softmax _log_softmax _safe_softmax")
_register(OpKind.EMBEDDING, "embedding embedding_bag")
_register(OpKind.LOSS, "cross_entropy_loss nll_loss nll_loss_forward nll_loss2d nll_loss2d_forward mse_loss "
          "binary_cross_entropy_with_logits binary_cross_entropy smooth_l1_loss l1_loss")
_register(OpKind.REDUCTION, "sum mean amax amin max min argmax argmin var std var_mean std_mean prod norm "
          "linalg_vector_norm logsumexp all any")
_register(OpKind.VIEW, "view _unsafe_view reshape _reshape_alias transpose t permute expand expand_as unsqueeze "
          "squeeze slice select alias as_strided unflatten flatten split split_with_sizes chunk narrow unbind "
          "view_as detach movedim diagonal lift_fresh unfold swapaxes numpy_T mT")
_register(OpKind.COPY, "cat stack contiguous clone index index_select gather scatter scatter_add index_add "
          "index_put repeat repeat_interleave pad constant_pad_nd copy copy_ roll flip masked_select take "
          "masked_scatter")
_register(OpKind.ELEMENTWISE, "add sub mul div neg pow rsqrt sqrt exp log log1p tanh sigmoid silu gelu relu "
          "dropout native_dropout where masked_fill to _to_copy clamp clamp_min clamp_max abs eq ne lt gt le ge "
          "logical_and logical_or logical_not bitwise_and bitwise_or bitwise_not __and__ __or__ __invert__ sin "
          "cos reciprocal erf tril triu maximum minimum fill zeros_like ones_like full_like type_as mish "
          "softplus lerp addcmul addcdiv rsub floor_divide remainder round floor ceil sign hardtanh leaky_relu "
          "elu celu selu gelu_ hardswish hardsigmoid glu _assert_tensor_metadata relu6 square exp2 "
          "bernoulli rand_like randn_like quick_gelu fmod trunc isinf isnan nan_to_num")

def base_name(target: str) -> str:
    """`aten.add_.Tensor` -> `add` (in-place variants share the rule of the out-of-place op)."""
    parts = target.split(".")
    name = parts[1] if len(parts) > 1 else parts[0]
    return name[:-1] if name.endswith("_") and not name.startswith("_") and name[:-1] in KIND_BY_NAME else name


def tensor_args(op: RawOp) -> list[Value]:
    out: list[Value] = []
    _collect((op.args, op.kwargs), out)
    return out


def _collect(obj: Any, out: list[Value]) -> None:
    if isinstance(obj, Value):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _collect(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _collect(o, out)


def kind_of(op: RawOp) -> OpKind:
    name = base_name(op.target)
    kind = KIND_BY_NAME.get(name)
    if kind is not None:
        if name in ("to", "_to_copy", "type_as", "contiguous") and is_alias(op) and moves_no_bytes(op):
            return OpKind.VIEW
        if kind is OpKind.VIEW and not moves_no_bytes(op):
            return OpKind.COPY
        return kind
    return OpKind.OTHER


def is_alias(op: RawOp) -> bool:
    """A view, or a cast/contiguous that returns its input's values unchanged (same shape and dtype).
    Saved tensors are deduplicated through aliases (graph.py)."""
    name = base_name(op.target)
    if KIND_BY_NAME.get(name) is OpKind.VIEW or name == "contiguous":
        return True
    if name in ("to", "_to_copy", "type_as"):
        ins = tensor_args(op)
        return bool(ins and op.outputs) and ins[0].dtype == op.outputs[0].dtype and ins[0].shape == op.outputs[0].shape
    return False


def moves_no_bytes(op: RawOp) -> bool:
    """An alias that also copies nothing: `contiguous` or `reshape` of a non-contiguous tensor (as after a
    transpose) copies it, unless the reshape only adds or drops unit dims."""
    if not is_alias(op):
        return False
    name = base_name(op.target)
    ins = tensor_args(op)
    if name in ("reshape", "flatten", "contiguous") and ins and op.outputs and not ins[0].contiguous:
        return name == "reshape" and _only_adds_unit_dims(ins[0].shape, op.outputs[0].shape)
    return True


def _only_adds_unit_dims(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    return [s for s in src if s != 1] == [d for d in dst if d != 1]


def arg(op: RawOp, index: int, name: str, default: Any = None) -> Any:
    if len(op.args) > index:
        return op.args[index]
    return op.kwargs.get(name, default)


# ---- FLOPs -------------------------------------------------------------------------------------------


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def contraction_operands(op: RawOp) -> tuple[Value, Value] | None:
    """The two contracted operands (a, b) of a matmul-like op, or None."""
    name = base_name(op.target)
    if name in ("mm", "bmm", "matmul", "_grouped_mm"):
        return op.args[0], op.args[1]
    if name in ("addmm", "baddbmm", "addbmm"):
        return op.args[1], op.args[2]
    if name in ("linear", "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                "conv_transpose2d"):
        return op.args[0], op.args[1]
    if name == "einsum":
        operands = op.args[1]
        return (operands[0], operands[1]) if len(operands) == 2 else None
    return None


def fwd_flops(op: RawOp) -> int:
    from torch.utils import flop_counter as fc

    name = base_name(op.target)
    kind = KIND_BY_NAME.get(name)
    if kind not in (OpKind.MATMUL, OpKind.ATTENTION) or not op.outputs:
        return 0
    out = op.outputs[0].shape
    if name == "linear":
        return 2 * _prod(out) * op.args[0].shape[-1]
    if name == "matmul":
        a = op.args[0].shape
        return 2 * _prod(out) * a[-1]
    if name == "einsum":
        return _einsum_flops(op.args[0], [v.shape for v in op.args[1]])
    if name in ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d"):
        return fc.conv_flop_count(op.args[0].shape, op.args[1].shape, out, transposed="transpose" in name)
    if kind is OpKind.ATTENTION:
        q, k, v = (t.shape for t in op.args[:3])
        return fc.sdpa_flop_count(q, k, v)
    packet = _packet(op.target)
    formula = fc.flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0
    shape_args, shape_kwargs = _shapes((op.args, op.kwargs))
    return int(formula.__wrapped__(*shape_args, out_shape=out, **shape_kwargs))


def bwd_flops(op: RawOp, needs_grad: dict[int, bool]) -> int:
    from torch.utils import flop_counter as fc

    kind = KIND_BY_NAME.get(base_name(op.target))
    if kind is OpKind.ATTENTION:
        q, k, v = op.args[:3]
        if not any(needs_grad.get(t.vid, False) for t in (q, k, v)):
            return 0
        return int(fc.sdpa_backward_flop_count(op.outputs[0].shape, q.shape, k.shape, v.shape))
    operands = contraction_operands(op)
    if kind is not OpKind.MATMUL or operands is None:
        return 0
    fwd = fwd_flops(op)
    return sum(fwd for t in operands if isinstance(t, Value) and needs_grad.get(t.vid, False))


def _einsum_flops(equation: str, shapes: list[tuple[int, ...]]) -> int:
    lhs = equation.replace(" ", "").split("->")[0]
    sizes: dict[str, int] = {}
    for term, shape in zip(lhs.split(","), shapes):
        for letter, size in zip(term.replace("...", ""), shape[-len(term.replace("...", "")):] if term else ()):
            sizes[letter] = size
    batch = _prod(shapes[0][: len(shapes[0]) - len(lhs.split(",")[0].replace("...", ""))]) if "..." in lhs else 1
    return 2 * batch * _prod(sizes.values())


def _packet(target: str) -> Any:
    import torch

    parts = target.split(".")
    if len(parts) < 2 or parts[0] != "aten":
        return None
    return getattr(torch.ops.aten, parts[1], None)


def _shapes(obj: Any) -> Any:
    if isinstance(obj, Value):
        return obj.shape
    if isinstance(obj, (list, tuple)):
        return type(obj)(_shapes(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _shapes(v) for k, v in obj.items()}
    return obj


# ---- saved tensors -------------------------------------------------------------------------------------

SAVES_INPUT = {"silu", "gelu", "pow", "log", "log1p", "sin", "cos", "erf", "mish", "softplus", "leaky_relu",
               "hardswish", "hardsigmoid", "elu", "celu", "selu", "quick_gelu", "glu", "square", "abs",
               "hardtanh", "clamp", "clamp_min", "clamp_max", "maximum", "minimum", "reciprocal"}
SAVES_OUTPUT = {"relu", "relu6", "tanh", "sigmoid", "exp", "exp2", "rsqrt", "sqrt", "softmax", "_softmax",
                "log_softmax", "_log_softmax", "_safe_softmax"}
SAVES_INDICES = {"embedding", "index", "index_select", "gather", "embedding_bag", "take"}


def saved_tensors(op: RawOp, needs_grad: dict[int, bool]) -> list[tuple[Value | None, tuple[int, ...], str]]:
    """What `op` saves for backward: (value or None for a new tensor, shape, dtype) triples."""
    ins = tensor_args(op)
    if not any(needs_grad.get(t.vid, False) for t in ins):
        return []
    g = lambda t: isinstance(t, Value) and needs_grad.get(t.vid, False)  # noqa: E731
    name = base_name(op.target)
    kind = KIND_BY_NAME.get(name)
    out = op.outputs[0] if op.outputs else None
    saved: list[Any] = []
    if kind is OpKind.MATMUL:
        operands = contraction_operands(op)
        if operands:
            a, b = operands
            saved += [b] if g(a) else []
            saved += [a] if g(b) else []
    elif kind is OpKind.ATTENTION:
        q, k, v = op.args[:3]
        mask = arg(op, 3, "attn_mask")
        saved += [q, k, v, out, (None, q.shape[:-1], "float32")]
        saved += [mask] if isinstance(mask, Value) else []
    elif name in ("mul", "div"):
        a, b = op.args[0], op.args[1]
        if name == "mul":
            saved += [b] if g(a) else []
            saved += [a] if g(b) else []
        else:
            saved += [b] if isinstance(b, Value) else []
            saved += [a] if g(b) else []
    elif name in SAVES_INPUT:
        saved.append(op.args[0])
    elif name in SAVES_OUTPUT:
        saved.append(out)
    elif name in ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm", "native_group_norm"):
        x = op.args[0]
        stats_shape = _norm_stats_shape(op)
        saved += [x, (None, stats_shape, "float32")]
        saved += [(None, stats_shape, "float32")] if "layer" in name or "group" in name else []
    elif name in ("dropout", "native_dropout") and out is not None and _dropout_active(op):
        saved.append((None, out.shape, "bool"))
    elif name in ("cross_entropy_loss", "nll_loss", "nll_loss_forward"):
        logits, target = op.args[0], op.args[1]
        saved += [(None, logits.shape, logits.dtype)] if name == "cross_entropy_loss" else [logits]
        saved.append(target)
    elif name in SAVES_INDICES:
        saved += [t for t in ins if t.dtype in ("int64", "int32")]
    elif name in ("where", "masked_fill"):
        saved += [t for t in ins if t.dtype == "bool"]
    result = []
    for s in saved:
        if isinstance(s, Value):
            result.append((s, s.shape, s.dtype))
        elif isinstance(s, tuple):
            result.append(s)
    return result


def _norm_stats_shape(op: RawOp) -> tuple[int, ...]:
    x = op.args[0].shape
    name = base_name(op.target)
    if "group" in name:
        groups = arg(op, 1, "num_groups", 1) if name == "group_norm" else op.args[6]
        return (x[0], int(groups))
    normalized = arg(op, 1, "normalized_shape", None)
    n = len(normalized) if isinstance(normalized, (list, tuple)) else 1
    return tuple(x[:-n]) + (1,) * n


def _dropout_active(op: RawOp) -> bool:
    p = arg(op, 1, "p", 0.5)
    train = arg(op, 2, "train", True)
    return bool(train) and isinstance(p, (int, float)) and p > 0


def bytes_moved(op: RawOp, weight_bytes: dict[int, int]) -> int:
    """Forward bytes read + written; 0 for views/aliases. Parameter-derived inputs cost at most their params."""
    if moves_no_bytes(op):
        return 0
    if KIND_BY_NAME.get(base_name(op.target)) is OpKind.EMBEDDING:  # reads only the looked-up rows
        return sum(_nbytes(t) for t in tensor_args(op) if t.dtype in ("int64", "int32")) + 2 * sum(
            _nbytes(o) for o in op.outputs)
    seen: set[int] = set()
    total = 0
    for t in tensor_args(op):
        if t.vid in seen:
            continue
        seen.add(t.vid)
        nbytes = _nbytes(t)
        total += min(nbytes, weight_bytes.get(t.vid, nbytes))
    for o in op.outputs:
        if o.vid not in weight_bytes:
            total += _nbytes(o)
    return total


def _nbytes(t: Value) -> int:
    from tracer.ir import DTYPE_BYTES

    return _prod(t.shape) * DTYPE_BYTES.get(t.dtype, 4)
