"""Selective checkpointing: what the executor's policy (`executor.api.selective_policy`, torchtitan's
"op" policy) keeps through forward is what soap prices (`costmodel.memory_activations.selective_cached`
and `block_saved`), measured tensor by tensor on HF layers on the CPU, and what it recomputes is what the
simulator and the estimator price as the recompute."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from costmodel.memory_activations import _Sizer, block_saved, selective_cached
from executor.api import selective_policy
from tracer.api import trace
from tracer.ir import OpKind

BATCH, SEQ = 2, 32
SMALL = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, vocab_size=128,
             max_position_embeddings=64)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create, while they stay alive; views of the `outside` tensors' storages
    (parameters, rotary tables) are not counted."""

    def __init__(self, outside):
        super().__init__()
        self.live: dict[int, int] = {}
        self.outside = {t.untyped_storage().data_ptr() for t in outside}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and key not in self.outside:
                    self.live[key] = storage.nbytes()
                    weakref.finalize(storage, self.live.pop, key, None)
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.live.values())


def _family(name: str):
    from transformers import BertConfig, GPT2Config, LlamaConfig, MixtralConfig, Qwen2MoeConfig

    if name == "llama":
        return LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **SMALL), "causal-lm"
    if name == "mixtral":  # experts run as grouped_mm, transformers' default, which the executor trains with
        return MixtralConfig(num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             router_jitter_noise=0.0, **SMALL), "causal-lm"
    if name == "qwen2_moe":  # routed experts and a shared expert
        return Qwen2MoeConfig(num_hidden_layers=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1,
                              mlp_only_layers=[], **SMALL), "causal-lm"
    if name == "gpt2":
        return GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0), "causal-lm"
    return BertConfig(num_hidden_layers=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **SMALL), "masked-lm"


def _layer_call(name: str, config, dtype):
    """(the first block as a function of its input, the input, the tensors it reads besides)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = (AutoModelForCausalLM if name != "bert" else AutoModelForMaskedLM).from_config(config).to(dtype)
    x = torch.randn(BATCH, SEQ, 64, dtype=dtype, requires_grad=True)
    if name in ("llama", "mixtral", "qwen2_moe"):
        layer = model.model.layers[0]
        rotary = model.model.rotary_emb(x, torch.arange(SEQ)[None].expand(BATCH, SEQ))
        return (lambda h: layer(h, position_embeddings=rotary, attention_mask=None)), x, (*layer.parameters(), *rotary)
    layer = model.transformer.h[0] if name == "gpt2" else model.bert.encoder.layer[0]
    return (lambda h: layer(h)), x, tuple(layer.parameters())


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "mixtral", "qwen2_moe"])
def test_selective_checkpointing_keeps_what_soap_prices(name, dtype):
    config, task = _family(name)
    torch_dtype = getattr(torch, dtype)
    block, x, outside = _layer_call(name, config, torch_dtype)
    live = LiveBytes((*outside, x))
    with live:
        out = _first(checkpoint(block, x, use_reentrant=False,
                                context_fn=lambda: create_selective_checkpoint_contexts(selective_policy())))
        kept = live.nbytes - out.untyped_storage().nbytes() + x.untyped_storage().nbytes()
    graph = trace(config, task=task, batch=BATCH, seq_len=SEQ, dtype=dtype)
    ops = [op for op in graph.ops if op.block_id == graph.blocks[0].id]
    size = _Sizer(micro_batch=BATCH, batch_traced=BATCH, split={}, precision=None)
    assert size(block_saved(ops, "selective", "sdpa")) == kept
    _first(out).float().sum().backward()  # the recomputation makes the forward's choices


def test_the_policy_caches_every_other_weight_matmul_and_the_attention_cores():
    """On a Llama layer: q, v, gate and down of the seven projections, and the SDPA core."""
    config, task = _family("llama")
    graph = trace(config, task=task, batch=BATCH, seq_len=SEQ, dtype="float32")
    ops = [op for op in graph.ops if op.block_id == graph.blocks[0].id]
    cached = [op.module_fqn.rsplit(".", 1)[-1] if op.kind is OpKind.MATMUL else op.kind.name
              for op, kept in zip(ops, selective_cached(ops, "sdpa"), strict=True) if kept]
    assert cached == ["q_proj", "v_proj", "ATTENTION", "gate_proj", "down_proj"]
    assert not any(op.kind is OpKind.ATTENTION for op, kept in zip(ops, selective_cached(ops, "eager")) if kept)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_simulator_and_the_estimator_price_the_uncached_forward_as_the_recompute(attention):
    """A block's selective recompute is the forward of exactly the ops the policy does not cache: every
    op but q, v, gate, down and (under SDPA) the attention core on a Llama layer."""
    from costmodel.profiles import load_cluster
    from costmodel.simulator.pricing import ProfilePricer, price_step
    from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
    from planner.estimate import Estimator
    from planner.units import model_units

    config, task = _family("llama")
    graph = trace(config, task=task, batch=BATCH, seq_len=SEQ, dtype="bfloat16")
    cluster = load_cluster("dgx-h100-datasheet")  # no host-bound floor: the ops' own prices, not the host's pace
    train = TrainingConfig(global_batch=BATCH, seq_len=SEQ, micro_batch=BATCH, precision="bf16",
                           recompute="selective", attention=attention)
    costs, _ = price_step(graph, Strategy(dims=ParallelDims(), train=train), cluster)
    ops = [op for op in graph.ops if op.block_id == graph.blocks[0].id]
    pricer = ProfilePricer(cluster, "bf16")
    forward = [pricer.op(op, {}, BATCH, graph.batch)[0] for op in ops]
    uncached = sum(f for f, kept in zip(forward, selective_cached(ops, attention), strict=True) if not kept)
    chunk = next(c for c in costs.stages[0].chunks if c.recompute_s > 0)
    assert chunk.recompute_s == pytest.approx(uncached, rel=1e-9)
    assert 0 < uncached < sum(forward)
    estimator = Estimator(graph, cluster, model_units(graph))
    u = next(i for i, unit in enumerate(estimator.units) if unit.id == graph.blocks[0].id)
    assert estimator.unit_time(u, 1, 1, 1, BATCH, "bf16", attention)[2] == pytest.approx(uncached, rel=1e-9)
