"""Pricing real graphs: placements and their collectives, memory, monotonicity of the predicted step."""

import dataclasses
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodel.placement import (
    ActivationShape, OpSplit, block_placements, candidate_splits, reshard, tp_plan, vocab_parallel_ops,
)
from costmodel.profiles import load_cluster
from costmodel.schedule import build_schedule
from costmodel.simulator import simulate, simulate_costs
from costmodel.simulator.costs import ChunkCost, StageCost, StepCosts
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
from tracer.errors import SoapError

sys.path.insert(0, str(Path(__file__).parent))
from test_sim_graphs import tiny_decoder  # noqa: E402

GRAPH = tiny_decoder()
CLUSTER = load_cluster("dgx-h100")
SHAPE = ActivationShape(micro_batch=1, seq_len=64, hidden=64, itemsize=2, kv_heads=4, head_dim=16)


def _strategy(*, tp=1, pp=1, dp=1, cp=1, zero=0, mb=4, **train):
    dims = ParallelDims(tp=tp, pp=pp, dp_shard=dp, cp=cp)
    return Strategy(dims=dims, train=TrainingConfig(global_batch=dp * mb, seq_len=64, num_microbatches=mb,
                                                    grad_accum=mb if pp == 1 else 1, zero=zero, **train))


def _bus_bytes(placements, n):
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    return sum(factor[c.kind] * c.nbytes for p in placements for c in p.collectives if c.group == "tp")


def test_sequence_parallel_moves_the_same_bytes_as_tp_allreduce_split_into_rs_and_ag():
    tp = block_placements(GRAPH.ops_of("model.layers"), _strategy(tp=4), SHAPE)
    sp = block_placements(GRAPH.ops_of("model.layers"), _strategy(tp=4, sequence_parallel=True), SHAPE)
    tp_kinds = sorted(c.kind for p in tp for c in p.collectives)
    sp_kinds = sorted(c.kind for p in sp for c in p.collectives)
    assert tp_kinds == ["all_reduce"] * 4  # two regions, forward and backward
    assert sp_kinds == ["all_gather"] * 4 + ["reduce_scatter"] * 4
    assert _bus_bytes(sp, 4) == pytest.approx(_bus_bytes(tp, 4))


def test_megatron_splits_heads_and_ffn_and_sequence_parallel_norms():
    placed = {p.op.name.split(".")[-1]: p.split for p in
              block_placements(GRAPH.ops_of("model.layers"), _strategy(tp=2, dp=4, sequence_parallel=True), SHAPE)}
    assert placed["q_proj:linear"].style == "colwise" and placed["q_proj:linear"].parameter == 2
    assert placed["o_proj:linear"].style == "rowwise"
    assert placed["self_attn:sdpa"].describe() == "Sample x4, Parameter x2"
    assert placed["input_layernorm:mul"].describe() == "Sample x4, Attribute x2"


def test_context_parallel_gathers_kv_for_each_attention():
    placed = block_placements(GRAPH.ops_of("model.layers"), _strategy(cp=2), SHAPE)
    cp = [c for p in placed for c in p.collectives if c.group == "cp"]
    assert [(c.kind, c.phase) for c in cp] == [("all_gather", "fwd"), ("reduce_scatter", "bwd")]
    assert cp[0].nbytes == 2 * 1 * 64 * 4 * 16 * 2  # K and V, whole sequence, 4 KV heads of 16, bf16


def _outside_placements(strategy):
    return {p.op.name: p for seg in GRAPH.segments() if seg.block_id is None
            for p in block_placements(seg.ops, strategy, SHAPE)}


def test_vocab_parallel_embedding_head_and_loss_with_and_without_a_pipeline():
    """As executor.tensor_parallel runs them (and Megatron-Core): vocab-parallel whenever tp > 1; a
    pipeline's first stage holds the embedding and its last the head and loss, with the same collectives."""
    embedding, head = vocab_parallel_ops(GRAPH.ops)
    loss = next(op.name for op in GRAPH.ops if op.kind.name == "LOSS")
    whole = _outside_placements(_strategy(tp=2))
    assert whole[embedding].split.style == "vocab_parallel" and whole[head].split.style == "colwise"
    assert [(c.kind, c.phase) for c in whole[embedding].collectives] == [("all_reduce", "fwd")]
    assert [(c.kind, c.phase) for c in whole[head].collectives] == [("all_reduce", "bwd")]
    assert [(c.kind, c.phase) for c in whole[loss].collectives] == [("all_reduce", "fwd")] * 3
    pipelined = _outside_placements(_strategy(tp=2, pp=2))
    assert {name: (p.split, p.collectives) for name, p in pipelined.items()} == \
        {name: (p.split, p.collectives) for name, p in whole.items()}
    sp = _outside_placements(_strategy(tp=2, pp=2, sequence_parallel=True))
    assert [(c.kind, c.phase) for c in sp[embedding].collectives] == [("all_reduce", "fwd"), ("all_gather", "bwd")]
    assert [(c.kind, c.phase) for c in sp[head].collectives] == [("all_gather", "fwd"), ("all_reduce", "bwd")]


@pytest.mark.parametrize("family, task, expected", [
    ("gpt2", "causal-lm", ("transformer.wte:embedding", "lm_head:linear")),
    ("bert", "masked-lm", ("bert.embeddings.word_embeddings:embedding", "cls.predictions.decoder:linear")),
])
def test_position_tables_and_head_transforms_are_not_vocab_parallel(family, task, expected):
    """GPT-2's wpe, BERT's position / token-type tables and its head transform replicate, as the
    executor's get_input_embeddings / get_output_embeddings leave them."""
    import tracer
    from exec_helpers import tiny_config
    from transformers import AutoConfig

    fields = tiny_config(family)
    graph = tracer.trace(AutoConfig.for_model(fields.pop("model_type"), **fields), batch=2, seq_len=16, task=task)
    assert vocab_parallel_ops(graph.ops) == expected
    epilogue = [seg.ops for seg in graph.segments() if seg.block_id is None][-1]
    assert vocab_parallel_ops(epilogue)[1] == expected[1]


def test_tp_plan_has_torch_shape_relative_to_the_block():
    plan = tp_plan(GRAPH.ops, _strategy(tp=2, sequence_parallel=True))
    assert plan["self_attn.q_proj"] == "colwise" and plan["mlp.down_proj"] == "rowwise"
    assert plan["input_layernorm"] == "sequence_parallel"
    assert tp_plan(GRAPH.ops, _strategy()) == {}


def test_reshard_table_names_the_collective_between_layouts():
    h = GRAPH.ops[1].inputs[0]
    rowwise, colwise = OpSplit(1, 1, 2, "rowwise"), OpSplit(1, 1, 2, "colwise")
    replicated, seq = OpSplit(1, 1, 1, None), OpSplit(1, 2, 1, "sequence_parallel")
    assert reshard(rowwise, replicated, h).kind == "all_reduce"
    assert reshard(rowwise, seq, h).kind == "reduce_scatter"
    assert reshard(seq, colwise, h).kind == "all_gather"
    assert reshard(replicated, colwise, h).kind is None
    assert reshard(rowwise, replicated, h).nbytes == h.nbytes


def test_candidate_splits_offer_replicated_tensor_and_sequence_parallel():
    q_proj = GRAPH.ops[2]
    kinds = {c.style for c in candidate_splits(q_proj, ParallelDims(tp=2, dp_shard=2))}
    assert kinds == {"replicate", "colwise", "sequence_parallel"}


def test_1f1b_first_stage_holds_pp_microbatches_of_activations():
    r = simulate(GRAPH, _strategy(pp=2, mb=4), CLUSTER)
    one = simulate(GRAPH, _strategy(pp=2, mb=1), CLUSTER)
    assert r.memory[0].at_peak.activations == 2 * one.memory[0].at_peak.activations


def test_full_recompute_trades_memory_for_time():
    # two micro-batches: the first one's gradients are live at the second one's activation peak
    plain = simulate(GRAPH, _strategy(mb=2), CLUSTER)
    full = simulate(GRAPH, _strategy(mb=2, recompute="full"), CLUSTER)
    assert full.peak_memory_bytes < plain.peak_memory_bytes
    assert full.breakdown.compute > plain.breakdown.compute
    assert full.facts.hardware_flops > full.facts.model_flops == plain.facts.model_flops


def test_one_micro_batch_peaks_on_activations_or_gradients_not_both():
    """zero_grad(set_to_none=True) frees the gradients after each step: with one micro-batch and no DDP the
    backward's activations and the gradients it makes replace each other, the peak holds the larger; a second
    micro-batch (or DDP's buckets) keeps them all live at the activation peak."""
    one = simulate(GRAPH, _strategy(mb=1), CLUSTER).memory[0]
    two = simulate(GRAPH, _strategy(mb=2), CLUSTER).memory[0]  # two micro-batches of one: same activations
    ddp = simulate(GRAPH, _strategy(mb=1, dp=2), CLUSTER).memory[0]
    assert one.at_peak.activations == two.at_peak.activations and one.grads_bytes == two.grads_bytes > 0
    assert two.at_peak.grads == two.grads_bytes and ddp.at_peak.grads == ddp.grads_bytes
    state = one.at_peak.weights + one.at_peak.optimizer + one.at_peak.buffers + one.at_peak.workspace
    assert one.peak_bytes == pytest.approx(state + max(one.at_peak.activations, one.grads_bytes), abs=1)
    assert one.peak_bytes < two.peak_bytes
    assert max(v for _, v in one.timeline) == one.peak_bytes  # the drawn timeline reaches the same peak


def test_zero3_gathers_parameters_and_shards_state():
    ddp = simulate(GRAPH, _strategy(dp=4, mb=1), CLUSTER)
    fsdp = simulate(GRAPH, _strategy(dp=4, mb=1, zero=3), CLUSTER)
    assert any(e.category == "fsdp" for e in fsdp.events) and not any(e.category == "fsdp" for e in ddp.events)
    # bf16: DDP holds the fp32 parameters (4 bytes) and autocast's bf16 copy of what matmuls read (2), FSDP2 the
    # fp32 shard (4 / 4)
    from costmodel.memory import stage_params

    params = stage_params(GRAPH.ops, block_counts={b.id: b.count for b in GRAPH.blocks})
    assert 0 < params.autocast_copied < params.trainable
    assert fsdp.memory[0].at_peak.weights * 4 + 2 * params.autocast_copied == pytest.approx(
        ddp.memory[0].at_peak.weights, rel=0.01)


def test_every_schedule_simulates_on_a_real_graph():
    for name, v in [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)]:
        r = simulate(GRAPH, _strategy(pp=2, mb=4, schedule=name, virtual_stages=v), CLUSTER)
        b = r.breakdown
        assert b.compute + b.exposed_comm + b.bubble + b.optimizer + b.other == pytest.approx(r.step_time_s)


def test_stage_bounds_are_validated():
    with pytest.raises(SoapError, match="stage 1 has no layers"):
        simulate(GRAPH, _strategy(pp=2), CLUSTER, stages=(0, 6, 6))
    r = simulate(GRAPH, _strategy(pp=2), CLUSTER, stages=(0, 2, 6))
    assert r.memory[1].at_peak.weights > r.memory[0].at_peak.weights


def test_contract_json_has_every_key():
    c = simulate(GRAPH, _strategy(tp=2, dp=2), CLUSTER).to_contract()
    for key in ("step_time_s", "tokens_per_s", "samples_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
                "mfu", "hfu", "peak_memory_gib", "parallelism", "breakdown_s"):
        assert key in c
    assert set(c["breakdown_s"]) == {"compute", "exposed_comm", "bubble", "optimizer", "other"}
    assert {"dp", "zero", "tp", "pp", "cp", "micro_batch", "grad_accum", "num_microbatches", "schedule",
            "recompute", "precision", "optimizer"} <= set(c["parallelism"])
    assert 0 < c["mfu"] < 1


# --- monotonicity --------------------------------------------------------------------------------


def _scaled_cluster(bandwidth=1.0, compute=1.0):
    dev = CLUSTER.device
    dev = dataclasses.replace(dev, peak_flops={k: v * compute for k, v in dev.peak_flops.items()},
                              memory_bandwidth=dev.memory_bandwidth * compute)
    return dataclasses.replace(
        CLUSTER, device=dev,
        intra_node=dataclasses.replace(CLUSTER.intra_node, bandwidth=CLUSTER.intra_node.bandwidth * bandwidth),
        inter_node=dataclasses.replace(CLUSTER.inter_node, bandwidth=CLUSTER.inter_node.bandwidth * bandwidth),
    )


STRATEGIES = st.sampled_from([
    _strategy(tp=2, pp=2, dp=2, mb=4, sequence_parallel=True),
    _strategy(dp=8, mb=2, zero=3),
    _strategy(pp=4, mb=8, schedule="Interleaved1F1B", virtual_stages=1),
    _strategy(tp=4, dp=2, mb=1, zero=2, recompute="full"),
    _strategy(pp=2, cp=2, dp=2, mb=4, schedule="ZBVZeroBubble", virtual_stages=2),
])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategy=STRATEGIES, factor=st.floats(1.0, 64.0))
def test_more_bandwidth_never_slows_the_step(strategy, factor):
    base = simulate(GRAPH, strategy, _scaled_cluster()).step_time_s
    assert simulate(GRAPH, strategy, _scaled_cluster(bandwidth=factor)).step_time_s <= base * (1 + 1e-9)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategy=STRATEGIES, factor=st.floats(1.0, 64.0))
def test_faster_compute_never_slows_the_step(strategy, factor):
    base = simulate(GRAPH, strategy, _scaled_cluster()).step_time_s
    assert simulate(GRAPH, strategy, _scaled_cluster(compute=factor)).step_time_s <= base * (1 + 1e-9)


chunk_costs = st.builds(
    lambda f, b, c, g, s: ChunkCost(name="c", fwd_s=f, bwd_input_s=b, bwd_weight_s=b, fwd_comm_s=c, bwd_comm_s=c,
                                    grad_sync_s=g, param_gather_s=s),
    *[st.floats(0.0, 2.0)] * 5,
)


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(chunk_costs, min_size=4, max_size=4),
    send=st.floats(0.0, 2.0),
    shrink=st.floats(0.0, 1.0),
    schedule=st.sampled_from([("GPipe", 2, 1), ("1F1B", 2, 1), ("Interleaved1F1B", 2, 2), ("ZBVZeroBubble", 2, 2)]),
    every_mb=st.booleans(),
)
def test_fewer_bytes_moved_never_slows_the_step(chunks, send, shrink, schedule, every_mb):
    name, pp, v = schedule

    def step(k):
        stages = tuple(
            StageCost(chunks=(dataclasses.replace(c, fwd_comm_s=c.fwd_comm_s * k, bwd_comm_s=c.bwd_comm_s * k,
                                                  grad_sync_s=c.grad_sync_s * k, param_gather_s=c.param_gather_s * k),),
                      send_activation_s=send * k, send_gradient_s=send * k, optimizer_s=0.1)
            for c in chunks[: pp * v]
        )
        costs = StepCosts(stages=stages, schedule=build_schedule(name, pp, 4, v), grad_sync_every_microbatch=every_mb)
        return simulate_costs(costs).step_time_s

    assert step(shrink) <= step(1.0) * (1 + 1e-9)


def test_expert_parallel_adds_all_to_all_and_keeps_local_work():
    import dataclasses as dc

    up = GRAPH.ops_of("model.layers")[7]
    experts = dc.replace(up, name="model.layers.0.mlp.experts:bmm", module_fqn="model.layers.0.mlp.experts")
    ops = (*GRAPH.ops_of("model.layers")[:7], experts)
    dims = ParallelDims(dp_shard=4, ep=4)
    strategy = Strategy(dims=dims, train=TrainingConfig(global_batch=4, seq_len=64))
    placed = block_placements(ops, strategy, dataclasses.replace(SHAPE, experts_per_token=2))
    expert = placed[-1]
    assert expert.split.describe() == "Sample x4, Parameter x4" and expert.split.local() == {}
    a2a = [c for p in placed for c in p.collectives if c.kind == "all_to_all"]
    assert len(a2a) == 4 and {c.phase for c in a2a} == {"fwd", "bwd"}
    assert a2a[0].nbytes == SHAPE.hidden_bytes(1) * 2


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.lists(chunk_costs, min_size=4, max_size=4),
    send=st.floats(0.0, 2.0),
    schedule=st.sampled_from([("GPipe", 2, 1), ("1F1B", 2, 1), ("InterleavedZeroBubble", 2, 2), ("ZBVZeroBubble", 2, 2)]),
)
def test_breakdown_is_non_negative_and_sums_to_the_step(chunks, send, schedule):
    name, pp, v = schedule
    stages = tuple(StageCost(chunks=(c,), send_activation_s=send, send_gradient_s=send, optimizer_s=0.1) for c in chunks[: pp * v])
    result = simulate_costs(StepCosts(stages=stages, schedule=build_schedule(name, pp, 4, v)))
    for b in result.rank_breakdowns:
        parts = (b.compute, b.exposed_comm, b.bubble, b.optimizer, b.other)
        assert min(parts) >= -1e-12
        assert sum(parts) == pytest.approx(result.step_time_s, rel=1e-9, abs=1e-12)


def test_op_costs_explain_where_the_time_goes():
    from costmodel.simulator.explain import op_costs

    rows = op_costs(GRAPH, _strategy(tp=2, sequence_parallel=True), CLUSTER)
    by_name = {r.op.split(".")[-1]: r for r in rows}
    assert by_name["q_proj:linear"].placement == "Parameter x2" and by_name["q_proj:linear"].count == 4
    assert by_name["o_proj:linear"].comm_s > 0 and by_name["up_proj:linear"].comm_s > 0
    replicated = op_costs(GRAPH, _strategy(), CLUSTER)
    # the blocks' work is split (the loss, vocabulary-parallel, launches more kernels than replicated)
    assert sum(r.count * r.fwd_s for r in rows if r.block) < sum(r.count * r.fwd_s for r in replicated if r.block)


def test_stages_may_be_given_as_layer_ranges():
    by_bounds = simulate(GRAPH, _strategy(pp=2), CLUSTER, stages=(0, 2, 6))
    by_ranges = simulate(GRAPH, _strategy(pp=2), CLUSTER, stages=[(0, 2), (2, 6)])
    assert by_ranges.step_time_s == by_bounds.step_time_s
    with pytest.raises(SoapError, match="not contiguous"):
        simulate(GRAPH, _strategy(pp=2), CLUSTER, stages=[(0, 2), (3, 6)])


def test_selective_recompute_keeps_less_than_none_and_more_than_full():
    peaks = {policy: simulate(GRAPH, _strategy(mb=1, recompute=policy), CLUSTER).memory[0].at_peak.activations
             for policy in ("none", "selective", "full")}
    assert peaks["full"] < peaks["selective"] < peaks["none"]


def _named(ops, splits):
    return tuple((op.name, tuple(sorted({"sample": s.sample, "attribute": s.attribute, "parameter": s.parameter}.items())))
                 for op, s in zip(ops, splits))


def test_op_splits_that_differ_from_megatron_change_the_predicted_step():
    strategy = _strategy(tp=4, sequence_parallel=True)
    ops = GRAPH.ops_of("model.layers")
    splits = [OpSplit(1, 1, 1, "replicate") if op.kind.name == "NORM" else p.split
              for op, p in zip(ops, block_placements(ops, strategy, SHAPE))]
    assert any(op.kind.name == "NORM" for op in ops)
    # without the host-bound floor, which paces this tiny model whatever its kernels cost
    cluster = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, host_dispatch_s=0.0))
    changed = simulate(GRAPH, dataclasses.replace(strategy, op_splits=_named(ops, splits)), cluster)
    assert changed.step_time_s != pytest.approx(simulate(GRAPH, strategy, cluster).step_time_s)


def test_op_splits_naming_a_split_the_op_cannot_take_is_a_clear_error():
    strategy = _strategy(tp=2)
    op = next(op for op in GRAPH.ops_of("model.layers") if op.kind.name == "NORM")
    bad = dataclasses.replace(strategy, op_splits=((op.name, (("parameter", 8),)),))
    with pytest.raises(SoapError, match="cannot take the split"):
        simulate(GRAPH, bad, CLUSTER)


def test_q_k_v_read_the_norm_output_not_each_other():
    from costmodel.placement import dataflow_edges

    ops = GRAPH.ops_of("model.layers")
    index = {op.name.split(".")[-1]: i for i, op in enumerate(ops)}
    edges = set(dataflow_edges(ops))
    norm = index["input_layernorm:mul"]
    for name in ("q_proj:linear", "k_proj:linear", "v_proj:linear"):
        assert (norm, index[name]) in edges, name
    assert (index["q_proj:linear"], index["k_proj:linear"]) not in edges
    assert (index["add#2"] if "add#2" in index else len(ops) - 1, norm) in edges  # the next repeat reads the residual


def test_ddp_pays_per_bucket_not_per_block_while_fsdp_pays_per_unit():
    """DDP all-reduces a tiny model's gradients (under 1 MiB) in its one first bucket, so its fixed call cost
    does not grow with the number of blocks; FSDP issues one reduce-scatter per unit."""
    from costmodel.simulator.pricing import ProfilePricer, mesh_groups, price_step

    cluster = load_cluster("local-cpu-kernels")
    ddp = Strategy(dims=ParallelDims(dp_replicate=2), train=TrainingConfig(global_batch=2, seq_len=64))
    costs, _ = price_step(GRAPH, ddp, cluster)
    chunks = costs.stages[0].chunks
    synced = [c for c in chunks if c.grad_sync_s > 0]
    assert len(synced) >= 3
    pricer = ProfilePricer(cluster, "fp32")
    fixed = pricer.collective("all_reduce", 4, mesh_groups(ddp, cluster.gpus_per_node).dp)
    per_block_calls = sum(c.grad_sync_s for c in synced)
    assert GRAPH.params_trainable * 4 < 2**20
    # per chunk, every chunk paid `fixed`; bucketed, the stage pays it once, plus the bytes' transfer time
    assert fixed <= per_block_calls < 1.5 * fixed
    fsdp = Strategy(dims=ParallelDims(dp_shard=2), train=TrainingConfig(global_batch=2, seq_len=64, zero=3))
    fsdp_chunks = [c for c in price_step(GRAPH, fsdp, cluster)[0].stages[0].chunks if c.grad_sync_s > 0]
    assert all(c.grad_sync_s >= fixed * 0.5 for c in fsdp_chunks)


@pytest.mark.parametrize("zero, gathers_per_microbatch", [(2, 1), (3, 2)])
def test_fsdp_with_accumulation_syncs_and_gathers_every_microbatch(zero, gathers_per_microbatch):
    """The executor's FSDP2 has no no_sync: with 4 accumulated micro-batches every unit reduce-scatters 4
    times; ZeRO-2 (no reshard after forward) all-gathers once per micro-batch, ZeRO-3 twice; DDP's
    accumulation syncs once, after the last backward."""
    cluster = load_cluster("local-cpu-kernels")

    def count(dims, **train):
        s = Strategy(dims=dims, train=TrainingConfig(global_batch=8, seq_len=64, num_microbatches=4, grad_accum=4,
                                                     **train))
        names = [e.name for e in simulate(GRAPH, s, cluster).events if e.rank == 0 and e.stream == "dp-comm"]
        return sum(n.startswith("grad sync") for n in names), sum(n.startswith("all-gather ") for n in names)

    from costmodel.simulator.pricing import price_step

    plain = Strategy(dims=ParallelDims(dp_shard=2), train=TrainingConfig(global_batch=2, seq_len=64, zero=zero))
    units = sum(c.grad_sync_s > 0 for c in price_step(GRAPH, plain, cluster)[0].stages[0].chunks)
    syncs, gathers = count(ParallelDims(dp_shard=2), zero=zero)
    assert syncs == 4 * units
    assert gathers == 4 * gathers_per_microbatch * units
    ddp_syncs, ddp_gathers = count(ParallelDims(dp_replicate=2))
    assert ddp_syncs == units and ddp_gathers == 0


def test_a_tp_group_that_leaves_the_nvlink_domain_is_priced_on_the_inter_node_link():
    """tp16 on 8-GPU nodes (issue 26: a pinned tp may span nodes) runs its TP collectives over the NICs;
    declare an NVLink domain of 16 (GB200-style, `nvlink_domain`) and the same plan stays on NVLink."""
    from costmodel.simulator.pricing import price_step

    graph = tiny_decoder(heads=16, hidden=256, ffn=512)
    strategy = _strategy(tp=16, mb=1)
    spanning, _ = price_step(graph, strategy, CLUSTER)
    one_domain = dataclasses.replace(CLUSTER, nvlink_domain=16)
    inside, _ = price_step(graph, strategy, one_domain)
    assert spanning.links["tp-comm"] == "inter_node" and inside.links["tp-comm"] == "intra_node"
    assert simulate(graph, strategy, CLUSTER).step_time_s > simulate(graph, strategy, one_domain).step_time_s


def test_recomputed_blocks_keep_no_autocast_copy_of_their_weights():
    """bf16 autocast saves each matmul's 16-bit weight for its backward, unless the block recomputes (full or
    selective re-cast it in the backward): then only the copies outside the blocks (the LM head) stay."""
    from costmodel.memory import blocks_keep_autocast_copies, held_autocast_copies, stage_params

    def held(recompute, per_block=()):
        train = TrainingConfig(global_batch=1, seq_len=64, recompute=recompute, recompute_per_block=tuple(per_block))
        return held_autocast_copies(params, blocks_keep=blocks_keep_autocast_copies(train))

    params = stage_params(GRAPH.ops, block_counts={b.id: b.count for b in GRAPH.blocks})
    assert 0 < params.autocast_copied_outside < params.autocast_copied
    outside = [("<prologue>", "none"), ("<epilogue>", "none")]  # what a plan's blocks list says of the segments
    for policy in ("full", "selective"):
        assert held(policy, outside) == params.autocast_copied_outside
    assert held("none") == params.autocast_copied
    assert held("full", [("model.layers", "none")]) == params.autocast_copied
    plain = simulate(GRAPH, _strategy(mb=2, precision="bf16"), CLUSTER).memory[0].at_peak
    full = simulate(GRAPH, _strategy(mb=2, precision="bf16", recompute="full"), CLUSTER).memory[0].at_peak
    copies = 2 * (params.autocast_copied - params.autocast_copied_outside)
    assert plain.weights - full.weights == pytest.approx(copies, abs=16)
