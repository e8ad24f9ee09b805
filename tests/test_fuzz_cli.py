"""Issue 8 §2: generated argument lists for `soap plan / trace / simulate / execute` never produce a traceback,
a hang, an exception nobody validated, or a partially written output file.

To fuzz the argument-parsing and validation layer at more than a thousand examples, the expensive step
after validation is replaced by a stop sign: the plan search (`planner.pricing.run_search`), the capture
(`tracer.api._trace_resolved`) and the launch (`executor.launch.run_plan`). Everything before it runs for
real: argparse, model and cluster resolution, pins, tracing the model for its dimensions (cached
models only: the gpt2 / bert presets and a tiny llama config), world-size and checkpoint checks.
`soap simulate` runs end to end on real plans. Output paths (`-o`, `--trace`, `--png`) hold a previous
content before each run: after a failure they must hold it still, with no temporary files left behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_plan_json import UNEXPECTED, time_limit
from test_reliability_support import cli, gpt2_plan_text, tiny_plan

PREVIOUS = "previous content\n"
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.filter_too_much])


class Validated(BaseException):
    """Raised where the stubbed expensive step would start: the arguments passed validation."""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fuzz-cli")
    gpt2 = root / "gpt2.plan.json"
    gpt2.write_text(gpt2_plan_text())
    config = root / "tiny-llama" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "vocab_size": 96, "max_position_embeddings": 64}))
    broken = root / "broken.json"
    broken.write_text('{"schema_version": 1, "model": ')
    ckpt = root / "ckpt"
    (ckpt / "step-00000002").mkdir(parents=True)
    (ckpt / "latest").write_text("step-00000002\n")
    return {"gpt2_plan": str(gpt2), "tiny_plan": str(tiny_plan(root / "tiny.plan.json")), "config": str(config),
            "config_dir": str(config.parent), "broken": str(broken), "ckpt": str(ckpt), "root": str(root)}


@pytest.fixture
def stubs(monkeypatch, tmp_path):
    import executor.launch
    import planner.pricing
    import tracer.api

    def stop(*args, **kwargs):
        raise Validated

    monkeypatch.setattr(planner.pricing, "run_search", stop)
    monkeypatch.setattr(tracer.api, "_trace_resolved", stop)
    monkeypatch.setattr(executor.launch, "run_plan", stop)
    monkeypatch.setenv("SOAP_CACHE_DIR", str(tmp_path / "trace-cache"))


GOOD_INTS = st.sampled_from(["1", "2", "4", "8", "3", "12", "16", "1024"])
BAD_INTS = st.sampled_from(["0", "-1", "-8", "7", "99999999999999999999", "2.5", "1e3", "", "x", "０", "nan"])
INTS = st.one_of(GOOD_INTS, GOOD_INTS, BAD_INTS)
"""Mostly well-formed numbers (so most lists get past argparse to soap's own checks), some malformed."""
FLOATS = st.one_of(st.sampled_from(["80", "0.5", "0.01", "0", "-3", "1e-300", "1e300", "inf", "-inf", "nan"]),
                   st.sampled_from(["x", ""]))


def _mostly(good: list[str], bad: list[str]) -> st.SearchStrategy[str]:
    """A choice flag's value: a valid choice two times in three."""
    return st.one_of(st.sampled_from(good), st.sampled_from(good), st.sampled_from(bad))
NAMES = st.sampled_from(["", " ", "-", "--", "x" * 200, "x" * 300, "é", "\u202e", "a/b", "../..", "/dev/null", "-h2",
                         "none", "None", "null", "{}", "%s", "\\", "a\nb", "\r", "x.json\n", "\x1b[31mred",
                         "a\u2028b", "\x85", "\udcff.json"])
"""Odd names; those with line breaks, escapes or an undecodable byte (a surrogate, as Python decodes
argv) must still give a one-line error: soap.cli escapes them."""

PRINTABLE = st.text(st.characters(blacklist_characters="\x00"), max_size=8)
"""Any text but NUL (which no command line can carry)."""


def _flags(spec: dict[str, st.SearchStrategy]) -> st.SearchStrategy[list[str]]:
    """Some of the flags in `spec`, each with a value drawn from its strategy (None: a bare switch)."""
    def build(chosen: list[tuple[str, str | None]]) -> list[str]:
        argv: list[str] = []
        for flag, value in chosen:
            argv += [flag] if value is None else [flag, value]
        return argv

    pairs = [st.tuples(st.just(flag), values if values is not None else st.none()) for flag, values in spec.items()]
    return st.lists(st.one_of(*pairs), max_size=5).map(build)


def _models(files: dict[str, str]) -> st.SearchStrategy[str]:
    good = st.sampled_from(["gpt2", "bert-base-uncased", files["config"], files["config_dir"]])
    bad = st.sampled_from([files["broken"], files["root"], files["root"] + "/missing/config.json", "no-such-preset",
                           "org/model", "a/b/c"])
    return st.one_of(good, good, good, bad, NAMES)


def _plan_args(files):
    flags = {"--gpus": INTS, "--cluster": st.one_of(st.sampled_from(["dgx-h100", "dgx-a100-80g", "local-cpu",
                                                                     "l40s-pcie", "nope", files["broken"]]), NAMES),
             "--gpus-per-node": INTS, "--task": st.one_of(st.sampled_from(["causal-lm", "masked-lm", "seq-cls",
                                                                          "seq2seq-lm", "image-cls"]), NAMES),
             "--global-batch": INTS, "--seq-len": st.sampled_from(["64", "0", "-64", "100000", "x", "63"]),
             "--precision": _mostly(["bf16", "fp8", "fp16", "fp32", "tf32"], ["fp4", ""]),
             "--optimizer": _mostly(["adamw", "auto", "adafactor", "sgd", "adamw8bit"], ["lion", ""]),
             "--tp": INTS, "--pp": INTS, "--dp": INTS, "--cp": INTS, "--zero": INTS, "--micro-batch": INTS,
             "--grad-accum": INTS, "--recompute": _mostly(["none", "full", "selective"], ["half", ""]),
             "--schedule": _mostly(["1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"], ["ZigZag"]),
             "--mem-limit": FLOATS, "--time-budget": FLOATS, "--seed": INTS, "--json": None}
    gpus = st.one_of(st.just(["--gpus", "2"]), st.just(["--gpus", "8"]), st.just([]),
                     st.tuples(st.just("--gpus"), INTS).map(list))
    return st.tuples(_models(files), gpus, _flags(flags)).map(lambda t: ["plan", t[0], *t[1], *t[2]])


def _trace_args(files):
    flags = {"--task": st.one_of(st.sampled_from(["causal-lm", "masked-lm", "seq-cls", "seq2seq-lm", "image-cls"]),
                                 NAMES),
             "--seq-len": INTS, "--batch": INTS, "--frontend": _mostly(["auto", "export", "hf-fx", "dispatch"],
                                                                       ["fx", ""]),
             "--trust-remote-code": None, "--no-cache": None, "--json": None}
    return st.tuples(_models(files), _flags(flags)).map(lambda t: ["trace", t[0], *t[1]])


def _execute_args(files):
    flags = {"--steps": INTS, "--seed": INTS, "--lr": FLOATS, "--data": st.sampled_from([files["config"], "nope.npy"]),
             "--weights": st.sampled_from([files["root"], "no-such-dir"]),
             "--checkpoint-dir": st.sampled_from([files["ckpt"], files["root"] + "/fresh", ""]),
             "--checkpoint-every": INTS, "--resume": None, "--json": None, "--nproc-per-node": INTS,
             "--nnodes": st.sampled_from(["1", "2", "1:2", "2:1", "0", "a:b", ":", "1:", ""]), "--node-rank": INTS,
             "--rdzv-backend": st.sampled_from(["static", "c10d", "etcd", ""]), "--max-restarts": INTS,
             "--master-port": INTS}
    plans = st.sampled_from([files["tiny_plan"], files["gpt2_plan"], files["broken"], files["root"], "nope.json"])
    return st.tuples(plans, _flags(flags)).map(lambda t: ["execute", t[0], *t[1]])


def _garbage_args():
    """Words of any command line; `calibrate` and `profiles` are left out (calibrate would measure for real)."""
    words = st.one_of(st.sampled_from(["plan", "trace", "simulate", "execute", "--help",
                                       "-h", "--debug", "--json", "--gpus", "gpt2", "--", "-"]), PRINTABLE)
    return st.lists(words, max_size=6)


def _check(argv: list[str], outputs: list[Path]) -> str:
    for out in outputs:
        out.write_text(PREVIOUS)
    try:
        with time_limit(60):
            code, stdout, stderr = cli(argv)
    except Validated:
        code, stdout, stderr = None, "", ""
    assert "Traceback" not in stderr, (argv, stderr)
    if code is None or code == 0:
        return "validated" if code is None else "ok"
    assert code == 2, (argv, code, stderr)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, stderr)
    assert UNEXPECTED not in lines[0], (argv, lines[0])
    for out in outputs:
        assert out.read_text() == PREVIOUS, f"{argv}: {out} was changed by a failed command"
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temporary file left"
    return "error"


def test_plan_arguments(files, stubs, tmp_path):
    out = tmp_path / "plan.json"

    @settings(FUZZ, max_examples=450)
    @given(argv=_plan_args(files), write=st.booleans())
    def run(argv, write):
        _check([*argv, "-o", str(out)] if write else argv, [out] if write else [])

    run()


def test_trace_arguments(files, stubs):
    @settings(FUZZ, max_examples=250)
    @given(argv=_trace_args(files))
    def run(argv):
        _check(argv, [])

    run()


def test_simulate_arguments_end_to_end(files, tmp_path):
    trace, png = tmp_path / "trace.json", tmp_path / "timeline.png"
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder\n")
    unwritable = [str(blocker / "out"), str(tmp_path), str(tmp_path / ("x" * 300)), str(blocker / "deeper" / "x")]
    output = st.sampled_from(["none", "none", "good", "good", "bad"])
    plans = st.one_of(st.sampled_from([files["gpt2_plan"], files["tiny_plan"], files["broken"], files["root"],
                                       files["config"], "nope.json"]), NAMES)

    @settings(FUZZ, max_examples=150)
    @given(plan=plans, json_flag=st.booleans(), trace_to=output, png_to=output, bad=st.sampled_from(unwritable))
    def run(plan, json_flag, trace_to, png_to, bad):
        argv, written = ["simulate", plan, *(["--json"] if json_flag else [])], []
        for flag, good, where in (("--trace", trace, trace_to), ("--png", png, png_to)):
            if where == "good":
                argv += [flag, str(good)]
                written.append(good)
            elif where == "bad":
                argv += [flag, bad]
        outcome = _check(argv, written)
        if outcome == "ok":
            assert all(out.read_text(errors="replace") != PREVIOUS for out in written), "an output was not written"
        assert "bad" not in (trace_to, png_to) or outcome == "error", f"{argv}: an unwritable output was accepted"

    run()


def test_execute_arguments(files, stubs):
    @settings(FUZZ, max_examples=150)
    @given(argv=_execute_args(files))
    def run(argv):
        _check(argv, [])

    run()


def test_garbage_argument_lists(files, stubs):
    @settings(FUZZ, max_examples=150)
    @given(argv=_garbage_args())
    def run(argv):
        _check(argv, [])

    run()


def test_a_failed_plan_write_keeps_the_previous_file(tmp_path, monkeypatch):
    """A crash while plan.json is written (here: fsync fails) leaves the old file whole and no temp file."""
    out = tmp_path / "plan.json"
    out.write_text(PREVIOUS)

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    code, _, err = cli(["plan", "gpt2", "--gpus", "2", "-o", str(out)])
    assert code == 2 and err.startswith("error: "), err
    assert out.read_text() == PREVIOUS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
