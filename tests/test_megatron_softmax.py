"""Megatron's fused attention softmax falls back to unfused PyTorch ops where its availability rule fails
(costmodel.fused_softmax): the rule as Megatron writes it, and the extra kernels in the simulator only there."""

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from costmodel.fused_softmax import batch_per_block, fallback_cost, fused_kernel_available
from costmodel.profiles import load_cluster
from costmodel.simulator import simulate
from costmodel.simulator.pricing import price_step
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
from executor.validation.grid import StackPlan, as_run

sys.path.insert(0, str(Path(__file__).parent))
from test_sim_graphs import tiny_decoder  # noqa: E402


def test_the_fused_kernel_needs_four_attention_batches_per_block_as_megatron_says():
    """16 heads at seq 1024 (vTrain's GPT models): only tp8 (2 heads a rank) at micro-batch 1 falls back."""
    assert batch_per_block(1024) == 4 and batch_per_block(128) == 8 and batch_per_block(16) == 16
    for tp in (1, 2, 4, 8):
        for mb in (1, 2, 4, 8, 16):
            available = fused_kernel_available(micro_batch=mb, local_heads=16 // tp, sq=1024, sk=1024, half=True)
            assert available == ((tp, mb) != (8, 1))
    assert not fused_kernel_available(micro_batch=4, local_heads=4, sq=1024, sk=1024, half=False)  # fp32 input
    assert not fused_kernel_available(micro_batch=4, local_heads=4, sq=8192, sk=8192, half=True)  # sk > 4096
    assert not fused_kernel_available(micro_batch=4, local_heads=4, sq=16, sk=16, half=True)  # sk <= 16
    assert not fused_kernel_available(micro_batch=4, local_heads=4, sq=1022, sk=1022, half=True)  # sq % 4


def test_the_unfused_path_adds_four_kernels_each_way_at_16_bits_and_two_at_fp32():
    free = fallback_cost(scores=1e6, width=2, pass_time=lambda nbytes: 0.0, launch_s=1.0)
    assert (free.fwd_kernels, free.bwd_kernels, free.fwd_s, free.bwd_s) == (4, 4, 4.0, 4.0)
    fp32 = fallback_cost(scores=1e6, width=4, pass_time=lambda nbytes: 0.0, launch_s=1.0)
    assert (fp32.fwd_kernels, fp32.bwd_kernels) == (2, 2)
    moved = fallback_cost(scores=1.0, width=2, pass_time=lambda nbytes: nbytes, launch_s=0.0)
    assert moved.fwd_s == pytest.approx(6 + 8 + 8 + 8 + 6 - 4) and moved.bwd_s == pytest.approx(6 + 8 + 8 + 12 + 6 - 6)


def _strategy(*, tp: int, mb: int, seq: int, megatron: bool) -> Strategy:
    return Strategy(dims=ParallelDims(tp=tp), train=TrainingConfig(
        global_batch=4 * mb, seq_len=seq, micro_batch=mb, num_microbatches=4, grad_accum=4, precision="fp16",
        recompute="full", megatron_softmax=megatron))


def test_a_megatron_stack_pays_the_unfused_softmax_kernels_only_where_the_rule_fails():
    """4 heads at seq 256: tp4 at micro-batch 1 has 1 head a rank (no fused kernel), tp2 at micro-batch 2 has 4
    attention batches (fused). Host-bound (a large host time per kernel), a block's forward grows by exactly 4
    kernels' host time where the kernel is unavailable, its backward by 4, and nothing moves where it is."""
    graph = tiny_decoder(layers=2, seq=256)
    host = 1e-3
    base = load_cluster("dgx-a100-80g-datasheet")
    cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, host_dispatch_s=host))
    for tp, mb, extra in ((4, 1, 4), (2, 2, 0)):
        plain = price_step(graph, _strategy(tp=tp, mb=mb, seq=256, megatron=False), cluster)[0].stages[0].chunks
        megatron = price_step(graph, _strategy(tp=tp, mb=mb, seq=256, megatron=True), cluster)[0].stages[0].chunks
        blocks = [(p, m) for p, m in zip(plain, megatron) if not p.name.startswith("<")]
        assert blocks
        for p, m in blocks:
            assert m.fwd_s - p.fwd_s == pytest.approx(extra * host)
            assert m.recompute_s - p.recompute_s == pytest.approx(extra * host)
            assert (m.bwd_input_s + m.bwd_weight_s) - (p.bwd_input_s + p.bwd_weight_s) == pytest.approx(extra * host)
    steps = [simulate(graph, _strategy(tp=4, mb=1, seq=256, megatron=m), cluster).step_time_s for m in (False, True)]
    assert steps[1] > steps[0]


def test_only_megatron_deepspeed_rows_run_megatrons_softmax():
    plan = SimpleNamespace(strategy=lambda: _strategy(tp=8, mb=1, seq=1024, megatron=False))
    megatron = as_run(plan, SimpleNamespace(stack="megatron-deepspeed"))
    assert isinstance(megatron, StackPlan) and megatron.strategy().train.megatron_softmax
    assert not as_run(plan, SimpleNamespace(stack="torch-native")).strategy().train.megatron_softmax
