"""Activation memory: the tensors saved for backward by one micro-batch, under a recompute policy.

Inputs are the traced graph's ops with their `saved` tensors (each saved tensor is expected once in the
graph, attributed to the op that saves it). Sizes are at local shapes: every saved tensor is scaled by
`opcost.local_scale` (micro_batch / batch_traced on its sample dimension, 1/d per split role it
carries). Under fp16/bf16/fp8 (`precision`; None keeps the traced dtypes) a graph traced in fp32 has its
floating-point tensors counted at 2 bytes per element; a graph traced at a 16-bit regime
(`traced_in_low_precision`: 16-bit parameters, or fp32 parameters under the autocast emulation, see
tracer/autocast.py) already carries the real dtypes, fp32 upcasts (RMSNorm statistics, fp32 logits for
the loss, and under autocast the fp32 residual stream, norms and GELU) included, and is counted as
traced.

Attention implementation (`attention_saved`), for ops of kind ATTENTION (the fused SDPA core):
- sdpa: what the traced SDPA op saves (q, k, v, out, the fp32 logsumexp [b, h, s_q], a mask if any),
  less whatever an earlier op already saved (the tracer counts each tensor once).
- eager: the unfused math keeps the same tensors but no logsumexp, plus the softmax probabilities
  [b, h, s_q, s_k] (one s x s matrix per head); with attention dropout (`attrs["dropout"] > 0`) also
  the 1-byte dropout mask and the dropped probabilities the second matmul saves.
- sdpa-fp32 (`SDPA_FP32`, what `sdpa_attention` makes of sdpa on a GPU at 4-byte precision, fp32 or tf32):
  eager's saves, one fp32 [b, h, s_q, s_k] matrix per core. With fp32 queries torch has neither FlashAttention
  nor cuDNN; HF's Llama passes a boolean mask (and K/V repeated to the query heads) in this regime, and either
  the math path (its softmax probabilities) or the memory-efficient kernel (its bias expanded to every head)
  keeps such a matrix for backward. On a lent H200 (2026-11-28, benchmarks/techniques_h200.py) a tf32 Llama 3.2 1B
  step (4 x 2,048 tokens a micro-batch, 32 heads) allocated 85.0 GiB where the sdpa rule counted 51.4: 32 GiB,
  one fp32 [4, 32, 2,048, 2,048] matrix for each of its 16 layers. Which of the two kernels ran was not traced;
  no fp32 run of a model without the mask was measured. The CPU's SDPA (flash for fp32) keeps none.

Recompute policies (`block_saved`), applied to ops inside repeated blocks (ops outside blocks, the
embeddings, final norm, LM head and loss, are never checkpointed):
- none: every op keeps its saved tensors.
- selective: op-level selective checkpointing as the executor runs it (torchtitan's "op" policy,
  `selective_cached`): each block instance keeps its input and the outputs of every other weight matmul
  (the 1st, 3rd, ... in the block: q and v, gate and down for a Llama layer) and of every SDPA core (its
  output and fp32 logsumexp); backward recomputes everything else (norms, element-wise ops, the other
  matmuls, an eager attention core) from those, one block at a time, so the rest of one block's none
  set is live again during its backward. Measured on CPU against the executor's policy
  (tests/test_selective_checkpointing.py): equal, byte for byte, on Llama, GPT-2, BERT, Mixtral and
  Qwen2-MoE layers (MoE experts as transformers runs them by default, one grouped_mm per projection).
- full: each block instance keeps only its input (the first input of its first op that has a sample
  dimension); backward recomputes one block at a time, so one block's "none" set, less the input it
  already holds, is live at once.

torch.compile (`compiled=True`; the executor compiles each block, so it applies to block ops only):
Inductor's min-cut partitioner (`torch._functorch.partitioners.min_cut_rematerialization_partition`)
saves what the ops it cannot fuse need (matmul inputs, the attention core's q, k, v, out and logsumexp)
and recomputes in backward what cheap pointwise and reduction ops compute from those, instead of saving
the tensors eager autograd gives each of them (norm statistics and their fp32 upcasts, activation
inputs and outputs, casts, residual sums). `compiled_keep` writes that down per op:
- an unfusible op (matmul, attention, embedding, loss, other) keeps what it saves eagerly;
- a fusible op (`FUSIBLE_KINDS`: elementwise, norm, softmax, reduction, copy, view) keeps only the
  saved tensors that are an earlier unfusible op's output (each output once, matched by shape, dtype
  and roles in op order): those cannot be recomputed by fused pointwise code;
- the block holds its input (`block_input`), where recomputation starts.
The compiled none set is capped at the eager one (eager's saved set is itself a cut the partitioner
could take). Under selective and full the policy fixes what is kept, as eagerly, but the recompute
window is the compiled none set less it (the fused backward materializes only what the partitioner
saves). So compiled <= eager for every term.
Measured (tests/test_compile_memory.py, one HF Llama decoder layer, hidden h = 256, ffn f = 704,
kv width k = 64, bf16, 256 tokens, each storage once, parameters and rotary tables left out): eager
autograd saves 11,048 bytes per token, the partitioner 7,592 (x 0.69): 2 x (6h + 2k + 3f) = 7,552 plus
the fp32 logsumexp (32) and two norms' fp32 statistics (8). It keeps the block input, the qkv input,
q, k, v, the attention output, the o_proj output (to recompute the residual sum and the second norm),
the MLP input, gate, up and their product. Eager keeps 2 x (10h + 2k + 4f) + 40 = 11,048: in place of
the block input and the o_proj output, the fp32 copies of both norm inputs (4h bytes each) and their
bf16 normalized outputs, and also the SiLU output. `compiled_keep` on soap's trace of the same layer
gives 7,584 bytes per token (-0.1%: the norm statistics); its eager none set is eager's 11,048 exactly.
Compiled selective checkpointing also drops a cached output no backward reads: the block's last
projection when it is cached and only the residual sum reads it (`compiled_selective_dropped`; 2h bytes
per token on a Llama layer, measured the same test), which selective's compiled kept set leaves out.

Loss (`loss_tensors`): what the loss op saves and the transient tensors around it, by the cross-entropy
the run computes (`TrainingConfig.cross_entropy`). Per [tokens, vocab] logits (the largest activations of a
language model's step), with L the loss's floating-point inputs as traced (fp32: a 16-bit trace records the
upcast) and H the logits as the head produced them (16-bit in a 16-bit run, else L):
- chunked (the executor's `executor.cross_entropy`): the gradient buffer it saves (H) beside the logits,
  which are live while it fills it (H, held on by a pipeline stage anyway), and its n token slices one at a
  time in fp32 (L / n, n = `costmodel.opcost.cross_entropy_slices` of L's local fp32 bytes: one per 512 MiB,
  1 to 8), twice where 16-bit logits are upcast to a copy that the out-of-place log-softmax reads: 2H + 2L/n,
  2H + L/n with fp32 logits or vocabulary-parallel ones (in place). Measured on CPU with live storages tracked
  (`tests/test_memory.py`): at 8 slices 1.25 x the fp32 logits with a bf16 head, 2.13 x in fp32, pipelined or
  not (priced 1.25 and 2.125); on an H100 the 16k-token step of four Llama-3-8B layers peaked in the loss at
  38.97 GiB, 0.98 GiB (one fp32 slice) over the in-place path's 37.99 (docs/benchmarks.md).
- upcast (`F.cross_entropy(logits.float())`, Hugging Face's and torchtitan's loss): the log-probabilities
  it saves (L), and its backward's gradients of the log-probabilities and then of the fp32 logits while
  they are live (2L); a pipeline holds the logits too (H). Measured the same way: 3.0 x the fp32 logits
  with the logits freed, in fp32 and with a bf16 head alike; held, 4.0 x in fp32 and 3.5 x with a bf16
  head.
- megatron (Megatron-LM's and nanotron's vocab-parallel cross-entropy, another stack's loss, priced not
  executed; read in nanotron 0.4's `_ShardedCrossEntropy` and `LlamaForTraining`): the head's logits cast
  to fp32 (L; the 16-bit ones freed), a max-shifted copy made out of place (L), turned into the softmax in
  place and saved; backward makes the gradient in place in it and casts it to the head's width (H): the
  peak is max(2L, L + H) = 2L, pipelined or not (the last stage's output is the loss, not the logits).
A pipeline holds the whole epilogue per micro-batch in flight, which over-counts the transients there
(they exist for one micro-batch at a time). Under tensor parallelism the head's logits and the loss are
vocab-parallel (`executor.tensor_parallel`): these tensors, whose vocabulary dimension has the parameter
role, hold the rank's vocabulary shard, so a `split` of {"parameter": tp} divides them by tp as it should.

Peak (`activation_bytes`; its terms from `activation_parts`): with none, the end of the forward pass,
when everything is live: prologue + sum over blocks (instances x kept) + epilogue. With recomputation,
the same at the end of forward, or later, once the epilogue's backward has freed its tensors and one
block is recomputed: prologue + kept + max(epilogue, largest block's none set - what it kept).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from costmodel.opcost import (
    CROSS_ENTROPY_MAX_SLICES, FLOAT_DTYPES, LOW_PRECISION_DTYPES, activation_itemsize, cross_entropy_slices,
    local_scale, loss_fp32_bytes, loss_slices,
)
from tracer.errors import SoapError
from tracer.ir import DTYPE_BYTES, DimRole, OpKind, OpNode, TensorMeta, split_roles

RECOMPUTE_POLICIES = ("none", "selective", "full")
ATTENTION_IMPLS = ("sdpa", "eager")
SDPA_FP32 = "sdpa-fp32"
"""sdpa as torch runs it on a GPU at 4-byte precision (module docstring): eager's saves."""
SELECTIVE_MATMUL_PERIOD = 2
"""Selective checkpointing caches one weight matmul output in this many (`selective_cached`)."""
FUSIBLE_KINDS = frozenset({OpKind.ELEMENTWISE, OpKind.NORM, OpKind.SOFTMAX, OpKind.REDUCTION, OpKind.COPY, OpKind.VIEW})
"""Op kinds Inductor fuses into pointwise and reduction kernels, recomputed rather than saved when compiled."""
LOSS_GRADIENTS = 2
"""The upcast loss's gradients of the log-probabilities and of the logits, live with what it saves."""


def _is_logsumexp(t: TensorMeta, q: TensorMeta) -> bool:
    return t.dtype == "float32" and t.shape == q.shape[:-1]


def _whole_sequence(t: TensorMeta) -> TensorMeta:
    """`t` as a context-parallel rank holds it after an all-gather over the sequence (cp no longer divides it)."""
    return TensorMeta(t.shape, t.dtype, tuple(DimRole.NONE if r is DimRole.ATTRIBUTE else r for r in t.roles))


def context_parallel_saved(op: OpNode, saved: Sequence[TensorMeta]) -> tuple[TensorMeta, ...]:
    """What an attention core saves under context parallelism as `executor.context_parallel` runs it: the
    K and V it all-gathers over the sequence, whole (in place of any local K or V the trace attributed to
    it: every saved tensor of K's size but the query), and no mask: the traced s x s mask is dropped, the causal
    mask being the lower-right kernels' own (two calls, each saving its chunk's query, output and logsumexp, which
    together are the rank's; until 2026-11-27 the executor built and kept an [S/cp, S] boolean mask)."""
    q, k = op.inputs[:2]
    v = op.inputs[2] if len(op.inputs) > 2 else k
    seq_k = k.shape[-2]
    out: list[TensorMeta] = []
    query_seen = q.numel != k.numel
    for t in saved:
        if len(t.shape) >= 2 and t.shape[-1] == t.shape[-2] == seq_k:
            continue  # the traced mask
        if t.numel == k.numel and query_seen:
            continue  # a local K or V
        query_seen = query_seen or t.numel == q.numel
        out.append(t)
    out.extend((_whole_sequence(k), _whole_sequence(v)))
    return tuple(out)


def _core_saved(op: OpNode, cp: int) -> tuple[TensorMeta, ...]:
    """What the attention core saves as traced, or under context parallelism `cp` as the executor runs it."""
    return op.saved if cp == 1 else context_parallel_saved(op, op.saved)


def sdpa_attention(attention: str, precision: str | None, device_kind: str) -> str:
    """The implementation whose saves a run's attention cores keep: `SDPA_FP32` for sdpa on a GPU (`device_kind`,
    `DeviceProfile.kind`) at a 4-byte precision (fp32, tf32: no autocast), else `attention`."""
    if attention == "sdpa" and device_kind == "gpu" and precision is not None and activation_itemsize(precision) == 4:
        return SDPA_FP32
    return attention


def core_impl(attention: str) -> str:
    """sdpa or eager: the saves of an attention core under `attention`."""
    return "eager" if attention == SDPA_FP32 else attention


def attention_saved(op: OpNode, attention: str, cp: int = 1) -> tuple[TensorMeta, ...]:
    """What an ATTENTION op saves under `attention` and context parallelism `cp` (see the module docstring)."""
    q, k = op.inputs[:2]
    saved = _core_saved(op, cp)
    attention = core_impl(attention)
    if attention == "sdpa":
        return saved
    probs = TensorMeta((*q.shape[:-1], k.shape[-2]), q.dtype, (*q.roles[:-1], DimRole.NONE if cp > 1 else k.roles[-2]))
    kept = tuple(t for t in saved if not _is_logsumexp(t, q))
    if float(op.attrs.get("dropout", 0.0)) > 0:
        return (*kept, probs, TensorMeta(probs.shape, "bool", probs.roles), probs)
    return (*kept, probs)


def op_saved(op: OpNode, attention: str, cp: int = 1) -> tuple[TensorMeta, ...]:
    if op.kind is OpKind.ATTENTION and len(op.inputs) >= 2:
        return attention_saved(op, attention, cp)
    return op.saved


def block_input(ops: Sequence[OpNode]) -> TensorMeta | None:
    """The tensor entering a block: the first input with a sample dimension of its first such op."""
    for op in ops:
        for t in op.inputs:
            if DimRole.SAMPLE in split_roles(t.roles):
                return t
    return None


def compiled_keep(ops: Sequence[OpNode], saved: Sequence[Sequence[TensorMeta]]) -> tuple[tuple[TensorMeta, ...], ...]:
    """What each op of one compiled block instance keeps, given what it saves eagerly (`saved`, in op
    order): the partitioner's set (see the module docstring)."""
    unclaimed: list[TensorMeta] = []  # outputs of unfusible ops that no fusible op has kept yet
    first = block_input(ops)
    out: list[tuple[TensorMeta, ...]] = []
    for op, eager in zip(ops, saved, strict=True):
        if op.kind in FUSIBLE_KINDS:
            keep = []
            for t in eager:
                if t in unclaimed:
                    unclaimed.remove(t)
                    keep.append(t)
        else:
            keep = list(eager)
            unclaimed.extend(op.outputs)
        if first is not None and first in op.inputs:
            if first not in keep:
                keep.insert(0, first)
            first = None
        out.append(tuple(keep))
    return tuple(out)


def block_saved(ops: Sequence[OpNode], policy: str, attention: str, cp: int = 1, compiled: bool = False
                ) -> tuple[TensorMeta, ...]:
    """Tensors one block instance keeps through the forward pass under `policy` (and context parallelism `cp`;
    `compiled`: under torch.compile, whose none set is `compiled_keep`'s, not capped here)."""
    if policy == "none":
        if compiled:
            return tuple(t for kept in compiled_keep(ops, [op_saved(op, attention, cp) for op in ops]) for t in kept)
        return tuple(t for op in ops for t in op_saved(op, attention, cp))
    first = block_input(ops)
    if policy == "selective":
        kept = [] if first is None else [first]
        for op, cached in zip(ops, selective_cached(ops, attention), strict=True):
            if cached and op.kind is OpKind.ATTENTION:
                q = op.inputs[0]
                kept.extend((*op.outputs, *(t for t in _core_saved(op, cp) if _is_logsumexp(t, q))))
            elif cached:
                kept.extend(op.outputs)
        return tuple(kept)
    return () if first is None else (first,)


def compiled_selective_dropped(ops: Sequence[OpNode], attention: str) -> tuple[TensorMeta, ...]:
    """The cached outputs of one block instance that torch.compile's partitioner does not keep under
    selective checkpointing: a cached weight matmul output whose only reader is the block's last op, an
    element-wise op that saves nothing (the residual sum after a Llama layer's down projection: its
    backward reads neither input, and nothing in backward recomputes it). Measured in
    tests/test_compile_memory.py: exactly this tensor, 2h bytes per token at 16 bits."""
    if not ops or ops[-1].kind is not OpKind.ELEMENTWISE or ops[-1].saved:
        return ()
    last = ops[-1]
    dropped = []
    for i, (op, cached) in enumerate(zip(ops[:-1], selective_cached(ops, attention)[:-1])):
        if not (cached and op.kind is OpKind.MATMUL and op.params):
            continue
        dropped.extend(t for t in op.outputs
                       if t in last.inputs and not any(t in later.inputs for later in ops[i + 1:-1]))
    return tuple(dropped)


def selective_cached(ops: Sequence[OpNode], attention: str) -> tuple[bool, ...]:
    """Per op of one block instance (in order), whether selective checkpointing caches its outputs: the
    rule `executor.api.apply_recompute` runs (torchtitan's "op" policy): every other weight matmul,
    counting from the first, and every SDPA attention core (its output and log-sum-exp); every other op,
    the eager attention's matmuls and softmax included, is recomputed in backward from the block input
    and the cached outputs. The memory models keep these outputs; the simulator and the estimator price
    the forward of every op not cached as the recompute."""
    cached, matmuls = [], 0
    for op in ops:
        if op.kind is OpKind.MATMUL and op.params:
            matmuls += 1
            cached.append(matmuls % SELECTIVE_MATMUL_PERIOD == 1)
        else:
            cached.append(op.kind is OpKind.ATTENTION and len(op.inputs) >= 2 and core_impl(attention) == "sdpa")
    return tuple(cached)


def loss_tensors(op: OpNode, *, low_precision: bool = False, pipelined: bool = False,
                 cross_entropy: str = "chunked", slices: int = CROSS_ENTROPY_MAX_SLICES,
                 vocab_parallel: bool = False) -> tuple[TensorMeta, ...]:
    """What a loss op saves plus the transient tensors around it, under `cross_entropy` (see the module
    docstring): L, its floating-point inputs as traced; H, the same at 16 bits in a `low_precision` run (the
    head's output, before the loss upcasts a copy); `pipelined`, a run whose stages hold their logits;
    `slices`, the chunked loss's (`costmodel.opcost.loss_slices`); `vocab_parallel`, logits sharded on the
    vocabulary (the chunked loss's in-place path: one fp32 slice where 16-bit logits take two)."""
    if op.kind is not OpKind.LOSS:
        raise ValueError(f"{op.name} is not a loss op")
    inputs = tuple(t for t in op.inputs if t.dtype in FLOAT_DTYPES)
    held = tuple(replace(t, dtype="bfloat16") if low_precision and t.dtype not in LOW_PRECISION_DTYPES else t
                 for t in inputs)
    if cross_entropy == "chunked":
        one = tuple(replace(t, shape=(*t.shape[:-1], -(-t.shape[-1] // slices))) for t in inputs)
        upcast = any(h.dtype != t.dtype for h, t in zip(held, inputs)) and not vocab_parallel
        return held * 2 + one * (2 if upcast else 1)
    if cross_entropy == "megatron":
        return inputs * 2
    if cross_entropy == "upcast":
        return op.saved + inputs * LOSS_GRADIENTS + (held if pipelined else ())
    raise SoapError(f"unknown cross-entropy {cross_entropy!r}; choose one of chunked, upcast, megatron")


def loss_transient(fp32_bytes: float, slices: int, cross_entropy: str = "chunked") -> float:
    """The loss's largest fp32 transient, made and freed before the step's peak, whose segment the caching
    allocator keeps reserved (`costmodel.allocator`, (1)), from `fp32_bytes`, the rank's logits in fp32: all of
    them under the upcast loss (its copy and gradients of that size) and Megatron's (its fp32 copy), one of the
    chunked loss's `slices` (`costmodel.opcost.loss_slices`). Measured on 19 lent-GPU runs
    (`benchmarks/allocator_reserve.py`): reserved - allocated = 0.8-1.15 x this for the Llama shapes, eager or
    compiled."""
    return fp32_bytes / slices if cross_entropy == "chunked" else float(fp32_bytes)


def traced_in_low_precision(ops: Sequence[OpNode]) -> bool:
    """Whether the graph was traced at a 16-bit regime (16-bit parameters, or fp32 parameters under
    autocast: `attrs["traced_dtype"]`): its tensors then carry the run's real dtypes (fp32 upcasts
    included) and are not rescaled."""
    return any(op.attrs.get("traced_dtype") or any(p.dtype in LOW_PRECISION_DTYPES for p in op.params) for op in ops)


class _Sizer:
    """Local bytes of saved tensors for one micro-batch."""

    def __init__(
        self, *, micro_batch: int, batch_traced: int, split: Mapping[str, int] | None, precision: str | None,
        traced_low_precision: bool = False,
    ):
        if micro_batch < 1 or batch_traced < 1:
            raise SoapError(f"micro_batch ({micro_batch}) and batch_traced ({batch_traced}) must be positive")
        self.sample_scale = micro_batch / batch_traced
        self.split = dict(split or {})
        self.width = None if precision is None or traced_low_precision else activation_itemsize(precision)

    def __call__(self, tensors: Iterable[TensorMeta]) -> float:
        total = 0.0
        for t in tensors:
            size = self.width if self.width is not None and t.dtype in FLOAT_DTYPES else DTYPE_BYTES.get(t.dtype, 4)
            total += t.numel * size * local_scale(t, sample_scale=self.sample_scale, split=self.split)
        return total


@dataclass(frozen=True)
class ActivationParts:
    """The terms of the activation peak for one micro-batch (bytes at local shapes)."""

    prologue: float
    """Saved by non-block ops before the first block (embeddings, masks, rotary tables)."""
    blocks: float
    """Kept through the forward pass by all block instances under their policies."""
    epilogue: float
    """Saved by non-block ops after the blocks (final norm, head, loss), plus the loss working set."""
    recompute_window: float
    """Live while one recomputed block runs its backward: its none set less what it kept."""

    @property
    def peak(self) -> int:
        if self.recompute_window:
            return int(self.prologue + self.blocks + max(self.epilogue, self.recompute_window))
        return int(self.prologue + self.blocks + self.epilogue)


def activation_parts(
    ops: Iterable[OpNode],
    *,
    micro_batch: int,
    batch_traced: int,
    recompute: str,
    attention: str,
    split: Mapping[str, int] | None = None,
    precision: str | None = None,
    block_counts: Mapping[str, int] | None = None,
    recompute_per_block: Mapping[str, str] | None = None,
    compiled: bool = False,
    pipelined: bool = False,
    cross_entropy: str = "chunked",
) -> ActivationParts:
    """The terms of `activation_bytes` (same arguments), for callers that schedule them themselves
    (a pipeline keeps `blocks` per in-flight micro-batch but needs one `recompute_window`). `pipelined`:
    the run has pipeline stages, whose schedule holds the logits through backward, and `cross_entropy` the
    loss it computes (`loss_tensors`)."""
    if recompute not in RECOMPUTE_POLICIES:
        raise SoapError(f"unknown recompute policy {recompute!r}; choose one of {', '.join(RECOMPUTE_POLICIES)}")
    if attention not in (*ATTENTION_IMPLS, SDPA_FP32):
        raise SoapError(f"unknown attention implementation {attention!r}; choose one of {', '.join(ATTENTION_IMPLS)}")
    ops = tuple(ops)
    traced_low = traced_in_low_precision(ops)
    size = _Sizer(micro_batch=micro_batch, batch_traced=batch_traced, split=split, precision=precision,
                  traced_low_precision=traced_low)
    low = traced_low or (precision is not None and activation_itemsize(precision) == 2)
    counts = dict(block_counts or {})
    cp = int(dict(split or {}).get("attribute", 1))
    policies = dict(recompute_per_block or {})
    prologue = epilogue = kept = window = 0.0
    blocks: dict[str, list[OpNode]] = {}
    seen_block = False
    for op in ops:
        if op.block_id is None:
            if op.kind is OpKind.LOSS:
                slices = loss_slices(op, micro_batch=micro_batch, batch_traced=batch_traced, split=split)
                saved = size(loss_tensors(op, low_precision=low, pipelined=pipelined, cross_entropy=cross_entropy,
                                          slices=slices,
                                          vocab_parallel=int(dict(split or {}).get("parameter", 1)) > 1))
            else:
                saved = size(op_saved(op, attention, cp))
            if seen_block:
                epilogue += saved
            else:
                prologue += saved
        else:
            seen_block = True
            blocks.setdefault(op.block_id, []).append(op)
    for block_id, block_ops in blocks.items():
        policy = policies.get(block_id, recompute)
        none = size(block_saved(block_ops, "none", attention, cp))
        if compiled:
            none = min(none, size(block_saved(block_ops, "none", attention, cp, compiled=True)))
        instance = none if policy == "none" else size(block_saved(block_ops, policy, attention, cp))
        if compiled and policy == "selective":
            instance -= size(compiled_selective_dropped(block_ops, attention))
        kept += counts.get(block_id, 1) * instance
        if policy != "none":
            window = max(window, none - instance)
    return ActivationParts(prologue, kept, epilogue, window)


def activation_bytes(
    ops: Iterable[OpNode],
    *,
    micro_batch: int,
    batch_traced: int,
    recompute: str,
    attention: str,
    split: Mapping[str, int] | None = None,
    precision: str | None = None,
    block_counts: Mapping[str, int] | None = None,
    recompute_per_block: Mapping[str, str] | None = None,
    compiled: bool = False,
    pipelined: bool = False,
    cross_entropy: str = "chunked",
) -> int:
    """Peak bytes saved for backward by `ops` for one micro-batch (see the module docstring).

    `block_counts[block_id]` says how many instances of a block the representative ops stand for
    (default 1); `recompute_per_block` overrides `recompute` per block id; `compiled` is torch.compile on
    every block; `pipelined`, a run with pipeline stages, and `cross_entropy` (`loss_tensors`).
    """
    return activation_parts(
        ops, micro_batch=micro_batch, batch_traced=batch_traced, recompute=recompute, attention=attention,
        split=split, precision=precision, block_counts=block_counts, recompute_per_block=recompute_per_block,
        compiled=compiled, pipelined=pipelined, cross_entropy=cross_entropy,
    ).peak


def chunk_activations(
    placed: Iterable[tuple[OpNode, Mapping[str, int]]],
    *,
    policy: str,
    micro_batch: int,
    batch_traced: int,
    attention: str,
    precision: str,
    block_input_bytes: float,
    compiled: bool = False,
    pipelined: bool = False,
    cross_entropy: str = "chunked",
) -> tuple[int, int]:
    """(kept, recompute window) bytes of one chunk (a block instance, or a run of non-block ops) for one
    micro-batch, each op sized at its own local split (`costmodel.placement`): the one rule the
    simulator's chunks and the planner's estimate share (`costmodel.memory_schedule` schedules them).

    - none: kept = everything the ops save; no window.
    - selective: kept = the selective set (`block_saved`); window = the none set less it.
    - full: kept = the block's input, `block_input_bytes` ([micro_batch, seq/cp, hidden] at activation
      width, /tp under sequence parallelism); window = the none set, re-materialized while the block's
      backward runs.
    Under torch.compile (`compiled`, a block instance only) the none set is the partitioner's
    (`compiled_keep` over the whole chunk, since a fused op may keep a matmul output placed at another
    split), capped at the eager one: it is what none keeps and what the windows re-materialize; selective
    keeps its set less `compiled_selective_dropped`. `pipelined`: the run has pipeline stages;
    `cross_entropy`, its loss (`loss_tensors`).
    """
    ops = tuple(placed)

    def by_split(kept: Sequence[tuple[TensorMeta, ...]]) -> Iterable[tuple[tuple, list[tuple[OpNode, tuple]]]]:
        """(split, [(op, what it keeps)]) per split, in op order."""
        groups: dict[tuple, list[tuple[OpNode, tuple]]] = {}
        for (op, split), tensors in zip(ops, kept, strict=True):
            groups.setdefault(tuple(sorted(split.items())), []).append((op, tensors))
        return groups.items()

    def saved(p: str) -> int:
        total = 0.0
        for split, group in by_split([()] * len(ops)):
            parts = activation_parts([op for op, _ in group], micro_batch=micro_batch, batch_traced=batch_traced,
                                     recompute=p, attention=attention, split=dict(split), precision=precision,
                                     pipelined=pipelined, cross_entropy=cross_entropy)
            total += parts.prologue + parts.blocks + parts.epilogue
        return int(total)

    def sized(per_op: Sequence[tuple[TensorMeta, ...]]) -> int:
        """Bytes of the tensors listed per op, each at its op's split."""
        total = 0.0
        for split, group in by_split(per_op):
            size = _Sizer(micro_batch=micro_batch, batch_traced=batch_traced, split=dict(split), precision=precision,
                          traced_low_precision=traced_in_low_precision([op for op, _ in group]))
            total += size(t for _, kept in group for t in kept)
        return int(total)

    def compiled_none() -> int:
        eager = [op_saved(op, attention, int(split.get("attribute", 1))) for op, split in ops]
        return sized(compiled_keep([op for op, _ in ops], eager))

    none = saved("none")
    if compiled and ops and all(op.block_id is not None for op, _ in ops):
        none = min(none, compiled_none())
    if policy == "full":
        return int(block_input_bytes), none
    if policy == "selective":
        kept = saved("selective")
        if compiled and ops and all(op.block_id is not None for op, _ in ops):
            dropped = {id(t) for t in compiled_selective_dropped([op for op, _ in ops], attention)}
            kept -= sized([tuple(t for t in op.outputs if id(t) in dropped) for op, _ in ops])
        return kept, none - kept
    return none, 0


def logits_transient_bytes(tokens: int, vocab: int, cross_entropy: str = "chunked") -> float:
    """`loss_transient` from a run's numbers rather than its graph: [tokens, vocab] logits on one rank (the
    vocabulary's shard where it is sharded), for a runs log's plan (`executor.validation.refit`)."""
    fp32 = tokens * vocab * 4
    return loss_transient(fp32, cross_entropy_slices(fp32, tokens), cross_entropy)


def chunk_loss_transient(placed: Iterable[tuple[OpNode, Mapping[str, int]]], *, micro_batch: int, batch_traced: int,
                         cross_entropy: str = "chunked") -> int:
    """Bytes of `loss_transient` for the loss ops of one chunk (0 without one), each at its local split
    (`costmodel.opcost.loss_fp32_bytes`, `loss_slices`): what the simulator's chunks and the planner's estimate
    reserve beyond a rank's allocated peak on a profile with a fitted allocator reserve."""
    best = 0.0
    for op, split in placed:
        if op.kind is OpKind.LOSS:
            sizes = dict(micro_batch=micro_batch, batch_traced=batch_traced, split=split)
            best = max(best, loss_transient(loss_fp32_bytes(op, **sizes), loss_slices(op, **sizes), cross_entropy))
    return int(best)
