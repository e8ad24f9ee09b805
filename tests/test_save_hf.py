"""`soap execute --save-hf` and `soap export-hf`: the trained model comes back as a transformers directory.

Each layout (FSDP ZeRO-3, TP, GPT-2's tied Conv1D model through a 2-stage pipeline, expert parallelism
with FSDP) trains 3 steps on 2 gloo ranks and saves with --save-hf (and a DCP checkpoint); a second run
of the same plan trains 4 steps, and its last reported loss is the loss of the weights after 3 steps on
step 3's batch. `AutoModelForCausalLM.from_pretrained` of the saved directory gives that loss on that
batch (rel 1e-5), so every weight came back, renamed and re-fused to HF's layout. The DCP checkpoint,
converted in one process by `soap export-hf`, gives bit-identical tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from exec_helpers import make_plan, spawn_cases

from executor.data import TokenSource
from soap.cli import main

pytestmark = pytest.mark.slow

LAYOUTS = {
    "llama-zero3": ("llama", dict(dp_shard=2, zero=3, micro_batch=2)),
    "llama-tp": ("llama", dict(tp=2, micro_batch=4)),
    "gpt2-pp-tied": ("gpt2", dict(pp=2, micro_batch=2, num_microbatches=2)),
    "mixtral-ep2-zero3": ("mixtral", dict(dp_shard=2, ep=2, zero=3, micro_batch=2, optimizer="sgd")),
}
STEPS = 3
LR = 1e-2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("save-hf")
    payload = []
    for name, (family, plan) in LAYOUTS.items():
        saved = {"save_hf": str(root / name / "hf"), "checkpoint_dir": str(root / name / "ckpt")}
        payload.append({"name": name, "family": family, "plan": plan,
                        "run": {"steps": STEPS, "lr": LR, **saved}})
        payload.append({"name": f"{name}-one-more-step", "family": family, "plan": plan,
                        "run": {"steps": STEPS + 1, "lr": LR}})
    results = spawn_cases(2, payload)
    for name, value in results.items():
        assert isinstance(value, list), f"{name}: {value}"
    return root, results


def _hf_loss(directory, family: str, plan_fields: dict) -> float:
    from transformers import AutoModelForCausalLM

    plan = make_plan(family, **plan_fields)
    model = AutoModelForCausalLM.from_pretrained(directory)
    batch = TokenSource(vocab_size=model.config.vocab_size, global_batch=plan.global_batch, seq_len=plan.seq_len,
                        task=plan.model.task, seed=0).batch_for_step(STEPS)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
    return float(F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()))


@pytest.mark.parametrize("name", LAYOUTS)
def test_saved_hf_model_gives_the_trained_models_loss(runs, name):
    root, results = runs
    family, plan_fields = LAYOUTS[name]
    trained = results[f"{name}-one-more-step"][STEPS]
    assert results[name] == results[f"{name}-one-more-step"][:STEPS]  # the same run up to the save
    assert _hf_loss(root / name / "hf", family, plan_fields) == pytest.approx(trained, rel=1e-5)


def test_gpt2_is_saved_in_hfs_own_layout(runs):
    from safetensors import safe_open

    root, _ = runs
    with safe_open(str(root / "gpt2-pp-tied" / "hf" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        assert f.get_slice("transformer.h.0.attn.c_attn.weight").get_shape() == [32, 96]  # Conv1D: [in, 3*out]
        assert f.get_slice("transformer.h.0.mlp.c_fc.weight").get_shape() == [32, 128]
    assert "lm_head.weight" not in keys  # tied to transformer.wte.weight: saved once
    assert not any(".q." in k or ".k." in k or ".v." in k for k in keys)


@pytest.mark.parametrize("name", ["gpt2-pp-tied", "mixtral-ep2-zero3"])
def test_dcp_checkpoint_converts_to_the_same_hf_directory(runs, name, tmp_path, capsys):
    import json

    from safetensors.torch import load_file

    root, _ = runs
    family, plan_fields = LAYOUTS[name]
    plan_path = tmp_path / "plan.json"
    make_plan(family, **plan_fields).save(plan_path)
    out = tmp_path / "hf"
    assert main(["export-hf", str(root / name / "ckpt"), "--plan", str(plan_path), "-o", str(out)]) == 0
    converted, saved = load_file(out / "model.safetensors"), load_file(root / name / "hf" / "model.safetensors")
    assert converted.keys() == saved.keys()
    for key in saved:
        assert torch.equal(converted[key], saved[key]), key
    assert json.loads((out / "config.json").read_text()) == json.loads((root / name / "hf" / "config.json").read_text())


def test_export_hf_names_a_missing_checkpoint(tmp_path, capsys):
    assert main(["export-hf", str(tmp_path / "nope"), "--plan", str(tmp_path / "plan.json"), "-o",
                 str(tmp_path / "hf")]) == 2
    assert "no such directory" in capsys.readouterr().err
