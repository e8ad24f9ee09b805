"""torch.compile's activation memory: what Inductor's partitioner saves, priced alike by the planner's
estimate and the simulator, never above eager (`costmodel.memory_activations.compiled_keep`)."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodel.memory_activations import (
    _Sizer, activation_parts, block_saved, chunk_activations, compiled_selective_dropped,
)
from plan_helpers import search_pieces, simulated_as_estimated

from planner.space import mesh_choices, training_choices
from tracer.api import trace

LAYER = dict(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=128)
BATCH, SEQ = 2, 128
ALIASES = frozenset({"t", "view", "_unsafe_view", "transpose", "permute", "expand", "detach", "alias"})
"""ATen ops whose output shares its input's storage."""


def _llama_layer():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(num_hidden_layers=1, attn_implementation="sdpa", **LAYER)
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, 0).to(torch.bfloat16)
    x = torch.randn(BATCH, SEQ, LAYER["hidden_size"], dtype=torch.bfloat16, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(SEQ)[None].expand(BATCH, SEQ))
    return layer, x, cos, sin


def _run(layer, params, x, cos, sin):
    out = torch.func.functional_call(layer, params, (x,), {"position_embeddings": (cos, sin), "attention_mask": None})
    return out[0] if isinstance(out, tuple) else out


class PartitionerSaved:
    """A partition_fn: Inductor's partitioner, recording the bytes its forward hands to backward, each
    storage once, leaving out inputs whose storage is in `outside` (parameters, rotary tables)."""

    def __init__(self, outside_shapes: set[tuple[int, ...]]):
        self.outside_shapes, self.saved = outside_shapes, {}

    def __call__(self, joint, joint_inputs, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        nodes = {n.name: n for n in fw.graph.nodes}
        for node in bw.graph.nodes:
            value = node.meta.get("val")
            if node.op != "placeholder" or node.name.startswith("tangents") or not isinstance(value, torch.Tensor):
                continue
            root = nodes[node.name]
            while root.op == "call_function" and getattr(getattr(root.target, "_overloadpacket", root.target),
                                                         "__name__", "") in ALIASES:
                root = root.args[0]
            if root.op == "placeholder" and tuple(root.meta["val"].shape) in self.outside_shapes:
                continue
            self.saved[root.name] = max(self.saved.get(root.name, 0), value.numel() * value.element_size())
        return fw, bw

    @property
    def bytes(self) -> int:
        return sum(self.saved.values())


def _keep(graph, _):
    return graph


@lru_cache(maxsize=1)
def measured_saved_bytes() -> tuple[int, int]:
    """(eager, partitioner) bytes one bf16 Llama decoder layer saves for backward, parameters and rotary
    tables excluded, each storage once: eager through autograd's saved-tensor hooks, compiled as the
    forward graph that `min_cut_rematerialization_partition` (Inductor's partitioner) hands to backward."""
    from torch._functorch.aot_autograd import aot_function

    layer, x, cos, sin = _llama_layer()
    params = dict(layer.named_parameters())
    outside = {t.untyped_storage().data_ptr() for t in (*params.values(), cos, sin)}
    eager: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in outside:
            eager[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run(layer, params, x, cos, sin)

    partition = PartitionerSaved({tuple(t.shape) for t in (*params.values(), cos, sin)})
    names = list(params)
    fn = aot_function(lambda *a: _run(layer, dict(zip(names, a[:-3])), a[-1], a[-3], a[-2]),
                      fw_compiler=_keep, bw_compiler=_keep, partition_fn=partition)
    fn(*params.values(), cos, sin, x).sum().backward()
    return sum(eager.values()), partition.bytes


@lru_cache(maxsize=1)
def traced_layer_ops():
    from transformers import LlamaConfig

    graph = trace(LlamaConfig(num_hidden_layers=2, **LAYER), task="causal-lm", batch=BATCH, seq_len=SEQ,
                  dtype="bfloat16")
    block = graph.blocks[0].id
    return graph, tuple(op for op in graph.ops if op.block_id == block)


def test_the_partitioner_saves_what_compiled_keep_predicts_on_a_llama_layer():
    eager, compiled = measured_saved_bytes()
    _, ops = traced_layer_ops()
    size = _Sizer(micro_batch=BATCH, batch_traced=BATCH, split={}, precision=None)
    assert size(block_saved(ops, "none", "sdpa")) == pytest.approx(eager, rel=0.01)
    # measured 7,592 bytes per token, the rule 7,584 (the module docstring)
    assert size(block_saved(ops, "none", "sdpa", compiled=True)) == pytest.approx(compiled, rel=0.01)
    assert compiled < 0.8 * eager


def test_compiled_selective_checkpointing_drops_only_the_saved_output_no_backward_reads():
    """The executor's selective policy (`executor.api.selective_policy`: every other weight matmul's and
    every attention core's output is cached) under torch.compile: eagerly the policy caches those outputs
    plus the block input; compiled, the partitioner keeps them all but the last projection's output,
    which only the residual sum reads (2h bytes per token)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from executor.api import selective_policy

    layer, x, cos, sin = _llama_layer()

    def context():
        return create_selective_checkpoint_contexts(selective_policy())

    def block(x):
        return checkpoint(lambda t: _run(layer, dict(layer.named_parameters()), t, cos, sin), x, use_reentrant=False,
                          context_fn=context)

    class CachedOutputs(TorchDispatchMode):
        nbytes = 0
        policy = staticmethod(selective_policy())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if self.policy(SimpleNamespace(is_recompute=False), func) is CheckpointPolicy.MUST_SAVE:
                self.nbytes += sum(t.numel() * t.element_size() for t in (out if isinstance(out, tuple) else (out,))
                                   if isinstance(t, torch.Tensor))
            return out

    with torch.no_grad(), CachedOutputs() as cached:
        _run(layer, dict(layer.named_parameters()), x, cos, sin)
    eager = cached.nbytes + x.numel() * x.element_size()
    partition = PartitionerSaved({tuple(t.shape) for t in (*layer.parameters(), cos, sin)})
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=aot_autograd(fw_compiler=_keep, bw_compiler=_keep, partition_fn=partition))
    compiled(x).sum().backward()
    tokens = BATCH * SEQ
    assert eager - partition.bytes == 2 * LAYER["hidden_size"] * tokens
    # soap's sets: eager selective, and compiled, less the down projection's output
    _, ops = traced_layer_ops()
    size = _Sizer(micro_batch=BATCH, batch_traced=BATCH, split={}, precision=None)
    assert size(block_saved(ops, "selective", "sdpa")) == eager
    assert size(block_saved(ops, "selective", "sdpa")) - size(compiled_selective_dropped(ops, "sdpa")) == partition.bytes


# --- estimator and simulator alike, compile on and off -----------------------------------------------

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "max_position_embeddings": 256, "tie_word_embeddings": False}
CASES = [{}, {"tp": 2}, {"pp": 2}, {"cp": 2}, {"tp": 2, "pp": 2, "precision": "fp32"}]


@pytest.mark.parametrize("pins", CASES, ids=[str(c) for c in CASES])
def test_estimate_and_simulation_agree_with_compile_on_and_off_and_compiled_is_never_above(pins, tmp_path):
    req, estimator, pricer = search_pieces(LLAMA, tmp_path, **pins)
    policies, lower = set(), 0
    for mesh in mesh_choices(req.space):
        per_policy: dict[str, list] = {}
        for train in training_choices(req.space, mesh):
            per_policy.setdefault(train.recompute, []).append(train)
        for train in (t for trains in per_policy.values() for t in trains[::max(1, len(trains) // 4)]):
            peaks = {}
            for compiled in (False, True):
                found = simulated_as_estimated(estimator, pricer, mesh, replace(train, compile=compiled))
                if found is not None:
                    peaks[compiled] = found[1].activations
            if len(peaks) == 2:
                assert peaks[True] <= peaks[False], (mesh, train)
                lower += peaks[True] < peaks[False]
                policies.add(train.recompute)
    assert policies >= {"none", "full"}
    assert lower > 0


# --- compiled <= eager, term by term --------------------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["none", "selective", "full"]), attention=st.sampled_from(["sdpa", "eager"]),
       precision=st.sampled_from(["fp32", "bf16", "fp8"]), tp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]),
       micro_batch=st.integers(1, 4))
def test_compiled_activations_are_never_above_eager(policy, attention, precision, tp, cp, micro_batch):
    graph, ops = traced_layer_ops()
    split = {"parameter": tp, "attribute": cp}
    args = dict(micro_batch=micro_batch, batch_traced=graph.batch, recompute=policy, attention=attention, split=split,
                precision=precision, block_counts={b.id: b.count for b in graph.blocks})
    eager, compiled = activation_parts(graph.ops, **args), activation_parts(graph.ops, compiled=True, **args)
    assert compiled.peak <= eager.peak
    assert (compiled.prologue, compiled.epilogue) == (eager.prologue, eager.epilogue)
    assert compiled.blocks <= eager.blocks and compiled.recompute_window <= eager.recompute_window
    chunk = dict(policy=policy, micro_batch=micro_batch, batch_traced=graph.batch, attention=attention,
                 precision=precision, block_input_bytes=1.0)
    placed = [(op, split) for op in ops]
    kept, window = chunk_activations(placed, compiled=True, **chunk)
    eager_kept, eager_window = chunk_activations(placed, **chunk)
    assert 0 <= kept <= eager_kept and 0 <= window <= eager_window
