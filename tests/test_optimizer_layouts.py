"""Adafactor runs where soap plans it, and is planned only where it runs (`costmodel.plan_rules.optimizer_violation`).

torch's Adafactor reduces each gradient over its rows and columns in place, which a DTensor sharded along one of
them cannot do: under TP or FSDP2 (ZeRO 2/3, a pipeline with data parallelism, offload) its first step failed
("in-place operations that require placement changes are not supported"), and `--optimizer auto` could pick it
there. The search now leaves those layouts out for it, a pin of one is an error line, the plan loader refuses one,
and the layouts it keeps train as one process does on 2 gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exec_helpers import init_single_process_group, make_plan, spawn_cases  # noqa: E402

from tracer.errors import SoapError  # noqa: E402

RUN = {"steps": 3, "lr": 1e-3}
ADAFACTOR = dict(optimizer="adafactor")
RUNS = {  # name: (family, plan), each on 2 ranks
    "ddp": ("llama", dict(dp_replicate=2, micro_batch=2)),
    "zero1": ("llama", dict(dp_shard=2, zero=1, micro_batch=2)),
    "pp2": ("llama", dict(pp=2, micro_batch=1, num_microbatches=4)),
    "cp2": ("llama", dict(cp=2, micro_batch=4)),
}
REFUSED = {"fsdp-zero3": ("llama", dict(dp_shard=2, zero=3, micro_batch=2)),
           "tp2": ("llama", dict(tp=2, micro_batch=4)),
           "pp2-dp2": ("llama", dict(pp=2, dp_replicate=2, micro_batch=1, num_microbatches=4)),
           "offload": ("llama", dict(dp_shard=2, zero=1, micro_batch=2, offload_optimizer=True))}


@pytest.fixture(scope="module")
def single_process_losses() -> list[float]:
    import torch.distributed as dist

    from executor.train import RunConfig, train

    init_single_process_group()
    try:
        return train(make_plan("llama", micro_batch=4, **ADAFACTOR), RunConfig(progress=False, **RUN)).losses
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_losses() -> dict:
    return spawn_cases(2, [{"name": name, "family": family, "plan": {**plan, **ADAFACTOR}, "run": RUN}
                           for name, (family, plan) in RUNS.items()])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_adafactor_trains_as_one_process_where_it_is_planned(name, two_rank_losses, single_process_losses):
    got = two_rank_losses[name]
    assert isinstance(got, list), f"{name} failed: {got}"
    assert got == pytest.approx(single_process_losses, rel=1e-4), name


@pytest.mark.parametrize("name", list(REFUSED))
def test_the_plan_loader_refuses_adafactor_on_sharded_parameters(name):
    family, plan = REFUSED[name]
    with pytest.raises(SoapError, match="adafactor"):
        make_plan(family, **plan, **ADAFACTOR)


def test_a_pinned_sharded_layout_is_one_error_line_and_the_search_avoids_them():
    from planner.api import plan

    with pytest.raises(SoapError, match="--optimizer adafactor under tp > 1"):
        plan("llama-3-8b", gpus=8, optimizer="adafactor", tp=2)
    chosen = plan("llama-3-8b", gpus=8, optimizer="adafactor").parallelism
    assert chosen.tp == 1 and not chosen.offload_optimizer
    assert chosen.dp == 1 or chosen.zero <= 1 and chosen.pp == 1
