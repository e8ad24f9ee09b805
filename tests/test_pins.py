"""Pins `--ep`, `--virtual-stages`, `--offload` and `--compile` hold in the written plan.json, and an
impossible one is refused before the search with one `error:` line (exit 2) naming the numbers and a fix."""

from __future__ import annotations

import json

import pytest

from planner.api import make_request
from planner.plan import load_plan
from soap.cli import main
from tracer.errors import SoapError
from tracer_helpers import TINY_GPT2, config_dir

TINY_MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    "max_position_embeddings": 512, "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return config_dir(tmp_path_factory, "tiny-gpt2", TINY_GPT2)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return config_dir(tmp_path_factory, "tiny-mixtral", TINY_MIXTRAL)


def _planned(model: str, tmp_path, *flags: str) -> dict:
    out = tmp_path / "plan.json"
    assert main(["plan", model, "--gpus", "8", "--global-batch", "64", "-o", str(out), *flags]) == 0
    load_plan(out)  # validates
    return json.loads(out.read_text())["parallelism"]


@pytest.mark.parametrize("flags, expect", [
    (("--virtual-stages", "2", "--pp", "2"), {"virtual_stages": 2, "pp": 2}),
    (("--virtual-stages", "2"), {"virtual_stages": 2}),
    (("--offload", "on"), {"offload_optimizer": True}),
    (("--offload",), {"offload_optimizer": True}),
    (("--no-offload",), {"offload_optimizer": False}),
    (("--compile", "on"), {"compile": True}),
    (("--compile",), {"compile": True}),
    (("--compile", "off"), {"compile": False}),
])
def test_pinned_techniques_hold_in_plan_json(tiny, tmp_path, flags, expect):
    parallelism = _planned(tiny, tmp_path, *flags)
    assert {k: parallelism[k] for k in expect} == expect
    if parallelism["virtual_stages"] > 1:
        assert parallelism["schedule"] in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")


@pytest.mark.parametrize("ep", [2, 4])
def test_pinned_expert_parallel_degree_holds_in_plan_json(moe, tmp_path, ep):
    assert _planned(moe, tmp_path, "--ep", str(ep))["ep"] == ep


@pytest.mark.parametrize("model, flags, words", [
    ("moe", ("--ep", "3"), ["--ep 3", "8 experts", "2, 4, 8"]),
    ("tiny", ("--ep", "2"), ["--ep 2", "dense"]),
    ("moe", ("--ep", "8", "--tp", "2"), ["--ep 8", "leaves 4"]),
    ("tiny", ("--virtual-stages", "2", "--pp", "1"), ["--virtual-stages 2", "pp is 1", "--pp 2"]),
    ("tiny", ("--virtual-stages", "2", "--schedule", "1F1B"), ["1F1B", "one stage per rank", "Interleaved1F1B"]),
    ("tiny", ("--virtual-stages", "4", "--pp", "2"), ["8 stages", "4 layers", "--virtual-stages 2"]),
    ("tiny", ("--virtual-stages", "0"), ["--virtual-stages=0", "positive"]),
])
def test_impossible_pins_print_one_error_line(request, capsys, model, flags, words):
    path = request.getfixturevalue(model)
    assert main(["plan", path, "--gpus", "8", "--global-batch", "64", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for word in words:
        assert word in err[0], (word, err[0])


def test_bad_switch_value_is_a_usage_error(tiny, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", tiny, "--gpus", "8", "--compile", "maybe"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--compile" in err[0]


@pytest.mark.parametrize("value, expect", [(True, True), ("on", True), ("off", False), (False, False)])
def test_python_pins_take_booleans_or_on_off(tiny, value, expect):
    req = make_request(tiny, gpus=8, global_batch=64, compile=value, offload=value)
    assert req.space.pins.compile is expect and req.space.pins.offload is expect


def test_python_pin_rejects_a_non_switch_value(tiny):
    with pytest.raises(SoapError, match="--compile"):
        make_request(tiny, gpus=8, global_batch=64, compile="sometimes")


def test_pins_no_configuration_meets_together_name_the_pin_to_drop(tmp_path, capsys):
    """Pins that pass one by one but leave no configuration together (Interleaved1F1B's two stages per
    rank on pp 2 need 4 layers; the model has 2) name the pins and which one to unpin."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_MIXTRAL, "num_local_experts": 4}))
    code = main(["plan", str(config), "--gpus", "4", "--cluster", "local-cpu", "--global-batch", "8",
                 "--pp", "2", "--schedule", "Interleaved1F1B"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "(--pp 2, --schedule Interleaved1F1B)" in err and "unpin --pp or --schedule" in err
    assert "Interleaved1F1B with 2 stages per rank needs 4 stages at pp=2, more than the model's 2 layers" in err


def test_pins_no_mesh_lets_the_pinned_optimizer_step_say_why(tmp_path, capsys):
    """A pinned optimizer that no mesh of the pinned pipeline can step (bitsandbytes' 8-bit AdamW on a pipeline
    with data parallelism, FSDP2's DTensors) is the reason given, from the mesh the pins decide most (no TP)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_MIXTRAL, "num_hidden_layers": 4, "num_local_experts": 4}))
    code = main(["plan", str(config), "--gpus", "4", "--cluster", "local-cpu", "--global-batch", "16",
                 "--pp", "2", "--optimizer", "adamw8bit", "--precision", "bf16"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "(optimizer adamw8bit under FSDP2" in err and "use adamw" in err


@pytest.mark.parametrize("flags, words", [
    (("--peft", "qlora", "--dp", "2"), "pp=2: soap's executor runs qlora with data parallelism"),
    (("--peft", "lora", "--dp", "1", "--pp", "1"), "soap's executor runs lora with data parallelism"),
])
def test_pins_every_mesh_of_which_a_rule_refuses_say_which_rule(tiny, capsys, flags, words):
    """Pins whose degrees divide the GPUs only into meshes a rule refuses (QLoRA runs DDP only, so --dp 2 on 4
    GPUs leaves tp, cp or pp at 2; LoRA with --dp 1 --pp 1 leaves tp or cp at 4) give that rule as the reason, from
    the mesh the pins decide most, beside the pin to drop."""
    code = main(["plan", tiny, "--gpus", "4", "--cluster", "local-cpu", "--global-batch", "8", *flags])
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]  # transformers may warn first
    assert code == 2 and "Traceback" not in err
    assert "satisfies the pins" in line and words in line and "unpin" in line


def test_a_pinned_expert_degree_without_shards_to_borrow_says_so(moe, capsys):
    """--ep 4 --zero 0 on 4 GPUs: DDP shards nothing for the experts to spread over, and at cp 1 no mesh holds
    them; the refusal says that, not the layer count of a pp=4 mesh (plans_execute seed 26 printed that one)."""
    code = main(["plan", moe, "--gpus", "4", "--cluster", "local-cpu", "--global-batch", "8", "--seq-len", "64",
                 "--ep", "4", "--zero", "0"])
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err
    assert "ZeRO 0 (DDP) shards nothing" in line and "--zero 1, 2 or 3" in line and "layers" not in line, line
