"""`costmodel.plan_rules`: one rule set that matches torch, keeps the search inside it, and stops a plan that
breaks it at load and before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from exec_helpers import make_plan

from costmodel.plan_rules import check_pipeline, executed_pipeline_violation, model_violation, pipeline_violation
from costmodel.strategy import SCHEDULES
from planner.plan import plan_from_dict
from planner.space import Pins, SpaceRequest, mesh_choices, training_choices
from soap.cli import main
from tracer.errors import SoapError
from tracer.ir import ModelDims

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 256}
"""The issue's tiny llama."""


# --- the rule is torch's -------------------------------------------------------------------------------


def _construct_torch_schedule(name: str, pp: int, v: int, m: int) -> None:
    """Build torch's schedule class `name` for rank 0 of a fake `pp`-rank group with `v` stages per rank."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(name)
    n = pp * v
    indices = [0, n - 1] if name == "ZBVZeroBubble" and v == 2 else list(range(0, n, pp))
    stages = [PipelineStage(nn.Linear(2, 2), i, n, torch.device("cpu")) for i in indices]
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:  # takes one stage; executor.pipeline.build_schedule refuses more, as we do here
            raise ValueError(f"{name} takes one stage")
        cls(stages[0], n_microbatches=m, loss_fn=lambda out, target: out.sum(), scale_grads=False)
    else:
        cls(stages, n_microbatches=m, loss_fn=lambda out, target: out.sum(), scale_grads=False)


@pytest.fixture
def fake_group(request):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", rank=0, world_size=request.param, store=FakeStore())
    yield request.param
    dist.destroy_process_group()


@pytest.mark.parametrize("fake_group", [2, 3, 4], indirect=True)
def test_the_pipeline_rule_says_exactly_when_torch_refuses_a_schedule(fake_group):
    pp, disagreements, refusals = fake_group, [], 0
    for name in SCHEDULES:
        for v in (1, 2, 3):
            for m in range(1, 10):
                reason = pipeline_violation(name, pp=pp, virtual_stages=v, num_microbatches=m)
                try:
                    _construct_torch_schedule(name, pp, v, m)
                    refused = None
                except ValueError as exc:
                    refused = str(exc)
                refusals += refused is not None
                if (reason is None) != (refused is None):
                    disagreements.append((name, v, m, reason, refused))
    assert not disagreements
    assert refusals > 0  # the sweep reaches torch's checks


def test_the_rule_counts_micro_batches_per_schedule_run():
    assert pipeline_violation("1F1B", pp=2, virtual_stages=1, num_microbatches=4, grad_accum=2) is None
    reason = pipeline_violation("1F1B", pp=4, virtual_stages=1, num_microbatches=4, grad_accum=2)
    assert "parallelism.num_microbatches" in reason and "2 micro-batch(es) per schedule run" in reason
    assert "parallelism.grad_accum=3" in pipeline_violation("GPipe", pp=2, virtual_stages=1, num_microbatches=4,
                                                           grad_accum=3)
    assert pipeline_violation("1F1B", pp=1, virtual_stages=1, num_microbatches=1) is None
    with pytest.raises(SoapError, match="fewer than the 2 pipeline stages 1F1B needs"):
        check_pipeline("1F1B", pp=2, virtual_stages=1, num_microbatches=1)


def test_model_rules_name_the_numbers():
    dims = dict(num_layers=4, heads=4, kv_heads=2, vocab=256, seq_len=64)
    assert model_violation(tp=2, pp=2, cp=1, **dims) is None
    assert "3" in model_violation(tp=3, pp=1, cp=1, **dims)
    reason = model_violation(tp=1, pp=1, cp=1, ep=3, num_experts=8, **dims)
    assert "ep=3 does not divide the model's 8 experts" in reason
    assert model_violation(tp=1, pp=1, cp=1, ep=4, num_experts=8, **dims) is None


# --- the search stays inside the rule ------------------------------------------------------------------


@pytest.mark.parametrize("gpus, global_batch, pins", [
    (2, 8, Pins(pp=2)),
    (4, 8, Pins(zero=3)),
    (4, 4, Pins(pp=4)),
    (4, 16, Pins(pp=2, grad_accum=2)),
    (4, 8, Pins(pp=4, schedule="1F1B")),
    (4, 2, Pins(pp=2)),
    (4, 8, Pins(pp=2, zero=3, schedule="ZBVZeroBubble")),
    (4, 8, Pins(pp=2, zero=3)),
])
def test_the_search_never_enumerates_a_plan_torch_refuses(gpus, global_batch, pins):
    dims = ModelDims(num_layers=8, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256)
    req = SpaceRequest(gpus=gpus, gpus_per_node=gpus, tp_across_nodes=False, dims=dims, seq_len=64,
                       global_batch=global_batch, precisions=("fp32",), pins=pins)
    seen = 0
    for mesh in mesh_choices(req):
        pp, local = mesh.dims.pp, global_batch // mesh.dims.dp
        for t in training_choices(req, mesh):
            seen += 1
            assert executed_pipeline_violation(t.schedule, pp=pp, virtual_stages=t.virtual_stages,
                                               num_microbatches=t.num_microbatches, grad_accum=t.grad_accum,
                                               zero=t.zero) is None
            if pp > 1 and local >= pp and not pins.grad_accum:
                assert t.num_microbatches // t.grad_accum >= pp, "a pipeline run with idle stages was offered"
    assert seen or pins.schedule == "ZBVZeroBubble" and pins.zero == 3


def test_split_backward_schedules_are_those_whose_ir_splits_the_backward():
    """The ZeRO-3 rule names the schedules whose weight backward runs apart (I and W actions in the
    schedule IR the executor runs): there FSDP keeps blocks gathered, so zero 3 would run as zero 2."""
    from costmodel.plan_rules import SPLIT_BACKWARD_SCHEDULES
    from costmodel.schedule import build_schedule
    from costmodel.strategy import MULTI_STAGE_SCHEDULES, SCHEDULES

    for name in SCHEDULES:
        v = 2 if name in MULTI_STAGE_SCHEDULES else 1
        assert build_schedule(name, 2, 4, v).splits_backward == (name in SPLIT_BACKWARD_SCHEDULES), name
        reason = executed_pipeline_violation(name, pp=2, virtual_stages=v, num_microbatches=4, zero=3)
        assert (reason is not None) == (name in SPLIT_BACKWARD_SCHEDULES), name
        assert executed_pipeline_violation(name, pp=2, virtual_stages=v, num_microbatches=4, zero=2) is None


def test_pins_that_leave_1f1b_too_few_micro_batches_are_refused_with_the_numbers(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    assert main(["plan", str(config), "--gpus", "2", "--cluster", "local-cpu", "--global-batch", "8", "--pp", "2",
                 "--schedule", "1F1B", "--micro-batch", "8"]) == 2
    assert "--schedule 1F1B needs at least 2 micro-batches per schedule run" in capsys.readouterr().err


def _plan_cli(tmp_path: Path, *extra: str) -> dict:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "p.json"
    assert main(["plan", str(config), "--gpus", "2", "--cluster", "local-cpu", "--global-batch", "8",
                 "--seq-len", "64", "--precision", "fp32", "--pp", "2", *extra, "-o", str(out)]) == 0
    return json.loads(out.read_text())


def test_the_issue_command_plans_at_least_two_micro_batches_per_run(tmp_path, capsys):
    p = _plan_cli(tmp_path)["parallelism"]
    assert p["pp"] == 2 and p["num_microbatches"] // p["grad_accum"] >= 2
    assert pipeline_violation(p["schedule"], pp=2, virtual_stages=p["virtual_stages"],
                              num_microbatches=p["num_microbatches"], grad_accum=p["grad_accum"]) is None


@pytest.mark.slow
def test_the_issue_plan_executes_on_two_gloo_ranks(tmp_path, capsys):
    plan = _plan_cli(tmp_path)
    assert plan["parallelism"]["num_microbatches"] >= 2
    proc = subprocess.run(
        [sys.executable, "-m", "soap", "execute", str(tmp_path / "p.json"), "--steps", "2", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(proc.stdout)["losses"]) == 2


# --- the loader and the launcher refuse what the rule forbids ------------------------------------------


def _one_micro_batch_1f1b() -> dict:
    data = json.loads(make_plan("llama", pp=2, micro_batch=2, num_microbatches=2).to_json())
    data["parallelism"].update(micro_batch=4, num_microbatches=1)
    return data


def test_the_loader_rejects_a_plan_torch_would_refuse_naming_the_field():
    with pytest.raises(SoapError, match=r"invalid plan: parallelism\.num_microbatches: 1 micro-batch"):
        plan_from_dict(_one_micro_batch_1f1b())
    data = json.loads(make_plan("llama", pp=2, micro_batch=2, num_microbatches=2).to_json())
    data["parallelism"]["virtual_stages"] = 2
    with pytest.raises(SoapError, match=r"parallelism\.virtual_stages=2: schedule 1F1B runs one stage per rank"):
        plan_from_dict(data)
    data = json.loads(make_plan("llama", tp=2, micro_batch=2).to_json())
    heads = data["model"]["config"]["num_attention_heads"]
    data["parallelism"].update(tp=heads * 2, dp=1)
    data["mesh"]["degrees"][-1] = heads * 2
    data["cluster"]["gpus"] = heads * 2
    with pytest.raises(SoapError, match=rf"invalid plan: parallelism: tp={heads * 2} does not divide {heads} "):
        plan_from_dict(data)


def test_execute_of_a_hand_edited_plan_fails_with_one_error_line(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_one_micro_batch_1f1b()))
    assert main(["execute", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "parallelism.num_microbatches" in err[0]


def test_the_launcher_checks_the_rule_before_spawning_workers():
    from executor.launch import LaunchOptions, run_plan
    from executor.train import RunConfig

    plan = make_plan("llama", pp=2, micro_batch=2, num_microbatches=2)
    unchecked = plan.model_copy(update={"parallelism": plan.parallelism.model_copy(
        update={"micro_batch": 4, "num_microbatches": 1})})  # model_copy skips validation, as a Python caller may
    with pytest.raises(SoapError, match="fewer than the 2 pipeline stages 1F1B needs"):
        run_plan(unchecked, RunConfig(), LaunchOptions())
    assert not dist.is_initialized()


def test_zbv_zero_bubble_is_planned_and_loaded(tmp_path, capsys):
    """ZBVZeroBubble executes (tests/test_executor_multiprocess.py holds it to a single process), so a pin
    plans it, with its V of two stages per rank, and a plan.json naming it loads."""
    assert executed_pipeline_violation("ZBVZeroBubble", pp=2, virtual_stages=2, num_microbatches=4) is None
    p = _plan_cli(tmp_path, "--schedule", "ZBVZeroBubble")
    assert p["parallelism"]["schedule"] == "ZBVZeroBubble" and p["parallelism"]["virtual_stages"] == 2
    assert [s["rank"] for s in sorted(p["stages"], key=lambda s: s["index"])] == [0, 1, 1, 0]
    assert plan_from_dict(p).parallelism.schedule == "ZBVZeroBubble"


def test_a_schedule_the_executor_cannot_run_is_never_planned_loaded_or_started(tmp_path, capsys, monkeypatch):
    """A schedule torch accepts but soap's executor cannot run (`NOT_EXECUTED`, empty today; LoopedBFS
    stands in): the search leaves it out, a pin or a plan.json naming it is refused, and so is a
    Python-built plan."""
    from costmodel.plan_rules import NOT_EXECUTED
    from executor.launch import LaunchOptions, run_plan
    from executor.train import RunConfig

    monkeypatch.setitem(NOT_EXECUTED, "LoopedBFS", "soap's executor does not run it yet (a test stand-in)")
    assert executed_pipeline_violation("LoopedBFS", pp=2, virtual_stages=2, num_microbatches=4) is not None
    assert pipeline_violation("LoopedBFS", pp=2, virtual_stages=2, num_microbatches=4) is None  # torch's own
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    assert main(["plan", str(config), "--gpus", "2", "--cluster", "local-cpu", "--global-batch", "8", "--pp", "2",
                 "--schedule", "LoopedBFS"]) == 2
    assert "--schedule LoopedBFS: soap's executor does not run it yet" in capsys.readouterr().err
    data = json.loads(make_plan("llama", pp=2, micro_batch=1, num_microbatches=4).to_json())
    data["parallelism"].update(schedule="LoopedBFS", virtual_stages=2)
    with pytest.raises(SoapError, match=r"parallelism\.schedule=LoopedBFS: soap's executor does not run it"):
        plan_from_dict(data)
    plan = make_plan("llama", pp=2, micro_batch=1, num_microbatches=4)
    unchecked = plan.model_copy(update={"parallelism": plan.parallelism.model_copy(
        update={"schedule": "LoopedBFS", "virtual_stages": 2})})
    with pytest.raises(SoapError, match="LoopedBFS"):
        run_plan(unchecked, RunConfig(), LaunchOptions())
