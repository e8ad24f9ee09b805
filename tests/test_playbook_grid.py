"""The grid loader of `executor.validation.grid`: a grid file's rows that ran and crashed, one priced as published."""

import json
from pathlib import Path

import pytest

from costmodel.profiles import load_cluster
from executor.validation.grid import group_scores, load_grid, price_row

PLAYBOOK = Path(__file__).resolve().parents[2] / "shared" / "published-runs" / "nanotron-playbook-1b-h100.json"


def _row(name: str, tp: int, pp: int, dp: int, zero: int, mb: int, ga: int, tokens: float | None) -> dict:
    row = {"name": name, "gpus": 8, "nodes": 1, "tp": tp, "pp": pp, "cp": 1, "dp": dp, "zero": zero,
           "micro_batch": mb, "grad_accum": ga, "global_batch": dp * mb * ga, "seq": 512,
           "sequence_parallel": tp > 1, "pp_schedule": "1F1B" if pp > 1 else None, "precision": "bf16",
           "recompute": "none", "torch_compile": False}
    if tokens:
        row.update(tokens_per_s_per_gpu=tokens, memory_gb=10.0)
    return row


def test_grid_loader_reads_ran_and_crashed_rows_and_prices_one_as_published(tmp_path):
    grid = {"stack": "nanotron", "model": {"hidden": 256, "ffn": 1024, "layers": 2, "heads": 4, "kv_heads": 4,
                                           "vocab": 1024, "mlp": "gated-silu", "tie_word_embeddings": True},
            "rows": [_row("a", 1, 1, 8, 0, 2, 4, 9000.0), _row("b", 2, 1, 4, 0, 4, 4, 8000.0),
                     _row("c", 1, 2, 4, 1, 4, 1, 7000.0)],
            "crashed_or_oom": {"rows": [_row("d", 1, 2, 4, 1, 64, 1, None)]}}
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(grid))
    ran, crashed = load_grid(path, cluster="dgx-h100")
    assert [r.name for r in ran] == ["a", "b", "c"] and [r.name for r in crashed] == ["d"]
    assert ran[0].stack == "nanotron" and ran[0].memory_gib == pytest.approx(10.0 * 1e9 / 2**30)
    cluster, graphs = load_cluster("dgx-h100"), {}
    prices = [price_row(r, cluster, graphs=graphs) for r in ran]
    a = prices[0]
    assert a.plan.parallelism.dp == 8 and a.plan.parallelism.grad_accum == 4
    assert a.tokens_per_s_per_gpu == pytest.approx(8 * 2 * 4 * 512 / (a.step_s * 8))
    assert a.peak_memory_gib > 0
    assert prices[1].plan.parallelism.sequence_parallel
    # nanotron accumulates gradients locally beside TP and syncs once a step; soap's executor (FSDP2 beside TP)
    # syncs every micro-batch: the row is priced as nanotron ran it, and not slower than soap's own way
    assert prices[1].plan.strategy().train.accumulate_locally
    from executor.validation.refit import simulate_on

    own = simulate_on(prices[1].plan.plan, next(iter(graphs.values())), cluster).step_time_s
    assert prices[1].step_s <= own
    # one micro-batch per pipeline: priced as GPipe (the same timeline as 1F1B)
    assert prices[2].plan.parallelism.pp == 2 and prices[2].plan.parallelism.schedule == "GPipe"
    (score,) = group_scores(ran, [p.tokens_per_s_per_gpu for p in prices])
    assert score.rows == 3 and 0 < score.pick_best <= 1


@pytest.mark.skipif(not PLAYBOOK.exists(), reason="the published-runs corpus is not checked out beside the repo")
def test_playbook_grid_file_loads():
    ran, crashed = load_grid(PLAYBOOK, cluster="dgx-h100")
    assert len(ran) == 527 and len(crashed) == 266
    assert {r.nodes for r in ran} == {1, 2, 4, 8, 16, 32, 64}


def test_nanotron_rows_are_priced_with_its_fixed_tensor_parallel_placement():
    """nanotron's TP is a fixed column/row split with sequence parallelism: a row is priced on the Megatron default
    placement, not on the per-op splits soap's search would pick for its own executor (at 8 nodes it dropped
    sequence parallelism around the norms of the Playbook's dp2 x tp32 rows and priced their TP 4x the tp32 rows
    at 4 nodes)."""
    from dataclasses import replace

    from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
    from executor.validation.grid import as_run
    from executor.validation.run_records import RunRecord

    searched = Strategy(dims=ParallelDims(tp=2), train=TrainingConfig(global_batch=8, seq_len=16),
                        op_splits=(("model.layers.0.input_layernorm:mul", (("attribute", 1), ("parameter", 1))),))

    class Plan:
        def strategy(self):
            return searched

    row = dict(name="r", model="gpt2", gpus=8, seq=16, micro_batch=1, tp=2, precision="bf16", step_time_s=1.0)
    assert as_run(Plan(), RunRecord(**row)).strategy().op_splits  # soap's own stack keeps its search
    priced = as_run(Plan(), RunRecord(**row, stack="nanotron")).strategy()
    assert priced.op_splits == () and priced == replace(searched, op_splits=(), train=priced.train)
    assert priced.train.accumulate_locally


def test_rows_of_one_model_in_two_precision_regimes_get_two_graphs():
    """`graph_key` keys on the dtype the plan's regime traces at: a DDP row (autocast over fp32 parameters) and an
    FSDP row (bf16 parameters) of the same model, sequence and precision are two graphs, two FSDP rows one."""
    from exec_helpers import make_plan

    from executor.validation.grid import graph_key

    cluster = load_cluster("dgx-h100")
    ddp = make_plan("llama", dp_replicate=2, precision="bf16")
    fsdp = make_plan("llama", dp_shard=2, zero=3, precision="bf16")
    fsdp_mb1 = make_plan("llama", dp_shard=2, zero=3, precision="bf16", micro_batch=1)
    assert graph_key(ddp, cluster) != graph_key(fsdp, cluster)
    assert graph_key(fsdp, cluster) == graph_key(fsdp_mb1, cluster)
    assert "autocast-bfloat16" in graph_key(ddp, cluster) and "bfloat16" in graph_key(fsdp, cluster)
