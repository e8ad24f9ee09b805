"""The pure search kernels against brute force on tiny inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from planner.intra_op import BlockSplitCache, assignment_cost, solve_block_splits
from planner.stages import one_f_one_b_in_flight, partition_stages
from tracer.errors import SoapError


def _brute_force_splits(nodes, edges):
    best = np.inf
    for choice in itertools.product(*(range(len(c)) for c in nodes)):
        best = min(best, assignment_cost(choice, nodes, edges))
    return best


def _random_block(rng, n_ops, chain):
    nodes = [rng.uniform(0, 10, size=rng.integers(1, 4)) for _ in range(n_ops)]
    pairs = [(i, i + 1) for i in range(n_ops - 1)]
    if not chain:
        pairs += [(i, j) for i in range(n_ops) for j in range(i + 2, n_ops) if rng.random() < 0.4]
    edges = {(i, j): rng.uniform(0, 10, size=(len(nodes[i]), len(nodes[j]))) * (rng.random() < 0.8) for i, j in pairs}
    return nodes, edges


@pytest.mark.parametrize("seed", range(12))
def test_block_splits_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    nodes, edges = _random_block(rng, n_ops=int(rng.integers(2, 6)), chain=seed % 2 == 0)
    choice = solve_block_splits(nodes, edges)
    assert assignment_cost(choice, nodes, edges) == pytest.approx(_brute_force_splits(nodes, edges), rel=1e-4, abs=1e-4)


def test_resharding_cost_pulls_neighbours_to_agree():
    # op 1 alone prefers split 1, but switching layout after op 0 (which must use split 0) costs more
    nodes = [np.array([1.0, np.inf]), np.array([2.0, 1.5]), np.array([1.0, 1.0])]
    edges = {(0, 1): np.array([[0.0, 5.0], [5.0, 0.0]]), (1, 2): np.zeros((2, 2))}
    assert solve_block_splits(nodes, edges)[:2] == [0, 0]


def test_all_choices_forbidden_is_a_clear_error():
    with pytest.raises(SoapError, match="no combination"):
        solve_block_splits([np.array([np.inf]), np.array([1.0])], {})


def test_repeated_block_tables_are_solved_once():
    nodes, edges = _random_block(np.random.default_rng(3), 4, chain=True)
    cache = BlockSplitCache()
    first = cache.solve(nodes, edges)
    again = cache.solve([c.copy() for c in nodes], {k: v.copy() for k, v in edges.items()})
    assert first == again and cache.solves == 1


def _brute_force_partition(t, s, a, flight, limit):
    n, stages = len(t), len(flight)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        ranges = list(zip(bounds, bounds[1:]))
        if any(sum(s[i:j]) + flight[k] * sum(a[i:j]) > limit for k, (i, j) in enumerate(ranges)):
            continue
        value = max(sum(t[i:j]) for i, j in ranges)
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_stage_partition_matches_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 9))
    stages = int(rng.integers(1, 5))
    t, s, a = (rng.uniform(0.5, 3.0, n) for _ in range(3))
    flight = one_f_one_b_in_flight(stages)
    limit = float(rng.uniform(2.0, 20.0))
    expected = _brute_force_partition(t, s, a, flight, limit)
    got = partition_stages(t, s, a, in_flight=flight, memory_limit=limit)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got.bottleneck == pytest.approx(expected)
        assert all(m <= limit + 1e-9 for m in got.stage_memory) and min(got.sizes) >= 1


def test_heavy_lm_head_gets_fewer_blocks_on_its_stage():
    # embedding (cheap), 8 equal blocks, LM head + loss worth two blocks
    t = [0.2] + [1.0] * 8 + [2.0]
    part = partition_stages(t, [0.0] * 10, [0.0] * 10, in_flight=(1, 1, 1, 1), memory_limit=1.0)
    assert part.bottleneck == pytest.approx(3.0)
    assert part.sizes[-1] <= 2


def test_first_stage_memory_pressure_moves_layers_later():
    # 1F1B: the first stage keeps 4 micro-batches in flight, so it can hold fewer layers
    n = 8
    part = partition_stages([1.0] * n, [0.0] * n, [1.0] * n, in_flight=(4, 3, 2, 1), memory_limit=6.0)
    assert part is not None and part.sizes[0] == 1 and part.sizes[-1] >= 2
