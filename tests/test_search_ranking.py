"""Ranking by simulation, baselines and MCMC refinement, with a synthetic simulator."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from costmodel.strategy import ParallelDims, TrainingConfig
from costmodel.memory import MemoryBreakdown
from planner.estimate import Estimate
from planner.search import Candidate, Priced, SearchConfig, search
from planner.space import MeshChoice

LLAMA_1B = str(Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / "llama-3.2-1b.json")


def _candidate(tp, dp, mb, estimated_s):
    mesh = MeshChoice(dims=ParallelDims(dp_replicate=dp, tp=tp), zero=0)
    train = TrainingConfig(global_batch=dp * 8, seq_len=128, micro_batch=mb, num_microbatches=8 // mb, grad_accum=8 // mb)
    parts = MemoryBreakdown(weights=1e8 * tp, grads=0, optimizer=0, activations=0, buffers=0, workspace=0)
    est = Estimate(step_time_s=estimated_s, memory=parts, compute_s=0, comm_s=0, bubble_s=0, optimizer_s=0)
    return Candidate(mesh, train, est)


def _space():
    # the estimate prefers tp=8, but the "simulator" says pure data parallelism is fastest
    cands = [_candidate(tp, 8 // tp, mb, estimated_s=1.0 / tp + 0.01 * mb) for tp in (1, 2, 4, 8) for mb in (1, 2, 4, 8)]
    return sorted(cands, key=lambda c: (c.estimate.step_time_s, c.key))


def _simulate(c, memory_limit=1e9):
    step = 1.0 + 0.1 * c.mesh.dims.tp - 0.01 * c.train.micro_batch
    memory = 1e8 * c.train.micro_batch
    return Priced(candidate=c, step_time_s=step, peak_memory_bytes=memory, result=None, fits=memory <= memory_limit)


def test_chosen_plan_is_at_least_as_fast_as_every_baseline():
    ddp = SimpleNamespace(name="DDP", member=lambda c: c.mesh.dims.tp == 1)
    outcome = search(_space(), _simulate, baselines=lambda best: [ddp], config=SearchConfig(simulate_top=2, simulate_meshes=1))
    best = outcome.ranked[0]
    name, baseline = outcome.baselines[0]
    assert baseline is not None and best.step_time_s <= baseline.step_time_s
    assert best.candidate.mesh.dims.tp == 1  # the baseline family's simulation revealed the faster plan


def test_plans_over_the_memory_limit_in_simulation_are_dropped():
    outcome = search(_space(), lambda c: _simulate(c, memory_limit=4e8), config=SearchConfig(simulate_top=64))
    assert outcome.ranked and all(p.peak_memory_bytes <= 4e8 for p in outcome.ranked)
    assert outcome.rejected_by_simulation


def test_refinement_is_reproducible_for_a_seed_and_improves_on_the_estimate():
    config = SearchConfig(simulate_top=1, simulate_meshes=1, time_budget_s=60, max_refine_steps=40, seed=7)
    first = search(_space(), _simulate, config=config)
    second = search(_space(), _simulate, config=config)
    assert [p.candidate.key for p in first.ranked] == [p.candidate.key for p in second.ranked]
    assert first.refine_steps == 40
    unrefined = search(_space(), _simulate, config=SearchConfig(simulate_top=1, simulate_meshes=1))
    assert first.ranked[0].step_time_s < unrefined.ranked[0].step_time_s


def test_ranking_breaks_time_ties_by_strategy_key():
    flat = [_candidate(1, 8, mb, estimated_s=1.0) for mb in (8, 4, 2, 1)]
    tie = lambda c: Priced(candidate=c, step_time_s=1.0, peak_memory_bytes=0, result=None, fits=True)  # noqa: E731
    ranked = search(sorted(flat, key=lambda c: c.key), tie, config=SearchConfig(simulate_top=8)).ranked
    assert [p.candidate.train.micro_batch for p in ranked] == [1, 2, 4, 8]


def test_when_the_best_estimates_overflow_in_simulation_the_most_frugal_are_tried():
    def simulate(c):
        memory = 1e8 * c.mesh.dims.tp  # only tp=1 fits a 1.5e8 limit, but the estimate prefers tp=8
        return Priced(candidate=c, step_time_s=1.0, peak_memory_bytes=memory, result=None, fits=memory <= 1.5e8)

    outcome = search(_space(), simulate, config=SearchConfig(simulate_top=1, simulate_meshes=1))
    assert outcome.ranked and outcome.ranked[0].candidate.mesh.dims.tp == 1


@pytest.mark.parametrize("cluster", ["dgx-h100", "dgx-h100-datasheet"])
def test_with_compile_pinned_the_estimate_prices_compile_and_stays_below_the_simulation(cluster):
    """The estimator once priced every candidate eager, so with `--compile on` pinned its estimates were the eager
    ones: 6.8% above the simulated compiled step of llama-3-8b on 8 fitted H100s (63.1 against 59.1 s), against
    the lower bound the search's pruning assumes. Now it applies the device's compile factors as the simulator does."""
    from planner.api import plan_report

    report = plan_report("llama-3-8b", gpus=8, cluster=cluster, compile="on")
    for priced in (report.chosen, *report.alternatives[:3]):
        assert priced.candidate.train.compile
        assert priced.candidate.estimate.step_time_s <= 1.015 * priced.result.step_time_s, priced.candidate.key


def test_a_pipeline_estimate_counts_its_sends_as_the_simulator_overlaps_them():
    """The estimator once put every stage-to-stage send on the rank's critical path, each micro-batch, v times
    under interleaving: pipelined candidates were estimated 1.7-15% above their simulation (llama-3-8b on 16 fitted
    H100s at pp4: 10-13% under ZBV and interleaving), so the search simulated fewer of them than it should. The
    simulator sends on a stream of its own; the estimate now waits for the sends only in the bubble."""
    from planner.api import plan_report

    report = plan_report("llama-3-8b", gpus=16, cluster="dgx-h100", pp=4, compile="off")
    pipelined = [p for p in (report.chosen, *report.alternatives) if p.candidate.mesh.dims.pp == 4]
    assert len(pipelined) >= 3 and {p.candidate.train.virtual_stages for p in pipelined} - {1}
    for priced in pipelined:
        assert abs(priced.candidate.estimate.step_time_s / priced.result.step_time_s - 1) < 0.015, priced.candidate.key


def test_an_expert_parallel_estimate_prices_each_experts_routed_tokens():
    """The estimator once divided an expert op's work by ep, where each rank holds 1/ep of the experts but receives
    the tokens of all ep ranks routed to them (`costmodel.placement.OpSplit.local`): Mixtral 8x7B's ep8 candidates on
    64 fitted H100s were estimated at 8.1 s against 41.0 s simulated (benchmarks/estimate_accuracy.py), so the search
    ranked and simulated mostly expert-parallel layouts. Now every simulated candidate, ep > 1 among them, is within
    1.5% of its simulation."""
    from planner.api import plan_report

    report = plan_report("mixtral-8x7b", gpus=64, cluster="dgx-h100", compile="off")
    priced = (report.chosen, *report.alternatives)
    assert any(p.candidate.mesh.dims.ep > 1 for p in priced)
    for p in priced:
        assert abs(p.candidate.estimate.step_time_s / p.result.step_time_s - 1) < 0.015, p.candidate.key


def _estimate_errors(model, gpus, cluster="dgx-h100", **pins):
    from planner.api import plan_report

    report = plan_report(model, gpus=gpus, cluster=cluster, **pins)
    priced = [p for p in (report.chosen, *report.alternatives) if p.result is not None]
    assert len(priced) >= 3
    return {p.candidate.key: p.candidate.estimate.step_time_s / p.result.step_time_s - 1 for p in priced}


def test_a_tensor_parallel_estimate_prices_the_placements_collectives_as_the_simulator_does():
    """The estimator once priced TP as two all-reduces per region, at none of the device's
    `activation_collective_factor` (0.63 on the fitted H100) and with none of sequence parallelism's second
    collective, nor the vocabulary-parallel head's and loss's: llama-3-8b's tp8 candidates on 8 fitted H100s
    were estimated from -29% to +2.6% of their simulation, Llama 3 70B's on 64 about 2% above (past the search's
    tolerance). It now prices the collectives the simulator's placement issues, as the simulator prices them."""
    errors = _estimate_errors("llama-3-8b", 8, tp=8, compile="off")
    assert all(abs(e) < 0.005 for e in errors.values()), errors


def test_a_pipelined_tp_estimate_charges_each_collectives_host_waits():
    """Where a profile carries host waits (`host_jitter_s`, and `pipelined_sync_s` in a pipelined run:
    `costmodel.host_sync`), each activation collective pays them in the simulator; the estimate charged none
    (-22% at tp4 x pp2 with the waits and factor below) and now charges them per collective."""
    import dataclasses

    from costmodel.profiles import load_cluster

    cluster = load_cluster("dgx-h100")
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, pipelined_sync_s=2e-4, host_jitter_s=2e-5, activation_collective_factor=1.5))
    errors = _estimate_errors("llama-3-8b", 16, cluster=cluster, tp=4, pp=2, compile="off")
    assert all(abs(e) < 0.015 for e in errors.values()), errors


def test_an_eager_estimate_keeps_the_host_floor():
    """The simulator holds an eager chunk to its kernels times the device's `host_dispatch_s`; the estimate did not,
    and put gpt2's candidate at micro-batch 4 on one H100 30% under its simulated step."""
    errors = _estimate_errors("gpt2", 1, compile="off")
    assert all(abs(e) < 0.005 for e in errors.values()), errors


def test_a_zero3_estimate_exposes_what_each_phase_cannot_hide():
    """ZeRO 3 without a pipeline: a forward hides only its own gathers and never the first unit's (the 0.5 GB
    embedding of Llama 3.2 1B, which opens it), a backward its gathers and syncs and never the first unit's sync
    (which closes it). The estimate hid all the traffic behind all the compute, up to 10% under the simulation on
    256 fitted H100s; now within 4% under, and still a lower bound within the search's tolerance."""
    errors = _estimate_errors(LLAMA_1B, 256, zero=3, tp=1, compile="off")
    assert all(-0.04 < e < 0.015 for e in errors.values()), errors


def test_a_pipelines_fill_and_drain_are_estimated_from_the_other_stages():
    """The estimate's bubble was pp - 1 times the busiest stage's micro-batch; the fill and drain wait for the other
    stages, which are lighter where the stages are unbalanced (Llama 3 70B's 80 layers over 4 stages, the head on
    the last). At 4 micro-batches it was 5% above the simulation (2.6% with the collectives priced as simulated)."""
    from planner.api import plan_report

    report = plan_report("llama-3-70b", gpus=64, tp=4, pp=4, dp=4, schedule="1F1B", micro_batch=1, zero=1,
                         offload="off", global_batch=16, recompute="none", compile="off")
    priced = report.chosen
    assert priced.candidate.train.num_microbatches == 4
    assert abs(priced.candidate.estimate.step_time_s / priced.result.step_time_s - 1) < 0.015


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "fp8"])
def test_fsdp_without_gathers_lets_a_micro_batchs_syncs_hide_behind_the_next_forward(precision):
    """FSDP2 at ZeRO 0/1 beside TP syncs gradients every micro-batch but gathers nothing: a micro-batch's closing sync
    hides behind the next one's forward (nothing queues behind it on the dp stream), as the simulator runs it. The
    estimate charged it to every micro-batch, 1.8-1.9% above the simulation for llama-3-8b tp2 on 16 H100s."""
    errors = _estimate_errors("llama-3-8b", 16, precision=precision, tp=2, compile="off")
    assert all(abs(e) < 0.015 for e in errors.values()), errors
