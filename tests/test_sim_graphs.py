"""Hand-made OpGraphs for simulator tests: a tiny decoder with Llama's module names, no tracer needed."""

from tracer.ir import Block, DimRole, ModelDims, OpGraph, OpKind, OpNode, ParamMeta, TensorMeta

S, A, P, N = DimRole.SAMPLE, DimRole.ATTRIBUTE, DimRole.PARAMETER, DimRole.NONE


def _t(*shape, roles, dtype="float32"):
    return TensorMeta(tuple(shape), dtype, tuple(roles))


def _linear(name, block, b, s, k, n, *, bias=False):
    x, y = _t(b, s, k, roles=(S, A, P)), _t(b, s, n, roles=(S, A, P))
    w = ParamMeta(f"{name}.weight", (n, k), "float32")
    flops = 2 * b * s * k * n
    return OpNode(f"{name}:linear", OpKind.MATMUL, "aten.linear.default", name, block, (x, _t(n, k, roles=(P, P))), (y,),
                  (w,), flops, 2 * flops, x.nbytes + y.nbytes + n * k * 4, (x,))


def _elementwise(name, module, block, b, s, h, kind=OpKind.ELEMENTWISE, params=()):
    x = _t(b, s, h, roles=(S, A, P))
    return OpNode(name, kind, "aten.add.Tensor", module, block, (x, x), (x,), params, b * s * h, b * s * h, 3 * x.nbytes, (x,))


def tiny_decoder(*, layers=4, batch=2, seq=64, hidden=64, ffn=128, heads=4, vocab=256) -> OpGraph:
    b, s, h = batch, seq, hidden
    blk = "model.layers"
    pre = "model.layers.0"
    ids = _t(b, s, roles=(S, A), dtype="int64")
    emb_out = _t(b, s, h, roles=(S, A, P))
    embed = OpNode("model.embed_tokens:embedding", OpKind.EMBEDDING, "aten.embedding.default", "model.embed_tokens", None,
                   (_t(vocab, h, roles=(P, P)), ids), (emb_out,), (ParamMeta("model.embed_tokens.weight", (vocab, h), "float32"),),
                   0, 0, emb_out.nbytes, (ids,))
    q = _t(b, heads, s, h // heads, roles=(S, P, A, P))
    attn = OpNode(f"{pre}.self_attn:sdpa", OpKind.ATTENTION, "aten.sdpa", f"{pre}.self_attn", blk, (q, q, q), (q,), (),
                  4 * b * s * s * h, 8 * b * s * s * h, 4 * q.nbytes, (q, q, q, q))
    norm_w = ParamMeta(f"{pre}.input_layernorm.weight", (h,), "float32")
    ops_block = (
        _elementwise(f"{pre}.input_layernorm:mul", f"{pre}.input_layernorm", blk, b, s, h, OpKind.NORM, (norm_w,)),
        _linear(f"{pre}.self_attn.q_proj", blk, b, s, h, h),
        _linear(f"{pre}.self_attn.k_proj", blk, b, s, h, h),
        _linear(f"{pre}.self_attn.v_proj", blk, b, s, h, h),
        attn,
        _linear(f"{pre}.self_attn.o_proj", blk, b, s, h, h),
        _elementwise(f"{pre}:add", pre, blk, b, s, h),
        _linear(f"{pre}.mlp.up_proj", blk, b, s, h, ffn),
        _elementwise(f"{pre}.mlp.act_fn:silu", f"{pre}.mlp.act_fn", blk, b, s, ffn),
        _linear(f"{pre}.mlp.down_proj", blk, b, s, ffn, h),
        _elementwise(f"{pre}:add#2", pre, blk, b, s, h),
    )
    head = _linear("lm_head", None, b, s, h, vocab)
    logits = _t(b * s, vocab, roles=(S, P))
    loss = OpNode("model:cross_entropy_loss", OpKind.LOSS, "aten.cross_entropy_loss", "", None, (logits, _t(b * s, roles=(S,), dtype="int64")),
                  (_t(roles=()),), (), 3 * b * s * vocab, 2 * b * s * vocab, logits.nbytes, (logits,))
    ops = (embed, *ops_block, head, loss)
    block_params = 4 * h * h + 2 * h * ffn + h
    total = vocab * h * 2 + layers * block_params
    return OpGraph(
        model="tiny-decoder", task="causal-lm", batch=b, seq_len=s, ops=ops,
        blocks=(Block(blk, "TinyDecoderLayer", layers, 1),), params_total=total, params_trainable=total,
        dims=ModelDims(num_layers=layers, hidden=h, heads=heads, kv_heads=heads, head_dim=h // heads, ffn=ffn, vocab=vocab),
        frontend="hand",
    )


def test_tiny_decoder_is_prologue_block_epilogue():
    graph = tiny_decoder(layers=3)
    segments = list(graph.segments())
    assert [(s.block_id, s.repeat) for s in segments] == [(None, 1), ("model.layers", 3), (None, 1)]
    assert graph.fwd_flops > 0 and graph.bwd_flops > graph.fwd_flops


def test_layer_names_are_real_module_paths_for_a_second_layer_type():
    import dataclasses

    from costmodel.simulator.stages import layer_sequence

    graph = tiny_decoder(layers=3)
    renamed = tuple(
        dataclasses.replace(op, block_id="model.layers#1", module_fqn=op.module_fqn.replace("model.layers.0", "model.layers.1"))
        if op.block_id else op
        for op in graph.ops
    )
    graph = dataclasses.replace(graph, ops=renamed, blocks=(dataclasses.replace(graph.blocks[0], id="model.layers#1"),))
    names = [layer.name for layer in layer_sequence(graph)]
    assert names == ["<prologue>", "model.layers.1", "model.layers.2", "model.layers.3", "<epilogue>"]
