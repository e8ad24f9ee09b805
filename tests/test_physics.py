"""Physics the cost model must get right whatever a fit says (issue 16): properties and hand arithmetic."""

import collections
import dataclasses
import sys
from pathlib import Path

import pytest

from costmodel.memory_activations import block_saved
from costmodel.opcost import backward_kernels, has_backward
from costmodel.profiles import load_cluster, load_device
from costmodel.simulator import simulate
from costmodel.simulator.pricing import price_step
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
from planner.estimate import Estimator
from planner.space import MeshChoice
from planner.units import model_units
from tracer.ir import DTYPE_BYTES, OpKind

sys.path.insert(0, str(Path(__file__).parent))
from test_sim_graphs import tiny_decoder  # noqa: E402

GPU_DEVICES = ("a100-sxm-40g", "a100-sxm-80g", "h100-sxm", "h100-x1-measured", "h200-sxm", "l40s", "v100-sxm2-16g")


def _strategy(*, tp=1, pp=1, dp=1, zero=0, mb=1, microbatches=4, seq, precision="bf16", recompute="none", **train):
    grad_accum = microbatches if pp == 1 else 1
    return Strategy(dims=ParallelDims(tp=tp, pp=pp, dp_shard=dp), train=TrainingConfig(
        global_batch=dp * mb * microbatches, seq_len=seq, micro_batch=mb, num_microbatches=microbatches,
        grad_accum=grad_accum, zero=zero, precision=precision, recompute=recompute, **train))


# --- 1. selective recompute never costs more than full --------------------------------------------

def _gpt2_config(path, *, layers, hidden, heads, vocab, positions):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], '
        f'"n_embd": {hidden}, "n_layer": {layers}, "n_head": {heads}, "vocab_size": {vocab}, "n_positions": {positions}}}')
    return path


MESHES = [  # (cluster, mesh and training pins)
    ("dgx-a100-80g", dict(tp=8, pp=8, mb=1, microbatches=16, schedule="1F1B", precision="fp16", sequence_parallel=True)),
    ("dgx-a100-80g", dict(tp=8, pp=8, mb=4, microbatches=16, schedule="Interleaved1F1B", virtual_stages=2,
                          precision="fp16", sequence_parallel=True)),
    ("dgx-h100", dict(tp=2, pp=2, dp=2, mb=2, microbatches=4, schedule="1F1B")),
    ("dgx-h100", dict(dp=8, zero=3, mb=2, microbatches=2)),
    ("dgx-h100", dict(tp=4, dp=4, zero=1, mb=1, microbatches=2, sequence_parallel=True)),
    ("dgx1-v100-16g", dict(dp=4, mb=4, microbatches=2, precision="fp16")),
]


@pytest.fixture(scope="module")
def gpt_graphs(tmp_path_factory):
    import tracer

    root = tmp_path_factory.mktemp("gpt")
    return {
        "tiny-decoder": tiny_decoder(layers=16, seq=64, hidden=64, heads=8),
        "gpt2-small": tracer.trace(str(_gpt2_config(root / "small", layers=16, hidden=256, heads=8, vocab=1024, positions=256)),
                                   seq_len=256),
    }


@pytest.mark.parametrize("cluster,pins", MESHES)
@pytest.mark.parametrize("model", ["tiny-decoder", "gpt2-small"])
def test_selective_recompute_is_never_slower_than_full(gpt_graphs, model, cluster, pins):
    graph, spec = gpt_graphs[model], load_cluster(cluster)
    estimator = Estimator(graph, spec, model_units(graph))
    times, estimates = {}, {}
    for policy in ("none", "selective", "full"):
        strategy = _strategy(seq=graph.seq_len, recompute=policy, **pins)
        times[policy] = simulate(graph, strategy, spec).step_time_s
        estimates[policy] = estimator.estimate(MeshChoice(strategy.dims, strategy.train.zero), strategy.train).step_time_s
    for t in (times, estimates):
        assert t["none"] <= t["selective"] * (1 + 1e-9)
        assert t["selective"] <= t["full"] * (1 + 1e-9)


def test_gpt3_175b_selective_beats_full_on_64_a100s(tmp_path):
    """The issue's case: 96 layers, hidden 12288, 96 heads, seq 2048, tp8 pp8 on 64 A100-80GB, fp16."""
    import tracer

    graph = tracer.trace(str(_gpt2_config(tmp_path, layers=96, hidden=12288, heads=96, vocab=51200, positions=2048)),
                         seq_len=2048)
    cluster = load_cluster("dgx-a100-80g")
    pins = dict(tp=8, pp=8, mb=1, microbatches=64, schedule="1F1B", precision="fp16", sequence_parallel=True)
    costs = {p: price_step(graph, _strategy(seq=2048, recompute=p, **pins), cluster)[0] for p in ("selective", "full")}
    for sel, full in zip(costs["selective"].stages[0].chunks, costs["full"].stages[0].chunks):
        assert sel.recompute_s <= full.recompute_s  # a subset of the forward, no collectives again
        assert sel.bwd_comm_s <= full.bwd_comm_s
    sel, full = (simulate(graph, _strategy(seq=2048, recompute=p, **pins), cluster).step_time_s for p in ("selective", "full"))
    assert sel < full


# --- 2. ZeRO-3 / FSDP over many nodes is communication-bound at micro-batch 1 ------------------------

def test_zero3_at_512_gpus_is_at_least_its_nic_arithmetic_and_the_estimate_agrees():
    """Per micro-batch each GPU gathers all parameters twice (forward; backward with its recompute) at 2
    bytes and reduce-scatters fp32 gradients; a node imports/exports (N-1)/N of it through its g NICs
    (see costmodel.simulator.pricing's ZeRO/FSDP arithmetic)."""
    import tracer

    graph = tracer.trace("llama-3-8b", seq_len=2048)
    cluster = load_cluster("dgx-h100-datasheet")
    gpus, g = 512, cluster.gpus_per_node
    nodes = gpus // g
    strategy = _strategy(dp=gpus, zero=3, mb=1, microbatches=1, seq=2048)
    nic = cluster.inter_node.bandwidth  # per GPU, line rate
    per_microbatch_bytes = graph.params_total * (2 + 2 + 4) * (nodes - 1) / nodes
    hand = per_microbatch_bytes / (g * nic)
    assert hand == pytest.approx(0.158, rel=0.01)
    sim = simulate(graph, strategy, cluster)
    assert sim.step_time_s >= hand
    assert sim.breakdown.exposed_comm > 0  # communication-bound: compute alone is about hand's size
    assert sim.step_time_s >= sim.breakdown.compute + 0.5 * hand
    estimate = Estimator(graph, cluster, model_units(graph)).estimate(MeshChoice(strategy.dims, 3), strategy.train)
    assert estimate.step_time_s >= hand
    assert estimate.step_time_s == pytest.approx(sim.step_time_s, rel=0.15)
    accumulated = _strategy(dp=gpus, zero=3, mb=1, microbatches=2, seq=2048)  # FSDP2 gathers and syncs again
    assert simulate(graph, accumulated, cluster).step_time_s >= 2 * hand


def test_fsdp_backward_prefetch_overlaps_gathers_with_reduce_scatters():
    """Per chunk the dp stream carries one gather and one reduce-scatter while the chunk computes: the
    step is not the serial sum of compute, gathers and syncs."""
    graph = tiny_decoder(layers=8)
    cluster = load_cluster("dgx-h100")
    strategy = _strategy(dp=64, zero=3, mb=1, microbatches=1, seq=graph.seq_len)
    costs, _ = price_step(graph, strategy, cluster)
    chunks = costs.stages[0].chunks
    compute = sum(c.fwd_s + c.bwd_input_s + c.bwd_weight_s for c in chunks)
    comm = sum(2 * c.param_gather_s + c.grad_sync_s for c in chunks)
    step = simulate(graph, strategy, cluster).step_time_s
    assert step >= max(compute, comm)
    assert step < compute + comm


# --- 3. eager attention memory, term by term, against a real CPU forward ---------------------------

def _tiny_bert(**overrides):
    from transformers import BertConfig

    cfg = dict(hidden_size=64, num_attention_heads=4, intermediate_size=256, num_hidden_layers=2, vocab_size=512,
               max_position_embeddings=128, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return BertConfig(**{**cfg, **overrides})


def _measured_layer_saved(cfg, batch, seq):
    """Bytes of activations (parameters excluded) torch saves for backward in encoder layer 0, and the
    elements of the dropout masks among them, from saved-tensor hooks on a real eager forward on CPU."""
    import torch
    from transformers import BertForMaskedLM

    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack = ["<root>"]

    def enter(name):
        return lambda module, args: stack.append(name)

    def leave(module, args, output):
        stack.pop()

    for name, module in model.named_modules():
        if name:
            module.register_forward_pre_hook(enter(name))
            module.register_forward_hook(leave)
    seen, per_module = set(), collections.defaultdict(list)

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen and key not in params:
            seen.add(key)
            per_module[stack[-1]].append(t)
        return t

    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    layer = [t for m, ts in per_module.items() if m.startswith("bert.encoder.layer.0.") for t in ts]
    return sum(t.untyped_storage().nbytes() for t in layer)


def _layer_ops(graph):
    return [op for op in graph.ops if op.block_id is not None and ".layer.0." in op.module_fqn + "."]


def _bytes(tensors):
    return sum(t.numel * DTYPE_BYTES[t.dtype] for t in tensors)


def _with_attention_dropout(ops, p):
    """The traced SDPA op with the dropout its call had (what `tracer.graph._attrs` should record)."""
    return [dataclasses.replace(op, attrs={**op.attrs, "dropout": p}) if op.kind is OpKind.ATTENTION else op
            for op in ops]


def test_eager_bert_layer_keeps_what_torch_saves_on_cpu():
    """Per layer and head, eager attention keeps q, k, v (its two matmuls' inputs), the softmax output,
    the dropout mask and the dropped probabilities, and the output projection's input; the model holds
    the mask at 1 byte (GPU's fused dropout); CPU's unfused dropout keeps it in the input's dtype, as
    every dropout's mask here."""
    import tracer

    batch, seq, p = 4, 128, 0.1
    cfg = _tiny_bert()
    measured = _measured_layer_saved(cfg, batch, seq)
    graph = tracer.trace(_tiny_bert(), seq_len=seq, batch=batch, task="masked-lm")
    ops = _with_attention_dropout(_layer_ops(graph), p)
    kept = block_saved(ops, "none", "eager")
    masks = sum(t.numel for t in kept if t.dtype == "bool")
    assert _bytes(kept) + 3 * masks == measured  # CPU masks at 4 bytes, the model's at 1
    h, s = cfg.num_attention_heads, seq
    probs = batch * h * s * s
    sdpa = block_saved(ops, "none", "sdpa")
    # eager over sdpa: softmax output and dropped probabilities (fp32) and the mask, less the logsumexp
    assert _bytes(kept) - _bytes(sdpa) == probs * (4 + 4 + 1) - batch * h * s * 4


def test_traced_bert_attention_records_its_dropout():
    """Without SDPA's dropout_p in the op's attributes, eager attention memory misses the mask and the
    dropped probabilities."""
    import tracer

    graph = tracer.trace(_tiny_bert(), seq_len=128, batch=4, task="masked-lm")
    attention = [op for op in _layer_ops(graph) if op.kind is OpKind.ATTENTION]
    assert attention and float(attention[0].attrs.get("dropout", 0.0)) == pytest.approx(0.1)


# --- 4. small models on a node: launch and per-collective overheads ---------------------------------

@pytest.mark.parametrize("name", GPU_DEVICES)
def test_gpu_profiles_carry_kernel_and_collective_overheads_with_sources(name):
    device = load_device(name)
    assert device.kernel_overhead_s > 0 and device.collective_call_overhead_s > 0
    assert "collective_call_overhead_us" in device.sources and "kernel_overhead_us" in device.sources


def test_gpt2_on_8_h100s_has_a_launch_floor():
    import tracer

    graph = tracer.trace("gpt2", seq_len=128)
    cluster = load_cluster("dgx-h100")
    strategy = _strategy(dp=8, mb=1, microbatches=1, seq=128)
    device = cluster.device
    kernels = sum(graph.multiplicity(op) * ((1 if op.fwd_flops or op.bytes_moved else 0)
                                            + (backward_kernels(op) if has_backward(op) else 0))
                  for op in graph.ops)
    step = simulate(graph, strategy, cluster).step_time_s
    assert kernels > 300
    assert step >= kernels * device.kernel_overhead_s


def test_sc21_175b_fp16_zero3_needs_350_gb_without_offload_and_its_rings_grow_with_the_ranks(tmp_path):
    """The worked example of costmodel.simulator.pricing: a 175B GPT, fp16, full recompute, batch 1,536 on
    768 A100 80GB. Soap's FSDP2 ZeRO-3 without offload keeps autocast's fp16 copy of every matmul weight
    (350 GB per GPU), the tp8 x pp16 plan fits in 80; its gathers' ring latency doubles with the ranks."""
    import tracer
    from costmodel.collectives import CommGroup, ring_latency
    from executor.validation.refit import simulate_on
    from planner.api import plan_report

    path = _gpt2_config(tmp_path, layers=96, hidden=12288, heads=96, vocab=51200, positions=2048)
    graph = tracer.trace(str(path), seq_len=2048)
    cluster = load_cluster("dgx-a100-80g")
    common = dict(gpus=768, cluster=cluster, graph=graph, seq_len=2048, global_batch=1536, precision="fp16",
                  recompute="full", mem_limit_gib=1e6)
    zero3 = plan_report(str(path), dp=768, tp=1, pp=1, zero=3, micro_batch=1, **common).plan
    three_d = plan_report(str(path), tp=8, pp=16, dp=6, zero=1, micro_batch=1, schedule="1F1B", **common).plan
    peak = {name: max(m.at_peak.total for m in simulate_on(p, graph, cluster).memory) / 2**30
            for name, p in (("zero3", zero3), ("3d", three_d))}
    assert peak["zero3"] > 300 > 80 > peak["3d"]
    latency = {n: ring_latency("all_gather", CommGroup(n, 8), cluster) for n in (384, 768, 1536)}
    assert latency[768] == pytest.approx(672 * 1.9e-6 + 95 * 4e-6, rel=0.01)
    assert latency[1536] > 1.9 * latency[768] > 3.6 * latency[384]


def test_a_host_slower_than_the_kernels_sets_the_chunk_time_and_tp_no_longer_helps():
    """The host-bound floor (costmodel.simulator.pricing): with 1 ms of host time per kernel a tiny model's
    chunk forward is its kernel count x 1 ms, and sharding it over tp shrinks the kernels, not the step."""
    graph = tiny_decoder(layers=2)
    base = load_cluster("dgx-h100")
    slow = dataclasses.replace(base, device=dataclasses.replace(base.device, host_dispatch_s=1e-3))
    plain = price_step(graph, _strategy(seq=graph.seq_len), base)[0].stages[0].chunks
    floored = price_step(graph, _strategy(seq=graph.seq_len), slow)[0].stages[0].chunks
    for p, f in zip(plain, floored):
        assert f.fwd_s >= p.fwd_s
        if p.fwd_s > 0:
            assert f.fwd_s == pytest.approx(round(f.fwd_s / 1e-3) * 1e-3)  # a whole number of dispatches
            assert f.bwd_input_s + f.bwd_weight_s >= p.bwd_input_s + p.bwd_weight_s
    one, two = (simulate(graph, _strategy(seq=graph.seq_len, tp=tp), slow).step_time_s for tp in (1, 2))
    assert two >= 0.95 * one
