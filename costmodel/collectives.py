"""Collective cost over the cluster topology: ring, tree, hierarchical and in-network (SHARP).

Notation: n ranks in the group, g of them per node (`CommGroup.ranks_per_node`), N = ceil(n / g) nodes,
S = `nbytes` in nccl-tests' convention (the full buffer per rank: the all-reduce tensor, the gathered
all-gather output, the reduce-scatter input, the message of a send/recv or broadcast).

Every phase is an alpha-beta term (`phase_time`, with `achieved` = bw * e(S)):

    t = factor(kind, n) * S / (bw * e(S)) + steps * alpha

with nccl-tests' bus-bandwidth factors (`bus_factor`): 2(n-1)/n for all-reduce; (n-1)/n for
reduce-scatter, all-gather and all-to-all; 1 for broadcast and send/recv. e(S) is the link level's
efficiency curve at the message size, alpha its per-step latency.

Which link (`flat_path`): a group inside one node (N == 1) uses the intra-node level. A group spanning
nodes is bounded by the inter-node NICs: the node's g ranks share g per-GPU shares of the node's NICs
(the profile's inter-node bandwidth is per GPU; the node's other GPUs are busy with their own groups),
so a flat ring across nodes runs at bw*e = min(intra_bw * e_intra(S), g * inter_bw * e_inter(S)) with
alpha = max(alpha_intra, alpha_inter) (each synchronous ring step waits for its slowest hop).

Algorithms (`collective_cost` prices every applicable one and keeps the fastest):
- ring (`ring_time`): steps 2(n-1) for all-reduce, n-1 for the others except send/recv (1 step). Across
  nodes the steps that cross a node boundary (N-1 per pass over the ring; 2 passes for all-reduce) take the
  inter-node alpha and the rest the intra-node alpha (`ring_latency`, NCCL's tuner): a ring's latency grows
  with its group, so a 768-rank all-gather costs 672 x 1.9 + 95 x 4 = 1.66 ms on DGX A100 nodes before a byte
  of bandwidth (FSDP/ZeRO-3 pays it per unit gathered, `costmodel.simulator.pricing`, or per parameter
  tensor, three times per micro-batch, in DeepSpeed's ZeRO-3 of 2021: `costmodel.param_gathers`).
- tree (`tree_time`, all-reduce and broadcast): NCCL's double binary tree, bandwidth factor 2 for
  all-reduce (reduce up, broadcast down) and 1 for broadcast, 2*ceil(log2 n) (all-reduce) or
  ceil(log2 n) (broadcast) latency steps.
- hierarchical (`hierarchical_time`, all-reduce, N > 1 and g > 1): intra-node reduce-scatter(S) ->
  inter-node all-reduce(S/g) among the N ranks holding the same shard -> intra-node all-gather(S) (the
  shape of NCCL's tree and NVLS-tree across nodes). The inter-node phase runs g concurrent groups of N
  ranks (one rank per node), each on its own per-GPU NIC share. All-gather and reduce-scatter have no
  such algorithm in NCCL for more than one GPU per node (ring only; PAT, NCCL 2.23, needs one rank per
  node): across nodes they are rings.
- SHARP (`sharp_time`, all-reduce inside a node whose intra link has `sharp`, e.g. NVLS; or the
  inter-node phase of the hierarchical algorithm when the inter link has it): the reduction happens in
  the switch, so the bus factor 2(n-1)/n becomes the link's `sharp_all_reduce_factor` (~1, from a
  measurement where the profile has one) and the latency is two steps (up to the switch and back).
- all-to-all across nodes (`all_to_all_time`): each rank sends (g-1)/n of S inside its node and (n-g)/n
  across nodes at the same time: t = max(intra part, inter part) + (n-1) * alpha, the inter part at
  the rank's own NIC share (bounded by the flat path).

Measured per-collective behaviour (`collective_factor`): the time of the fastest algorithm is multiplied
by the link's `collective_factors` curve for `kind/m` at S, where the link is the intra-node level for a
one-node group and the inter-node level otherwise, and m is the largest group size in the table not above
n (none: factor 1). GPU profiles have no table (factor 1); the local-cpu profile uses it to say, as data,
that gloo's reduce-scatter on 4 oversubscribed ranks costs like an all-reduce and its send/recv a third of
the ring model.

Scale (`LinkLevel.node_scaling`, `achieved`): a fabric's achieved bandwidth falls as a collective spans
more nodes (congestion, adaptive routing, rail and spine oversubscription, stragglers): on the Ultra-Scale
Playbook's EFA cluster the all-reduce bus bandwidth falls 362 -> 33 GB/s from 2 to 64 nodes. The inter-node
level may carry a measured curve s(x) (x = nodes of G ranks, log-interpolated), and every inter-node term of a
group spanning nodes runs at bw * e(S) * s(x), x from `scale_nodes` (below): the flat ring's NIC share, the
hierarchical algorithm's inter-node phase, SHARP across nodes and all-to-all's remote part. Without a curve
s = 1. A collective's own curve (`LinkLevel.collective_node_scaling`, e.g. all-gather's, which on that cluster
falls 185 -> 11 GB/s) replaces s for it; the inter-node phase of a hierarchical algorithm falls off as the collective it
belongs to (the hierarchical all-reduce's inter-node all-reduce on S/g is an all-reduce). `soap calibrate
--from-nccl-tests` fits e(S), alpha and s(N) from nccl-tests logs (`costmodel.calibration.nccl_tests`).

Where a group sits on that curve (`scale_nodes`): at its ranks counted in whole nodes, x = max(2, n / G) for a
group spanning nodes (G = the GPUs of a node, or of the NVLink domain where larger), not at the N nodes it touches.
A measurement at N nodes is a collective of n = G x N ranks (nccl-tests runs one rank per GPU), so the two readings
agree on every measured point; they differ for a group with g < G ranks per node (data parallelism beside TP or a
pipeline inside the node), and the physics says ranks: the fall-off is the collective waiting on its participants
(a ring's 2(n-1) or a tree's 2 log2 n synchronized steps each wait for the slowest hop, and the chance that one of
n ranks' NICs is in its slow tail grows with n: the Playbook cluster's p5 bus bandwidth is 1/1.5 to 1/3.6 of its
median at 4-64 nodes), while what a rank carries through its NIC share is the same for the G/g groups that cross a
node side by side as for one group of G per node. On the Playbook grid at 32 nodes (256 H100), dp64 x tp4 and dp256
x tp1 move the same gradient bytes per NIC at the same compute, and measured 0.172 s and 0.261 s per step: read at
N = 32 nodes both are priced alike (0.273 and 0.282 s), read at n / G = 8 and 32 they are not
(benchmarks/playbook_grid.py). `soap calibrate --from-nccl-tests` places a log at its nodes, which is n / G for
logs of one rank per GPU (the default); a log with fewer ranks per node would be read at n / G, short of the N
nodes it was fitted at.

A group of size 1 or zero bytes costs 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from costmodel.profiles import ClusterSpec, LinkLevel
from tracer.errors import SoapError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")
ALGORITHMS = ("ring", "tree", "hierarchical", "sharp")


@dataclass(frozen=True)
class CommGroup:
    size: int
    """Ranks in the group."""
    ranks_per_node: int
    """How many of them share a node (== size for an intra-node group)."""

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.ranks_per_node)


@dataclass(frozen=True)
class CollectiveCost:
    """The fastest algorithm's time for one collective, with the alternatives it beat."""

    seconds: float
    algorithm: str
    alternatives: tuple[tuple[str, float], ...] = ()


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


def ring_steps(kind: str, n: int) -> int:
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind == "send_recv":
        return 1
    return n - 1


def phase_time(factor: float, nbytes: float, bandwidth: float, latency_s: float, steps: float) -> float:
    """factor * S / bandwidth + steps * alpha, with `bandwidth` already scaled by the efficiency at S."""
    return factor * nbytes / bandwidth + steps * latency_s


def achieved(link: LinkLevel, nbytes: float, share: float = 1.0, nodes: float = 1, kind: str | None = None) -> float:
    """Bytes/s a rank gets from `share` per-GPU shares of `link` for an S-byte message of collective `kind`, in a
    group spanning `nodes` nodes (the link's `node_scaling`, `kind`'s own where the link has one)."""
    return share * link.bandwidth * link.efficiency.at(nbytes) * link.scale_at(nodes, kind)


def scale_nodes(group: CommGroup, cluster: ClusterSpec) -> float:
    """Where `group` reads the inter-node level's node-scaling curve: its ranks in whole nodes of the cluster's
    GPUs, at least 2 for a group spanning nodes (1 inside one node; module docstring, Scale)."""
    if group.nodes <= 1:
        return 1.0
    return max(2.0, group.size / cluster.domain_size)


def flat_path(nbytes: float, group: CommGroup, cluster: ClusterSpec, kind: str | None = None) -> tuple[float, float]:
    """(achieved bandwidth, per-step latency) of a flat algorithm of `kind` over `group` (the tree's steps: every
    level of a tree across nodes waits for its slowest hop)."""
    intra, inter = cluster.intra_node, cluster.inter_node
    if group.nodes == 1:
        return achieved(intra, nbytes), intra.latency_s
    remote = achieved(inter, nbytes, group.ranks_per_node, scale_nodes(group, cluster), kind)
    bandwidth = min(achieved(intra, nbytes), remote)
    return bandwidth, max(intra.latency_s, inter.latency_s)


def ring_latency(kind: str, group: CommGroup, cluster: ClusterSpec) -> float:
    """The ring's latency term: of its steps, those that cross a node boundary at the inter-node alpha and the
    rest at the intra-node alpha (NCCL's tuner, src/graph/tuning.cc: (nsteps - nInterSteps) x intraLat +
    nInterSteps x interLat; a ring over N nodes enters each node once: N - 1 inter-node steps per pass)."""
    steps = ring_steps(kind, group.size)
    if group.nodes == 1:
        return steps * cluster.intra_node.latency_s
    passes = 2 if kind == "all_reduce" else 1
    inter = min(steps, passes * (group.nodes - 1))
    return (steps - inter) * cluster.intra_node.latency_s + inter * cluster.inter_node.latency_s


def ring_time(kind: str, nbytes: float, group: CommGroup, cluster: ClusterSpec) -> float:
    bandwidth, _ = flat_path(nbytes, group, cluster, kind)
    return phase_time(bus_factor(kind, group.size), nbytes, bandwidth, 0.0, 0) + ring_latency(kind, group, cluster)


def tree_time(kind: str, nbytes: float, group: CommGroup, cluster: ClusterSpec) -> float | None:
    if kind not in ("all_reduce", "broadcast"):
        return None
    bandwidth, alpha = flat_path(nbytes, group, cluster, kind)
    depth = math.ceil(math.log2(group.size))
    if kind == "all_reduce":
        return phase_time(2.0, nbytes, bandwidth, alpha, 2 * depth)
    return phase_time(1.0, nbytes, bandwidth, alpha, depth)


def sharp_time(nbytes: float, link: LinkLevel, nodes: float = 1) -> float:
    """All-reduce reduced in the switch of `link`: bus factor `sharp_all_reduce_factor`, two steps."""
    return phase_time(link.sharp_all_reduce_factor, nbytes, achieved(link, nbytes, nodes=nodes, kind="all_reduce"),
                      link.latency_s, 2)


def _level_ring(kind: str, nbytes: float, n: int, link: LinkLevel, nodes: int = 1, scale_kind: str | None = None) -> float:
    """A ring of `kind` over `n` ranks of one level; its fall-off with `nodes` is `scale_kind`'s (the collective
    the ring is a phase of)."""
    return phase_time(bus_factor(kind, n), nbytes, achieved(link, nbytes, nodes=nodes, kind=scale_kind or kind),
                      link.latency_s,
                      ring_steps(kind, n))


def _inter(kind: str, nbytes: float, nodes: int, cluster: ClusterSpec, scale: float | None = None) -> float:
    """A ring of `kind` over `nodes` ranks, one per node, reading the fall-off at `scale` (`scale_nodes` of the
    group it is a phase of; default `nodes`)."""
    link = cluster.inter_node
    at = nodes if scale is None else scale
    ring = phase_time(bus_factor(kind, nodes), nbytes, achieved(link, nbytes, nodes=at, kind=kind), link.latency_s,
                      ring_steps(kind, nodes))
    if kind == "all_reduce" and link.sharp:
        return min(ring, sharp_time(nbytes, link, at))
    return ring


def hierarchical_time(kind: str, nbytes: float, group: CommGroup, cluster: ClusterSpec) -> float | None:
    g, nodes = group.ranks_per_node, group.nodes
    if nodes == 1 or g == 1 or kind != "all_reduce":
        return None
    shard = nbytes / g
    intra = cluster.intra_node
    return (
        _level_ring("reduce_scatter", nbytes, g, intra)
        + _inter("all_reduce", shard, nodes, cluster, scale_nodes(group, cluster))
        + _level_ring("all_gather", nbytes, g, intra)
    )


def all_to_all_time(nbytes: float, group: CommGroup, cluster: ClusterSpec) -> float:
    n, g = group.size, group.ranks_per_node
    if group.nodes == 1:
        return ring_time("all_to_all", nbytes, group, cluster)
    remote_bw, alpha = flat_path(nbytes, group, cluster, "all_to_all")
    local = (g - 1) / n * nbytes / achieved(cluster.intra_node, nbytes)
    remote = (n - g) / n * nbytes / min(remote_bw, achieved(cluster.inter_node, nbytes,
                                                            nodes=scale_nodes(group, cluster), kind="all_to_all"))
    return max(local, remote) + (n - 1) * alpha


def _check(kind: str, nbytes: float, group: CommGroup, cluster: ClusterSpec) -> None:
    if kind not in COLLECTIVES:
        raise SoapError(f"unknown collective {kind!r}; choose one of {', '.join(COLLECTIVES)}")
    if nbytes < 0 or not math.isfinite(nbytes):
        raise SoapError(f"collective size must be a non-negative number of bytes, got {nbytes}")
    if group.size < 1 or group.ranks_per_node < 1:
        raise SoapError(f"group size ({group.size}) and ranks per node ({group.ranks_per_node}) must be positive")
    if group.ranks_per_node > min(group.size, cluster.domain_size):
        raise SoapError(
            f"{group.ranks_per_node} ranks per node exceeds the group size ({group.size}) or the "
            f"{cluster.domain_size} GPUs per NVLink domain of {cluster.name}"
        )


def collective_factor(kind: str, nbytes: float, group: CommGroup, cluster: ClusterSpec) -> float:
    """The link's measured time factor for `kind` on `group` at `nbytes` (see the module docstring)."""
    link = cluster.intra_node if group.nodes == 1 else cluster.inter_node
    sizes = [int(key.split("/")[1]) for key in link.collective_factors if key.split("/")[0] == kind]
    fitting = [m for m in sizes if m <= group.size]
    if not fitting:
        return 1.0
    return link.collective_factors[f"{kind}/{max(fitting)}"].at(nbytes)


def collective_cost(kind: str, nbytes: float, group: CommGroup, cluster: ClusterSpec) -> CollectiveCost:
    """Price every applicable algorithm and keep the fastest, times the link's measured factor for the
    collective (see the module docstring)."""
    _check(kind, nbytes, group, cluster)
    if group.size == 1 or nbytes == 0:
        return CollectiveCost(0.0, "none")
    factor = collective_factor(kind, nbytes, group, cluster)
    if kind == "all_to_all":
        return CollectiveCost(factor * all_to_all_time(nbytes, group, cluster), "direct")
    options: dict[str, float | None] = {
        "ring": ring_time(kind, nbytes, group, cluster),
        "tree": tree_time(kind, nbytes, group, cluster),
        "hierarchical": hierarchical_time(kind, nbytes, group, cluster),
    }
    if kind == "all_reduce" and group.nodes == 1 and cluster.intra_node.sharp:
        options["sharp"] = sharp_time(nbytes, cluster.intra_node)
    priced = tuple((name, factor * t) for name, t in options.items() if t is not None)
    best = min(priced, key=lambda item: item[1])
    return CollectiveCost(best[1], best[0], priced)


def collective_time(kind: str, nbytes: float, group: CommGroup, cluster: ClusterSpec) -> float:
    """Seconds for one collective. `nbytes` follows nccl-tests' "size": the full buffer per rank
    (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the input;
    send_recv: the message)."""
    return collective_cost(kind, nbytes, group, cluster).seconds
