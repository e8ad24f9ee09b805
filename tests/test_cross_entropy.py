"""The chunked cross-entropy (`executor.cross_entropy`) computes torch's loss and gradient.

Against `F.cross_entropy(logits.float(), reduction="sum")`: the summed loss and the logits' gradient, in fp32
and bf16, with ignored labels, for chunk counts that do and do not divide the tokens (and more chunks than
tokens), and with every label ignored; a meta tensor (a pipeline's shape inference) gives a meta scalar. Its
memory is `tests/test_memory.py`'s; vocabulary-parallel logits (a DTensor sharded over 2 gloo ranks, an uneven
vocabulary too) train like one process in `tests/test_executor_multiprocess.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from costmodel.opcost import (CHUNKED_LOSS_KERNELS, UPCAST_LOSS_KERNELS, VOCAB_PARALLEL_LOSS_KERNELS,
                              extra_loss_kernels)
from executor.cross_entropy import IGNORE, chunked_cross_entropy


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(x.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    (loss * 0.37).backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("chunks", [1, 3, 8, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_gradient_are_torchs_cross_entropy(dtype, chunks):
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 37, 61)).to(dtype).requires_grad_()
    labels = torch.randint(0, 61, (2, 37))
    labels[0, :5] = IGNORE
    labels[1, -1] = IGNORE
    expected_loss, expected_grad = _reference(logits, labels)
    loss = chunked_cross_entropy(logits, labels, chunks=chunks)
    (loss * 0.37).backward()
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    assert logits.grad.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: the gradient rounded once more
    assert torch.allclose(logits.grad.float(), expected_grad.float(), atol=tolerance, rtol=0)
    assert not logits.grad[0, :5].any()  # ignored tokens get no gradient


def test_every_label_ignored_gives_zero_loss_and_gradient():
    logits = torch.randn(4, 10, requires_grad=True)
    loss = chunked_cross_entropy(logits, torch.full((4,), IGNORE))
    loss.backward()
    assert loss.item() == 0 and not logits.grad.any()


METADATA_OPS = ("view", "squeeze", "unsqueeze", "slice", "select", "alias", "detach", "expand", "as_strided",
                "t.default", "transpose", "empty")
"""ATen ops that launch no kernel: views and allocations."""


def _kernels(fn, aten_only: bool = False) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Count() as count:
        fn()
    return sum(not any(op.startswith(f"aten.{m}") for m in METADATA_OPS) and (op.startswith("aten.") or not aten_only)
               for op in count.ops)


def test_the_kernels_each_loss_launches_are_the_ones_priced():
    """`costmodel.opcost` prices the traced (upcast) loss's kernels and a launch overhead for each kernel more
    the chunked one launches: 6 per slice and 16 once, against the upcast one's 6; fp32 logits one a slice
    fewer (no copy)."""
    from executor.data import ScaledTokenLoss

    labels = torch.randint(0, 100, (1, 64))

    def step(loss: str, chunks: int | None = None, dtype: torch.dtype = torch.bfloat16) -> int:
        logits = torch.randn(1, 64, 100, dtype=dtype, requires_grad=True)
        if chunks is None:
            return _kernels(lambda: ScaledTokenLoss(loss)(logits, labels).backward())
        return _kernels(lambda: chunked_cross_entropy(logits, labels, chunks=chunks).backward())

    per_slice, once = CHUNKED_LOSS_KERNELS
    assert step("chunked", 8) - step("chunked", 4) == 4 * per_slice
    assert step("chunked", 8, torch.float32) - step("chunked", 4, torch.float32) == 4 * (per_slice - 1)
    assert step("chunked", 1) == per_slice + once + 1  # + the backward's seed (ones_like)
    # small logits: one slice
    assert step("chunked") - step("upcast") == extra_loss_kernels("chunked", 1) == per_slice + once - UPCAST_LOSS_KERNELS


def test_the_vocabulary_parallel_path_launches_the_kernels_priced():
    """Logits sharded on the vocabulary (here over a one-rank gloo group) take the in-place path: its ATen
    kernels (the all-reduces are priced as collectives) are `VOCAB_PARALLEL_LOSS_KERNELS`, and its loss and
    gradient are still torch's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        full = (3 * torch.randn(64, 100)).to(torch.bfloat16)
        labels = torch.randint(0, 100, (64,))
        labels[:3] = IGNORE
        expected_loss, expected_grad = _reference(full, labels)

        def run(chunks: int) -> tuple[int, torch.Tensor, torch.Tensor]:
            local = full.clone().requires_grad_()
            sharded = distribute_tensor(local.detach(), mesh, [Shard(-1)]).requires_grad_()
            out: list[torch.Tensor] = []
            n = _kernels(lambda: out.append(chunked_cross_entropy(sharded, labels, chunks=chunks)), aten_only=True)
            (out[0] * 0.37).backward()
            return n, out[0], sharded.grad.to_local()

        per_slice, _ = VOCAB_PARALLEL_LOSS_KERNELS
        (n4, loss, grad), (n8, _, _) = run(4), run(8)
        assert n8 - n4 == 4 * per_slice
        assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
        assert torch.allclose(grad.float(), expected_grad.float(), atol=4e-3, rtol=0)
    finally:
        dist.destroy_process_group()


def test_slices_follow_the_logits_size():
    from costmodel.opcost import CROSS_ENTROPY_SLICE_BYTES, cross_entropy_slices

    assert cross_entropy_slices(1e6) == 1 and cross_entropy_slices(CROSS_ENTROPY_SLICE_BYTES + 1) == 2
    assert cross_entropy_slices(4096 * 128256 * 4) == 4  # one Llama 3 sequence of 4k tokens
    assert cross_entropy_slices(16384 * 128256 * 4) == 8 and cross_entropy_slices(1e12) == 8
    assert cross_entropy_slices(1e12, tokens=3) == 3


def test_a_meta_tensor_gives_a_meta_scalar():
    loss = chunked_cross_entropy(torch.empty(2, 16, 50, device="meta", requires_grad=True),
                                 torch.empty(2, 16, dtype=torch.long, device="meta"))
    assert loss.device.type == "meta" and loss.shape == ()


# --- through the planner: the estimate and the simulator price each loss alike --------------------------------

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096,
         "max_position_embeddings": 256, "tie_word_embeddings": False}
"""A vocabulary large beside the hidden size, so that the loss is the activations' largest term."""
CASES = [{}, {"tp": 2}, {"pp": 2}, {"cp": 2}, {"tp": 2, "pp": 2, "precision": "fp32"}, {"precision": "fp8"}]


@pytest.mark.parametrize("pins", CASES, ids=[str(c) for c in CASES])
def test_estimate_and_simulation_agree_for_each_loss_and_the_chunked_one_holds_less(pins, tmp_path):
    from dataclasses import replace

    from plan_helpers import search_pieces, simulated_as_estimated

    from planner.space import mesh_choices, training_choices

    req, estimator, pricer = search_pieces(LLAMA, tmp_path, **pins)
    compared = 0
    for mesh in mesh_choices(req.space):
        trains = list(training_choices(req.space, mesh))
        for train in trains[::max(1, len(trains) // 6)]:
            peaks, steps = {}, {}
            for loss in ("chunked", "upcast"):
                found = simulated_as_estimated(estimator, pricer, mesh, replace(train, cross_entropy=loss))
                if found is not None:
                    peaks[loss], steps[loss] = found[1].activations, found[0].result.step_time_s
            if len(peaks) == 2:
                assert peaks["chunked"] < peaks["upcast"], (mesh, train)
                # the same passes over the logits, and a launch more for each extra kernel, per micro-batch
                device = req.cluster.device
                launches = extra_loss_kernels("chunked", 8, True) * max(device.kernel_overhead_s, device.host_dispatch_s)
                assert 0 < steps["chunked"] - steps["upcast"] <= train.num_microbatches * launches
                compared += 1
    assert compared > 0
