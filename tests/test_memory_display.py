"""Issue 14 item 6: the memory table of `soap plan` / `soap simulate`, `memory_breakdown_gib` in their
`--json`, and infeasibility errors that name the dominant term and the cheapest fix that works."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from types import SimpleNamespace

import pytest
from rich.console import Console

from costmodel.memory import MEMORY_TERMS, MemoryBreakdown
from costmodel.simulator.result import RankMemory
from planner.api import make_request, plan_report
from planner.feasibility import pin_changes
from planner.report import memory_table, render_summary, report_json
from soap.cli import main
from tracer.errors import SoapError
from tracer_helpers import TINY_GPT2, config_dir

GIB = 2**30
WIDE_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
}
ENTRY_KEYS = {"rank", "stages", *MEMORY_TERMS, "total"}
ROW = re.compile(r"^│ (\d+)\s+│ ([\d,]+)\s+│(.*)│$")
FIX = re.compile(r"cheapest fix: (--[a-z-]+) (\S+) \(")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return config_dir(tmp_path_factory, "tiny-gpt2", TINY_GPT2)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return config_dir(tmp_path_factory, "wide-llama", WIDE_LLAMA)


@pytest.fixture(scope="module")
def pipelined(tiny):
    """A 2-stage plan with virtual stages possible, so a rank may hold several stages."""
    return plan_report(tiny, gpus=4, pp=2, global_batch=16)


def _table_rows(text: str) -> dict[int, tuple[str, list[str]]]:
    """rank -> (stages, the other cells) of the memory table printed in `text`."""
    start = text.index("Memory per GPU at its peak")
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("└"):
            break
        match = ROW.match(line)
        if match:
            rows[int(match.group(1))] = (match.group(2), [c.strip() for c in match.group(3).split("│")])
    return rows


def test_plan_prints_one_memory_row_per_pipeline_rank_whose_totals_are_the_stage_peaks(pipelined, capsys):
    render_summary(pipelined)
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if "activations" in line and "of limit" in line)
    assert [c.strip() for c in header.strip("┃").split("┃")] == ["rank", "stages", *MEMORY_TERMS, "total", "of limit"]
    rows = _table_rows(text)
    peaks = report_json(pipelined)["peak_memory_per_stage_gib"]
    assert sorted(rows) == list(range(len(peaks))) == [m.rank for m in pipelined.chosen.result.memory]
    limit = pipelined.memory_limit_bytes / GIB
    for m, peak in zip(pipelined.chosen.result.memory, peaks):
        stages, cells = rows[m.rank]
        assert stages == ",".join(map(str, m.stages))
        total = float(cells[len(MEMORY_TERMS)])
        assert total == pytest.approx(peak, abs=0.006)
        assert cells[-1] == f"{peak / limit:.0%}"
    assert "peak = allocated (no allocator reserve fitted for h100-sxm-fitted)" in text or "peak = reserved" in text


def test_json_memory_breakdown_has_every_term_per_rank_and_totals_equal_the_stage_peaks(pipelined):
    out = report_json(pipelined)
    entries = out["memory_breakdown_gib"]
    assert len(entries) == len(out["peak_memory_per_stage_gib"]) == pipelined.plan.parallelism.pp
    stages = sorted(s for e in entries for s in e["stages"])
    assert stages == list(range(len(pipelined.plan.stages)))
    for entry, peak in zip(entries, out["peak_memory_per_stage_gib"]):
        assert set(entry) == ENTRY_KEYS
        assert entry["total"] == pytest.approx(peak, rel=1e-12)
        device_terms = sum(entry[t] for t in MEMORY_TERMS if t != "host")
        assert entry["total"] == pytest.approx(device_terms, rel=1e-12)
    assert max(e["total"] for e in entries) == pytest.approx(out["peak_memory_gib"], rel=1e-12)
    assert out["memory_limit_gib"] == pytest.approx(80.0 * (1 - out["memory_margin"]))  # costmodel.allocator


def test_plan_and_simulate_json_carry_the_breakdown_and_simulate_prints_the_table(tiny, tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", tiny, "--gpus", "2", "--global-batch", "8", "--json", "-o", str(path)]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["simulate", str(path), "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    for out in (planned, simulated):
        assert all(set(e) == ENTRY_KEYS for e in out["memory_breakdown_gib"])
        assert [e["total"] for e in out["memory_breakdown_gib"]] == pytest.approx(out["peak_memory_per_stage_gib"])
    for term in ("total", *MEMORY_TERMS):
        assert [e[term] for e in simulated["memory_breakdown_gib"]] == pytest.approx(
            [e[term] for e in planned["memory_breakdown_gib"]], rel=1e-9)
    assert simulated["memory_limit_gib"] == pytest.approx(80.0)
    assert main(["simulate", str(path)]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert [float(cells[len(MEMORY_TERMS)]) for _, (_, cells) in sorted(rows.items())] == pytest.approx(
        simulated["peak_memory_per_stage_gib"], abs=0.006)


@pytest.mark.parametrize(("reserved", "says"), [
    (False, "peak = allocated (no allocator reserve fitted for test-gpu)"),
    (True, "peak = reserved (allocator reserve fitted from runs)"),
])
def test_the_table_says_whether_the_peak_is_allocated_or_reserved(reserved, says):
    device = SimpleNamespace(name="test-gpu", predicts_reserved_memory=reserved)
    at_peak = MemoryBreakdown(weights=GIB, grads=GIB, optimizer=2 * GIB, activations=4 * GIB, buffers=0,
                              workspace=GIB, host=3 * GIB)
    memory = [RankMemory(rank=0, stages=(0, 3), at_peak=at_peak, timeline=())]
    console = Console(file=io.StringIO(), width=140)
    console.print(memory_table(memory, 16 * GIB, device))
    text = console.file.getvalue()
    assert says in text and "limit 16.0 GiB" in text
    stages, cells = _table_rows(text)[0]
    assert stages == "0,3"
    gib = at_peak.as_gib()
    assert cells == [*(f"{gib[t]:.2f}" for t in (*MEMORY_TERMS, "total")), f"{at_peak.total / (16 * GIB):.0%}"]
    assert (gib["host"], gib["total"]) == (3.0, 9.0)  # host memory is shown, outside the device total


def test_suggested_fixes_are_flags_of_soap_plan_and_never_the_current_setting():
    import argparse

    from soap.commands import plan

    plan_parser = plan.add_parser(argparse.ArgumentParser().add_subparsers())
    flags = {o for a in plan_parser._actions for o in a.option_strings}
    req = make_request("gpt2", gpus=8, tp=2, pp=2, dp=2, cp=1, zero=1, micro_batch=4, recompute="selective",
                       precision="fp32", seq_len=1024, global_batch=64).space
    changes = pin_changes(req)
    assert {flag.split()[0] for flag, _ in changes} == {"--zero", "--optimizer", "--recompute", "--micro-batch",
                                                         "--tp", "--cp", "--pp", "--dp", "--precision"} <= flags
    for flag, pins in changes:
        name, value = flag.split()
        field = name[2:].replace("-", "_")
        assert str(getattr(pins, field)) == value != str(getattr(req.pins, field)), flag


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def _apply(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with `flag` set to `value` (replacing the pinned value)."""
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


@pytest.mark.parametrize(("model", "argv", "term"), [
    ("gpt2", ["--gpus", "1", "--mem-limit", "8", "--recompute", "none", "--micro-batch", "16", "--seq-len", "1024",
              "--global-batch", "64"], "activations"),
    ("wide", ["--gpus", "8", "--dp", "8", "--zero", "1", "--mem-limit", "6", "--seq-len", "1024",
              "--global-batch", "64"], "weights"),
])
def test_infeasible_pins_name_the_dominant_term_and_a_fix_that_plans(model, argv, term, wide, capsys):
    argv = ["plan", wide if model == "wide" else model, *argv]
    err = _error(argv, capsys)
    assert f"its {term} " in err and "dominates" in err and "--mem-limit" in err
    fix = FIX.search(err)
    assert fix, err
    flag, value = fix.groups()
    assert flag in ("--zero", "--optimizer", "--recompute", "--micro-batch", "--tp", "--cp", "--pp", "--dp",
                    "--precision")
    current = argv[argv.index(flag) + 1] if flag in argv else {"--optimizer": "adamw"}.get(flag)
    assert value != current
    assert main(_apply(argv, flag, value) + ["--json"]) == 0, f"the suggested {flag} {value} does not plan"
    assert json.loads(capsys.readouterr().out)["peak_memory_gib"] <= float(argv[argv.index("--mem-limit") + 1])


def test_nothing_fits_without_a_pin_to_change_names_no_flag_fix(capsys):
    err = _error(["plan", "gpt2", "--gpus", "2", "--mem-limit", "0.01"], capsys)
    assert "does not fit on 2 x 0.01 GiB" in err and "dominates" in err
    assert "cheapest fix" not in err and "add GPUs or use a larger --mem-limit" in err


def test_when_only_simulation_overflows_the_error_names_the_simulated_term_and_a_simulated_fix(monkeypatch, capsys):
    """The estimator under-counts activations 3x here (the simulator is made to triple them): every plan fits
    by estimate and none in simulation, so the error comes from the simulated plans and the fix it names must
    fit in simulation too."""
    import planner.pricing

    real = planner.pricing.simulate

    def tripled(*args, **kwargs):
        result = real(*args, **kwargs)
        memory = tuple(dataclasses.replace(m, at_peak=dataclasses.replace(m.at_peak, activations=3 * m.at_peak.activations))
                       for m in result.memory)
        return dataclasses.replace(result, memory=memory)

    monkeypatch.setattr(planner.pricing, "simulate", tripled)
    argv = ["plan", "gpt2", "--gpus", "1", "--mem-limit", "25", "--recompute", "none", "--micro-batch", "16",
            "--seq-len", "1024", "--global-batch", "64"]
    err = _error(argv, capsys)
    assert "the most frugal plan simulated (dp1 mb16x4 " in err
    assert "its activations " in err and "dominates" in err
    fix = FIX.search(err)
    assert fix and "simulated" in err[fix.start():], err
    flag, value = fix.groups()
    assert flag in ("--recompute", "--micro-batch") and value not in ("none", "16")
    assert main(_apply(argv, flag, value) + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_memory_gib"] <= 25


def test_the_frugal_plan_names_pinned_settings_as_pinned(capsys):
    with pytest.raises(SoapError, match=r"micro-batch 16 \(pinned\), no recompute \(pinned\)"):
        plan_report("gpt2", gpus=1, mem_limit_gib=3, recompute="none", micro_batch=16, seq_len=1024, global_batch=64)
