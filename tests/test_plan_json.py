"""plan.json: exact round trip, readable placements, `soap simulate` on a plan, and bad plans."""

import json

import pytest

import tracer
from costmodel.profiles import load_cluster
from costmodel.simulator import simulate
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
from planner.plan import ModelSpecRecord, config_hash, load_plan, plan_from_simulation, stage_bounds
from soap.cli import main
from soap.commands.simulate import _config


@pytest.fixture(scope="module")
def tiny():
    from transformers import GPT2Config

    config = GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=128, vocab_size=512)
    data = json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str))
    record = ModelSpecRecord(name="tiny-gpt2", source="module", task="causal-lm", config=data, config_hash=config_hash(data))
    graph = tracer.trace(config, task="causal-lm", seq_len=64)
    return record, graph


def _plan(tiny, *, tp=2, pp=2, dp=2, m=4, stages=None):
    record, graph = tiny
    cluster = load_cluster("dgx-h100")
    strategy = Strategy(dims=ParallelDims(tp=tp, pp=pp, dp_shard=dp),
                        train=TrainingConfig(global_batch=dp * m, seq_len=64, num_microbatches=m, zero=1, sequence_parallel=True))
    result = simulate(graph, strategy, cluster, stages=stages)
    return plan_from_simulation(model=record, graph=graph, cluster=cluster, gpus=strategy.dims.world_size,
                                strategy=strategy, result=result, stages=stages, launch="soap execute plan.json"), result


def test_plan_round_trips_exactly(tiny, tmp_path):
    plan, _ = _plan(tiny)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = load_plan(path)
    assert loaded == plan
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()


def test_plan_shows_per_block_and_per_op_placements(tiny):
    plan, _ = _plan(tiny)
    block = next(b for b in plan.blocks if b.id == "transformer.h")
    ops = {o.op: o for o in block.ops}
    assert ops["attn.c_attn:addmm"].placement == "Sample x2, Parameter x2"
    assert ops["attn:scaled_dot_product_attention"].placement == "Sample x2, Parameter x2"
    assert ops["ln_1:layer_norm"].placement == "Sample x2, Attribute x2"
    colwise = [o for o in block.ops if o.style == "colwise"]
    assert colwise and all(o.placement == "Sample x2, Parameter x2" for o in colwise)
    assert any("reduce_scatter over tp" in c for o in block.ops for c in o.collectives)
    assert plan.tp_plan["attn.c_attn"] == "colwise" and plan.tp_plan["mlp.c_proj"] == "rowwise"
    assert [s.layers for s in plan.stages] == [(0, 3), (3, 6)]
    assert plan.stages[0].modules[0] == "transformer.wte" and plan.stages[-1].modules[-1] == "lm_head"


def test_stage_bounds_come_back_from_the_plan(tiny):
    plan, _ = _plan(tiny, stages=(0, 2, 6))
    assert stage_bounds(plan, tiny[1]) == (0, 2, 6)
    without_layers = plan.model_copy(update={"stages": tuple(s.model_copy(update={"layers": None}) for s in plan.stages)})
    assert stage_bounds(without_layers, tiny[1]) == (0, 2, 6)


def test_soap_simulate_prints_contract_json_and_writes_trace_and_png(tiny, tmp_path, capsys):
    plan, _ = _plan(tiny)
    # soap simulate prices a plan on the graph of its precision regime: bf16 under FSDP is the bf16 trace
    graph = tracer.trace(_config(tiny[0].config), task="causal-lm", seq_len=64, dtype="bfloat16")
    direct = simulate(graph, plan.strategy(), load_cluster("dgx-h100"), stages=stage_bounds(plan, graph))
    path = tmp_path / "plan.json"
    plan.save(path)
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    assert main(["simulate", str(path), "--json", "--trace", str(trace), "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] == pytest.approx(direct.step_time_s)
    assert out["parallelism"]["tp"] == 2 and set(out["breakdown_s"]) == {"compute", "exposed_comm", "bubble", "optimizer", "other"}
    events = json.loads(trace.read_text())["traceEvents"]
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert threads == {"compute", "tp-comm", "dp-comm", "pp-p2p"}
    starts = {e["id"] for e in events if e["ph"] == "s"}
    finishes = {e["id"] for e in events if e["ph"] == "f"}
    assert starts and starts == finishes
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bad(tmp_path, plan, edit):
    data = json.loads(plan.to_json())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.update(schema_version=99), "schema_version"),
    (lambda d: d["cluster"].update(gpus=6), "mesh.degrees multiply to 8"),
    (lambda d: d["stages"][1].update(modules=[], layers=[6, 6]), "stages[1] has no layers"),
    (lambda d: d["model"]["config"].update(n_layer=40), "config_hash"),
    (lambda d: d["parallelism"].update(schedule="Zigzag"), "parallelism.schedule"),
    (lambda d: d.pop("schema_version"), "schema_version is missing"),
])
def test_bad_plans_exit_2_with_one_error_line_naming_the_field(tiny, tmp_path, capsys, edit, field):
    plan, _ = _plan(tiny)
    path = _bad(tmp_path, plan, edit)
    assert main(["simulate", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and field in err[0]


def test_missing_plan_file_is_a_clear_error(tmp_path, capsys):
    assert main(["simulate", str(tmp_path / "nope.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
