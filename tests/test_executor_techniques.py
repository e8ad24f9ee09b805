"""Single-process executor behaviour: precisions, optimizers, data, the loss normalization and the seeded init."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
import torch.distributed as dist
from exec_helpers import TASKS, init_single_process_group, make_plan, tiny_config

from executor.data import IGNORE, ScaledTokenLoss, Slicer, TokenSource
from executor.train import RunConfig, train
from tracer.errors import SoapError

RUN = RunConfig(steps=3, lr=1e-2, progress=False)


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    init_single_process_group()
    yield
    dist.destroy_process_group()


def test_bf16_autocast_trains_close_to_fp32():
    fp32 = train(make_plan("llama", micro_batch=4), RUN).losses
    bf16 = train(make_plan("llama", micro_batch=4, precision="bf16"), RUN).losses
    assert bf16 != fp32
    assert bf16 == pytest.approx(fp32, rel=2e-2)


def test_fp16_trains_with_a_gradient_scaler():
    losses = train(make_plan("gpt2", micro_batch=4, precision="fp16"), RUN).losses
    assert all(np.isfinite(losses))


def test_optimizer_offload_trains_like_keeping_it_on_the_device():
    """offload_optimizer runs FSDP2's CPUOffloadPolicy (here on a one-rank mesh: no data parallelism)."""
    plain = train(make_plan("llama", micro_batch=4), RUN).losses
    offloaded = train(make_plan("llama", micro_batch=4, offload_optimizer=True), RUN).losses
    assert offloaded == pytest.approx(plain, rel=1e-5)


def test_an_offloaded_adamw_steps_fused_on_the_host_and_trains_like_foreach():
    """The host's fused AdamW is one pass, 4.1x the foreach one's speed (benchmarks/host_adamw.py), which
    `costmodel.offload` prices; a CPU rank without offload keeps the foreach one. SGD stays foreach on the host too:
    DTensor (FSDP2's parameters) has no sharding rule for torch's fused SGD."""
    from executor.data_parallel import build_optimizer

    offload = make_plan("llama", micro_batch=4, offload_optimizer=True)
    one = [torch.nn.Parameter(torch.zeros(4))]
    assert build_optimizer(offload, one, lr=0.1, mesh=None).defaults["fused"]
    assert build_optimizer(make_plan("llama"), one, lr=0.1, mesh=None).defaults["foreach"]
    plain = train(make_plan("llama", micro_batch=4), RUN).losses
    assert train(offload, RUN).losses == pytest.approx(plain, rel=1e-5)


def test_compiled_blocks_train_like_eager():
    """compile=True compiles every block with torch.compile (inductor's C++ backend on the CPU)."""
    eager = train(make_plan("llama", micro_batch=4), RUN).losses
    compiled = train(make_plan("llama", micro_batch=4, compile=True), RUN).losses
    assert compiled == pytest.approx(eager, rel=1e-4)


def test_fp8_on_a_gpu_without_fp8_is_refused(monkeypatch):
    """An A100 (compute capability 8.0) has no fp8 tensor cores: one error line. On the CPU torchao emulates the
    float8 Linears instead (tests/test_fp8_execute.py)."""
    from executor import precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(SoapError, match="fp8 needs a GPU"):
        precision.convert_fp8(torch.nn.Linear(16, 16), make_plan("llama", micro_batch=4, precision="fp8"))


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")
def test_adamw8bit_without_bitsandbytes_is_refused():
    with pytest.raises(SoapError, match="bitsandbytes"):
        train(make_plan("llama", micro_batch=4, optimizer="adamw8bit"), RUN)


@pytest.mark.parametrize("optimizer", ["adafactor", "sgd"])
def test_planned_optimizer_trains(optimizer):
    losses = train(make_plan("llama", micro_batch=4, optimizer=optimizer), RUN).losses
    assert len(set(losses)) == 3 and all(np.isfinite(losses))


def test_token_file_batches_are_consecutive_windows(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    source = TokenSource(vocab_size=1000, global_batch=2, seq_len=8, task="causal-lm", seed=0, data_file=str(path))
    step1 = source.batch_for_step(1)
    assert step1.input_ids[0].tolist() == list(range(18, 26))
    assert step1.labels[1].tolist() == list(range(28, 36))


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(100))
    with pytest.raises(SoapError, match="vocab size 50"):
        TokenSource(vocab_size=50, global_batch=1, seq_len=8, task="causal-lm", seed=0, data_file=str(path))


def test_masked_lm_labels_only_the_masked_positions():
    batch = TokenSource(vocab_size=96, global_batch=8, seq_len=64, task="masked-lm", seed=3).batch_for_step(0)
    labelled = batch.labels != IGNORE
    assert (batch.input_ids[labelled] == 95).all()  # min(103, vocab - 1) is the mask id
    assert 0.05 < labelled.float().mean() < 0.3


def test_scaled_losses_sum_to_the_global_mean_over_any_split():
    """The loss normalization: micro-batch and rank shards of a batch give back its global mean."""
    torch.manual_seed(0)
    logits, labels = torch.randn(4, 8, 10), torch.randint(0, 10, (4, 8))
    labels[0, :3] = IGNORE
    n = int((labels != IGNORE).sum())
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    loss = ScaledTokenLoss()
    loss.set_step(num_labels=n, ranks_averaging=2)
    per_rank = []
    for dp_rank in range(2):
        shard = Slicer(dp_rank=dp_rank, per_rank=2, cp_rank=0, cp=1)
        local_logits, local_labels = shard.local(logits), shard.local(labels)
        per_rank.append(sum(loss(local_logits[i:i + 1], local_labels[i:i + 1]) for i in range(2)))
    assert (sum(per_rank) / 2).item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_without_a_pipeline_nothing_holds_the_logits_through_backward(monkeypatch, precision):
    """The memory rule `costmodel.memory_activations.loss_tensors` counts no held logits without a
    pipeline: the training loop must have dropped them by the time the loss's backward starts."""
    import weakref

    alive: list[bool] = []
    call = ScaledTokenLoss.__call__

    def watched(self, logits, labels):
        held = weakref.ref(logits)
        loss = call(self, logits, labels)
        loss.register_hook(lambda grad: alive.append(held() is not None))
        return loss

    monkeypatch.setattr(ScaledTokenLoss, "__call__", watched)
    train(make_plan("llama", micro_batch=2, num_microbatches=2, precision=precision), RunConfig(steps=1, progress=False))
    assert alive == [False, False]


def test_without_a_pipeline_the_loss_runs_after_autocast_has_dropped_its_weight_copies(monkeypatch):
    """Autocast caches a 16-bit copy of each weight until its context exits. A recomputed block makes its copies
    again in backward, so the memory model holds none of them (`costmodel.memory.held_autocast_copies`); the
    training loop must leave autocast before the loss, whose forward is the chunked loss's peak."""
    enabled: list[bool] = []
    call = ScaledTokenLoss.__call__

    def watched(self, logits, labels):
        enabled.append(torch.is_autocast_enabled(logits.device.type))
        return call(self, logits, labels)

    monkeypatch.setattr(ScaledTokenLoss, "__call__", watched)
    plan = make_plan("llama", micro_batch=2, num_microbatches=2, precision="bf16", recompute="selective")
    losses = train(plan, RunConfig(steps=2, progress=False)).losses
    assert enabled == [False] * 4 and all(np.isfinite(losses))



def test_a_pipeline_part_autocasts_its_own_forward_and_nothing_after_it():
    """A pipeline stage's part runs its forward under autocast (`PrecisionRuntime.autocast_each_forward`), and
    the schedule's loss and backward run outside it, as the loop without a pipeline does: autocast's cache of
    16-bit weight copies is cleared after each forward."""
    from torch import nn

    from executor.precision import PrecisionRuntime

    seen: list[bool] = []

    class Part(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.is_autocast_enabled("cpu"))
            return self.linear(x)

    part = Part()
    PrecisionRuntime("cpu", torch.bfloat16).autocast_each_forward(part)
    out = part(torch.randn(2, 8))
    assert seen == [True] and out.dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu")
    out.float().sum().backward()
    assert part.linear.weight.grad.dtype == torch.float32
    PrecisionRuntime("cpu", None).autocast_each_forward(fp32 := Part())  # no autocast: no hooks
    assert fp32(torch.randn(2, 8)).dtype == torch.float32 and seen[-1] is False


T5 = dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=2, vocab_size=96,
          dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "mixtral", "qwen2_moe", "deepseek_v3", "t5"])
def test_the_seeded_init_draws_each_parameter_as_hf_does(family):
    """Every parameter of a meta-built model materialized by seed (`executor.model.SeededInit`) is drawn at the
    scale HF's own init gives it: T5's projections at their fan-in scales (they were all drawn at T5's generic
    std of 1.0) and GPT-2's residual projections at 0.02 / sqrt(2 n_layer) (they were drawn at 0.02), both set by
    a parent module's `_init_weights`; constants (norms, biases) exactly."""
    import copy

    import transformers

    from executor.model import build_meta_model, materialize

    config = transformers.AutoConfig.for_model("t5", **T5).to_dict() if family == "t5" else tiny_config(family)
    task = "seq2seq-lm" if family == "t5" else TASKS[family]
    model = build_meta_model(config, task)
    materialize(model, copy.deepcopy(model), torch.device("cpu"), seed=0)
    fields = {k: v for k, v in config.items() if k not in ("transformers_version", "architectures", "model_type")}
    auto = {"causal-lm": transformers.AutoModelForCausalLM, "masked-lm": transformers.AutoModelForMaskedLM,
            "seq2seq-lm": transformers.AutoModelForSeq2SeqLM}[task]
    torch.manual_seed(0)
    hf = dict(auto.from_config(transformers.AutoConfig.for_model(config["model_type"], **fields)).named_parameters())
    compared = 0
    for name, param in model.named_parameters():
        if name not in hf:  # GPT-2's fused c_attn is three Linears here (`executor.model.normalize_for_tp`)
            continue
        ours, theirs = param.detach().float(), hf[name].detach().float()
        if theirs.std() == 0:
            assert torch.equal(ours, theirs), name
        elif theirs.numel() >= 64:
            assert 0.8 < ours.std() / theirs.std() < 1.25, (name, ours.std().item(), theirs.std().item())
        compared += 1
    assert compared >= 0.8 * len(hf)
