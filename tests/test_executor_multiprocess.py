"""Multi-process executor behaviour on CPU gloo, at 2 and 4 ranks.

- Equivalence: every parallel layout trains exactly like one process: losses over 3 steps from the
  same seed match a single-process run (fp32, relative 1e-4) on tiny llama, gpt2 and bert; also GPT-2's
  tied embeddings split across pipeline stages, optimizer CPU offload, and fp16 loss scaling through a
  pipeline (against a single-process fp16 run).
- Communication: for a TP+SP plan (using the simulator's own tp_plan), the collectives CommDebugMode
  counts inside each block equal those `costmodel.placement.block_placements` schedules per block.
- Resume: 6 steps straight equal 3 steps + resume + 3 steps (losses and final weights).

Starting ranks is the expensive part, so everything at 2 ranks runs inside one group, everything at 4
ranks inside another and TP x PP x DP (8 ranks, one thread each on however few cores) in a third;
each returns its results to the parent through a file (`exec_helpers.spawn_cases`).
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch.distributed as dist
from exec_helpers import init_single_process_group, make_plan, spawn_cases, tiny_config

from executor.train import RunConfig, train

pytestmark = pytest.mark.slow

RUN = {"steps": 3, "lr": 1e-2}
UNTIED = {f: {"config": tiny_config(f, tie_word_embeddings=False)} for f in ("llama", "gpt2")}


def _cases_2_ranks() -> dict[str, tuple[str, dict]]:
    cases: dict[str, tuple[str, dict]] = {}
    for f in ("llama", "gpt2"):
        cases |= {
            f"{f}-ddp": (f, dict(dp_replicate=2, micro_batch=2)),
            f"{f}-zero1": (f, dict(dp_shard=2, zero=1, micro_batch=2)),
            f"{f}-zero2": (f, dict(dp_shard=2, zero=2, micro_batch=2)),
            f"{f}-zero3": (f, dict(dp_shard=2, zero=3, micro_batch=2)),
            f"{f}-tp": (f, dict(tp=2, micro_batch=4)),
            f"{f}-tp-sp": (f, dict(tp=2, micro_batch=4, sequence_parallel=True)),
            f"{f}-cp": (f, dict(cp=2, micro_batch=4)),
            f"{f}-pp-gpipe": (f, dict(pp=2, micro_batch=1, num_microbatches=4, schedule="GPipe", **UNTIED[f])),
            f"{f}-pp-1f1b": (f, dict(pp=2, micro_batch=2, num_microbatches=2, schedule="1F1B", **UNTIED[f])),
            f"{f}-pp-interleaved": (f, dict(pp=2, virtual_stages=2, micro_batch=2, num_microbatches=2,
                                            schedule="Interleaved1F1B", **UNTIED[f])),
            f"{f}-pp-grad-accum": (f, dict(pp=2, micro_batch=1, num_microbatches=4, grad_accum=2, **UNTIED[f])),
            f"{f}-recompute-full": (f, dict(dp_replicate=2, micro_batch=2, recompute="full")),
            f"{f}-recompute-selective": (f, dict(dp_shard=2, zero=3, micro_batch=2, recompute="selective")),
            f"{f}-grad-accum": (f, dict(dp_replicate=2, micro_batch=1, num_microbatches=2)),
        }
    cases |= {
        "gpt2-pp-tied": ("gpt2", dict(pp=2, micro_batch=2, num_microbatches=2)),
        "gpt2-pp-tied-interleaved": ("gpt2", dict(pp=2, virtual_stages=2, micro_batch=2, num_microbatches=2,
                                                  schedule="Interleaved1F1B")),
        "llama-zero3-offload": ("llama", dict(dp_shard=2, zero=3, micro_batch=2, offload_optimizer=True)),
        "llama-pp-fp16": ("llama", dict(pp=2, micro_batch=2, num_microbatches=2, precision="fp16", optimizer="sgd",
                                        **UNTIED["llama"])),
        "bert-ddp": ("bert", dict(dp_replicate=2, micro_batch=2)),
        "bert-zero3": ("bert", dict(dp_shard=2, zero=3, micro_batch=2)),
        "bert-tp": ("bert", dict(tp=2, micro_batch=4)),
    }
    return cases


def _cases_4_ranks() -> dict[str, tuple[str, dict]]:
    cases: dict[str, tuple[str, dict]] = {}
    for f in ("llama", "gpt2"):
        cases |= {
            f"{f}-fsdp-x-tp": (f, dict(dp_shard=2, zero=3, tp=2, micro_batch=2)),
            f"{f}-pp-x-dp": (f, dict(pp=2, dp_replicate=2, micro_batch=1, num_microbatches=2, **UNTIED[f])),
            f"{f}-tp-x-pp": (f, dict(tp=2, pp=2, micro_batch=2, num_microbatches=2, **UNTIED[f])),
            f"{f}-tp-sp-x-pp": (f, dict(tp=2, pp=2, sequence_parallel=True, micro_batch=2, num_microbatches=2,
                                        **UNTIED[f])),
        }
    cases |= {
        "llama-hsdp": ("llama", dict(dp_replicate=2, dp_shard=2, zero=3, micro_batch=1)),
        "llama-cp-x-fsdp": ("llama", dict(cp=2, dp_shard=2, zero=3, micro_batch=2)),
        "bert-fsdp-x-tp": ("bert", dict(dp_shard=2, zero=3, tp=2, micro_batch=2)),
        "gpt2-pp-tied-x-fsdp": ("gpt2", dict(pp=2, dp_shard=2, zero=3, micro_batch=1, num_microbatches=2)),
        "gpt2-tp-x-pp-tied": ("gpt2", dict(tp=2, pp=2, micro_batch=2, num_microbatches=2)),
    }
    return cases


def _cases_8_ranks() -> dict[str, tuple[str, dict]]:
    return {
        "llama-tp-x-pp-x-fsdp": ("llama", dict(tp=2, pp=2, dp_shard=2, zero=3, micro_batch=1, num_microbatches=2,
                                               **UNTIED["llama"])),
        "gpt2-tp-sp-x-pp-x-ddp": ("gpt2", dict(tp=2, pp=2, dp_replicate=2, sequence_parallel=True, micro_batch=1,
                                               num_microbatches=2, **UNTIED["gpt2"])),
    }


def _spawn(world: int, cases: dict[str, tuple[str, dict]], extra: tuple[dict, ...] = ()) -> dict:
    payload = [{"name": n, "family": f, "plan": kw, "run": RUN} for n, (f, kw) in cases.items()] + list(extra)
    return spawn_cases(world, payload)


@pytest.fixture(scope="module")
def single_process_losses() -> dict[str, list[float]]:
    init_single_process_group()
    try:
        refs = {f: train(make_plan(f, micro_batch=4), RunConfig(progress=False, **RUN)).losses
                for f in ("llama", "gpt2", "bert")}
        for f in ("llama", "gpt2"):
            refs[f"{f}-untied"] = train(make_plan(f, micro_batch=4, **UNTIED[f]), RunConfig(progress=False, **RUN)).losses
        # SGD, unlike AdamW, would show gradients left multiplied by the loss scale
        refs["llama-untied-fp16-sgd"] = train(make_plan("llama", micro_batch=4, precision="fp16", optimizer="sgd",
                                                        **UNTIED["llama"]), RunConfig(progress=False, **RUN)).losses
    finally:
        dist.destroy_process_group()
    return refs


def _simulated_tp_plan_and_block_collectives() -> tuple[dict[str, str], collections.Counter]:
    """The simulator's tp_plan and per-block collectives for the tiny llama TP2+SP plan."""
    import tracer
    from costmodel.placement import ActivationShape, block_placements, tp_plan
    from transformers import AutoConfig

    fields = tiny_config("llama")
    graph = tracer.trace(AutoConfig.for_model(fields.pop("model_type"), **fields), batch=4, seq_len=16)
    strategy = make_plan("llama", **COMM_PLAN).strategy()
    block = [op for op in graph.ops if op.block_id == "model.layers"]
    placed = block_placements(block, strategy, ActivationShape(micro_batch=4, seq_len=16, hidden=32, itemsize=4))
    counts = collections.Counter((c.kind, c.phase) for p in placed for c in p.collectives if c.group == "tp")
    return tp_plan(block, strategy), counts


ORDER_PLANS = {
    "GPipe": dict(pp=2, micro_batch=1, num_microbatches=4, schedule="GPipe", **UNTIED["llama"]),
    "1F1B": dict(pp=2, micro_batch=1, num_microbatches=4, schedule="1F1B", **UNTIED["llama"]),
    "Interleaved1F1B": dict(pp=2, virtual_stages=2, micro_batch=1, num_microbatches=4,
                            schedule="Interleaved1F1B", **UNTIED["llama"]),
}
COMM_PLAN = dict(tp=2, micro_batch=4, sequence_parallel=True)
RESUME_PLAN = dict(dp_shard=2, zero=3, micro_batch=2)


@pytest.fixture(scope="module")
def resume_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume")
    return {"straight": root / "straight", "split": root / "split"}


@pytest.fixture(scope="module")
def simulated() -> tuple[dict[str, str], collections.Counter]:
    return _simulated_tp_plan_and_block_collectives()


@pytest.fixture(scope="module")
def two_rank_losses(resume_dirs, simulated) -> dict:
    sim_tp_plan, _ = simulated
    straight, split = str(resume_dirs["straight"]), str(resume_dirs["split"])
    extra = (
        {"name": "comm-tp-sp", "family": "llama", "plan": {**COMM_PLAN, "tp_plan": sim_tp_plan},
         "run": {"steps": 1}, "count_block_collectives": True},
        *({"name": f"order-{name}", "family": "llama", "plan": kwargs, "run": {"steps": 2},
           "record_pipeline_order": True} for name, kwargs in ORDER_PLANS.items()),
        {"name": "resume-straight", "family": "llama", "plan": RESUME_PLAN,
         "run": {**RUN, "steps": 6, "checkpoint_dir": straight, "checkpoint_every": 3}},
        {"name": "resume-first", "family": "llama", "plan": RESUME_PLAN,
         "run": {**RUN, "steps": 3, "checkpoint_dir": split}},
        {"name": "resume-second", "family": "llama", "plan": RESUME_PLAN,
         "run": {**RUN, "steps": 6, "checkpoint_dir": split, "resume": True}},
    )
    return _spawn(2, _cases_2_ranks(), extra)


@pytest.fixture(scope="module")
def four_rank_losses() -> dict:
    return _spawn(4, _cases_4_ranks())


@pytest.fixture(scope="module")
def eight_rank_losses() -> dict:
    return _spawn(8, _cases_8_ranks())


def _reference(name: str, family: str, kwargs: dict, refs: dict) -> list[float]:
    key = f"{family}-untied" if "config" in kwargs else family
    if kwargs.get("precision") == "fp16":
        key += f"-fp16-{kwargs['optimizer']}"
    return refs[key]


def _check(name: str, got, expected: list[float]) -> None:
    assert isinstance(got, list), f"{name} failed: {got}"
    assert got == pytest.approx(expected, rel=1e-4), name


@pytest.mark.parametrize("name", list(_cases_2_ranks()))
def test_two_rank_layout_matches_single_process(name, two_rank_losses, single_process_losses):
    family, kwargs = _cases_2_ranks()[name]
    _check(name, two_rank_losses[name], _reference(name, family, kwargs, single_process_losses))


@pytest.mark.parametrize("name", list(_cases_4_ranks()))
def test_four_rank_layout_matches_single_process(name, four_rank_losses, single_process_losses):
    family, kwargs = _cases_4_ranks()[name]
    _check(name, four_rank_losses[name], _reference(name, family, kwargs, single_process_losses))


@pytest.mark.parametrize("name", list(_cases_8_ranks()))
def test_tp_x_pp_x_dp_matches_single_process(name, eight_rank_losses, single_process_losses):
    family, kwargs = _cases_8_ranks()[name]
    _check(name, eight_rank_losses[name], _reference(name, family, kwargs, single_process_losses))


def test_losses_change_between_steps(single_process_losses):
    """The equivalence is not vacuous: training moves the loss, so a wrong gradient would show."""
    for losses in single_process_losses.values():
        assert len(set(round(x, 6) for x in losses)) == 3


def test_tp_sp_block_collectives_equal_the_simulated_ones(two_rank_losses, simulated):
    """CommDebugMode's per-block counts = the simulator's per-block collectives, plus the executor's
    sequence-parallel boundary (hand-derived): the first block's input slice is an all-gather in
    backward, the last block's output gather an all-gather in forward. (The simulator prices those
    boundaries as the vocab-parallel embedding / LM head instead; the executor keeps those replicated.)"""
    measured = two_rank_losses["comm-tp-sp"]
    assert isinstance(measured, dict), measured
    _, expected = simulated
    assert sum(expected.values()) == 8  # 2 TP regions x (fwd AG + RS, bwd RS + AG)
    blocks = sorted((k for k in measured if k != "total"), key=lambda k: int(k.rsplit(".", 1)[1]))
    assert len(blocks) == 4
    names = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
    for i, block in enumerate(blocks):
        got = collections.Counter({(names[op], "fwd" if phase == "forward" else "bwd"): n
                                   for phase, ops in measured[block].items() for op, n in ops.items()})
        boundary = collections.Counter()
        if i == 0:
            boundary[("all_gather", "bwd")] += 1
        if i == len(blocks) - 1:
            boundary[("all_gather", "fwd")] += 1
        assert got == expected + boundary, block
    # outside the blocks, only the per-step reductions: 2 SP norm-weight gradients per block, the loss
    # and the peak-memory report
    assert measured["total"]["all_reduce"] == 2 * len(blocks)


def test_resume_continues_exactly(two_rank_losses, resume_dirs):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch

    straight, first, second = (two_rank_losses[k] for k in ("resume-straight", "resume-first", "resume-second"))
    for result in (straight, first, second):
        assert isinstance(result, list), result
    assert len(second) == 3
    assert first == pytest.approx(straight[:3], rel=1e-6)
    assert second == pytest.approx(straight[3:], rel=1e-6)
    weights = {}
    for name, root in resume_dirs.items():
        assert (root / "latest").read_text().strip() == "step-00000006"
        assert not list(root.glob(".tmp-*")) and len(list(root.glob("step-*"))) == 1
        dcp_to_torch_save(root / "step-00000006", root / "full.pt")
        weights[name] = torch.load(root / "full.pt", weights_only=True)
    model_keys = [k for k in weights["straight"] if k.startswith("model.")]
    assert len(model_keys) > 10
    for key in weights["straight"]:
        torch.testing.assert_close(weights["split"][key], weights["straight"][key], rtol=0, atol=0)


@pytest.mark.parametrize("schedule", list(ORDER_PLANS))
def test_pipeline_runs_the_schedule_ir_order(schedule, two_rank_losses):
    """The forward/backward order each pipeline rank really ran equals costmodel.schedule's IR, which
    the simulator prices."""
    from costmodel.schedule import build_schedule

    recorded = two_rank_losses[f"order-{schedule}"]
    assert isinstance(recorded, list), recorded
    kwargs = ORDER_PLANS[schedule]
    ir = build_schedule(schedule, kwargs["pp"], kwargs["num_microbatches"], kwargs.get("virtual_stages", 1))
    for rank, ran in enumerate(recorded):
        assert ran == [str(a) for a in ir.actions[rank] if a.is_compute], f"rank {rank}"
