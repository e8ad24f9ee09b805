"""`soap calibrate --from-nccl-tests`: a cluster's network from the logs its operators already have.

Reading (`read_log`). One log is the standard output of one nccl-tests binary (`all_reduce_perf`,
`all_gather_perf`, `reduce_scatter_perf`, `alltoall_perf`, `sendrecv_perf`; rccl-tests prints the same;
format: shared/reference/nccl-tests.md). Launcher prefixes (`[1,0]<stdout>:`, `0: `) are stripped. The
collective comes from `# Collective test starting: NAME`, else the file name, else `--collective`. The
group is read from the `#  Rank R ... on HOST device D` lines: n = the largest rank + 1, ranks per node g =
the largest device index + 1 (publishers sometimes cut rank lines, device indices survive), nodes N = n / g.
Each data row gives the per-rank size S (nccl-tests' convention, which is soap's: `collective_time`) and the
out-of-place time t. A line that is none of these and not a comment is an error naming the file and line.

Model fitted. The link levels of `costmodel.collectives` (t = factor x S / (bw e(S) s(N)) + steps alpha, the
fastest algorithm) with the line rates `bw` kept from the given cluster (a datasheet ceiling) and fitted:
- the intra-node level from the one-node logs: latency alpha and efficiency e(S);
- the inter-node level from the logs of the fewest nodes N0 > 1: alpha and e(S), with s(N0) = 1;
- the inter-node `node_scaling` s(N) for every larger node count N: the factor that makes the median of
  log(predicted / measured) over the bandwidth-bound rows (S >= `BANDWIDTH_BOUND_BYTES`) zero;
- where the logs hold more than one collective across nodes, each collective's own curve
  (`collective_node_scaling`) the same way on its logs alone, at every node count from N0 (in (0, 2]: the
  level's e(S) is fitted on all collectives together).
alpha and e(S) are found on the model itself (`_fit_level`): coordinate descent (`SWEEPS` sweeps of a
golden-section search per parameter) on log alpha and the log efficiencies, minimizing the squared log
errors of every row (rows between `LATENCY_BOUND_BYTES` and `MIN_CURVE_BYTES` left out: neither latency nor
bandwidth rules them), efficiencies kept in [`MIN_EFFICIENCY`, 1] and s(N) in [`MIN_EFFICIENCY`, 1] (a fabric
does not speed up with scale; a log that says so is clamped, and the per-log error shows it). The
efficiency points are `CURVE_POINTS` log-spaced sizes from the smallest per-node shard of a logged size
(the hierarchical algorithms' inter-node phase runs on S / g) to the largest logged size.

Bandwidth tables (`logs_from_bus_bandwidth`). A cluster's measurements published as bus bandwidth per node count
(a figure: GB/s against nodes, message size not stated) become logs the same fit reads: one log per collective
and node count, its rows at `TABLE_SIZES` (all bandwidth-bound) at t = factor(kind, n) x S / busbw, the bus
bandwidth taken as it is at every size. Such logs fix the bandwidth terms (e(S) at large S and s(N)) and
leave alpha and the small-message efficiencies as the given cluster has them.

Reported (`NcclFit.errors`): per log, the mean absolute error of the fitted model's times against the
measured ones over the rows from `MIN_CURVE_BYTES` up. Every fitted number's source names its logs.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from costmodel.calibration.fit import golden_section
from costmodel.collectives import CommGroup, collective_time
from costmodel.profiles import ClusterSpec, EfficiencyCurve, LinkLevel
from tracer.errors import SoapError

BINARIES = {"all_reduce_perf": "all_reduce", "all_gather_perf": "all_gather", "reduce_scatter_perf": "reduce_scatter",
            "alltoall_perf": "all_to_all", "sendrecv_perf": "send_recv"}
"""nccl-tests binary -> soap's collective."""
LATENCY_BOUND_BYTES = 64 * 2**10
BANDWIDTH_BOUND_BYTES = 16 * 2**20
MIN_CURVE_BYTES = 4096
CURVE_POINTS = 10
SWEEPS = 4
GOLDEN_STEPS = 18
MIN_EFFICIENCY = 1e-3
MAX_KIND_SCALE = 2.0
"""A collective's own fall-off curve may sit above the shared one (up to the profile loader's bound): the level's
e(S) is fitted on every collective together, and one collective may run faster than their median."""
TABLE_SIZES = (64 * 2**20, 256 * 2**20, 2**30)
"""Sizes of the rows a bus-bandwidth table becomes (`logs_from_bus_bandwidth`): bandwidth-bound, from
`BANDWIDTH_BOUND_BYTES` up."""

_PREFIX = re.compile(r"^(\[\d+,\d+\]<std(?:out|err)>:|\d+:\s)")
_RANK = re.compile(r"^#\s+Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+(\d+)")
_STARTING = re.compile(r"^#\s*Collective test starting:\s*(\S+)")


@dataclass(frozen=True)
class NcclLog:
    """One nccl-tests log: the collective, its group, and (size bytes, out-of-place seconds) rows."""

    path: str
    collective: str
    ranks: int
    ranks_per_node: int
    rows: tuple[tuple[float, float], ...]

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / self.ranks_per_node)

    @property
    def group(self) -> CommGroup:
        return CommGroup(size=self.ranks, ranks_per_node=self.ranks_per_node)

    @property
    def name(self) -> str:
        return Path(self.path).name


def collective_of(path: str, text: str, given: str | None) -> str:
    """The soap collective a log measured: its `Collective test starting` line, its file name, or `given`."""
    for line in text.splitlines():
        match = _STARTING.match(_PREFIX.sub("", line.strip()))
        if match and match.group(1) in BINARIES:
            return BINARIES[match.group(1)]
    for binary, kind in BINARIES.items():
        if binary in Path(path).name:
            return kind
    if given:
        return given
    raise SoapError(f"{path}: cannot tell which collective this log measured (no 'Collective test starting' line, "
                    f"no {'/'.join(BINARIES)} in the file name); pass --collective "
                    f"{'|'.join(sorted(set(BINARIES.values())))}")


def read_log(path: str, *, collective: str | None = None) -> NcclLog:
    """Parse one nccl-tests log (module docstring); any line it cannot read is one SoapError naming it."""
    if collective is not None and collective not in BINARIES.values():
        raise SoapError(f"--collective {collective}: choose one of {', '.join(sorted(set(BINARIES.values())))}")
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        raise SoapError(f"cannot read nccl-tests log {path} ({exc.strerror or exc})") from None
    kind = collective_of(path, text, collective)
    ranks: dict[int, tuple[str, int]] = {}
    rows: list[tuple[float, float]] = []
    in_table = False
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _PREFIX.sub("", raw.strip()).strip()
        match = _RANK.match(line)
        if match:
            ranks[int(match.group(1))] = (match.group(2), int(match.group(3)))
            continue
        if line.startswith("#"):
            in_table = in_table or "size" in line and "time" in line and "busbw" in line
            continue
        fields = line.split()
        if in_table and fields and fields[0].isdigit():
            try:
                size, seconds = float(fields[0]), float(fields[5]) * 1e-6
            except (IndexError, ValueError):
                raise SoapError(f"{path} line {number}: a data row needs 'size count type redop root time ...', "
                                f"got {line[:80]!r}") from None
            if len(fields) < 9 or seconds <= 0:
                raise SoapError(f"{path} line {number}: expected size, count, type, redop, root, then time, algbw, "
                                f"busbw and #wrong (out of place), got {line[:80]!r}")
            if size > 0:  # all_gather prints 0-byte rows for sizes below one element per rank: nothing moved
                rows.append((size, seconds))
    if not rows:
        raise SoapError(f"{path}: no data rows (after the 'size count type redop root time algbw busbw' header); "
                        "is it the output of an nccl-tests binary?")
    if not ranks:
        raise SoapError(f"{path}: no '#  Rank R Group 0 Pid P on HOST device D' lines, so the group size is unknown; "
                        "keep them in the log")
    per_node = max(device for _, device in ranks.values()) + 1
    return NcclLog(path=str(path), collective=kind, ranks=max(ranks) + 1, ranks_per_node=min(per_node, max(ranks) + 1),
                   rows=tuple(rows))


@dataclass(frozen=True)
class NcclFit:
    cluster: ClusterSpec
    errors: dict[str, tuple[float, float]]
    """Per log file: (mean absolute error % of the given profile, of the fitted one)."""


def predicted(log: NcclLog, cluster: ClusterSpec) -> np.ndarray:
    return np.array([collective_time(log.collective, size, log.group, cluster) for size, _ in log.rows])


def _measured(log: NcclLog) -> np.ndarray:
    return np.array([seconds for _, seconds in log.rows])


def fit_error_pct(log: NcclLog, cluster: ClusterSpec) -> float:
    """Mean absolute % error of `cluster`'s times on the rows of `log` from MIN_CURVE_BYTES up."""
    keep = np.array([size >= MIN_CURVE_BYTES for size, _ in log.rows])
    if not keep.any():
        keep[:] = True
    pred, meas = predicted(log, cluster)[keep], _measured(log)[keep]
    return float(np.mean(np.abs(pred / meas - 1.0)) * 100)


def _grid(logs: list[NcclLog]) -> list[float]:
    sizes = sorted({size for log in logs for size, _ in log.rows if size >= MIN_CURVE_BYTES})
    if len(sizes) <= CURVE_POINTS:
        return sizes
    picks = np.unique(np.round(np.linspace(0, len(sizes) - 1, CURVE_POINTS)).astype(int))
    return [sizes[i] for i in picks]


def _with_level(cluster: ClusterSpec, level: str, link: LinkLevel) -> ClusterSpec:
    return replace(cluster, **{level: link})


def _fit_level(cluster: ClusterSpec, level: str, logs: list[NcclLog], source: str) -> ClusterSpec:
    """alpha and e(S) of `level` fitted to `logs` (module docstring): coordinate descent on log alpha and the
    log efficiencies, each a golden-section search, minimizing the squared log errors of every row."""
    link: LinkLevel = getattr(cluster, level)
    smallest = min(size / log.ranks_per_node for log in logs for size, _ in log.rows if size >= MIN_CURVE_BYTES)
    largest = max(size for log in logs for size, _ in log.rows)
    grid = [float(f"{x:.4g}") for x in np.geomspace(max(smallest, 1.0), largest, CURVE_POINTS)]
    rows = [(log, size, seconds) for log in logs for size, seconds in log.rows if size >= MIN_CURVE_BYTES
            or size <= LATENCY_BOUND_BYTES]
    meas = np.log([seconds for _, _, seconds in rows])
    theta = np.log([max(link.latency_s, 1e-7), *(link.efficiency.at(x) for x in grid)])
    bounds = [(math.log(1e-8), math.log(1e-2))] + [(math.log(MIN_EFFICIENCY), 0.0)] * len(grid)

    def at(t: np.ndarray) -> ClusterSpec:
        curve = EfficiencyCurve(tuple((x, float(math.exp(e))) for x, e in zip(grid, t[1:])), source=source)
        return _with_level(cluster, level, replace(link, latency_s=float(math.exp(t[0])), efficiency=curve))

    def loss(t: np.ndarray) -> float:
        trial = at(t)
        pred = np.log([collective_time(log.collective, size, log.group, trial) for log, size, _ in rows])
        return float(np.sum((pred - meas) ** 2))

    for _ in range(SWEEPS):
        for j, (low_bound, high_bound) in enumerate(bounds):
            low, high = max(low_bound, theta[j] - 2.0), min(high_bound, theta[j] + 2.0)

            def value(x: float) -> float:
                trial = theta.copy()
                trial[j] = x
                return loss(trial)

            best = golden_section(value, low, high, GOLDEN_STEPS)
            if value(best) < loss(theta):
                theta[j] = best
    fitted = at(theta)
    curve = EfficiencyCurve(tuple((x, float(f"{math.exp(e):.4g}")) for x, e in zip(grid, theta[1:])), source=source)
    sources = {**link.sources, "latency_us": source}
    return _with_level(cluster, level, replace(getattr(fitted, level), latency_s=float(f"{math.exp(theta[0]):.4g}"),
                                               efficiency=curve, sources=sources))


def _bias_zero(bias: Callable[[float], float], low: float, high: float) -> float:
    """exp of the x in [low, high] (logs) where the decreasing `bias` crosses 0 (clamped to the ends)."""
    if bias(high) >= 0:
        return math.exp(high)
    if bias(low) <= 0:
        return math.exp(low)
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if bias(mid) > 0 else (low, mid)
    return float(math.exp((low + high) / 2))


def _median_log_ratio(cluster: ClusterSpec, rows: list[tuple[NcclLog, float, float]]) -> float:
    return float(np.median([math.log(collective_time(log.collective, size, log.group, cluster) / seconds)
                            for log, size, seconds in rows]))


def _bandwidth_rows(logs: list[NcclLog]) -> list[tuple[NcclLog, float, float]]:
    rows = [(log, size, seconds) for log in logs for size, seconds in log.rows if size >= BANDWIDTH_BOUND_BYTES]
    return rows or [(log, size, seconds) for log in logs for size, seconds in log.rows[-3:]]


def _fit_scale(cluster: ClusterSpec, logs: list[NcclLog], kind: str | None = None, high: float = 1.0) -> float:
    """s(N) for logs of one node count: the factor zeroing the median log ratio of their bandwidth-bound rows;
    with `kind`, that collective's own curve (`LinkLevel.collective_node_scaling`), up to `high`."""
    rows = _bandwidth_rows(logs)

    def bias(log_scale: float) -> float:
        curve = EfficiencyCurve(((2.0, math.exp(log_scale)),), source="-")
        link = cluster.inter_node
        if kind is None:
            link = replace(link, node_scaling=curve)
        else:
            link = replace(link, collective_node_scaling={**link.collective_node_scaling, kind: curve})
        return _median_log_ratio(_with_level(cluster, "inter_node", link), rows)

    return _bias_zero(bias, math.log(MIN_EFFICIENCY), math.log(high))


def _fit_level_bandwidth(cluster: ClusterSpec, level: str, logs: list[NcclLog], source: str) -> ClusterSpec:
    """One factor on `level`'s e(S) (its shape and alpha kept): the factor zeroing the median log ratio of the
    bandwidth-bound rows, the efficiencies kept in [MIN_EFFICIENCY, 1]. For logs that give bandwidth only."""
    link: LinkLevel = getattr(cluster, level)
    rows = _bandwidth_rows(logs)

    def scaled(factor: float) -> LinkLevel:
        points = tuple((x, float(f"{min(max(e * factor, MIN_EFFICIENCY), 1.0):.4g}")) for x, e in link.efficiency.points)
        return replace(link, efficiency=EfficiencyCurve(points, source=f"{link.efficiency.source}; scaled by "
                                                        f"{factor:.4g}, {source}"))

    def bias(log_factor: float) -> float:
        return _median_log_ratio(_with_level(cluster, level, scaled(math.exp(log_factor))), rows)

    top = -math.log(min(e for _, e in link.efficiency.points))
    factor = _bias_zero(bias, math.log(MIN_EFFICIENCY), top)
    return _with_level(cluster, level, scaled(factor))


def fit_nccl_logs(logs: list[NcclLog], cluster: ClusterSpec, *, name: str | None = None,
                  bandwidth_only: bool = False) -> NcclFit:
    """Fit `cluster`'s network to `logs` (module docstring); the fitted cluster is named `name`. `bandwidth_only`:
    the logs hold bandwidth-bound rows only (`logs_from_bus_bandwidth`), so each level's e(S) is scaled by
    one factor and alpha kept."""
    fit_level = _fit_level_bandwidth if bandwidth_only else _fit_level
    if not logs:
        raise SoapError("--from-nccl-tests needs at least one log")
    stamp = datetime.date.today().isoformat()

    def named(chosen: list[NcclLog]) -> str:
        return f"fitted by soap calibrate --from-nccl-tests to {', '.join(log.name for log in chosen)}, {stamp}"

    for log in logs:
        if log.ranks_per_node > cluster.domain_size:
            raise SoapError(f"{log.path}: {log.ranks_per_node} ranks per node, but {cluster.name} has "
                            f"{cluster.domain_size} GPUs per node; pass the matching --cluster")
    fitted = replace(cluster, name=name or f"{cluster.name}-nccl",
                     inter_node=replace(cluster.inter_node, node_scaling=None, collective_node_scaling={}))
    one_node = [log for log in logs if log.nodes == 1]
    if one_node:
        fitted = fit_level(fitted, "intra_node", one_node, named(one_node))
    spanning = sorted({log.nodes for log in logs if log.nodes > 1})
    if spanning:
        base = [log for log in logs if log.nodes == spanning[0]]
        fitted = fit_level(fitted, "inter_node", base, named(base))
        scale = [(float(spanning[0]), 1.0)]
        for nodes in spanning[1:]:
            scale.append((float(nodes), float(f"{_fit_scale(fitted, [log for log in logs if log.nodes == nodes]):.4g}")))
        if len(scale) > 1:
            chosen = [log for log in logs if log.nodes > 1]
            curve = EfficiencyCurve(tuple(scale), source=named(chosen) + "; x = nodes of full-node ranks (n / G), "
                                    f"factor on the inter-node bandwidth relative to {spanning[0]} nodes")
            fitted = _with_level(fitted, "inter_node", replace(fitted.inter_node, node_scaling=curve))
        kinds = sorted({log.collective for log in logs if log.nodes > 1})
        if len(kinds) > 1:
            own = {}
            for kind in kinds:
                points = []
                for nodes in spanning:
                    chosen = [log for log in logs if log.nodes == nodes and log.collective == kind]
                    if chosen:
                        points.append((float(nodes), float(f"{_fit_scale(fitted, chosen, kind, MAX_KIND_SCALE):.4g}")))
                if points:
                    chosen = [log for log in logs if log.nodes > 1 and log.collective == kind]
                    own[kind] = EfficiencyCurve(tuple(points), source=named(chosen) + "; x = nodes of full-node ranks "
                                                f"(n / G), {kind}'s factor on the inter-node bandwidth (in place of "
                                                "node_scaling)")
            fitted = _with_level(fitted, "inter_node", replace(fitted.inter_node, collective_node_scaling=own))
    errors = {log.path: (fit_error_pct(log, cluster), fit_error_pct(log, fitted)) for log in logs}
    return NcclFit(cluster=fitted, errors=errors)


def logs_from_bus_bandwidth(table: dict[str, dict[int, float]], *, ranks_per_node: int,
                            source: str = "table") -> list[NcclLog]:
    """Logs from measured bus bandwidth (module docstring): `table[collective][nodes]` in bytes/s."""
    from costmodel.collectives import bus_factor

    logs = []
    for kind, by_nodes in table.items():
        if kind not in BINARIES.values():
            raise SoapError(f"{source}: unknown collective {kind!r}")
        for nodes, busbw in sorted(by_nodes.items()):
            if busbw <= 0:
                raise SoapError(f"{source}: {kind} at {nodes} nodes: bus bandwidth must be positive, got {busbw}")
            n = nodes * ranks_per_node
            rows = tuple((float(size), bus_factor(kind, n) * size / busbw) for size in TABLE_SIZES)
            logs.append(NcclLog(path=f"{source}:{kind}@{nodes}x{ranks_per_node}", collective=kind, ranks=n,
                                ranks_per_node=ranks_per_node, rows=rows))
    return logs


def write_log(path: str | Path, kind: str, cluster: ClusterSpec, *, nodes: int, ranks_per_node: int,
              sizes: list[int]) -> None:
    """An nccl-tests log of `kind` as `cluster` predicts it (for tests and for showing a profile as a log):
    the rank lines, the table header and one row per size, in nccl-tests 2.17's layout."""
    binary = next(b for b, k in BINARIES.items() if k == kind)
    n = nodes * ranks_per_node
    group = CommGroup(size=n, ranks_per_node=ranks_per_node)
    lines = ["# nccl-tests version 2.17.9 nccl-headers=22403 nccl-library=22403",
             f"# Collective test starting: {binary}",
             f"# nThread 1 nGpus 1 minBytes {sizes[0]} maxBytes {sizes[-1]} step: 2(factor) warmup iters: 1 iters: 20 "
             "agg iters: 1 validation: 1 graph: 0", "#", "# Using devices"]
    lines += [f"#  Rank {r:2d} Group  0 Pid {1000 + r} on node{r // ranks_per_node:03d} device {r % ranks_per_node:2d} "
              f"[0000:00:00] soap model" for r in range(n)]
    lines += ["#", "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw"
              "   busbw  #wrong", "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)"
              "             (us)  (GB/s)  (GB/s)"]
    from costmodel.collectives import bus_factor

    for size in sizes:
        us = collective_time(kind, size, group, cluster) * 1e6
        algbw = size / us / 1e3
        busbw = algbw * bus_factor(kind, n)
        redop = "sum" if kind in ("all_reduce", "reduce_scatter") else "none"
        cells = f"{us:8.2f} {algbw:7.2f} {busbw:7.2f}       0"
        lines.append(f"{size:12d} {max(1, size // 4):13d}     float {redop:>7s}      -1 {cells} {cells}")
    lines += ["# Out of bounds values : 0 OK", f"# Collective test concluded: {binary}"]
    Path(path).write_text("\n".join(lines) + "\n")
