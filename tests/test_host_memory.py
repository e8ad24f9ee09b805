"""Host memory per node: cluster profiles carry it, and offload plans must fit it (planner.host_memory)."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from costmodel.profiles import (
    GIB,
    cluster_from_dict,
    cluster_to_dict,
    list_clusters,
    load_cluster,
)
from costmodel.strategy import ParallelDims, TrainingConfig
from planner.api import plan_report
from planner.host_memory import HostMemoryCheck, pinned_rounding, pow2_ceil
from soap.cli import main
from tracer.errors import SoapError
from tracer.ir import OpKind, ParamMeta

MEDIUM_LLAMA = {  # about 0.9B parameters: on one GPU with 10 GiB only offloading fits (tests/test_plan_search.py)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    path = tmp_path_factory.mktemp("medium-llama")
    (path / "config.json").write_text(json.dumps(MEDIUM_LLAMA))
    return str(path)


def _with_host(name: str, gib: float | None):
    data = cluster_to_dict(load_cluster(name))
    if gib is None:
        data.pop("host_memory_gib")
    else:
        data["host_memory_gib"] = {"value": gib, "source": "test"}
    return cluster_from_dict(data)


# ---------------------------------------------------------------------------------------------
# Profiles


def test_every_shipped_cluster_states_its_host_memory_per_node_with_a_source():
    for name in list_clusters():
        cluster = load_cluster(name)
        assert cluster.host_memory_bytes and cluster.host_memory_bytes > 0, name
        assert cluster.sources["host_memory_gib"].strip(), name
    assert load_cluster("dgx-a100-40g").host_memory_bytes == 1024 * GIB
    assert load_cluster("dgx-h100").host_memory_bytes == 2048 * GIB


def test_host_memory_round_trips_through_the_json_writer_with_its_source():
    for name in list_clusters():
        cluster = load_cluster(name)
        again = cluster_from_dict(json.loads(json.dumps(cluster_to_dict(cluster))))
        assert again.host_memory_bytes == cluster.host_memory_bytes
        assert again.sources == cluster.sources


def test_a_cluster_file_without_host_memory_loads_as_unknown(tmp_path):
    data = cluster_to_dict(load_cluster("dgx-h100"))
    del data["host_memory_gib"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    cluster = load_cluster(str(path))
    assert cluster.host_memory_bytes is None
    assert "host_memory_gib" not in cluster_to_dict(cluster)


@pytest.mark.parametrize("entry, problem", [
    ({"value": -1, "source": "x"}, "must be positive"),
    ({"value": 0, "source": "x"}, "must be positive"),
    ({"value": "2 TB", "source": "x"}, "finite number"),
    ({"value": 2048}, "missing key(s) source"),
    ({"value": 2048, "source": ""}, "non-empty string"),
    ({"value": 2.0**40, "source": "x"}, "at most"),
    (2048, "expected an object"),
])
def test_loader_rejects_a_bad_host_memory_value_naming_the_field(tmp_path, entry, problem):
    data = cluster_to_dict(load_cluster("dgx-h100"))
    data["host_memory_gib"] = entry
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SoapError) as info:
        load_cluster(str(path))
    assert "host_memory_gib" in str(info.value) and problem in str(info.value)


# ---------------------------------------------------------------------------------------------
# The rule


def _check(gpus_per_node: int, capacity_gib: float | None = 1.0, graph=None) -> HostMemoryCheck:
    cluster = replace(load_cluster("dgx-h100"), host_memory_bytes=None if capacity_gib is None else int(capacity_gib * GIB))
    return HostMemoryCheck(cluster, gpus_per_node, graph)


def _offload() -> TrainingConfig:
    return TrainingConfig(global_batch=8, seq_len=16, offload_optimizer=True)


def test_node_host_memory_sums_the_ranks_of_each_node_in_mesh_order(monkeypatch):
    check = _check(gpus_per_node=4)
    monkeypatch.setattr(check, "rank_bytes", lambda host, dims, train: host)
    two_stages = ParallelDims(pp=2, dp_shard=4)  # ranks 0-3 run stage 0 on node 0, ranks 4-7 stage 1 on node 1
    assert check.node_bytes([3.0, 5.0], two_stages, _offload()) == 4 * 5.0
    wide = _check(gpus_per_node=8)
    monkeypatch.setattr(wide, "rank_bytes", lambda host, dims, train: host)
    assert wide.node_bytes([3.0, 5.0], two_stages, _offload()) == 4 * 3.0 + 4 * 5.0
    # fewer ranks than a node holds: only those ranks
    assert wide.node_bytes([7.0], ParallelDims(dp_shard=2), _offload()) == 2 * 7.0


def test_a_cluster_without_host_memory_accepts_every_plan():
    check = _check(gpus_per_node=8, capacity_gib=None)
    est = SimpleNamespace(memory=SimpleNamespace(host=1e18))
    assert check.estimate_fits(SimpleNamespace(dims=ParallelDims(dp_shard=8)), _offload(), est)


def test_pinned_shards_are_counted_at_the_pinned_allocators_power_of_two_blocks():
    assert [pow2_ceil(n) for n in (1, 2, 3, 48, 64, 65)] == [1, 2, 4, 64, 64, 128]
    # one block of 2 instances, each with a trainable 3 x 4 fp32 weight: a 48-byte shard takes a 64-byte block
    op = SimpleNamespace(name="layers.w:mm", kind=OpKind.MATMUL, block_id="layers", module_fqn="layers.0.w", outputs=(),
                         params=(ParamMeta("layers.w", (3, 4), "float32"),), attrs={})
    graph = SimpleNamespace(ops=(op,), blocks=(SimpleNamespace(id="layers", count=2),))
    rho, share = pinned_rounding(graph, tp=1, pp=1, dp_shard=1, optimizer="adamw", precision="bf16")
    assert rho == pytest.approx(64 / 48)
    assert share == pytest.approx(8 / (8 + 8))  # fp32 parameter + gradient pinned, AdamW's 8 bytes pageable
    check = _check(gpus_per_node=8, graph=graph)
    assert check.rank_bytes(1000.0, ParallelDims(), _offload()) == pytest.approx(1000 * (1 + 0.5 * (64 / 48 - 1)))
    assert check.rank_bytes(0.0, ParallelDims(), _offload()) == 0.0


# ---------------------------------------------------------------------------------------------
# The search


def test_405b_on_two_a100_40g_fails_with_one_line_naming_host_memory(capsys):
    """Offloading 405B's fp32 master weights, gradients and AdamW state over 2 GPUs needs about 3 TiB of
    host memory per GPU; a DGX A100 320GB node has 1 TB."""
    assert main(["plan", "llama-3.1-405b", "--gpus", "2", "--cluster", "dgx-a100-40g"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert "host memory" in err and "on a node with 1024 GiB" in err and "add GPUs" in err, err
    per_gpu = float(err.split("offloading needs ")[1].split(" GiB")[0])
    assert per_gpu >= 3000  # 405.9e9 parameters x 16 bytes / 2 GPUs = 3024 GiB, pinned rounding on top


def test_an_offload_plan_that_fits_host_memory_still_plans(medium):
    report = plan_report(medium, gpus=1, global_batch=64, mem_limit_gib=10, cluster=_with_host("dgx-h100", 64))
    p = report.plan.parallelism
    assert p.offload_optimizer
    assert report.chosen.result.memory[0].at_peak.host < 64 * GIB


def test_offload_that_does_not_fit_host_memory_is_never_chosen(medium):
    with pytest.raises(SoapError) as info:
        plan_report(medium, gpus=1, global_batch=64, mem_limit_gib=10, cluster=_with_host("dgx-h100", 4))
    message = str(info.value)
    assert "host memory" in message and "on a node with 4 GiB" in message and "\n" not in message


def test_without_host_memory_in_the_profile_offload_is_not_checked(medium):
    report = plan_report(medium, gpus=1, global_batch=64, mem_limit_gib=10, cluster=_with_host("dgx-h100", None))
    assert report.plan.parallelism.offload_optimizer
