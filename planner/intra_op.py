"""Per-op SOAP splits inside one block, chosen jointly and exactly (Alpa's intra-op pass).

Model. A block is a small graph of ops i = 0..n-1. Op i has candidate splits k = 0..K_i-1 (e.g.
"replicated", "column-parallel", "row-parallel", "sequence-sharded"), each with a cost c_i[k]: its
compute time on the local shard plus the collectives that split itself needs. Each edge (i, j) of the
dataflow has a resharding cost r_ij[a, b]: the time to turn op i's output laid out by split a into the
layout op j's split b expects (zero when they agree).

Variables: x[i, k] in {0, 1}, one split per op: sum_k x[i, k] = 1.
           y[i, j, a, b] in {0, 1}, the edge's joint choice, linearised as Alpa does:
           sum_b y[i, j, a, b] = x[i, a] and sum_a y[i, j, a, b] = x[j, b].
Objective: minimise sum_i sum_k c_i[k] x[i, k] + sum_(i,j) sum_(a,b) r_ij[a, b] y[i, j, a, b].

Costs are scaled to integers with `COST_RESOLUTION` steps between zero and the largest finite cost
(CP-SAT needs integer coefficients, and exact integer sums make ties exact); an infinite (or NaN)
cost forbids the choice.

Solver. A block's dataflow is a chain with a few skip edges (residuals), so exact variable
elimination is cheap (`_eliminate`): eliminate ops from the last to the first; eliminating op i sums
every table that mentions it into one table over op i and its remaining neighbours (ops before i)
and takes the minimum over op i's split. The tables stay small: their width is the number of edges
crossing a point of the op order (the main path, the residual stream, a few more inside attention):
at most 486 entries for the shipped presets' blocks. Assigning ops first to last, each op takes the lowest split index that reaches
the minimum given the ops before it, so the answer is the lexicographically smallest optimum and
deterministic. Where a table would pass `ELIMINATION_LIMIT` entries (a densely connected block),
CP-SAT solves the same integer model instead (`_cp_sat`): single-threaded with a fixed seed, its hint
the lowest allowed choice of each op. Keeping CP-SAT off the common path also keeps its import
(ortools and pandas, about half a second) out of `soap plan`.

The kernel (`solve_block_splits`) is a pure function over arrays; `BlockSplitCache` solves each
distinct cost table once (a block type under one tp/cp/sp setting) and reuses the answer for every
repeat.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import numpy as np

from tracer.errors import SoapError

COST_RESOLUTION = 1_000_000
"""Integer steps between zero and the largest finite cost; rounding changes a cost by at most
max_cost / COST_RESOLUTION, far below what separates the splits of a real block."""

ELIMINATION_LIMIT = 1 << 20
"""Entries of the largest table variable elimination may build before CP-SAT takes over."""

SOLVER_TIME_LIMIT_S = 10.0
"""A safety net: real blocks (tens of ops, a handful of splits each) solve in milliseconds."""


def _as_costs(node_costs: Sequence[np.ndarray], edge_costs: Mapping[tuple[int, int], np.ndarray]):
    nodes = [np.asarray(c, dtype=float).reshape(-1) for c in node_costs]
    edges: dict[tuple[int, int], np.ndarray] = {}
    for (i, j), table in sorted(edge_costs.items()):
        t = np.asarray(table, dtype=float)
        if not (0 <= i < len(nodes) and 0 <= j < len(nodes)) or i == j:
            raise ValueError(f"edge ({i}, {j}) does not join two distinct ops of {len(nodes)}")
        if t.shape != (nodes[i].size, nodes[j].size):
            raise ValueError(f"edge ({i}, {j}) table has shape {t.shape}, expected {(nodes[i].size, nodes[j].size)}")
        edges[(i, j)] = t
    for i, c in enumerate(nodes):
        if c.size == 0:
            raise ValueError(f"op {i} has no candidate split")
    return nodes, edges


def _scale(nodes: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray]) -> float:
    finite = [a[np.isfinite(a)] for a in [*nodes, *edges.values()]]
    top = max((float(np.abs(a).max()) for a in finite if a.size), default=0.0)
    return COST_RESOLUTION / top if top > 0 else 1.0


def solve_block_splits(
    node_costs: Sequence[np.ndarray], edge_costs: Mapping[tuple[int, int], np.ndarray]
) -> list[int]:
    """The split index of every op minimising node costs plus edge (resharding) costs.

    `node_costs[i][k]` is op i's cost under split k; `edge_costs[(i, j)][a, b]` is the cost of op i
    under split a feeding op j under split b. `inf` forbids a choice. Raises SoapError when every
    assignment is forbidden.
    """
    nodes, edges = _as_costs(node_costs, edge_costs)
    scale = _scale(nodes, edges)
    nodes = [_integer_costs(c, scale) for c in nodes]
    edges = {e: _integer_costs(t, scale) for e, t in edges.items() if not np.all(t == 0)}
    choice = _eliminate(nodes, edges)
    if choice is None:
        choice = _cp_sat(nodes, edges)
    if choice is None:
        raise SoapError("no combination of per-op splits is allowed for this block; relax the pinned degrees")
    return choice


def _integer_costs(costs: np.ndarray, scale: float) -> np.ndarray:
    """Costs rounded to integer steps (held as floats, exact below 2^53), inf where forbidden."""
    finite = np.isfinite(costs)
    return np.where(finite, np.round(np.where(finite, costs, 0.0) * scale), np.inf)


def _eliminate(nodes: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray]) -> list[int] | None:
    """The lexicographically smallest optimal assignment by variable elimination (module docstring), or
    None when a table would pass `ELIMINATION_LIMIT` entries or every assignment is forbidden (CP-SAT
    then decides, or confirms that nothing is allowed)."""
    factors: list[tuple[tuple[int, ...], np.ndarray]] = [((i,), c) for i, c in enumerate(nodes)]
    factors += [((i, j), t) if i < j else ((j, i), t.T) for (i, j), t in edges.items()]
    sizes = [c.size for c in nodes]
    eliminated: list[tuple[tuple[int, ...], np.ndarray]] = [((), np.zeros(0))] * len(nodes)
    for op in reversed(range(len(nodes))):
        mine = [f for f in factors if op in f[0]]
        factors = [f for f in factors if op not in f[0]]
        scope = tuple(sorted({v for vs, _ in mine for v in vs}))
        if math.prod(sizes[v] for v in scope) > ELIMINATION_LIMIT:
            return None
        table = np.zeros([sizes[v] for v in scope])
        for vs, t in mine:
            shape = [sizes[v] if v in vs else 1 for v in scope]
            table = table + t.reshape(shape)
        eliminated[op] = (scope, table)
        factors.append((tuple(v for v in scope if v != op), table.min(axis=scope.index(op))))
    choice: list[int] = []
    for op, (scope, table) in enumerate(eliminated):
        costs = table[tuple(choice[v] if v != op else slice(None) for v in scope)]
        if not np.isfinite(costs.min()):
            return None
        choice.append(int(np.argmin(costs)))
    return choice


def _cp_sat(nodes: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray]) -> list[int] | None:
    """The same integer model solved by CP-SAT; None when every assignment is forbidden."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    objective = []
    x: list[list] = []
    for i, costs in enumerate(nodes):
        row = [model.NewBoolVar(f"x{i}_{k}") for k in range(costs.size)]
        model.AddExactlyOne(row)
        for k, c in enumerate(costs):
            if not np.isfinite(c):
                model.Add(row[k] == 0)
            elif c:
                objective.append(int(c) * row[k])
        allowed = [k for k, c in enumerate(costs) if np.isfinite(c)]
        model.AddHint(row[allowed[0] if allowed else 0], 1)
        x.append(row)
    for (i, j), table in edges.items():
        y = [[model.NewBoolVar(f"y{i}_{j}_{a}_{b}") for b in range(table.shape[1])] for a in range(table.shape[0])]
        for a in range(table.shape[0]):
            model.Add(sum(y[a]) == x[i][a])
        for b in range(table.shape[1]):
            model.Add(sum(y[a][b] for a in range(table.shape[0])) == x[j][b])
        for a in range(table.shape[0]):
            for b in range(table.shape[1]):
                c = table[a, b]
                if not np.isfinite(c):
                    model.Add(y[a][b] == 0)
                elif c:
                    objective.append(int(c) * y[a][b])
    model.Minimize(sum(objective))
    solver = cp_model.CpSolver()
    solver.parameters.num_search_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_time_in_seconds = SOLVER_TIME_LIMIT_S
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return [next(k for k, v in enumerate(row) if solver.Value(v)) for row in x]


def assignment_cost(
    choice: Sequence[int], node_costs: Sequence[np.ndarray], edge_costs: Mapping[tuple[int, int], np.ndarray]
) -> float:
    """Total cost of one assignment (what `solve_block_splits` minimises)."""
    total = sum(float(np.asarray(c, dtype=float).reshape(-1)[k]) for c, k in zip(node_costs, choice))
    for (i, j), table in edge_costs.items():
        total += float(np.asarray(table, dtype=float)[choice[i], choice[j]])
    return total


def _table_key(nodes: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray]) -> str:
    h = hashlib.sha256()
    for c in nodes:
        h.update(np.ascontiguousarray(c).tobytes() + b"|")
    for (i, j), t in edges.items():
        h.update(f"{i},{j}:".encode() + np.ascontiguousarray(t).tobytes() + b"|")
    return h.hexdigest()


class BlockSplitCache:
    """Solves each distinct block cost table once; repeats (same block type, same degrees) reuse it."""

    def __init__(self) -> None:
        self._solved: dict[str, tuple[int, ...]] = {}
        self.solves = 0
        """How many times CP-SAT actually ran (the rest were cache hits)."""

    def solve(
        self, node_costs: Sequence[np.ndarray], edge_costs: Mapping[tuple[int, int], np.ndarray]
    ) -> tuple[int, ...]:
        nodes, edges = _as_costs(node_costs, edge_costs)
        key = _table_key(nodes, edges)
        if key not in self._solved:
            self._solved[key] = tuple(solve_block_splits(nodes, edges))
            self.solves += 1
        return self._solved[key]
