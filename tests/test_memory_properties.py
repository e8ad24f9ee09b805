"""Memory is right under every precision and split: properties over model families x precision x splits.

The bf16 x TP bug (every block weight counted whole on every TP rank, because an autocast cast read
the weight before its matmul) passed 742 tests that never crossed precision with TP. These properties
cross them all: for random tiny models of each family, precisions and (tp, pp, dp/zero, cp, ep,
offload), the simulated per-GPU memory (the number the search compares with the limit)
- never grows when a dimension is sharded further (model state for pp, every term otherwise);
- has its blocks' TP weights divided by tp, whatever the trace's dtype regime;
- has ZeRO stage s shard what it claims (1: optimizer state, 2: + gradients, 3: + weights);
- has context parallelism divide every activation that the executor splits by cp.
"""

from __future__ import annotations

import math
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracer
from costmodel.memory import stage_params
from costmodel.memory_activations import activation_parts, context_parallel_saved
from costmodel.profiles import load_cluster
from costmodel.simulator import simulate
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
from tracer.ir import DimRole, OpKind

SEQ = 64
FAMILIES = ("llama", "gpt2", "mixtral", "bert")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
CLUSTER = load_cluster("dgx-h100")


def _config(family: str):
    from transformers import BertConfig, GPT2Config, LlamaConfig, MixtralConfig

    if family == "llama":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    if family == "gpt2":
        return GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0, eos_token_id=0)
    if family == "mixtral":
        return MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                             max_position_embeddings=128)
    return BertConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, vocab_size=256,
                      max_position_embeddings=128)


@lru_cache(maxsize=None)
def graph(family: str, dtype: str = "float32"):
    return tracer.trace(_config(family), batch=1, seq_len=SEQ, dtype=dtype)


def peak(family: str, dims: ParallelDims, train: TrainingConfig):
    result = simulate(graph(family), Strategy(dims=dims, train=train), CLUSTER)
    return max((m.at_peak for m in result.memory), key=lambda b: b.total)


def _train(precision: str, recompute: str, mb: int, dims: ParallelDims, zero: int, offload: bool, m: int = 1,
           schedule: str = "1F1B") -> TrainingConfig:
    return TrainingConfig(global_batch=dims.dp * mb * m, seq_len=SEQ, micro_batch=mb, num_microbatches=m,
                          precision=precision, recompute=recompute, zero=zero, offload_optimizer=offload,
                          sequence_parallel=False, schedule=schedule)


splits = st.fixed_dictionaries({
    "family": st.sampled_from(FAMILIES), "precision": st.sampled_from(PRECISIONS),
    "recompute": st.sampled_from(("none", "selective", "full")), "mb": st.sampled_from((1, 2)),
    "zero": st.sampled_from((0, 1, 2, 3)), "offload": st.booleans(),
    "dp": st.sampled_from((1, 2)), "tp": st.sampled_from((1, 2)), "cp": st.sampled_from((1, 2)),
})
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _dims(s, **more) -> ParallelDims:
    values = {"dp_shard": s["dp"], "tp": s["tp"], "cp": s["cp"], **more}
    return ParallelDims(**values)


@PROPERTY
@given(s=splits, dimension=st.sampled_from(("tp", "cp", "dp_shard", "ep", "offload")))
def test_sharding_a_dimension_never_increases_per_gpu_memory(s, dimension):
    family = s["family"]
    if dimension == "ep" and family != "mixtral":
        dimension = "dp_shard"
    base = _dims(s)
    if dimension == "offload":
        if s["offload"]:
            return
        more, train_more = base, _train(s["precision"], s["recompute"], s["mb"], base, s["zero"], True)
    else:
        grown = {"tp": base.tp, "cp": base.cp, "dp_shard": base.dp_shard, "ep": base.ep}
        grown[dimension] *= 2
        if dimension == "ep":
            grown["dp_shard"] = max(grown["dp_shard"], 2)  # ep borrows ranks from dp_shard x cp
            base = ParallelDims(dp_shard=grown["dp_shard"], tp=base.tp, cp=base.cp)
        if grown["tp"] > 2:  # 4 heads, 2 KV heads
            return
        more = ParallelDims(**grown)
        train_more = _train(s["precision"], s["recompute"], s["mb"], more, s["zero"], s["offload"])
    train = _train(s["precision"], s["recompute"], s["mb"], base, s["zero"], s["offload"])
    before, after = peak(family, base, train), peak(family, more, train_more)
    assert after.total <= before.total * (1 + 1e-9) + 64, (dimension, before, after)


@PROPERTY
@given(s=splits, pp=st.sampled_from((2, 4)))
def test_a_pipeline_never_increases_the_model_state_a_gpu_holds(s, pp):
    """Without offload: with it, torch's pipeline stage defers FSDP's gradient sync to the schedule's last
    backward, so a stage's unsharded fp32 gradients accumulate on the device (`costmodel.memory`)."""
    if s["offload"]:
        return
    base = _dims(s)
    staged = _dims(s, pp=pp)
    train = _train(s["precision"], s["recompute"], s["mb"], base, s["zero"], s["offload"], m=pp)
    state = lambda b: b.weights + b.grads + b.optimizer  # noqa: E731
    before, after = peak(s["family"], base, train), peak(s["family"], staged, train)
    assert state(after) <= state(before) * (1 + 1e-9) + 64


def _tensor_parallel_linears(model) -> int:
    """Elements of the Linear (GPT-2: Conv1D) modules inside the layer lists that Megatron's TP plan shards,
    read off the real module tree: the column- and row-parallel projections by name."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    from costmodel.placement import COLWISE, ROWWISE

    total = 0
    for name, module in model.named_modules():
        parts = name.split(".")
        in_block = any(p.isdigit() for p in parts)
        parallel = parts[-1] in COLWISE | ROWWISE or (parts[-1] == "dense" and parts[-2] in ("intermediate", "output"))
        if in_block and parallel and isinstance(module, (nn.Linear, Conv1D)):
            total += sum(p.numel() for p in module.parameters(recurse=False))
    return total


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "autocast-bfloat16", "autocast-float16"])
def test_tensor_parallelism_divides_the_blocks_linear_weights_by_tp_in_every_regime(family, dtype):
    """Whatever op reads a weight first (under autocast a cast does), TP=2 halves exactly the blocks'
    column/row-parallel projections, counted on the real module tree, and nothing else."""
    from transformers import AutoModel

    g = graph(family, dtype)
    counts = {b.id: b.count for b in g.blocks}
    whole = stage_params(g.ops, block_counts=counts, vocab_parallel=False)
    split = stage_params(g.ops, block_counts=counts, tensor_parallel=2, vocab_parallel=False)
    linears = _tensor_parallel_linears(AutoModel.from_config(_config(family)))
    assert linears > 0
    assert whole.trainable - split.trainable == linears // 2


@PROPERTY
@given(family=st.sampled_from(FAMILIES), precision=st.sampled_from(PRECISIONS), optimizer=st.sampled_from(("adamw", "sgd", "adamw8bit")),
       n=st.sampled_from((2, 4, 8)))
def test_zero_stages_shard_what_they_claim(family, precision, optimizer, n):
    dims = ParallelDims(dp_shard=n)

    def state(zero):  # two micro-batches per rank: the gradients are live at the peak (grads_held_at_peak)
        train = TrainingConfig(global_batch=2 * n, seq_len=SEQ, precision=precision, optimizer=optimizer, zero=zero,
                               num_microbatches=2)
        return peak(family, dims, train)

    z0, z1, z2, z3 = (state(z) for z in range(4))
    for z in (z1, z2, z3):  # stage 1 and up: the optimizer state, 1/n of it
        assert z.optimizer == math.ceil(z0.optimizer / n)
    assert z1.grads == z0.grads  # stage 1 keeps the gradients whole
    for z in (z2, z3):  # stage 2 and up: the gradients, 1/n
        assert z.grads == math.ceil(z0.grads / n)
    autocast_copy = 2 * z0.grads // 4 if precision == "fp16" else 0  # fp16's 16-bit copy lives forward to backward
    assert z3.weights <= math.ceil(z0.weights / n) + autocast_copy  # stage 3: 1/n (gathered units are buffers)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_context_parallelism_divides_activations_by_cp_but_the_gathered_keys_and_values(family, recompute):
    """Every op runs on S/cp tokens (`executor.context_parallel`) and keeps 1/cp of its tensors; the
    attention core keeps the all-gathered K and V whole, and no mask (`executor.context_parallel`)."""
    g = graph(family)
    counts = {b.id: b.count for b in g.blocks}
    cp = 2

    def parts(ops, c):
        return activation_parts(ops, micro_batch=1, batch_traced=1, recompute=recompute, attention="sdpa",
                                split={"attribute": c}, precision="bf16", block_counts=counts)

    outside = [op for op in g.ops if op.block_id is None]
    one, two = parts(outside, 1), parts(outside, cp)
    assert two.prologue == pytest.approx(one.prologue / cp, rel=0.02, abs=64)
    assert two.epilogue == pytest.approx(one.epilogue / cp, rel=0.02, abs=64)
    no_attention = [op for op in g.ops if op.block_id is not None and op.kind is not OpKind.ATTENTION]
    assert parts(no_attention, cp).blocks == pytest.approx(parts(no_attention, 1).blocks / cp, rel=1e-6, abs=64)
    blocks = [op for op in g.ops if op.block_id is not None]
    if recompute == "full":  # one [S/cp, hidden] checkpoint per layer
        assert parts(blocks, cp).blocks == pytest.approx(parts(blocks, 1).blocks / cp, rel=1e-6)
    else:  # the attention cores' gathered K and V stay whole
        assert parts(blocks, cp).blocks <= parts(blocks, 1).blocks
    for op in (op for op in g.ops if op.kind is OpKind.ATTENTION):
        q, k = op.inputs[:2]
        saved = context_parallel_saved(op, op.saved)
        whole = [t for t in saved if DimRole.ATTRIBUTE not in t.roles and t.numel == k.numel]
        assert len(whole) == 2  # K and V, gathered over the sequence
        assert not [t for t in saved if t.dtype == "bool"]  # the lower-right kernels need no mask tensor
