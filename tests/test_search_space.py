"""The search space: factorizations, divisibility rules and pins."""

from __future__ import annotations

import pytest

from planner.space import (
    Pins,
    SpaceRequest,
    divisors,
    mesh_choices,
    micro_batching,
    schedule_choices,
    training_choices,
    validate_pins,
)
from tracer.errors import SoapError
from tracer.ir import ModelDims

LLAMA_8B = ModelDims(num_layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256)
GPT2 = ModelDims(num_layers=12, hidden=768, heads=12, kv_heads=12, head_dim=64, ffn=3072, vocab=50257)


def _request(dims=LLAMA_8B, gpus=16, pins=Pins(), seq_len=4096, global_batch=64, **kw):
    return SpaceRequest(
        gpus=gpus, gpus_per_node=kw.pop("gpus_per_node", 8), tp_across_nodes=kw.pop("tp_across_nodes", False),
        dims=dims, seq_len=seq_len, global_batch=global_batch, precisions=kw.pop("precisions", ("fp32", "bf16")),
        pins=pins, **kw,
    )


def test_divisors_are_sorted_and_complete():
    assert divisors(12) == (1, 2, 3, 4, 6, 12)
    assert divisors(1) == (1,)


def test_every_mesh_multiplies_to_the_gpu_count_and_obeys_model_rules():
    req = _request(dims=GPT2, gpus=24, global_batch=48, seq_len=1024)
    meshes = mesh_choices(req)
    assert meshes
    for m in meshes:
        d = m.dims
        assert d.world_size == 24
        assert 12 % d.tp == 0 and d.tp <= 8 and 8 % d.tp == 0
        assert 1024 % (2 * d.cp) == 0 and d.pp <= 12 and 48 % d.dp == 0
    assert {m.dims.tp for m in meshes} == {1, 2, 4}  # 3 and 6 divide 12 heads but not a node of 8


def test_tp_may_span_nodes_only_when_the_cluster_allows_it():
    spanning = _request(gpus=32, tp_across_nodes=True)
    assert max(m.dims.tp for m in mesh_choices(spanning)) == 32
    assert max(m.dims.tp for m in mesh_choices(_request(gpus=32))) == 8


def test_a_pinned_tp_spans_nodes_the_search_would_not():
    """`tp_across_nodes: false` keeps the search's TP inside a node; a pin is the user's to make (issue 26)."""
    pinned = _request(gpus=16, pins=Pins(tp=16))
    validate_pins(pinned)
    assert {m.dims.tp for m in mesh_choices(pinned)} == {16}
    assert max(m.dims.tp for m in mesh_choices(_request(gpus=16))) == 8


LLAMA_70B = ModelDims(num_layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256)


def test_an_nvlink_domain_larger_than_a_node_lets_the_search_span_its_nodes():
    """GB200 NVL72: trays of 4 GPUs in one NVLink domain of 72; TP up to 64 stays on NVLink."""
    nvl72 = _request(dims=LLAMA_70B, gpus=64, gpus_per_node=4, nvlink_domain=72, global_batch=128)
    assert max(m.dims.tp for m in mesh_choices(nvl72)) == 64
    assert max(m.dims.tp for m in mesh_choices(_request(dims=LLAMA_70B, gpus=64, gpus_per_node=4,
                                                        global_batch=128))) == 4
    # two domains: a TP group must not straddle them
    two_racks = _request(dims=LLAMA_70B, gpus=144, gpus_per_node=4, nvlink_domain=72, global_batch=144)
    assert {m.dims.tp for m in mesh_choices(two_racks)} <= {1, 2, 4, 8}


def test_sharding_choices_cover_ddp_zero_and_hsdp():
    meshes = [m for m in mesh_choices(_request(gpus=16)) if m.dims.tp == 2 and m.dims.pp == 1 and m.dims.cp == 1]
    forms = {(m.zero, m.dims.dp_replicate, m.dims.dp_shard) for m in meshes}
    assert forms == {(0, 8, 1), (1, 1, 8), (2, 1, 8), (3, 1, 8), (3, 2, 4)}  # HSDP shards the 4 data ranks of a node


def test_mesh_order_is_a_total_order():
    keys = [m.sort_key for m in mesh_choices(_request(gpus=64))]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


def test_pins_fix_their_dimension():
    req = _request(gpus=64, pins=Pins(tp=4, pp=2, zero=3, micro_batch=1, recompute="full", schedule="1F1B"))
    meshes = mesh_choices(req)
    assert meshes and all(m.dims.tp == 4 and m.dims.pp == 2 and m.zero == 3 for m in meshes)
    configs = [c for m in meshes for c in training_choices(req, m)]
    assert configs and all(c.micro_batch == 1 and c.recompute == "full" and c.schedule == "1F1B" for c in configs)


@pytest.mark.parametrize(
    ("pins", "match"),
    [
        (Pins(tp=3), "does not divide --gpus 16"),
        (Pins(pp=4, dp=8), "multiply to 32"),
        (Pins(cp=16), "divisible by 2\\*cp=32"),
        (Pins(precision="fp8"), "no fp8 support"),
        (Pins(dp=16, micro_batch=3), None),
    ],
)
def test_impossible_pins_are_rejected_with_the_numbers(pins, match):
    req = _request(gpus=16, seq_len=16, global_batch=64, pins=pins)
    if match is None:  # micro-batch 3 does not divide 64 / 16: no configuration rather than an error here
        assert not [c for m in mesh_choices(req) for c in training_choices(req, m)]
        return
    with pytest.raises(SoapError, match=match):
        validate_pins(req)


def test_tp_that_does_not_divide_heads_is_rejected():
    with pytest.raises(SoapError, match="does not divide 12 attention heads"):
        validate_pins(_request(dims=GPT2, gpus=8, pins=Pins(tp=8)))


def test_pipeline_deeper_than_the_model_is_rejected():
    with pytest.raises(SoapError, match="larger than the 12 layers"):
        validate_pins(_request(dims=GPT2, gpus=16, pins=Pins(pp=16)))


def test_bad_pin_values_are_rejected():
    for kwargs in ({"tp": 0}, {"zero": 4}, {"schedule": "Zigzag"}, {"precision": "int4"}, {"optimizer": "lion"}):
        with pytest.raises(SoapError):
            Pins(**kwargs)
    with pytest.raises(SoapError, match="--gpus"):
        validate_pins(_request(gpus=0))


def test_micro_batching_keeps_the_global_batch():
    req = _request(global_batch=64)
    for mb, count, accum in micro_batching(req, dp=4, pp=1):
        assert mb * count * 4 == 64 and accum == count
    for mb, count, accum in micro_batching(req, dp=4, pp=2):
        assert mb * count * 4 == 64 and accum == 1


def test_interleaved_schedules_need_microbatches_divisible_by_pp():
    req = _request()
    assert ("Interleaved1F1B", 2) in schedule_choices(req, pp=4, num_microbatches=8)
    assert all(v == 1 for _, v in schedule_choices(req, pp=4, num_microbatches=6))
    assert schedule_choices(req, pp=1, num_microbatches=6) == [("1F1B", 1)]


def test_fp8_is_searched_only_when_allowed_and_where_the_device_runs_it():
    auto = Pins(precision="auto")
    hopper = _request(gpus=1, global_batch=1, precisions=("fp32", "bf16", "fp8"))
    hopper_auto = _request(gpus=1, global_batch=1, precisions=("fp32", "bf16", "fp8"), pins=auto)
    ampere_auto = _request(gpus=1, global_batch=1, precisions=("fp32", "bf16"), pins=auto)
    volta = _request(gpus=1, global_batch=1, precisions=("fp32", "fp16"))
    precisions = lambda req: {c.precision for m in mesh_choices(req) for c in training_choices(req, m)}  # noqa: E731
    assert precisions(hopper) == {"bf16"}
    assert precisions(hopper_auto) == {"bf16", "fp8"}
    assert precisions(ampere_auto) == {"bf16"}
    assert precisions(volta) == {"fp16"}


def test_optimizer_is_searched_only_when_allowed():
    fixed = _request(gpus=1, global_batch=1)
    auto = _request(gpus=1, global_batch=1, pins=Pins(optimizer="auto"))
    optimizers = lambda req: {c.optimizer for m in mesh_choices(req) for c in training_choices(req, m)}  # noqa: E731
    assert optimizers(fixed) == {"adamw"}
    assert optimizers(auto) == {"adamw", "adamw8bit", "adafactor"}


def test_short_sequences_still_get_meshes_without_context_parallelism():
    req = _request(dims=GPT2, gpus=8, seq_len=64, global_batch=64)
    meshes = mesh_choices(req)
    assert meshes and {m.dims.cp for m in meshes} == {1}
