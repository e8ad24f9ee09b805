"""`soap calibrate --from-nccl-tests` (issue 28, items 1-2): nccl-tests logs in, a network with scale out.

Logs written in nccl-tests' format from a known profile whose inter-node bandwidth falls with node count
(`costmodel.calibration.nccl_tests.write_log`) are fitted back; the shipped real logs
(shared/reference/nccl-tests/) are read; a log soap cannot read is one error naming the file and line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from costmodel.calibration.nccl_tests import fit_nccl_logs, read_log, write_log
from costmodel.profiles import EfficiencyCurve, cluster_from_dict, cluster_to_dict, load_cluster
from costmodel.simulator import simulate
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
from soap.cli import main
from tracer.errors import SoapError

sys.path.insert(0, str(Path(__file__).parent))
from test_sim_graphs import tiny_decoder  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "nccl-tests"
NODES = (1, 2, 4, 8, 16, 32, 64)
FALLING = ((2, 1.0), (4, 0.6), (8, 0.35), (16, 0.25), (32, 0.18), (64, 0.1))
"""A fabric like the Playbook's EFA cluster: bus bandwidth falling about 10x from 2 to 64 nodes."""


@pytest.fixture(scope="module")
def known():
    base = load_cluster("dgx-h100")
    inter = dataclasses.replace(
        base.inter_node, latency_s=7e-6,
        efficiency=EfficiencyCurve(((64e3, 0.2), (1e6, 0.5), (64e6, 0.8), (1e9, 0.85)), source="test"),
        node_scaling=EfficiencyCurve(tuple((float(n), f) for n, f in FALLING), source="test"))
    return base, dataclasses.replace(base, inter_node=inter)


@pytest.fixture(scope="module")
def logs(known, tmp_path_factory):
    _, truth = known
    folder = tmp_path_factory.mktemp("nccl")
    paths = []
    for nodes in NODES:
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            path = folder / f"{kind}_perf-{nodes}x8.log"
            write_log(path, kind, truth, nodes=nodes, ranks_per_node=8, sizes=[2**k for k in range(3, 34)])
            paths.append(path)
    return paths


@pytest.fixture(scope="module")
def fitted(known, logs):
    base, _ = known
    return fit_nccl_logs([read_log(str(p)) for p in logs], base)


def test_logs_from_a_known_profile_are_fitted_back_within_5_percent(fitted, known):
    _, truth = known
    for path, (before, after) in fitted.errors.items():
        assert after <= 5.0, (path, before, after)
    inter = fitted.cluster.inter_node
    assert inter.latency_s == pytest.approx(truth.inter_node.latency_s, rel=0.05)
    for nodes, factor in FALLING:
        assert inter.scale_at(nodes) == pytest.approx(factor, rel=0.05), nodes
    assert all("--from-nccl-tests" in src for src in (inter.efficiency.source, inter.node_scaling.source,
                                                        inter.sources["latency_us"]))


def _step(cluster, dp):
    graph = tiny_decoder()
    strategy = Strategy(dims=ParallelDims(dp_replicate=dp),
                        train=TrainingConfig(global_batch=dp, seq_len=64, num_microbatches=1, precision="bf16"))
    return simulate(graph, strategy, cluster).step_time_s


def test_a_fabric_that_slows_with_scale_slows_a_128_gpu_step_but_not_a_one_node_step(fitted, known):
    base, _ = known
    fabric = fitted.cluster
    flat = dataclasses.replace(fabric, inter_node=dataclasses.replace(fabric.inter_node, node_scaling=None,
                                                                     collective_node_scaling={}))
    assert _step(fabric, 128) > _step(flat, 128)
    assert _step(fabric, 8) == pytest.approx(_step(flat, 8))
    assert _step(fabric, 128) > _step(base, 128)


def test_the_fitted_profile_survives_its_json_round_trip(fitted):
    again = cluster_from_dict(json.loads(json.dumps(cluster_to_dict(fitted.cluster))))
    assert again.inter_node.node_scaling.points == fitted.cluster.inter_node.node_scaling.points
    own = fitted.cluster.inter_node.collective_node_scaling
    assert own and {k: c.points for k, c in again.inter_node.collective_node_scaling.items()} == \
        {k: c.points for k, c in own.items()}


def test_a_bus_bandwidth_table_is_fitted_as_logs_with_each_collective_falling_off_on_its_own():
    """The Playbook's figure as a user would give it: median busbw per collective and node count, no sizes."""
    from costmodel.calibration.nccl_tests import logs_from_bus_bandwidth
    from costmodel.collectives import CommGroup, bus_factor, collective_time

    table = {"all_reduce": {1: 436e9, 2: 362e9, 8: 100e9, 64: 33e9},
             "all_gather": {1: 250e9, 2: 185e9, 8: 69e9, 64: 11e9}}
    logs = logs_from_bus_bandwidth(table, ranks_per_node=8, source="figure")
    assert len(logs) == 8 and all(size >= 16 * 2**20 for log in logs for size, _ in log.rows)
    fit = fit_nccl_logs(logs, load_cluster("dgx-h100"), bandwidth_only=True)
    inter = fit.cluster.inter_node
    assert inter.scale_at(64, "all_gather") < inter.scale_at(64, "all_reduce")
    for kind, nodes in (("all_gather", 8), ("all_gather", 64), ("all_reduce", 64)):
        group, size = CommGroup(8 * nodes, 8), 2**30
        busbw = bus_factor(kind, group.size) * size / collective_time(kind, size, group, fit.cluster)
        assert busbw == pytest.approx(table[kind][nodes], rel=0.1), (kind, nodes)


@pytest.mark.parametrize("name,collective,ranks,nodes", [
    ("dgx-h100-1x8-all_reduce_perf.log", "all_reduce", 8, 1),
    ("h100-2x8-gcp-a3mega-all_reduce_perf.log", "all_reduce", 16, 2),
    ("h100-4x8-ib-all_gather_perf.log", "all_gather", 32, 4),
    ("gb300-32x4-alltoall_perf.log", "all_to_all", 128, 32),  # rank lines cut by the publisher
    ("mi355x-1x8-rccl-alltoall_perf.log", "all_to_all", 8, 1),
])
def test_published_logs_are_read(name, collective, ranks, nodes):
    log = read_log(str(REFERENCE / name))
    assert (log.collective, log.ranks, log.nodes) == (collective, ranks, nodes)
    assert log.rows and all(size > 0 and seconds > 0 for size, seconds in log.rows)


def test_a_log_soap_cannot_read_is_one_error_naming_the_file_and_line(logs, tmp_path):
    lines = Path(logs[0]).read_text().splitlines()
    row = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    lines[row] = lines[row].split()[0] + " 2 float"
    broken = tmp_path / "all_reduce_perf-broken.log"
    broken.write_text("\n".join(lines) + "\n")
    with pytest.raises(SoapError, match=rf"all_reduce_perf-broken.log line {row + 1}: "):
        read_log(str(broken))
    anonymous = tmp_path / "cluster.log"
    anonymous.write_text("hello\n")
    with pytest.raises(SoapError, match="--collective"):
        read_log(str(anonymous))


def test_the_cli_writes_a_profile_that_plans(logs, tmp_path, capsys):
    out = tmp_path / "fitted.json"
    chosen = [str(p) for p in logs if "-1x8" in p.name or "-2x8" in p.name or "-8x8" in p.name]
    assert main(["calibrate", "--from-nccl-tests", *chosen, "--cluster", "dgx-h100", "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["written"] == str(out) and all(row["error_after_pct"] <= 5 for row in report["logs"])
    assert [n for n, _ in report["node_scaling"]] == [2, 8]
    assert main(["plan", "gpt2", "--gpus", "16", "--cluster", str(out), "--global-batch", "32", "--seq-len", "256"]) == 0
    assert main(["calibrate", "--from-nccl-tests", chosen[0]]) == 2
    assert "needs --cluster" in capsys.readouterr().err
