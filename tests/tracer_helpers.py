"""Shared helpers for the tracer tests: tiny configs and torch's own measurements of a real step."""

from __future__ import annotations

import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import flop_counter as fc

from tracer.build import build_model
from tracer.inputs import example_inputs
from tracer.spec import resolve_spec

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **overrides)


def _cpu_sdpa_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return fc.sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return fc.sdpa_backward_flop_count(grad_out, query, key, value)


CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
}
"""flop_counter has no formula for CPU flash attention; these apply its SDPA formulas to it."""


def without_dropout(config):
    """A copy of `config` with every dropout probability 0: CPU dropout saves float masks (CUDA's saves
    bool ones) and CPU attention falls back to unfused math under dropout."""
    import copy

    config = copy.deepcopy(config)
    for sub in [config, *[v for v in vars(config).values() if hasattr(v, "to_dict")]]:
        for key, value in list(vars(sub).items()):
            if isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "drop_rate", "drop_prob")):
                setattr(sub, key, 0.0)
    return config


def real_step(config, task: str, batch: int, seq_len: int, *, seed: int = 0):
    """Build `config` with random weights on CPU and run one forward+backward under flop and saved-tensor
    measurement. Returns (total flops, bytes of distinct non-parameter tensors saved for backward)."""
    torch.manual_seed(seed)
    spec = resolve_spec(config, task=task)
    model = build_model(spec, device="cpu")
    model.train()
    inputs = example_inputs(model, task, batch, seq_len, device="cpu")
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_storages:
            saved[ptr] = max(saved.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")  # the reference loop over experts, with real routing
    counter = fc.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)
    # The fused CPU kernel, whose backward flop_counter prices as the tracer does (the math fallback
    # decomposes into bmms whose backward costs 2x forward instead of SDPA's 2.5x).
    with counter, sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**inputs).loss
        loss.backward()
    return counter.get_total_flops(), sum(saved.values())


TINY_GPT2 = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 8,
    "vocab_size": 8192, "n_positions": 1024,
}
"""A 4-layer gpt2 that plans in well under a second (a MODEL directory holding its config.json)."""


def config_dir(tmp_path_factory, name: str, config: dict) -> str:
    """A fresh directory named `name` holding `config` as config.json: what `soap plan DIR` takes as MODEL."""
    path = tmp_path_factory.mktemp(name)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
