"""`soap plan` behaviour: what the search chooses for small models on simulated clusters."""

from __future__ import annotations

import json

import pytest

from costmodel.profiles import cluster_from_dict, cluster_to_dict, load_cluster
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
from planner.api import plan_report
from planner.block_splits import solved_splits
from planner.intra_op import BlockSplitCache

GIB = 2**30

TINY_GPT2 = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 8,
    "vocab_size": 8192, "n_positions": 1024,
}
MEDIUM_LLAMA = {  # about 0.9B parameters: 16 GB of AdamW state, so memory limits bite
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
}
LONG_LLAMA = {  # 4 heads: tensor parallelism can use at most 4 of 8 GPUs on one sequence
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 1408,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 8192,
    "max_position_embeddings": 131072, "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, config in (("tiny-gpt2", TINY_GPT2), ("medium-llama", MEDIUM_LLAMA), ("long-llama", LONG_LLAMA)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        paths[name] = str(root / name)
    return paths


def _parallelism(report):
    return report.plan.parallelism


def test_small_model_on_8_gpus_gets_the_data_parallel_family(models):
    report = plan_report(models["tiny-gpt2"], gpus=8)
    p = _parallelism(report)
    assert (p.tp, p.pp, p.cp, p.dp) == (1, 1, 1, 8)
    assert report.chosen.peak_memory_bytes <= 80 * GIB


def test_tight_memory_limit_forces_sharding_tensor_or_pipeline_parallelism(models):
    roomy = _parallelism(plan_report(models["medium-llama"], gpus=8, global_batch=64))
    tight = plan_report(models["medium-llama"], gpus=8, global_batch=64, mem_limit_gib=6)
    p = _parallelism(tight)
    assert (roomy.zero, roomy.tp, roomy.pp) == (0, 1, 1) or roomy.dp == 8
    assert p.zero > 0 or p.tp > 1 or p.pp > 1
    assert tight.chosen.peak_memory_bytes <= 6 * GIB


def test_slow_inter_node_links_keep_tensor_parallelism_inside_nodes(models):
    data = cluster_to_dict(load_cluster("dgx-h100"))
    data["tp_across_nodes"] = True  # allowed to span nodes, but the network makes it a bad idea
    data["links"]["inter_node"]["bandwidth_gbps"]["value"] = 1.0
    slow = cluster_from_dict(data)
    report = plan_report(models["medium-llama"], gpus=16, cluster=slow, global_batch=64, mem_limit_gib=12)
    p = _parallelism(report)
    assert p.tp * p.cp <= 8, "the tp (and cp) groups must stay on the fast intra-node link"
    assert p.pp > 1 or p.dp > 1  # what crosses the slow link is pipeline or data parallelism


def test_long_sequence_chooses_context_parallelism(models):
    report = plan_report(models["long-llama"], gpus=8, seq_len=131072, global_batch=1)
    p = _parallelism(report)
    assert p.cp > 1
    assert any("CP=" in line for line in report.why)


def test_pins_are_respected(models):
    report = plan_report(models["tiny-gpt2"], gpus=8, global_batch=64, tp=2, pp=2, zero=1, micro_batch=4,
                         recompute="full", schedule="GPipe")
    p = _parallelism(report)
    assert (p.tp, p.pp, p.dp, p.zero, p.micro_batch, p.recompute, p.schedule) == (2, 2, 2, 1, 4, "full", "GPipe")
    assert p.dp * p.micro_batch * p.num_microbatches == 64
    assert len(report.plan.stages) == 2 and all(s.modules for s in report.plan.stages)


def test_everything_pinned_simulates_that_one_configuration(models):
    pins = dict(tp=2, pp=2, dp=2, cp=1, zero=1, micro_batch=4, grad_accum=1, recompute="selective",
                schedule="1F1B", precision="bf16", optimizer="adamw")
    report = plan_report(models["tiny-gpt2"], gpus=8, global_batch=64, compile="off", **pins)
    p = _parallelism(report)
    assert {k: getattr(p, k) for k in pins} == pins
    assert report.alternatives == ()
    assert report.plan.predicted["step_time_s"] == pytest.approx(report.chosen.step_time_s)


def test_one_gpu_uses_single_device_techniques_to_fit(models):
    roomy = plan_report(models["medium-llama"], gpus=1, global_batch=64)
    # 7 GiB: with the model state offloaded (2 GiB of bf16 weights left on the GPU) and full recompute,
    # micro-batch 4 still needs 7.6 GiB
    tight = plan_report(models["medium-llama"], gpus=1, global_batch=64, mem_limit_gib=7)
    r, t = _parallelism(roomy), _parallelism(tight)
    assert (r.recompute, r.offload_optimizer) == ("none", False)
    assert t.offload_optimizer and t.recompute != "none" and t.micro_batch < r.micro_batch
    assert t.grad_accum == t.num_microbatches and t.micro_batch * t.grad_accum == 64
    assert tight.chosen.peak_memory_bytes <= 7 * GIB


def test_llama_3_8b_fits_one_80gb_gpu_by_offloading_master_weights_gradients_and_optimizer_state():
    """FSDP2's CPUOffloadPolicy (the executor's offload) leaves only the bf16 compute copy on the GPU;
    the fp32 master weights, fp32 gradients and AdamW's moments (16 bytes per parameter) are on the host."""
    report = plan_report("llama-3-8b", gpus=1)
    p = _parallelism(report)
    assert p.offload_optimizer and p.precision == "bf16" and p.dp == 1
    assert report.chosen.peak_memory_bytes <= 80 * GIB
    at_peak = report.chosen.result.memory[0].at_peak
    params = 8_030_261_248
    assert at_peak.host == params * (4 + 4 + 8)
    assert at_peak.weights == params * 2 and at_peak.grads == at_peak.optimizer == 0


def test_chosen_plan_is_at_least_as_fast_as_every_baseline(models):
    report = plan_report(models["medium-llama"], gpus=16, global_batch=64)
    names = [name for name, _ in report.baselines]
    assert names == ["DDP", "FSDP / ZeRO-3", "Megatron grid", "rules of thumb"]
    for _, baseline in report.baselines:
        if baseline is not None:
            assert report.chosen.step_time_s <= baseline.step_time_s


def test_per_op_split_search_finds_megatron_regions_with_sequence_parallel_norms(models):
    import tracer

    graph = tracer.trace(models["medium-llama"], batch=1, seq_len=4096)
    strategy = Strategy(dims=ParallelDims(tp=4, dp_shard=2), train=TrainingConfig(
        global_batch=16, seq_len=4096, micro_batch=1, num_microbatches=8, grad_accum=8, sequence_parallel=True))
    cache = BlockSplitCache()
    ops = graph.ops_of("model.layers")
    picked = solved_splits(ops, graph, strategy, load_cluster("dgx-h100"), cache)
    layer = {op.name.split(":")[0].split(".", 3)[-1] + ":" + op.name.split(":")[1]: split for op, split in zip(ops, picked)}
    for name in ("self_attn.q_proj:linear", "self_attn.k_proj:linear", "mlp.gate_proj:linear", "mlp.up_proj:linear"):
        assert (layer[name].parameter, layer[name].style) == (4, "colwise"), name
    for name in ("self_attn.o_proj:linear", "mlp.down_proj:linear"):
        assert (layer[name].parameter, layer[name].style) == (4, "rowwise"), name
    assert layer["self_attn:scaled_dot_product_attention"].parameter == 4
    assert layer["input_layernorm:pow"].attribute == 4  # sequence-parallel norm statistics
    assert all(split.sample == 2 for split in picked)
    solved = cache.solves
    solved_splits(ops, graph, strategy, load_cluster("dgx-h100"), cache)
    assert cache.solves == solved  # each block type is solved once, then reused


def _named(ops, splits):
    return tuple((op.name, tuple(sorted({"sample": s.sample, "attribute": s.attribute, "parameter": s.parameter}.items())))
                 for op, s in zip(ops, splits))


@pytest.mark.parametrize("sp", [False, True])
def test_megatron_splits_named_as_op_splits_simulate_like_the_default_placement(models, sp):
    import dataclasses

    import tracer
    from costmodel.placement import block_placements
    from costmodel.simulator import simulate
    from costmodel.simulator.pricing import activation_shape

    graph = tracer.trace(models["medium-llama"], batch=1, seq_len=1024)
    strategy = Strategy(dims=ParallelDims(tp=4, dp_shard=2), train=TrainingConfig(
        global_batch=16, seq_len=1024, micro_batch=1, num_microbatches=8, grad_accum=8, sequence_parallel=sp))
    ops = graph.ops_of("model.layers")
    default = [p.split for p in block_placements(ops, strategy, activation_shape(graph, strategy))]
    named = dataclasses.replace(strategy, op_splits=_named(ops, default))
    cluster = load_cluster("dgx-h100")
    assert simulate(graph, named, cluster).step_time_s == pytest.approx(simulate(graph, strategy, cluster).step_time_s)


@pytest.mark.parametrize("sp", [False, True])
def test_searched_op_splits_cost_no_more_than_megatron_and_the_plan_never_simulates_slower(models, sp):
    import dataclasses

    import tracer
    from costmodel.placement import block_placements
    from costmodel.simulator import simulate
    from costmodel.simulator.pricing import activation_shape
    from planner.block_splits import block_tables
    from planner.intra_op import assignment_cost

    graph = tracer.trace(models["medium-llama"], batch=1, seq_len=1024)
    cluster = load_cluster("dgx-h100")
    strategy = Strategy(dims=ParallelDims(tp=4, dp_shard=2), train=TrainingConfig(
        global_batch=16, seq_len=1024, micro_batch=1, num_microbatches=8, grad_accum=8, sequence_parallel=sp))
    ops = graph.ops_of("model.layers")
    choices, nodes, edges = block_tables(ops, graph, strategy, cluster)
    picked = BlockSplitCache().solve(nodes, edges)
    default = [p.split.soap() for p in block_placements(ops, strategy, activation_shape(graph, strategy))]
    index = [next(k for k, c in enumerate(cs) if c.soap() == want) for cs, want in zip(choices, default)]
    assert assignment_cost(picked, nodes, edges) <= assignment_cost(index, nodes, edges) + 1e-12
    report = plan_report(models["medium-llama"], graph=graph, gpus=8, tp=4, pp=1, global_batch=16, seq_len=1024)
    chosen = report.chosen.candidate.strategy
    megatron = simulate(graph, dataclasses.replace(chosen, op_splits=()), cluster)
    assert report.chosen.step_time_s <= megatron.step_time_s


def test_saved_plan_simulates_with_its_searched_op_splits_after_loading(models, tmp_path):
    """plan.json's per-op placements come back as `Strategy.op_splits`: save, load and simulate gives
    the planner's step time, not the Megatron default's."""
    import dataclasses

    import tracer
    from costmodel.simulator import simulate
    from planner.plan import load_plan, stage_bounds

    graph = tracer.trace(models["tiny-gpt2"], batch=1, seq_len=64)
    cluster = load_cluster("dgx-h100")
    report = plan_report(models["tiny-gpt2"], graph=graph, gpus=8, tp=2, pp=2, global_batch=16, seq_len=64)
    chosen = report.chosen.candidate.strategy
    assert chosen.op_splits, "the search picks non-Megatron splits for the tiny GPT-2 at tp=2, pp=2"
    bounds = stage_bounds(report.plan, graph)
    megatron = simulate(graph, dataclasses.replace(chosen, op_splits=()), cluster, stages=bounds).step_time_s
    assert megatron != pytest.approx(report.chosen.step_time_s, rel=1e-9)

    report.plan.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert dict(loaded.strategy().op_splits).items() >= dict(chosen.op_splits).items()
    result = simulate(graph, loaded.strategy(), cluster, stages=stage_bounds(loaded, graph))
    assert result.step_time_s == pytest.approx(report.chosen.step_time_s, rel=1e-12)


def test_the_why_line_says_a_pipeline_crosses_nodes_when_its_stages_span_them(tmp_path):
    """pp is the mesh's outermost dimension: 8 stages of 4 GPUs each on 8-GPU nodes span 4 nodes, even
    though one stage's dp x cp x tp group fits in a node (issue 15: "PP=16 ... inside nodes")."""
    config = dict(MEDIUM_LLAMA, num_hidden_layers=16, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024)
    (tmp_path / "config.json").write_text(json.dumps(config))
    report = plan_report(str(tmp_path), gpus=32, pp=8, gpus_per_node=8, global_batch=64, seq_len=128)
    assert report.plan.parallelism.pp == 8 and report.plan.parallelism.dp * report.plan.parallelism.tp < 8
    assert any(line.startswith("PP=8") and "across nodes" in line for line in report.why)
