"""Expert parallelism executed (`executor.expert_parallel`), on CPU gloo at 2 and 4 ranks.

- Equivalence: MoE models with their experts sharded over ep ranks borrowed from dp_shard x cp train
  exactly like one process: losses over 3 steps from the same seed match a single-process run (fp32,
  relative 1e-4). SGD for most layouts (unlike AdamW it would show expert gradients reduced over the
  wrong ranks or scaled wrongly), AdamW for one. 2 ranks: ep2 on dp_shard 2 under DDP (zero 0), ZeRO-1
  (the experts outside ZeroRedundancyOptimizer), ZeRO-2 with gradient accumulation, FSDP (zero 3, SGD
  and AdamW), ep2 over cp 2, Qwen2-MoE (a shared expert beside the routed ones), DeepSeek-V3 (a dense
  first layer, a router with a score-correction buffer, a shared expert, latent attention) under FSDP.
  4 ranks: ep4 on dp_shard 4, ep2 x tp2 (attention TP-sharded, experts not), ep2 with pp2 (per-stage
  expert groups), ep2 beside dp_replicate 2 (HSDP: experts reduced over their replicas only), and
  Qwen2-MoE ep2 x tp2 with sequence parallelism (the MoE block gathers whole sequences; its shared
  expert TP-replicated).
- Layout: every rank holds E/ep experts, its slice of the same seeded full tensor one process gets.
- Communication: the collectives CommDebugMode counts inside each block of a tiny Mixtral with ep2 in
  one training step equal those `costmodel.placement.block_placements` schedules for it.
- Refusals: MoE experts that are not one fused module are refused with a SoapError before any work.

Each rank count runs as one spawned group (`exec_helpers.spawn_cases`).
"""

from __future__ import annotations

import collections

import pytest
import torch.distributed as dist
from exec_helpers import init_single_process_group, make_plan, spawn_cases, tiny_config

from executor.train import RunConfig, train
from tracer.errors import SoapError

SGD = {"steps": 3, "lr": 1e-1}
ADAMW = {"steps": 3, "lr": 1e-2}

CASES_2: dict[str, tuple[str, dict]] = {
    "mixtral-ep2-ddp": ("mixtral", dict(dp_shard=2, ep=2, micro_batch=2, optimizer="sgd")),
    "mixtral-ep2-zero1": ("mixtral", dict(dp_shard=2, ep=2, zero=1, micro_batch=2, optimizer="sgd")),
    "mixtral-ep2-zero2-grad-accum": ("mixtral", dict(dp_shard=2, ep=2, zero=2, micro_batch=1, num_microbatches=2,
                                                     optimizer="sgd")),
    "mixtral-ep2-zero3": ("mixtral", dict(dp_shard=2, ep=2, zero=3, micro_batch=2, optimizer="sgd")),
    "mixtral-ep2-zero3-adamw": ("mixtral", dict(dp_shard=2, ep=2, zero=3, micro_batch=2)),
    "mixtral-ep2-cp2": ("mixtral", dict(cp=2, ep=2, micro_batch=4, optimizer="sgd")),
    "qwen2_moe-ep2-ddp": ("qwen2_moe", dict(dp_shard=2, ep=2, micro_batch=2, optimizer="sgd")),
    "deepseek_v3-ep2-zero3": ("deepseek_v3", dict(dp_shard=2, ep=2, zero=3, micro_batch=2, optimizer="sgd")),
}
CASES_4: dict[str, tuple[str, dict]] = {
    "mixtral-ep4-zero3": ("mixtral", dict(dp_shard=4, ep=4, zero=3, micro_batch=2, optimizer="sgd")),
    "mixtral-ep2-x-tp2": ("mixtral", dict(dp_shard=2, ep=2, tp=2, micro_batch=4, optimizer="sgd")),
    "mixtral-ep2-x-pp2": ("mixtral", dict(dp_shard=2, ep=2, pp=2, zero=3, micro_batch=2, num_microbatches=2,
                                          optimizer="sgd")),
    "mixtral-ep2-x-dp-replicate2": ("mixtral", dict(dp_replicate=2, dp_shard=2, ep=2, zero=3, micro_batch=2,
                                                    optimizer="sgd")),
    "qwen2_moe-ep2-x-tp2-sp": ("qwen2_moe", dict(dp_shard=2, ep=2, tp=2, sequence_parallel=True, micro_batch=4,
                                                 optimizer="sgd")),
}
COMM_PLAN = dict(dp_shard=2, ep=2, micro_batch=2)
LAYOUT_PLAN = dict(dp_shard=2, ep=2, micro_batch=2)


def _run(kwargs: dict) -> dict:
    return SGD if kwargs.get("optimizer") == "sgd" else ADAMW


def _reference_key(family: str, kwargs: dict) -> tuple[str, str, int]:
    plan = make_plan(family, **kwargs)
    return family, plan.parallelism.optimizer, plan.global_batch


def _spawn(world: int, cases: dict[str, tuple[str, dict]], extra: tuple[dict, ...] = ()) -> dict:
    payload = [{"name": n, "family": f, "plan": kw, "run": _run(kw)} for n, (f, kw) in cases.items()]
    return spawn_cases(world, payload + list(extra))


@pytest.fixture(scope="module")
def single_process_losses() -> dict[tuple[str, str, int], list[float]]:
    init_single_process_group()
    try:
        refs = {}
        for family, kwargs in (*CASES_2.values(), *CASES_4.values()):
            key = _reference_key(family, kwargs)
            if key not in refs:
                _, optimizer, batch = key
                run = SGD if optimizer == "sgd" else ADAMW
                refs[key] = train(make_plan(family, micro_batch=batch, optimizer=optimizer),
                                  RunConfig(progress=False, **run)).losses
    finally:
        dist.destroy_process_group()
    return refs


@pytest.fixture(scope="module")
def two_rank_results() -> dict:
    extra = (
        {"name": "comm-ep2", "family": "mixtral", "plan": COMM_PLAN, "run": {"steps": 1},
         "count_block_collectives": True},
        {"name": "layout-ep2", "family": "mixtral", "plan": LAYOUT_PLAN, "inspect_experts": True},
    )
    return _spawn(2, CASES_2, extra)


@pytest.fixture(scope="module")
def four_rank_results() -> dict:
    return _spawn(4, CASES_4)


def _check(name: str, got, expected: list[float]) -> None:
    assert isinstance(got, list), f"{name} failed: {got}"
    assert len(set(round(x, 6) for x in expected)) == 3  # training moves the loss: the comparison is not vacuous
    assert got == pytest.approx(expected, rel=1e-4), name


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_2))
def test_two_rank_expert_parallel_matches_single_process(name, two_rank_results, single_process_losses):
    family, kwargs = CASES_2[name]
    _check(name, two_rank_results[name], single_process_losses[_reference_key(family, kwargs)])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_4))
def test_four_rank_expert_parallel_matches_single_process(name, four_rank_results, single_process_losses):
    family, kwargs = CASES_4[name]
    _check(name, four_rank_results[name], single_process_losses[_reference_key(family, kwargs)])


@pytest.mark.slow
def test_each_ep_rank_holds_its_slice_of_the_seeded_experts(two_rank_results):
    """ep2 over 4 experts: rank r holds experts [2r, 2r+2) of the full tensor a single process starts from
    (materialization seeded per FQN), and the module runs 2 local experts."""
    import copy

    import torch

    from executor.model import build_meta_model, materialize

    got = two_rank_results["layout-ep2"]
    assert isinstance(got, dict), got
    plan = make_plan("mixtral", **LAYOUT_PLAN)
    reference = build_meta_model(plan.model.config, plan.model.task)
    materialize(reference, copy.deepcopy(reference), torch.device("cpu"), seed=0)
    full = reference.get_submodule(got["ranks"][0]["module"].split("module.", 1)[-1]).gate_up_proj.detach()
    assert full.shape[0] == 4
    for rank, layout in enumerate(got["ranks"]):
        assert layout["num_experts"] == 2 and layout["global_shape"] == list(full.shape)
        assert layout["local_shape"] == [2, *full.shape[1:]]
        assert layout["checksum"] == pytest.approx(float(full[2 * rank:2 * rank + 2].double().sum()), rel=1e-12)


def _simulated_block_collectives() -> collections.Counter:
    """The collectives `block_placements` schedules for one block of the tiny Mixtral under COMM_PLAN."""
    import tracer
    from costmodel.placement import ActivationShape, block_placements
    from transformers import AutoConfig

    fields = tiny_config("mixtral")
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    plan = make_plan("mixtral", **COMM_PLAN)
    graph = tracer.trace(config, batch=COMM_PLAN["micro_batch"], seq_len=plan.seq_len)
    shape = ActivationShape(micro_batch=COMM_PLAN["micro_batch"], seq_len=plan.seq_len, hidden=config.hidden_size,
                            itemsize=4, experts_per_token=config.num_experts_per_tok)
    block = [op for op in graph.ops if op.block_id == "model.layers"]
    placed = block_placements(block, plan.strategy(), shape)
    counts_bytes = [c.nbytes for p in placed for c in p.collectives if c.kind == "all_gather"]
    assert counts_bytes == [2 * config.num_local_experts * 8]  # ep x experts int64 token counts
    return collections.Counter((c.group, c.kind, c.phase) for p in placed for c in p.collectives)


@pytest.mark.slow
def test_ep_block_collectives_equal_the_simulated_ones(two_rank_results):
    """Per MoE block and micro-batch: forward, the all-gather of the per-expert token counts and the
    dispatch and combine all-to-alls; backward, their two reverse all-to-alls (torch's functional
    collectives; the experts' FSDP over one rank and DDP issue none inside the blocks)."""
    measured = two_rank_results["comm-ep2"]
    assert isinstance(measured, dict), measured
    expected = _simulated_block_collectives()
    assert expected == {("ep", "all_gather", "fwd"): 1, ("ep", "all_to_all", "fwd"): 2, ("ep", "all_to_all", "bwd"): 2}
    names = {"all_gather_into_tensor": "all_gather", "all_to_all_single": "all_to_all"}
    blocks = [k for k in measured if k != "total"]
    layers = tiny_config("mixtral")["num_hidden_layers"]
    assert len(blocks) == layers
    for block in blocks:
        got = collections.Counter({("ep", names.get(op, op), "fwd" if phase == "forward" else "bwd"): n
                                   for phase, ops in measured[block].items() for op, n in ops.items()})
        assert got == expected, block
    per_block = sum(n for (_, kind, _), n in expected.items() if kind == "all_to_all")
    assert measured["total"]["all_to_all_single"] == layers * per_block


def test_experts_that_are_not_one_fused_module_are_refused():
    from torch import nn

    from executor.expert_parallel import check_expert_parallel

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    plan = make_plan("mixtral", dp_shard=2, ep=2, micro_batch=2)
    with pytest.raises(SoapError, match="not a fused experts module"):
        check_expert_parallel(plan, nn.Sequential(MoE()))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_under_ep_the_moe_block_is_priced_and_planned_tp_replicated(sequence_parallel):
    """One rule for the executor and the cost model: with ep > 1 an MoE block's router and shared expert
    run TP-replicated (`executor.expert_parallel.tp_plan_outside_moe`), so the plan's tp_plan leaves them
    out, their placements carry no TP split and their weights are counted whole on every TP rank."""
    import tracer
    from costmodel.memory import parameter_degrees
    from costmodel.placement import ActivationShape, block_placements, is_expert, tp_plan
    from transformers import AutoConfig

    fields = tiny_config("qwen2_moe")
    graph = tracer.trace(AutoConfig.for_model(fields.pop("model_type"), **fields), batch=4, seq_len=16)
    block = [op for op in graph.ops if op.block_id == "model.layers"]
    strategy = make_plan("qwen2_moe", dp_shard=2, ep=2, tp=2, sequence_parallel=sequence_parallel,
                         micro_batch=4).strategy()
    moe_ops = [op for op in block if ".mlp." in f"{op.module_fqn}." and op.params and not is_expert(op)]
    assert {op.module_fqn.split(".mlp.")[-1] for op in moe_ops} >= {"shared_expert.gate_proj", "gate"}
    assert not any(key.startswith("mlp.") for key in tp_plan(block, strategy))
    shape = ActivationShape(micro_batch=4, seq_len=16, hidden=32, itemsize=4, experts_per_token=2)
    for placed in block_placements(block, strategy, shape):
        if placed.op in moe_ops:
            assert placed.split.parameter == 1 and placed.split.attribute == 1, placed.op.module_fqn
    degrees = parameter_degrees(graph.ops, tensor_parallel=2, expert_parallel=2)
    assert all(degrees[p.name] == 1 for op in moe_ops for p in op.params)
    assert any(degrees[p.name] == 2 for op in block if "q_proj" in op.module_fqn for p in op.params)
