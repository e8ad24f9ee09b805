"""Predicted activation memory against torch's own count, and exact model-state bytes.

Activations: for tiny Llama, GPT-2 and BERT configs, the peak bytes of tensors saved for backward,
as `costmodel.memory.activation_bytes` predicts them from the traced graph (less the loss's working set,
gradients that are not saved tensors), against a measurement on a
real CPU model: a `torch.autograd.graph.saved_tensors_hooks` pair that wraps every saved tensor, counts
each storage once while any wrapper holds it, and records the peak over forward and backward
(parameters excluded). With checkpointing, every block runs under reentrant `torch.utils.checkpoint`
(HF's `gradient_checkpointing_enable(use_reentrant=True)`), so the block inputs are saved through the
hooks and the recomputation in backward is seen too. The eager rows predict eager attention from the
SDPA trace (`attention="eager"`) and measure the model built with `attn_implementation="eager"`. The
bfloat16 rows run the model with bf16 parameters (as FSDP's mixed-precision policy computes) and predict
from a graph traced with bf16 parameters (`tracer.trace(..., dtype=torch.bfloat16)`), whose tensors
carry the real dtypes, fp32 upcasts included.

Model state: `model_state_bytes` for the trainable parameters the traced graph names
(`stage_params`), against bytes counted on real tensors: fp32 parameters, their fp32
gradients after backward, and the optimizer state tensors torch.optim creates after one step (AdamW:
exp_avg + exp_avg_sq; SGD: momentum_buffer; the per-tensor `step` scalars are excluded, as documented).

Run: `flock -x /tmp/soap-cpu.lock python -m benchmarks.memory_accuracy`.
"""

from __future__ import annotations

import copy
from dataclasses import replace
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import tracer  # noqa: E402
from benchmarks.report import update_section  # noqa: E402
from costmodel.memory import model_state_bytes, stage_params  # noqa: E402
from costmodel.memory_activations import (  # noqa: E402
    _Sizer, activation_parts, loss_tensors, traced_in_low_precision,
)
from tracer.ir import OpKind  # noqa: E402

BATCH, SEQ, LAYERS = 2, 128, 4


def tiny_configs() -> dict:
    from transformers import BertConfig, GPT2Config, LlamaConfig

    return {
        "llama": LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=LAYERS, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256),
        "gpt2": GPT2Config(n_embd=64, n_layer=LAYERS, n_head=4, vocab_size=1000, n_positions=256,
                           bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
        "bert": BertConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=256,
                           vocab_size=1000, max_position_embeddings=256, attention_probs_dropout_prob=0.0,
                           hidden_dropout_prob=0.0),
    }


class SavedTensorMeter:
    """Peak bytes of distinct storages saved for backward (parameters excluded)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.live: dict[int, list[int]] = {}
        self.current = 0
        self.peak = 0

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return t
        entry = self.live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Held(t, key, self)

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]


class _Held:
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedTensorMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter.release(self.key)


def build(config, *, attention: str, checkpoint: bool):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    torch.manual_seed(0)
    auto = AutoModelForMaskedLM if config.model_type == "bert" else AutoModelForCausalLM
    # from_config records the attention implementation on the config it is given: keep ours clean
    model = auto.from_config(copy.deepcopy(config), attn_implementation=attention)
    model.train()
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model


def measured_saved_peak(config, *, attention: str, checkpoint: bool, dtype=torch.float32) -> int:
    model = build(config, attention=attention, checkpoint=checkpoint).to(dtype)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    meter = SavedTensorMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        out = model(input_ids=ids, labels=ids.clone())
        out.loss.backward()
        del out
    return meter.peak


def predicted_saved_peak(config, *, attention: str, checkpoint: bool, dtype=torch.float32) -> int:
    """The activation peak less the loss's working set (`loss_tensors` of transformers' upcast loss, less what
    it saves: gradients, not saved tensors, which the hooks do not see)."""
    graph = tracer.trace(config, batch=BATCH, seq_len=SEQ, dtype=dtype)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    size = _Sizer(micro_batch=BATCH, batch_traced=graph.batch, split=None, precision=precision,
                  traced_low_precision=traced_in_low_precision(graph.ops))
    working = sum(size(loss_tensors(op, low_precision=dtype == torch.bfloat16, cross_entropy="upcast")) - size(op.saved)
                  for op in graph.ops if op.kind is OpKind.LOSS)
    parts = activation_parts(
        graph.ops, micro_batch=BATCH, batch_traced=graph.batch, recompute="full" if checkpoint else "none",
        attention=attention, block_counts={b.id: b.count for b in graph.blocks}, precision=precision,
        cross_entropy="upcast",
    )
    return replace(parts, epilogue=parts.epilogue - working).peak


def state_rows(config) -> list[tuple[str, int, int]]:
    """(what, predicted, measured) for weights, gradients and optimizer state of one model."""
    graph = tracer.trace(config, batch=BATCH, seq_len=SEQ)
    numel = stage_params(graph.ops, block_counts={b.id: b.count for b in graph.blocks}).trainable
    model = build(config, attention="sdpa", checkpoint=False)
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    model(input_ids=ids, labels=ids.clone()).loss.backward()
    rows = []
    fp32 = model_state_bytes(numel, precision="fp32", optimizer="adamw", zero=0, dp_shard=1, offload_optimizer=False)
    rows.append(("weights fp32", fp32.weights, sum(p.numel() * p.element_size() for p in params)))
    rows.append(("gradients fp32", fp32.grads, sum(p.grad.numel() * p.grad.element_size() for p in params)))
    for name, opt in (("adamw", torch.optim.AdamW(params, lr=1e-3)), ("sgd", torch.optim.SGD(params, lr=1e-3, momentum=0.9))):
        opt.step()
        measured = sum(
            v.numel() * v.element_size()
            for state in opt.state.values() for k, v in state.items() if torch.is_tensor(v) and k != "step"
        )
        predicted = model_state_bytes(numel, precision="fp32", optimizer=name, zero=0, dp_shard=1, offload_optimizer=False)
        rows.append((f"{name} state", predicted.optimizer, measured))
    return rows


def main() -> int:
    torch.set_num_threads(1)
    act_lines = [
        "| model | dtype | attention | checkpointing | predicted MiB | measured MiB | error |",
        "|---|---|---|---|---|---|---|",
    ]
    errors = []
    cases = (
        (torch.float32, "sdpa", False), (torch.float32, "sdpa", True), (torch.float32, "eager", False),
        (torch.bfloat16, "sdpa", False), (torch.bfloat16, "sdpa", True),
    )
    for name, config in tiny_configs().items():
        for dtype, attention, checkpoint in cases:
            pred = predicted_saved_peak(config, attention=attention, checkpoint=checkpoint, dtype=dtype)
            meas = measured_saved_peak(config, attention=attention, checkpoint=checkpoint, dtype=dtype)
            err = (pred - meas) / meas
            errors.append(abs(err))
            act_lines.append(
                f"| {name} | {str(dtype).removeprefix('torch.')} | {attention} | {'full' if checkpoint else 'none'} | "
                f"{pred / 2**20:.3f} | {meas / 2**20:.3f} | {err:+.1%} |"
            )
            print(act_lines[-1], file=sys.stderr)
    state_lines = ["| model | what | predicted bytes | measured bytes | exact |", "|---|---|---|---|---|"]
    for name, config in tiny_configs().items():
        for what, pred, meas in state_rows(config):
            state_lines.append(f"| {name} | {what} | {pred} | {meas} | {'yes' if pred == meas else 'NO'} |")
    body = (
        f"Tiny configs ({LAYERS} layers, hidden 64, vocab 1000), batch {BATCH} x {SEQ} tokens, train mode "
        "with dropout off (on CPU, torch's dropout saves a float32 mask where CUDA saves a bool one, and CPU SDPA "
        "with dropout falls back to the math kernel, so a CPU run with dropout would not test the GPU model). Predicted: `costmodel.memory.activation_bytes` on the graph from "
        "`tracer.trace`, less the loss's working set (gradients, which are not saved tensors). Measured: peak bytes of distinct storages held by autograd's saved tensors over forward "
        "and backward (`saved_tensors_hooks`, parameters excluded; checkpointing via HF's reentrant "
        "`gradient_checkpointing_enable`). Eager rows predict eager attention from the SDPA trace. bfloat16 rows: "
        "the model's parameters in bf16 (FSDP mixed-precision style), predicted from a graph traced with bf16 "
        "parameters, which carries the fp32 upcasts (RMSNorm statistics, loss logits). "
        f"Target: within 10%. Largest error: {max(errors):.1%}; median {sorted(errors)[len(errors) // 2]:.1%}.\n\n"
        + "\n".join(act_lines)
        + "\n\nKnown gap, in what the trace records rather than in the memory model: GPT-2's q, k, v are views of "
        "one c_attn output three times their size, and the trace counts a saved view at the view's size instead "
        "of its base's (about 0.5 MiB short in the fp32 row)."
        + "\n\nModel state (`model_state_bytes` on the trainable parameters the traced graph names, fp32, no ZeRO) "
        "against bytes counted on the real tensors (optimizer state after one step, per-tensor `step` scalars "
        "excluded):\n\n"
        + "\n".join(state_lines)
    )
    update_section("memory-accuracy", "Memory: predicted vs measured", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
