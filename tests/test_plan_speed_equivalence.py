"""The planner's fast paths give the numbers of the slow ones they replaced (issue 17).

- activation peaks from the schedule's compute order alone (`memory_schedule.activation_peaks`, what the
  estimator calls without building the schedule) equal the walk over the full schedule, communication
  included, that `rank_activation_peaks` was;
- shared (interned) actions are plain equal `Action`s, and the compute order is the schedule's compute;
- the simulator's tasks, timed as they are issued, equal the task graph and heap engine it replaced:
  tests/test_plan_speed_simulator.py;
- the estimator's memoized estimate (per-rank unit tables, data-parallel traffic, per-rank model state,
  activations and held parameters per partition) equals a fresh estimator's for the same candidates in
  any order.
"""

from __future__ import annotations

import json
import random

import pytest

from costmodel.memory_schedule import StageActivations, activation_peaks, rank_activation_peaks
from costmodel.schedule import B, F, I, W, Action, action, build_schedule, compute_order

SCHEDULES = (
    [("1F1B", 1, m, 1) for m in (1, 3, 8)]
    + [(name, pp, m, 1) for name in ("GPipe", "1F1B") for pp in (2, 3, 4) for m in (1, 2, 5, 8)]
    + [(name, pp, m, v) for name in ("Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS")
       for pp in (2, 4) for m in (pp, 2 * pp, 3 * pp) for v in (2, 3)]
    + [("ZBVZeroBubble", pp, m, 2) for pp in (2, 3) for m in (1, 4, 9)]
)


def _walked_peaks(name, pp, m, v, stages):
    """The module docstring's rule, walked action by action over the full schedule."""
    peaks = []
    for actions in build_schedule(name, pp, m, v).actions:
        live = peak = 0.0
        for a in actions:
            s = stages[a.stage]
            if a.kind is F:
                live += s.kept
                peak = max(peak, live)
            elif a.kind is B:
                peak = max(peak, live - s.kept + max(s.kept, s.backward_peak))
                live -= s.kept
            elif a.kind is I:
                peak = max(peak, live + s.window)
            elif a.kind is W:
                live -= s.kept
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("name,pp,m,v", SCHEDULES)
def test_peaks_from_compute_order_equal_the_walk_over_the_full_schedule(name, pp, m, v):
    rng = random.Random(hash((name, pp, m, v)) & 0xFFFF)
    stages = [StageActivations(kept=k, backward_peak=k + rng.uniform(0, 5e8), window=rng.uniform(0, 3e8))
              for k in (rng.uniform(1e8, 2e9) for _ in range(pp * v))]
    fast = activation_peaks(name, pp, m, v, stages)
    assert fast == rank_activation_peaks(build_schedule(name, pp, m, v), stages)
    assert fast == pytest.approx(_walked_peaks(name, pp, m, v, stages), rel=1e-12)


@pytest.mark.parametrize("name,pp,m,v", SCHEDULES)
def test_compute_order_is_the_schedules_compute(name, pp, m, v):
    schedule = build_schedule(name, pp, m, v)
    assert compute_order(name, pp, m, v) == tuple(tuple(a for a in acts if a.is_compute) for acts in schedule.actions)


def test_shared_actions_are_plain_equal_actions():
    assert action(3, F, 7) is action(3, F, 7)
    assert action(3, F, 7) == Action(3, F, 7) and hash(action(3, F, 7)) == hash(Action(3, F, 7))
    assert str(action(2, B, 0)) == "2B0"


def test_memoized_estimate_equals_a_fresh_estimators(tmp_path):
    from costmodel.profiles import load_cluster
    from planner.api import make_request
    from planner.estimate import Estimator
    from planner.space import mesh_choices, training_choices
    from planner.units import model_units

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 256, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    req = make_request(str(tmp_path), gpus=8, global_batch=32, seq_len=64, mem_limit_gib=1e6, cluster="dgx-h100")
    graph = req.model.trace(task=None, seq_len=64)
    space = req.space
    cluster = load_cluster("dgx-h100")
    pairs = [(mesh, train) for mesh in mesh_choices(space) for train in training_choices(space, mesh)]
    pairs = random.Random(0).sample(pairs, min(120, len(pairs)))
    shared = Estimator(graph, cluster, model_units(graph))
    for mesh, train in pairs:
        fresh = Estimator(graph, cluster, model_units(graph))
        assert shared.estimate(mesh, train) == fresh.estimate(mesh, train)


def test_unit_activations_read_the_pipeline_degree_only_through_the_vocabulary_rule(tmp_path):
    """The estimator keys a unit's activations on pp = 2 for every pipeline that shards the vocabulary as pp = 2
    does: they read the degree only through that rule and whether there is a pipeline (which holds the logits)."""
    from costmodel.strategy import shards_vocabulary
    from planner.api import make_request
    from planner.memory_estimate import MemoryTables
    from planner.units import model_units

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 256, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    req = make_request(str(tmp_path), gpus=8, global_batch=32, seq_len=64, mem_limit_gib=1e6, cluster="dgx-h100")
    graph = req.model.trace(task=None, seq_len=64)
    tables = MemoryTables(graph, model_units(graph))
    for u in range(len(tables.units)):
        for tp, cp, sp, policy, compiled, loss in [(1, 1, False, "none", False, "chunked"),
                                                   (2, 1, True, "selective", True, "upcast"),
                                                   (4, 2, False, "full", False, "chunked"),
                                                   (1, 1, False, "none", True, "upcast")]:
            args = (sp, 2, policy, "bf16", "sdpa", compiled, loss)
            two = tables._unit_activations_uncached(u, tp, cp, 1, 2, *args)
            for pp in (4, 8):
                if shards_vocabulary(tp=tp, pp=pp) == shards_vocabulary(tp=tp, pp=2):
                    assert tables._unit_activations_uncached(u, tp, cp, 1, pp, *args) == two


def test_the_search_pricers_memoized_prices_simulate_as_the_default_pricer(tmp_path):
    """`planner.pricing.Pricer` simulates every candidate with op and collective prices memoized across the
    search (`CachedPrices`); the results equal `simulate` with its own default pricer."""
    from costmodel.simulator import simulate
    from planner.api import make_request
    from planner.estimate import Estimator
    from planner.pricing import Pricer
    from planner.regimes import RegimeEstimator
    from planner.search import enumerate_candidates
    from planner.units import model_units

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 256, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    req = make_request(str(tmp_path), gpus=8, global_batch=32, seq_len=64, cluster="dgx-h100")
    graph = req.model.trace(task=None, seq_len=64)
    estimator = RegimeEstimator(graph, Estimator(graph, req.cluster, model_units(graph)), None)
    candidates, _ = enumerate_candidates(req.space, estimator, req.memory_limit, keep_meshes=1 << 30, keep_top=1 << 30)
    pricer = Pricer(req, graph, estimator)
    for c in random.Random(0).sample(candidates, min(40, len(candidates))):
        priced = pricer._simulate(c, graph, pricer.stage_bounds(c))
        plain = simulate(graph, c.strategy, req.cluster, stages=pricer.stage_bounds(c))
        assert (priced.step_time_s, priced.result.rank_breakdowns) == (plain.step_time_s, plain.rank_breakdowns)
        assert priced.result.memory == plain.memory
