"""The per-op split kernel solves by variable elimination and agrees with CP-SAT, which it replaces on
the common path (planning never imports ortools unless a block is too densely connected)."""

import itertools
import subprocess
import sys

import numpy as np
import pytest

from planner import intra_op
from planner.intra_op import assignment_cost, solve_block_splits
from tracer.errors import SoapError


def _tied_block(rng, n_ops):
    # small integer costs: many assignments tie, so the tie-break shows
    nodes = [rng.integers(0, 3, size=rng.integers(1, 4)).astype(float) for _ in range(n_ops)]
    pairs = [(i, i + 1) for i in range(n_ops - 1)] + [(i, i + 3) for i in range(n_ops - 3) if rng.random() < 0.5]
    edges = {(i, j): rng.integers(0, 3, size=(len(nodes[i]), len(nodes[j]))).astype(float) for i, j in pairs}
    return nodes, edges


@pytest.mark.parametrize("seed", range(8))
def test_split_search_picks_the_lexicographically_smallest_optimum(seed):
    rng = np.random.default_rng(seed)
    nodes, edges = _tied_block(rng, n_ops=int(rng.integers(2, 7)))
    assignments = list(itertools.product(*(range(c.size) for c in nodes)))
    best = min(assignment_cost(a, nodes, edges) for a in assignments)
    first = next(a for a in assignments if assignment_cost(a, nodes, edges) == best)
    assert solve_block_splits(nodes, edges) == list(first)


@pytest.mark.parametrize("seed", range(4))
def test_dense_blocks_fall_back_to_cp_sat_with_the_same_optimum(seed, monkeypatch):
    rng = np.random.default_rng(100 + seed)
    nodes = [rng.uniform(0, 10, size=3) for _ in range(6)]
    edges = {(i, j): rng.uniform(0, 10, size=(3, 3)) for i in range(6) for j in range(i + 1, 6)}
    exact = solve_block_splits(nodes, edges)
    monkeypatch.setattr(intra_op, "ELIMINATION_LIMIT", 3)
    assert assignment_cost(solve_block_splits(nodes, edges), nodes, edges) == pytest.approx(
        assignment_cost(exact, nodes, edges), rel=1e-5)


def test_forbidden_everywhere_is_reported_even_after_elimination():
    with pytest.raises(SoapError):
        solve_block_splits([np.array([1.0, 2.0]), np.array([1.0])], {(0, 1): np.array([[np.inf], [np.inf]])})


def test_planning_a_tensor_parallel_model_does_not_import_ortools():
    # gpt2 on 8 GPUs simulates tp > 1 candidates, so the split search runs
    code = ("import sys; from planner.api import plan_report; plan_report('gpt2', gpus=8); "
            "print(any(m.startswith('ortools') or m == 'pandas' for m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
