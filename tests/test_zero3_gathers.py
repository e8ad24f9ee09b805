"""ZeRO-3/FSDP parameter gathers (issue 28 item 4): what soap's executor gathers, and at what width."""

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
