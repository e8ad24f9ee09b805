"""Context parallelism's layout and attention (`executor.context_parallel`, `executor.data.cp_chunks`): each rank's
two chunks, attended through the lower-right causal kernels against the gathered keys, give exactly the whole
sequence's causal attention at those positions; the multiprocess tests run it end to end (`-k cp`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor.context_parallel import _in_sequence_order, cp_attention
from executor.data import Slicer, cp_chunks, cp_position_ids


def _positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    return torch.cat([torch.arange(start, start + size) for start, size in cp_chunks(seq, cp, rank)])


@pytest.mark.parametrize("cp", [2, 4])
def test_every_rank_holds_two_chunks_and_together_the_sequence(cp):
    seq = 8 * cp
    held = [_positions(seq, cp, rank) for rank in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    assert all(len(p) == seq // cp for p in held)
    assert held[0][0] == 0 and held[0][-1] == seq - 1  # rank 0: the first and the last chunk
    assert torch.equal(cp_position_ids(seq, cp, 1, torch.device("cpu"))[0], held[1])
    ids = torch.arange(2 * seq).view(2, seq)
    assert torch.equal(Slicer(dp_rank=1, per_rank=1, cp_rank=1, cp=cp).local(ids)[0], held[1] + seq)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_each_rank_attends_as_the_whole_causal_sequence_does(cp, kv_heads):
    torch.manual_seed(0)
    seq, heads, dim = 16 * cp, 4, 8
    q = torch.randn(2, heads, seq, dim, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, seq, dim, dtype=torch.float64) for _ in range(2))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    for rank in range(cp):
        mine = _positions(seq, cp, rank)
        out = cp_attention(q[:, :, mine], k, v, rank=rank, cp=cp, causal=True)
        torch.testing.assert_close(out, whole[:, :, mine])
    encoder = F.scaled_dot_product_attention(q, k, v, enable_gqa=kv_heads != heads)
    torch.testing.assert_close(cp_attention(q[:, :, mine], k, v, rank=cp - 1, cp=cp, causal=False),
                               encoder[:, :, mine])


def test_under_autocast_mixed_input_dtypes_attend_as_sdpa_would():
    """SDPA under autocast casts its inputs to the autocast dtype; the lower-right mask's dispatch comes before
    autocast, so the executor casts them itself (an fp8 plan's projections reached it as fp32 queries and keys and
    bf16 values: "Expected query, key, and value to have the same dtype")."""
    torch.manual_seed(0)
    cp, seq = 2, 32
    q, k = torch.randn(1, 4, seq, 8), torch.randn(1, 2, seq, 8)
    v = torch.randn(1, 2, seq, 8).bfloat16()
    mine = _positions(seq, cp, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cp_attention(q[:, :, mine], k, v, rank=1, cp=cp, causal=True)
        whole = F.scaled_dot_product_attention(q, k, v.float(), is_causal=True, enable_gqa=True)
    assert out.dtype == whole.dtype == torch.bfloat16
    torch.testing.assert_close(out, whole[:, :, mine])


def test_the_gathered_chunks_go_back_in_sequence_order():
    cp, seq = 4, 32
    k = torch.randn(1, 2, seq, 3)
    gathered = torch.cat([k[:, :, _positions(seq, cp, rank)] for rank in range(cp)], dim=2)  # all_gather's order
    assert torch.equal(_in_sequence_order(gathered, cp), k)


def test_the_executors_two_kernels_add_up_to_the_ranks_share():
    from costmodel.context_attention import pieces

    assert pieces(100.0, 10.0, 1) == ((100.0, 10.0, False),)
    for cp in (2, 4, 8):
        (f_sq, b_sq, lr_sq), (f_lr, b_lr, lr_lr) = pieces(100.0, 10.0, cp)
        assert (lr_sq, lr_lr) == (False, True)
        assert f_sq + f_lr == pytest.approx(100.0) and b_sq + b_lr == pytest.approx(10.0)
        assert f_sq == pytest.approx(100.0 / (4 * cp))  # c x c causal of the whole's 4 cp^2 such squares / cp


def _attention_price(cluster: str, cp: int, layout: str, seq: int = 32768) -> float:
    """soap's price of one rank's attention core of Llama-3-8B's layer (`benchmarks.cp_attention.priced`): "ring"
    at `cp`, "all-gather" as soap's executor runs it."""
    from benchmarks import cp_attention

    return cp_attention.priced(cluster, seq, cp, "soap" if layout == "all-gather" else "ring")


def test_context_parallel_attention_is_priced_as_the_layout_that_runs_it():
    """A ring is priced as the whole causal attention over cp (one kernel); soap's executor as its two kernels, the
    rectangular lower-right one on FlashAttention-2: 1.76x cuDNN's time on Hopper, the kernel torch runs whole causal
    attention on there (`costmodel.context_attention`), no factor on an A100 (FlashAttention-2 already)."""
    whole = _attention_price("h100-x1-measured", 1, "ring")
    ring = _attention_price("h100-x1-measured", 2, "ring")
    assert ring == pytest.approx(whole / 2, rel=0.02)
    executor = _attention_price("h100-x1-measured", 2, "all-gather")
    assert 1.5 * ring < executor < 2.0 * ring
    assert _attention_price("h100-x1-measured", 2, "all-gather", seq=8192) > 2.0 * _attention_price(
        "h100-x1-measured", 2, "ring", seq=8192)  # FlashAttention-2's small kernels
    a100_ring, a100_executor = (_attention_price("dgx-a100-80g", 2, layout) for layout in ("ring", "all-gather"))
    assert a100_ring <= a100_executor < 1.1 * a100_ring


def test_hopper_profiles_carry_the_measured_lower_right_factor():
    import json
    import math
    from pathlib import Path

    from benchmarks import cp_attention
    from costmodel.context_attention import H100_LOWER_RIGHT, H100_LOWER_RIGHT_CURVE, HOPPER_PROFILES, LOWER_RIGHT_CLASS
    from costmodel.profiles import FactorCurve, load_device

    data = json.loads(Path("benchmarks/data/h100-2026-11-27-kernels/sdpa-backends.json").read_text())
    ratios = [flash["seconds"] / cudnn["seconds"] for flash in data["rows"] for cudnn in data["rows"]
              if flash["backend"] == "FLASH_ATTENTION" and cudnn["backend"] == "CUDNN_ATTENTION"
              and flash["seq"] == cudnn["seq"] and flash["seconds"] and cudnn["seconds"]]
    assert H100_LOWER_RIGHT == pytest.approx(math.exp(sum(map(math.log, ratios)) / len(ratios)), abs=0.005)
    recorded = json.loads(cp_attention.DATA.read_text())
    refit = cp_attention.fit_curve([(f, v) for *_, f, v in cp_attention.needed_factors(recorded)])
    assert [f for f, _ in refit] == pytest.approx([f for f, _ in H100_LOWER_RIGHT_CURVE], rel=1e-3)
    assert [v for _, v in refit] == pytest.approx([v for _, v in H100_LOWER_RIGHT_CURVE], abs=0.01)
    assert H100_LOWER_RIGHT < H100_LOWER_RIGHT_CURVE[-1][1] < 1.1 * H100_LOWER_RIGHT  # large kernels: the whole's ratio
    curve = FactorCurve(H100_LOWER_RIGHT_CURVE)
    for name in HOPPER_PROFILES:
        factor = load_device(name).kernel_factors[f"{LOWER_RIGHT_CLASS}/bf16"]
        assert [factor.at(f) for f in (1e10, 1e12, 1e15)] == [curve.at(f) for f in (1e10, 1e12, 1e15)], name
    assert f"{LOWER_RIGHT_CLASS}/bf16" not in load_device("a100-sxm-80g-native").kernel_factors


def test_a_context_parallel_attention_layout_soap_does_not_know_is_refused():
    from costmodel.strategy import TrainingConfig
    from tracer.errors import SoapError

    with pytest.raises(SoapError, match="context-parallel attention"):
        TrainingConfig(global_batch=1, seq_len=8, cp_attention="ulysses")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cp", [2, 4])
def test_on_cuda_the_ranks_outputs_and_gradients_are_the_whole_causal_attentions(cp):
    """On a GPU the lower-right kernels are FlashAttention-2's with the K/V heads grouped (no repeat): every rank's
    output, and the gradients of queries, keys and values summed over the ranks, match the whole sequence's causal
    attention in bf16 (the cuDNN kernels), Llama-3-8B's heads."""
    torch.manual_seed(0)
    seq, heads, kv_heads, dim = 2048, 32, 8, 128
    make = lambda h: torch.randn(1, h, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    grad = torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    whole.backward(grad)
    expected = [t.grad.float() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    for rank in range(cp):
        mine = _positions(seq, cp, rank).cuda()
        out = cp_attention(q[:, :, mine], k, v, rank=rank, cp=cp, causal=True)
        torch.testing.assert_close(out.float(), whole[:, :, mine].float(), atol=2e-2, rtol=2e-2)
        out.backward(grad[:, :, mine])
    for got, want in zip((t.grad.float() for t in (q, k, v)), expected):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
