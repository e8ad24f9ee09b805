"""A LoRA and a QLoRA step on CPU, measured by live storages, against soap's per-term prediction.

For each case (tiny Llama and GPT-2, fp32 and bf16, lora and qlora) `soap.plan` plans one rank with the
pins below and the executor runs the plan in this process (gloo, one rank). Measured, term by term:
- weights: the storages of the model's parameters and floating buffers, and of each 4-bit weight's
  quantization state (absmax, nested absmax, code tables, offset), each storage once;
- grads: the parameters' gradients after backward;
- optimizer: the optimizer's state tensors after a step (the per-tensor `step` scalars left out, as the
  model leaves them out);
- activations + buffers + grads: the peak of the storages the forward and backward create (a dispatch
  mode tracks each until it is freed), against soap's activations, buffers (QLoRA's dequantized weight)
  and gradients, which are live together at the peak the model counts.
The prediction is the plan's simulated peak (`SimResult.memory`), which equals the planner's estimate
(checked here too). `python -m benchmarks.peft_memory` records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
from typing import Any

FAMILIES = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=96, max_position_embeddings=256,
                  tie_word_embeddings=False),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=4, n_head=4, vocab_size=96, n_positions=256, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}
SEQ, MICRO_BATCH = 128, 2
PEFT = {"rank": 8, "alpha": 16}
CASES = [(family, precision, method) for family in FAMILIES for precision in ("fp32", "bf16")
         for method in ("lora", "qlora")]
RECOMPUTE_CASES = [(family, "fp32", method, policy) for family in FAMILIES
                   for method, policy in (("lora", "full"), ("qlora", "full"), ("lora", "selective"))]
"""Recomputation under PEFT, recorded (not held by a test: its step peak is under-predicted, see the table)."""


def plan_case(family: str, precision: str, method: str, recompute: str = "none") -> Any:
    import dataclasses

    from transformers import AutoConfig

    from costmodel.profiles import load_cluster
    from planner.api import plan_report

    fields = dict(FAMILIES[family])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    # dgx-h100's terms, but the step is measured here, on the CPU, whose SDPA keeps no fp32 score matrices
    # (`costmodel.memory_activations.sdpa_attention`)
    h100 = load_cluster("dgx-h100")
    cluster = dataclasses.replace(h100, device=dataclasses.replace(h100.device, kind="cpu"))
    return plan_report(config, gpus=1, cluster=cluster, global_batch=MICRO_BATCH, seq_len=SEQ, dp=1, zero=0,
                       micro_batch=MICRO_BATCH, recompute=recompute, precision=precision, offload=False, compile=False,
                       peft={"method": method, **PEFT})


class LiveStorages:
    """A dispatch mode that tracks every storage an op creates until it is freed: the peak of live bytes
    (the harness of tests/test_memory.py too). Storages in `existing` (the model's state) are not new: a view of a
    parameter (a linear's transposed weight) returns its storage, which must not count again."""

    def __init__(self, existing: frozenset[int] = frozenset()) -> None:
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        owner = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if hasattr(t, "untyped_storage"):
                        owner.track(t.untyped_storage(), weakref)
                return out

        self.mode, self.live, self.now, self.peak = Mode(), dict.fromkeys(existing, 0), 0, 0

    def track(self, storage: Any, weakref: Any) -> None:
        key = storage.data_ptr()
        if key in self.live or not storage.nbytes():
            return
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, lambda: setattr(self, "now", self.now - self.live.pop(key, 0)))


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _state_tensors(model: Any) -> list:
    import torch

    tensors = [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:
            tensors += [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
            state = getattr(state, "state2", None)
    return tensors


def measure(plan: Any) -> dict[str, int]:
    """One step of `plan` in this process (see the module docstring); bytes per term."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='soap-pg-')}", rank=0,
                                world_size=1)
    try:
        return _measure(plan)
    finally:
        if owned:  # the test suite runs on in this process
            dist.destroy_process_group()


def _measure(plan: Any) -> dict[str, int]:
    import torch

    from executor.api import parallelize
    from executor.data import ScaledTokenLoss, TokenSource
    from executor.data_parallel import build_optimizer
    from executor.model import build_meta_model

    cpu = torch.device("cpu")
    parallel = parallelize(build_meta_model(plan.model.config, plan.model.task, plan=plan), plan, seed=0, device=cpu)
    model = parallel.model
    optimizer = build_optimizer(plan, list(model.parameters()), lr=1e-3, mesh=parallel.mesh)
    source = TokenSource(vocab_size=model.config.vocab_size, global_batch=plan.global_batch, seq_len=plan.seq_len,
                         task=plan.model.task, seed=0)
    loss_fn = ScaledTokenLoss()

    def forward_backward(step: int) -> None:
        batch = source.batch_for_step(step)
        loss_fn.set_step(num_labels=batch.num_labels, ranks_averaging=1)
        with parallel.precision.autocast():
            loss = loss_fn(model(input_ids=batch.input_ids, use_cache=False).logits, batch.labels)
        loss.backward()

    forward_backward(0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    live = LiveStorages(frozenset(t.untyped_storage().data_ptr() for t in _state_tensors(model) if t.numel()))
    with live.mode:
        forward_backward(1)
    grads = _storage_bytes(p.grad for p in model.parameters())
    optimizer_state = _storage_bytes(t for state in optimizer.state.values() for t in state.values()
                                     if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"weights": _storage_bytes(_state_tensors(model)), "grads": grads, "optimizer": optimizer_state,
            "step_peak": live.peak}


def predicted(report: Any) -> dict[str, float]:
    rank = max(report.chosen.result.memory, key=lambda m: m.at_peak.total)
    at_peak = rank.at_peak
    estimate = report.chosen.candidate.estimate.memory
    return {"weights": at_peak.weights, "grads": rank.grads_bytes, "optimizer": at_peak.optimizer,
            "step_peak": at_peak.activations + at_peak.buffers + at_peak.grads,
            "estimate_equals_simulation": float(estimate.total == at_peak.total)}


def rows() -> list[tuple[str, dict, dict]]:
    out = []
    for family, precision, method, recompute in [(*c, "none") for c in CASES] + RECOMPUTE_CASES:
        report = plan_case(family, precision, method, recompute)
        name = f"{family} {precision} {method}" + (f" recompute {recompute}" if recompute != "none" else "")
        out.append((name, measure(copy.deepcopy(report.plan)), predicted(report)))
    return out


def main() -> int:
    from benchmarks.report import update_section

    lines = ["| case | term | measured B | predicted B | error |", "|---|---|---:|---:|---:|"]
    for name, got, want in rows():
        for term in ("weights", "grads", "optimizer", "step_peak"):
            error = (want[term] - got[term]) / got[term] if got[term] else 0.0
            lines.append(f"| {name} | {term} | {got[term]:,} | {want[term]:,.0f} | {error:+.1%} |")
            print(lines[-1], flush=True)
    body = ("A LoRA and a QLoRA step (rank 8, alpha 16, all-linear; 2 x 128 tokens, one rank, no recompute unless "
            "named) measured by live storages on CPU against soap's per-term prediction (`benchmarks/peft_memory.py`; "
            "step_peak: the forward and backward's peak of new storages against activations + buffers + grads). "
            "Without recompute every term is within 5% (tests/test_peft.py holds two cases). Under recompute the "
            "step peak is under-predicted by 5-16%: open, not traced to its cause; the same comparison for full "
            "training (no adapters) is within 5% under full recompute, but there the gradient term, counted whole "
            "though only part of it is live at the peak, may hide a like gap. QLoRA under selective recompute is "
            "refused by the planner (its policy does not see bitsandbytes' matmuls), so it is not in the table.\n\n"
            + "\n".join(lines))
    update_section("peft-memory", "PEFT memory: LoRA and QLoRA steps against the prediction", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
