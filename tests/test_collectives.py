"""Collective cost: alpha-beta formulas by hand, topology bounds, SHARP, and monotonicity invariants."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.collectives import CommGroup, bus_factor, collective_cost, collective_time
from costmodel.profiles import ClusterSpec, EfficiencyCurve, LinkLevel, load_cluster, load_device
from tracer.errors import SoapError

GB = 1e9


def link(name, bandwidth, latency_s, eff=1.0, sharp=False, factor=1.0):
    return LinkLevel(name, bandwidth, latency_s, EfficiencyCurve(((1.0, eff),)), sharp, factor)


def flat_cluster(*, intra=400 * GB, inter=50 * GB, alpha_intra=1e-6, alpha_inter=5e-6, gpus_per_node=8, sharp=False):
    return ClusterSpec(
        name="flat",
        device=load_device("h100-sxm"),
        gpus_per_node=gpus_per_node,
        intra_node=link("intra_node", intra, alpha_intra, sharp=sharp, factor=1.2),
        inter_node=link("inter_node", inter, alpha_inter),
    )


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(kind, 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == 1 and bus_factor("send_recv", 2) == 1


def test_intra_node_ring_all_reduce_matches_the_hand_formula():
    c = flat_cluster()
    size = 1e9
    cost = collective_cost("all_reduce", size, CommGroup(8, 8), c)
    ring = 2 * 7 / 8 * size / (400 * GB) + 14 * 1e-6
    assert dict(cost.alternatives)["ring"] == pytest.approx(ring)
    assert cost.seconds == pytest.approx(ring) and cost.algorithm == "ring"


def test_small_messages_prefer_the_tree_for_its_log_latency():
    c = flat_cluster()
    cost = collective_cost("all_reduce", 1e3, CommGroup(8, 8), c)
    assert cost.algorithm == "tree"
    assert cost.seconds == pytest.approx(2 * 1e3 / (400 * GB) + 2 * 3 * 1e-6)


def test_group_spanning_nodes_is_bounded_by_the_shared_nics():
    c = flat_cluster()
    size = 1e9
    # one rank per node: the rank's own NIC share, 50 GB/s, inter-node latency
    two_nodes = collective_cost("all_gather", size, CommGroup(2, 1), c)
    assert two_nodes.seconds == pytest.approx(0.5 * size / (50 * GB) + 1 * 5e-6)
    # 4 ranks per node on 2 nodes: the ring gets 4 NIC shares (200 GB/s); of its 7 steps one crosses
    # nodes (inter-node alpha), 6 stay inside (intra-node alpha). NCCL has no hierarchical all-gather.
    cost = collective_cost("all_gather", size, CommGroup(8, 4), c)
    ring = 7 / 8 * size / (200 * GB) + 6 * 1e-6 + 1 * 5e-6
    assert dict(cost.alternatives)["ring"] == pytest.approx(ring)
    assert "hierarchical" not in dict(cost.alternatives)
    assert cost.seconds == pytest.approx(ring)


def test_ring_latency_grows_with_the_ranks_it_passes_through():
    """768 ranks on 96 nodes of 8: 672 intra-node and 95 inter-node steps per all-gather (NCCL's tuner),
    2 x that for an all-reduce's ring; a tiny message costs that latency and nothing else."""
    c = flat_cluster()
    group = CommGroup(768, 8)
    tiny = collective_cost("all_gather", 768.0, group, c)
    assert dict(tiny.alternatives)["ring"] == pytest.approx(672 * 1e-6 + 95 * 5e-6, rel=1e-3)
    assert collective_time("all_gather", 768.0, CommGroup(1536, 8), c) > 1.9 * tiny.seconds


def test_hierarchical_all_reduce_is_rs_then_inter_all_reduce_then_ag():
    c = flat_cluster()
    size = 8e8
    cost = collective_cost("all_reduce", size, CommGroup(32, 8), c)
    rs = 7 / 8 * size / (400 * GB) + 7 * 1e-6
    inter = 2 * 3 / 4 * (size / 8) / (50 * GB) + 6 * 5e-6
    assert dict(cost.alternatives)["hierarchical"] == pytest.approx(rs + inter + rs)


def test_sharp_replaces_the_ring_factor_inside_a_node():
    size = 1e9
    plain = collective_time("all_reduce", size, CommGroup(8, 8), flat_cluster())
    cost = collective_cost("all_reduce", size, CommGroup(8, 8), flat_cluster(sharp=True))
    assert cost.algorithm == "sharp"
    assert cost.seconds == pytest.approx(1.2 * size / (400 * GB) + 2 * 1e-6)
    assert cost.seconds < plain
    # SHARP does not apply to collectives other than all-reduce
    assert collective_time("all_gather", size, CommGroup(8, 8), flat_cluster(sharp=True)) == pytest.approx(
        collective_time("all_gather", size, CommGroup(8, 8), flat_cluster())
    )


def test_shipped_dgx_h100_reproduces_the_published_bus_bandwidths():
    c = load_cluster("dgx-h100-datasheet")  # the fitted dgx-h100's links are scaled by its runs
    size = 8 * 2**30
    ring = dict(collective_cost("all_reduce", size, CommGroup(8, 8), c).alternatives)["ring"]
    assert size / ring * 2 * 7 / 8 == pytest.approx(370e9, rel=0.03)  # nccl-tests#212
    nvls = collective_time("all_reduce", size, CommGroup(8, 8), c)
    assert size / nvls * 2 * 7 / 8 == pytest.approx(476e9, rel=0.03)  # nccl-tests#290
    two_nodes = collective_time("all_reduce", size, CommGroup(16, 8), c)
    assert size / two_nodes * 2 * 15 / 16 == pytest.approx(369e9, rel=0.05)  # nccl-tests#309


def test_trivial_collectives_cost_nothing_and_bad_input_is_refused():
    c = flat_cluster()
    assert collective_time("all_reduce", 1e9, CommGroup(1, 1), c) == 0
    assert collective_time("all_reduce", 0, CommGroup(8, 8), c) == 0
    with pytest.raises(SoapError, match="unknown collective"):
        collective_time("gossip", 1e6, CommGroup(8, 8), c)
    with pytest.raises(SoapError, match="ranks per node"):
        collective_time("all_reduce", 1e6, CommGroup(16, 16), c)
    with pytest.raises(SoapError, match="non-negative"):
        collective_time("all_reduce", -1, CommGroup(8, 8), c)


kinds = st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"])
sizes = st.floats(min_value=1.0, max_value=1e10)
clusters = st.sampled_from(["dgx-h100", "dgx-a100-80g", "dgx1-v100-16g", "l40s-pcie"])


@settings(max_examples=80, deadline=None)
@given(kind=kinds, nbytes=sizes, name=clusters, n=st.integers(2, 128), up_intra=st.floats(1, 10),
       up_inter=st.floats(1, 10), less_latency=st.floats(0, 1))
def test_more_bandwidth_never_predicts_a_slower_collective(kind, nbytes, name, n, up_intra, up_inter, less_latency):
    c = load_cluster(name)
    g = min(n, c.gpus_per_node)
    group = CommGroup(n, g)
    faster = dataclasses.replace(
        c,
        intra_node=dataclasses.replace(c.intra_node, bandwidth=c.intra_node.bandwidth * up_intra,
                                       latency_s=c.intra_node.latency_s * less_latency),
        inter_node=dataclasses.replace(c.inter_node, bandwidth=c.inter_node.bandwidth * up_inter),
    )
    assert collective_time(kind, nbytes, group, faster) <= collective_time(kind, nbytes, group, c) * (1 + 1e-12)


@settings(max_examples=80, deadline=None)
@given(nbytes=sizes, name=clusters, n=st.integers(1, 256), extra=st.integers(1, 256), per_node=st.integers(1, 8))
def test_a_larger_group_never_makes_an_all_reduce_cheaper(nbytes, name, n, extra, per_node):
    c = load_cluster(name)
    # packed groups (as many ranks per node as fit) ...
    small = CommGroup(n, min(n, c.gpus_per_node))
    large = CommGroup(n + extra, min(n + extra, c.gpus_per_node))
    assert collective_time("all_reduce", nbytes, large, c) >= collective_time("all_reduce", nbytes, small, c) * (1 - 1e-12)
    # ... and groups with a fixed number of ranks per node
    g = min(per_node, n)
    small = CommGroup(n, g)
    large = CommGroup(n + extra * g, g)
    assert collective_time("all_reduce", nbytes, large, c) >= collective_time("all_reduce", nbytes, small, c) * (1 - 1e-12)


def test_node_scaling_is_read_at_the_groups_ranks_not_the_nodes_it_touches():
    """A fall-off measured at N nodes of G ranks is a collective of G x N ranks: a group of n ranks with fewer than
    G per node (data parallelism beside TP inside the node) reads the curve at n / G (`collectives.scale_nodes`);
    a group of G per node reads it at its nodes, as measured."""
    falling = EfficiencyCurve(((2.0, 1.0), (8.0, 0.5), (32.0, 0.25)), source="test")
    c = flat_cluster()
    scaled = dataclasses.replace(c, inter_node=dataclasses.replace(c.inter_node, node_scaling=falling))
    at = {s: dataclasses.replace(c, inter_node=dataclasses.replace(c.inter_node, bandwidth=s * 50 * GB))
          for s in (0.5, 0.25, 1.0)}
    size = 1e9
    for kind in ("all_gather", "all_reduce"):
        # 64 ranks, 2 per node, over 32 nodes: the fall-off of 64 ranks (8 nodes of 8), not of 32 nodes
        dp_beside_tp4 = CommGroup(64, 2)
        assert collective_time(kind, size, dp_beside_tp4, scaled) == pytest.approx(
            collective_time(kind, size, dp_beside_tp4, at[0.5]))
        # the measured points themselves: 8 per node over 32 nodes reads s(32)
        assert collective_time(kind, size, CommGroup(256, 8), scaled) == pytest.approx(
            collective_time(kind, size, CommGroup(256, 8), at[0.25]))
        # fewer ranks than two full nodes still read the curve's first point (clamped)
        assert collective_time(kind, size, CommGroup(4, 1), scaled) == pytest.approx(
            collective_time(kind, size, CommGroup(4, 1), at[1.0]))
