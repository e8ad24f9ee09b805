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


def test_the_gathered_chunks_go_back_in_sequence_order():
    cp, seq = 4, 32
    k = torch.randn(1, 2, seq, 3)
    gathered = torch.cat([k[:, :, _positions(seq, cp, rank)] for rank in range(cp)], dim=2)  # all_gather's order
    assert torch.equal(_in_sequence_order(gathered, cp), k)
