"""The executor holds no more model state than Megatron-Core's layout, and the memory model says what it holds.

- Vocabulary-parallel ends on pipeline stages (tp > 1, any pp): the first stage's token embedding and the
  last stage's LM head are sharded over tp (weights, gradients and optimizer state), as Megatron-Core
  and torchtitan do; the embedding's gradient too (torch's RowwiseParallel would keep it whole).
- DDP's gradients are views of its reducer's buckets: one copy of them.
- ZeRO 2 (FSDP2) shards the fp32 master weights with the optimizer state.
Measured on gloo with `benchmarks.executor_memory` (allocated bytes and a census of the parameters,
gradients and optimizer state per rank after the last step's backward), against `costmodel.memory`.
Multi-process tests run one small group of 2 ranks and one of 4.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.executor_memory import predicted, run  # noqa: E402
from costmodel.memory import ParamSet, buffer_bytes, model_state_bytes  # noqa: E402
from costmodel.strategy import shards_vocabulary  # noqa: E402

TWO_RANKS = ("ddp (zero 0)", "fsdp2 zero 2 bf16", "tp2")
FOUR_RANKS = ("tp2 x pp2", "tp2 x pp2 tied")


def test_tensor_parallelism_shards_the_vocabulary_on_pipeline_stages_too():
    assert shards_vocabulary(tp=2, pp=1) and shards_vocabulary(tp=8, pp=8)
    assert not shards_vocabulary(tp=1, pp=4)


def test_ddp_counts_one_copy_of_the_gradients():
    params = ParamSet(trainable=1_000, frozen=0, shapes=(), largest_unit=100)
    for zero in (0, 1):
        assert buffer_bytes(params=params, precision="bf16", zero=zero, dp=8, dp_shard=8 if zero else 1) == 0
        state = model_state_bytes(1_000, precision="bf16", optimizer="adamw", zero=zero, dp_shard=8,
                                  offload_optimizer=False)
        assert state.grads == 4 * 1_000


@pytest.mark.parametrize("d", [2, 4, 8, 64])
def test_zero2_holds_no_more_than_megatrons_distributed_optimizer(d):
    """Megatron-Core's distributed optimizer (bf16): 16-bit weights and fp32 gradients whole, fp32 master
    and moments sharded, 6 + 12/d bytes per element. ZeRO 2 on FSDP2: fp32 shard, bf16 copy gathered from
    forward to backward, gradients and moments sharded, 2 + 16/d."""
    n = 64_000
    s = model_state_bytes(n, precision="bf16", optimizer="adamw", zero=2, dp_shard=d, offload_optimizer=False)
    shard = math.ceil(4 * n / d)
    assert (s.weights, s.grads, s.optimizer) == (shard + 2 * n, shard, math.ceil(8 * n / d))
    assert s.weights + s.grads + s.optimizer <= n * (6 + 12 / d)


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return run(list(TWO_RANKS))


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    return run(list(FOUR_RANKS), warm_up=False)


def _model(name: str) -> list[dict]:
    from exec_helpers import make_plan, tiny_config

    from benchmarks.executor_memory import CASES, CONFIGS, SEQ

    _, family, kwargs = CASES[name]
    return predicted(make_plan(family, config=tiny_config(family, **CONFIGS[family]), seq_len=SEQ, **kwargs))


def _census_matches_the_model(ranks: list[dict], stages: list[dict]) -> None:
    for r in ranks:
        m = stages[r["pp_rank"]]
        assert r["params"] == pytest.approx(m["master"], rel=0.01), r
        assert r["grads"] == pytest.approx(m["grads"], rel=0.01), r
        assert r["optimizer"] == pytest.approx(m["optimizer"], rel=0.01), r


@pytest.mark.slow
def test_ddp_gradients_are_its_buckets_and_zero2_shards_the_fp32_master(two_ranks):
    ddp, zero2 = two_ranks["ddp (zero 0)"], two_ranks["fsdp2 zero 2 bf16"]
    _census_matches_the_model(ddp, _model("ddp (zero 0)"))
    for r in ddp:
        # a separate bucket would add a whole second copy of the gradients to what the census does not see
        assert r["other"] < 0.4 * r["grads"], r
    _census_matches_the_model(zero2, _model("fsdp2 zero 2 bf16"))
    for r in zero2:  # each rank holds half of the fp32 parameters DDP holds whole
        assert r["params"] * 2 == pytest.approx(ddp[0]["params"], rel=0.01)


@pytest.mark.slow
def test_pipeline_stages_hold_a_tp_shard_of_the_embedding_and_head(four_ranks):
    """tp 2 x pp 2 on a vocabulary of 8192 beside small blocks: every rank holds half of its stage's
    parameters, the first stage's embedding and the last stage's head included (GPT-2's tied pair is a
    copy on each end, sharded alike)."""
    for name in FOUR_RANKS:
        ranks, stages = four_ranks[name], _model(name)
        _census_matches_the_model(ranks, stages)
    llama = four_ranks["tp2 x pp2"]
    vocab, hidden = 8192, 64
    assert all(r["params"] < vocab * hidden * 4 for r in llama)  # less than one whole embedding's fp32 weights


@pytest.mark.slow
def test_vocab_parallel_embedding_keeps_a_sharded_gradient(two_ranks):
    """tp 2 without a pipeline: the embedding's gradient is sharded like its weight (under torch's
    RowwiseParallel it came back replicated, a whole [vocab, hidden] gradient on every rank)."""
    ranks = two_ranks["tp2"]
    _census_matches_the_model(ranks, _model("tp2"))
    for r in ranks:
        assert r["grads"] == r["params"], r
