"""Front-ends and their fallback, user modules, block detection and dimension roles."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracer
from tracer.errors import SoapError
from tracer.ir import DimRole, OpKind
from tracer_helpers import TINY, tiny_config


class BranchyLM(nn.Module):
    """A model torch.export cannot capture: Python control flow on tensor values."""

    def __init__(self, vocab=100, hidden=32, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
            if h.mean() > 0:  # data-dependent branch
                h = torch.relu(h)
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def test_dispatch_captures_what_export_cannot():
    with pytest.raises(SoapError, match="export"):
        tracer.trace(BranchyLM(), seq_len=16, frontend="export")
    graph = tracer.trace(BranchyLM(), seq_len=16)
    assert graph.frontend == "dispatch"
    assert graph.params_total == sum(p.numel() for p in BranchyLM().parameters())
    assert [(b.id, b.count) for b in graph.blocks] == [("layers", 4)]
    matmuls = [op for op in graph.ops if op.kind is OpKind.MATMUL]
    assert sum(op.fwd_flops * graph.multiplicity(op) for op in matmuls) == 2 * 16 * (4 * 32 * 32 + 32 * 100)


def test_user_module_with_real_weights_is_left_untouched():
    model = BranchyLM()
    before = model.head.weight.detach().clone()
    tracer.trace(model, seq_len=8, frontend="dispatch")
    assert model.head.weight.device.type == "cpu" and torch.equal(model.head.weight, before)


def test_the_callers_config_is_left_untouched():
    """from_config records the attention and experts implementations on the config it is given; a caller
    who builds the model it trains from the same config (soap.plan, then soap.parallelize) must not get
    the tracer's choices (batched_mm experts switched on between a forward and its selective recompute
    broke the recompute)."""
    from transformers import MixtralConfig

    config = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=96, num_local_experts=4, num_experts_per_tok=2)
    before = dict(vars(config))
    tracer.trace(config, task="causal-lm", batch=2, seq_len=16)
    assert dict(vars(config)) == before


def test_failing_every_front_end_lists_each_reason():
    class Broken(nn.Module):
        def forward(self, input_ids, labels=None):
            raise RuntimeError("forward is broken")

    with pytest.raises(SoapError, match=r"tried export: .*broken.*; dispatch: .*broken"):
        tracer.trace(Broken(), seq_len=8)


def test_hf_fx_says_it_needs_transformers_4():
    with pytest.raises(SoapError, match="transformers < 5"):
        tracer.trace(tiny_config("llama", **TINY), seq_len=8, frontend="hf-fx")


@pytest.mark.parametrize("model_type,overrides,stacks", [
    ("llama", TINY, {"model.layers": 3}),
    ("gpt2", dict(n_embd=32, n_layer=3, n_head=2, vocab_size=64), {"transformer.h": 3}),
    ("bert", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, vocab_size=64),
     {"bert.encoder.layer": 3}),
    ("t5", dict(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=4, vocab_size=64),
     {"encoder.block#0": 1, "encoder.block#1": 3, "decoder.block#0": 1, "decoder.block#1": 3}),
])
def test_repeated_blocks_are_found_and_counted(model_type, overrides, stacks):
    graph = tracer.trace(tiny_config(model_type, **overrides), seq_len=16)
    assert {b.id: b.count for b in graph.blocks} == stacks
    for block in graph.blocks:
        assert len(block.indices) == block.count and block.id.startswith(block.stack)
    for block in graph.blocks:
        instances = {op.module_fqn.split(block.id.split("#")[0] + ".")[1].split(".")[0]
                     for op in graph.ops if op.block_id == block.id}
        assert len(instances) == 1  # one representative instance per block type


def test_truncated_trace_equals_full_trace():
    config = tiny_config("llama", **dict(TINY, num_hidden_layers=6))
    graph = tracer.trace(config, seq_len=32)
    assert graph.blocks[0].traced == 2 and graph.blocks[0].count == 6
    full = tracer.trace(config, seq_len=32, frontend="dispatch")
    assert graph.fwd_flops == full.fwd_flops and graph.bwd_flops == full.bwd_flops


def test_roles_label_batch_sequence_and_hidden():
    graph = tracer.trace("llama-3-8b", batch=2, seq_len=64)
    q = next(op for op in graph.ops if op.module_fqn.endswith("q_proj"))
    assert q.outputs[0].shape == (2, 64, 4096)
    assert q.outputs[0].roles == (DimRole.SAMPLE, DimRole.ATTRIBUTE, DimRole.PARAMETER)
    attn = next(op for op in graph.ops if op.kind is OpKind.ATTENTION)
    assert attn.inputs[0].roles == (DimRole.SAMPLE, DimRole.PARAMETER, DimRole.ATTRIBUTE, DimRole.PARAMETER)
    assert attn.attrs == {"heads": 32, "kv_heads": 8, "head_dim": 128, "causal": True, "dropout": 0.0}
    one = tracer.trace("llama-3-8b", batch=1, seq_len=64)
    q1 = next(op for op in one.ops if op.module_fqn.endswith("q_proj"))
    assert q1.outputs[0].roles[0] is DimRole.SAMPLE  # a batch of one keeps its sample dim
    assert all(op.bytes_moved == 0 for op in graph.ops if op.kind is OpKind.VIEW)


def test_repeated_trace_is_cached():
    a = tracer.trace("gpt2", seq_len=32)
    assert tracer.trace("gpt2", seq_len=32) is a


def test_graph_survives_a_json_round_trip():
    from tracer.serialize import graph_from_dict, graph_to_dict

    graph = tracer.trace(tiny_config("t5", d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=3, vocab_size=64),
                         seq_len=16)
    again = graph_from_dict(graph_to_dict(graph))
    assert again == graph


def test_disk_cache_returns_the_same_graph_without_retracing(tmp_path, monkeypatch):
    import tracer.api as api

    monkeypatch.setenv("SOAP_CACHE_DIR", str(tmp_path))
    first = tracer.trace("gpt2", seq_len=24, persistent_cache=True)
    assert len(list(tmp_path.glob("*.json"))) == 1
    api._CACHE.clear()
    monkeypatch.setattr(api, "_trace_uncached", lambda *a: pytest.fail("traced again despite the disk cache"))
    assert tracer.trace("gpt2", seq_len=24, persistent_cache=True) == first


def test_importing_tracer_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, tracer, tracer.ir, tracer.serialize; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))


def test_vision_model_traces_its_patch_tokens():
    config = tiny_config("vit", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         image_size=32, patch_size=8, num_labels=10)
    graph = tracer.trace(config, batch=2)
    assert graph.task == "image-cls" and graph.seq_len == 17  # (32/8)^2 patches + [CLS]
    with pytest.raises(SoapError, match="does not apply"):
        tracer.trace(config, seq_len=100)


def test_bf16_trace_halves_activation_bytes_of_bf16_ops():
    fp32 = tracer.trace("llama-3-8b", seq_len=64)
    bf16 = tracer.trace("llama-3-8b", seq_len=64, dtype="bfloat16")
    q = next(op for op in bf16.ops if op.module_fqn.endswith("q_proj"))
    assert q.outputs[0].dtype == "bfloat16" and q.params[0].dtype == "bfloat16"
    assert bf16.params_total == fp32.params_total and bf16.fwd_flops == fp32.fwd_flops
    assert bf16.activation_bytes < 0.75 * fp32.activation_bytes  # RMSNorm and the loss still upcast to fp32
    with pytest.raises(SoapError, match="floating dtype"):
        tracer.trace("gpt2", dtype="int8")


def test_moe_expert_matmuls_keep_the_flattened_token_dim():
    """The routed tokens are [batch * seq * top_k]: a token dim, which the micro-batch scales and context
    parallelism divides."""
    graph = tracer.trace("mixtral-8x7b", batch=2, seq_len=16)
    bmms = [op for op in graph.ops if op.module_fqn.endswith("experts") and op.target.startswith("aten.bmm")]
    assert len(bmms) == 2
    for op in bmms:
        assert op.outputs[0].shape[0] == 2 * 16 * 2  # tokens x experts per token
        assert op.outputs[0].roles[0] is DimRole.TOKEN
        assert op.saved_bytes < op.inputs[0].nbytes  # the gathered expert weights are not activations
    labels_pad = next(op for op in graph.ops if op.target.startswith(("aten.pad", "aten.constant_pad_nd")))
    assert labels_pad.outputs[0].roles == (DimRole.SAMPLE, DimRole.ATTRIBUTE)


def test_transpose_then_contiguous_is_a_copy_but_plain_views_move_nothing():
    graph = tracer.trace("llama-3-8b", batch=2, seq_len=64)
    attn_out = next(op for op in graph.ops if op.target.startswith("aten.contiguous") and op.block_id)
    assert attn_out.kind is OpKind.COPY and attn_out.bytes_moved == 2 * attn_out.outputs[0].nbytes
    assert all(op.bytes_moved == 0 for op in graph.ops if op.kind is OpKind.VIEW)


@pytest.mark.parametrize("name", ["gpt2", "llama-3-8b", "mixtral-8x7b", "bert-base-uncased"])
def test_presets_capture_with_dispatch_first_and_match_export(name):
    graph = tracer.trace(name, seq_len=128)
    exported = tracer.trace(name, seq_len=128, frontend="export")
    assert graph.frontend == "dispatch"
    assert (graph.params_total, graph.fwd_flops, graph.bwd_flops) == \
        (exported.params_total, exported.fwd_flops, exported.bwd_flops)
    assert graph.activation_bytes == pytest.approx(exported.activation_bytes, rel=0.005)


def test_config_file_of_a_preset_keeps_the_export_first_chain(tmp_path):
    from tracer.spec import PRESET_DIR

    (tmp_path / "config.json").write_text((PRESET_DIR / "gpt2.json").read_text())
    assert tracer.trace(str(tmp_path), seq_len=32).frontend == "export"


def test_dispatch_contiguous_after_transpose_aliases_what_attention_saved():
    """`.transpose(1, 2).contiguous()` of the attention output is recorded as `contiguous` (as export does),
    so the output projection's saved input is the attention output autograd already keeps, not a second copy."""
    graph = tracer.trace("llama-3-8b", seq_len=64, frontend="dispatch")
    o_proj = next(op for op in graph.ops if op.module_fqn.endswith("o_proj"))
    assert o_proj.saved == ()
    assert any(op.target == "aten.contiguous.default" and op.kind is OpKind.COPY for op in graph.ops)
