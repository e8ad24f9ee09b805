"""ZeRO-3/FSDP parameter gathers (issue 28 item 4): what soap's executor gathers, and at what width."""

import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from costmodel.profiles import load_cluster
from costmodel.simulator.pricing import price_step
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig

sys.path.insert(0, str(Path(__file__).parent))
from exec_helpers import init_single_process_group, make_plan  # noqa: E402
from test_sim_graphs import tiny_decoder  # noqa: E402


def _zero3(precision, *, dp=16, seq):
    return Strategy(dims=ParallelDims(dp_shard=dp), train=TrainingConfig(
        global_batch=dp, seq_len=seq, micro_batch=1, zero=3, precision=precision, recompute="full"))


@pytest.fixture
def single_process_group():
    init_single_process_group()
    yield
    dist.destroy_process_group()


def test_fp16_under_fsdp2_gathers_fp32_parameters_and_pricing_and_memory_say_so(single_process_group):
    """fp16 has no FSDP2 MixedPrecisionPolicy in the executor (autocast over fp32 parameters), so its
    all-gathers and gathered buffers are fp32's size; bf16's policy gathers 2 bytes."""
    from executor.data_parallel import apply_fsdp
    from executor.mesh import build_mesh
    from executor.model import build_meta_model

    seen = {}
    for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        plan = make_plan("gpt2", zero=3, precision=precision)
        model = build_meta_model(plan.model.config, plan.model.task)
        apply_fsdp(model, plan, build_mesh(plan, device_type="cpu"))
        model.to_empty(device="cpu")
        mlp = model.transformer.h[0].mlp.c_fc
        mlp.register_forward_pre_hook(lambda m, _, p=precision: seen.update({p: next(m.parameters()).dtype}))
        with torch.autocast("cpu", dtype=dtype):
            model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert seen == {"fp16": torch.float32, "bf16": torch.bfloat16}

    graph = tiny_decoder(layers=4)
    cluster = load_cluster("dgx-h100")
    costs = {p: price_step(graph, _zero3(p, seq=graph.seq_len), cluster)[0] for p in ("fp16", "bf16", "fp32")}
    gathers = {p: [c.param_gather_s for c in c_.stages[0].chunks] for p, c_ in costs.items()}
    assert gathers["fp16"] == gathers["fp32"]
    assert all(h > b for h, b in zip(gathers["fp16"], gathers["bf16"]) if b > 0)
    assert costs["fp16"].rank_buffer_bytes == costs["fp32"].rank_buffer_bytes > costs["bf16"].rank_buffer_bytes


def test_fsdp2_gathers_a_checkpointed_block_twice_per_micro_batch_not_three_times(single_process_group):
    """The executor's FSDP2 over HF-checkpointed blocks (full recompute): each block is unsharded once in
    forward and once in backward; the recompute runs under the backward's unshard (FSDP2 skips its forward
    pre-hook in the pre-backward state), as `data_parallel_traffic` prices it (2 gathers per micro-batch).
    Counted at FSDPParamGroup.unshard calls that would all-gather (a 1-rank group skips the collective)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_module

    from executor.api import apply_recompute
    from executor.data_parallel import apply_fsdp
    from executor.mesh import build_mesh
    from executor.model import build_meta_model

    plan = make_plan("gpt2", zero=3, recompute="full")
    model = build_meta_model(plan.model.config, plan.model.task)
    apply_recompute(model, "full")
    apply_fsdp(model, plan, build_mesh(plan, device_type="cpu"))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(std=0.02)  # FSDP2's shards are DTensors
    gathers, unshard = [], group_module.FSDPParamGroup.unshard

    def counting(self, async_op=False):
        backward = self._training_state == group_module.TrainingState.PRE_BACKWARD
        if self._all_gather_result is None and not self.is_unsharded and (self.unshard_in_backward or not backward):
            gathers.append(self._module_fqn)
        return unshard(self, async_op)

    group_module.FSDPParamGroup.unshard = counting
    try:
        ids = torch.randint(0, 96, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        group_module.FSDPParamGroup.unshard = unshard
    blocks = [f"transformer.h.{i}" for i in range(4)]
    assert gathers == ["", *blocks, *reversed(blocks)]  # the root (not resharded), forward, backward

def test_a_per_tensor_gather_pays_its_ring_and_one_copy_per_rank():
    """costmodel.param_gathers: one all-gather per tensor (the pricer's collective, call included) plus n
    list-output copies; a GPT block has 12 tensors, gathered 3 times per micro-batch under full recompute."""
    from costmodel.collectives import CommGroup
    from costmodel.param_gathers import gather_width, gathers_per_microbatch, tensor_gathers_time

    calls = []

    def collective(kind, nbytes, group):
        calls.append((kind, nbytes, group.size))
        return 1e-3

    group = CommGroup(1536, 8)
    tensors = [12288, 12288, 36864, 12288 * 36864, 12288, 12288**2, 12288, 12288, 49152, 12288 * 49152, 12288,
               49152 * 12288]
    t = tensor_gathers_time(tensors, 2, group, collective=collective, kernel_s=7e-6)
    assert t == pytest.approx(12 * (1e-3 + 1536 * 7e-6))
    assert calls[3] == ("all_gather", 2 * 12288 * 36864, 1536)
    assert gathers_per_microbatch(zero=3, sharded=True, granularity="tensor", recompute="full") == 3
    assert gathers_per_microbatch(zero=3, sharded=True, granularity="block", recompute="full") == 2
    assert gathers_per_microbatch(zero=2, sharded=True, granularity="tensor", recompute="full") == 1
    assert gathers_per_microbatch(zero=3, sharded=False, granularity="tensor", recompute="full") == 0
    assert (gather_width("fp16", "block"), gather_width("fp16", "tensor"), gather_width("bf16", "block")) == (4, 2, 2)


def test_per_tensor_gathers_block_compute_and_repeat_for_the_recompute():
    """Per tensor, a unit's gathers ride its critical path: forward once, backward twice under full
    recompute (recompute and backward), and nothing on the prefetched dp stream."""
    import dataclasses

    graph = tiny_decoder(layers=4)
    cluster = load_cluster("dgx-h100")
    block = _zero3("bf16", dp=64, seq=graph.seq_len)
    tensor = dataclasses.replace(block, train=dataclasses.replace(block.train, param_gather="tensor"))
    by_block = price_step(graph, block, cluster)[0].stages[0].chunks
    by_tensor = price_step(graph, tensor, cluster)[0].stages[0].chunks
    assert len(by_block) == 6  # the embeddings, 4 blocks, the head (recompute covers the blocks)
    for k, (b, t) in enumerate(zip(by_block, by_tensor)):
        assert t.param_gather_s == 0 < b.param_gather_s
        gather = t.fwd_comm_s - b.fwd_comm_s
        assert gather > b.param_gather_s  # more calls, each with its latency and copies
        assert t.bwd_comm_s - b.bwd_comm_s == pytest.approx(gather * (2 if 0 < k < 5 else 1))


def test_megatron_and_deepspeed_fp16_are_priced_on_a_half_model_without_autocast_casts():
    """Both stacks hold the fp16 model in half (fp32 masters in the optimizer): the 16-bit trace, not
    autocast's (whose weight casts soap's own executor pays every micro-batch)."""
    from executor.validation.grid import StackPlan, as_run
    from executor.validation.run_records import RunRecord
    from planner.regimes import regime_dtype

    dims, device = ParallelDims(dp_shard=8), load_cluster("dgx-a100-80g").device
    train = TrainingConfig(global_batch=8, seq_len=16, zero=3, precision="fp16")
    assert regime_dtype(dims, train, device) == "autocast-float16"
    half = TrainingConfig(global_batch=8, seq_len=16, zero=3, precision="fp16", half_model=True)
    assert regime_dtype(dims, half, device) == "float16"
    row = dict(name="r", model="gpt2", gpus=8, seq=16, micro_batch=1, precision="fp16", step_time_s=1.0)
    assert as_run("plan", RunRecord(**row)).train == {"cross_entropy": "upcast"}  # torch-native: torchtitan's loss
    for stack, expected in (("megatron-lm", {"accumulate_locally": True, "half_model": True, "cross_entropy": "megatron"}),
                            ("deepspeed-2021", {"param_gather": "tensor", "half_model": True,
                                                "cross_entropy": "megatron"})):
        priced = as_run("plan", RunRecord(**row, stack=stack))
        assert isinstance(priced, StackPlan) and priced.train == expected
        # a priced run crosses processes (a fit's prepared runs, pickled): it unpickles, its plan's fields readable
        again = pickle.loads(pickle.dumps(priced))
        assert again.train == expected and again.upper() == "PLAN"


@pytest.fixture(scope="module")
def sc21_graphs():
    return {}


@pytest.mark.parametrize("cluster_name", ["dgx-a100-80g-datasheet", "dgx-a100-80g"])
def test_sc21_zero3_as_deepspeed_ran_it_ranks_below_the_3d_plan(sc21_graphs, cluster_name):
    """SC'21 Table 4 (costmodel.param_gathers' worked example): priced as DeepSpeed ran it, ZeRO-3 of the 175B
    GPT falls with every doubling of the GPUs and ranks below Megatron's tp8 x pp12 at 768 and 1,536 GPUs
    (published 88 vs 149 and 44 vs 141 TFLOP/s). At 384 the published pair is 144 vs 153, 6% apart: soap
    ranks it the same way by a similar margin (docs/benchmarks.md), too close to hold a test to. On soap's
    own executor (FSDP2, per-block gathers) ZeRO-3 stays nearly flat. The ranking must hold on the datasheet
    A100 and on the shipped one (measured hardware, soap's executor's terms: slower memory-bound kernels and a
    host floor)."""
    from benchmarks.sc21_zero3 import STACKS, predicted_tflops

    cluster = load_cluster(cluster_name)
    zero3 = predicted_tflops("zero3", STACKS["zero3"], cluster, sc21_graphs)
    three_d = predicted_tflops("ptd-p", STACKS["ptd-p"], cluster, sc21_graphs)
    for gpus in (768, 1536):
        assert zero3[gpus] < three_d[gpus]
    assert zero3[768] < 0.75 * zero3[384] and zero3[1536] < 0.6 * zero3[768]  # published: 144 / 88 / 44
    assert three_d[1536] > 0.85 * three_d[384]  # published: 141 / 153
    if cluster_name.endswith("datasheet"):
        own = predicted_tflops("zero3", "torch-native", cluster, sc21_graphs)
        assert own[1536] > 0.8 * own[384] and own[1536] > 3 * zero3[1536]
