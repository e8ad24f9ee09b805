import pytest

from costmodel.strategy import ParallelDims, TrainingConfig
from tracer.errors import SoapError


def test_world_size_is_product_of_degrees():
    dims = ParallelDims(dp_replicate=2, dp_shard=4, cp=2, tp=8, pp=4)
    assert dims.world_size == 2 * 4 * 2 * 8 * 4
    assert dims.dp == 8 and dims.fsdp_enabled and dims.pp_enabled


def test_tp_that_does_not_divide_heads_is_refused_with_numbers():
    with pytest.raises(SoapError, match="tp=3 does not divide 32"):
        ParallelDims(tp=3).check_model(num_layers=32, heads=32, kv_heads=8, vocab=128256, seq_len=4096)


def test_unknown_schedule_is_refused():
    with pytest.raises(SoapError, match="unknown schedule"):
        TrainingConfig(global_batch=8, seq_len=128, schedule="Zigzag")
