"""On a GPU: the tracer's autocast emulation saves what real CUDA autocast saves, op for op (run by the
lead on a lent GPU; skipped on CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _tiny(kind: str):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if kind == "gpt2":
        config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=128, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        config = LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _split(kind: str, device: str):
    from benchmarks.amp_saved import saved_split
    from tracer.autocast_mode import CudaAutocastEmulation

    model = _tiny(kind).to(device).train()
    ids = torch.randint(0, 512, (2, 64), device=device)
    autocast = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else CudaAutocastEmulation(torch.bfloat16)
    split, _ = saved_split(model, ids, autocast=autocast)
    return split


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_emulated_autocast_saves_the_dtypes_cuda_autocast_saves(kind):
    real, emulated = _split(kind, "cuda"), _split(kind, "cpu")
    floating = ("float32", "bfloat16")  # integer bookkeeping (flash attention's RNG state) differs by device
    assert {d: emulated.by_storage[d] for d in floating} == {d: real.by_storage[d] for d in floating}
    assert {k: n for k, n in emulated.shapes.items() if k[0] in floating} == \
        {k: n for k, n in real.shapes.items() if k[0] in floating}


@pytest.mark.parametrize("op", [
    "pow", "layer_norm", "softmax", "sum", "mm", "linear", "cat_mixed", "exp", "rsqrt", "gelu", "mean",
    "log_softmax", "cross_entropy", "rms_norm", "silu", "mul_mixed", "sdpa", "baddbmm", "group_norm",
])
def test_emulated_op_output_dtype_matches_cuda_autocast(op):
    import torch.nn.functional as F

    from tracer.autocast_mode import CudaAutocastEmulation

    def call(device):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 8, 16, generator=g).to(device)
        h = x.to(torch.bfloat16)
        w = torch.randn(16, 16, generator=g).to(device)
        fns = {
            "pow": lambda: torch.pow(h, 3.0), "layer_norm": lambda: F.layer_norm(h, (16,)),
            "softmax": lambda: F.softmax(h, -1), "sum": lambda: h.sum(-1), "mm": lambda: x[0] @ w,
            "linear": lambda: F.linear(x, w), "cat_mixed": lambda: torch.cat([x, h]), "exp": lambda: h.exp(),
            "rsqrt": lambda: torch.rsqrt(h.abs() + 1), "gelu": lambda: F.gelu(x), "mean": lambda: h.mean(-1),
            "log_softmax": lambda: F.log_softmax(h, -1),
            "cross_entropy": lambda: F.cross_entropy(h[0], torch.zeros(8, dtype=torch.long, device=device)),
            "rms_norm": lambda: F.rms_norm(h, (16,)), "silu": lambda: F.silu(x), "mul_mixed": lambda: x * h,
            "sdpa": lambda: F.scaled_dot_product_attention(x, x, x), "baddbmm": lambda: torch.baddbmm(x.new_zeros(4, 8, 8), x, x.transpose(1, 2)),
            "group_norm": lambda: F.group_norm(h, 4),
        }
        ctx = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else CudaAutocastEmulation(torch.bfloat16)
        with ctx:
            return fns[op]().dtype

    assert call("cpu") == call("cuda")
