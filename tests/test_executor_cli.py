"""`soap execute` and `soap.parallelize`: launching, refusing bad input, loading weights, the Python API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from exec_helpers import init_single_process_group, make_plan, tiny_config

from soap.cli import main
from tracer.errors import SoapError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def plan_file(tmp_path) -> Path:
    path = tmp_path / "plan.json"
    make_plan("llama", dp_shard=2, zero=3, micro_batch=2,
              predicted={"step_time_s": 0.5, "peak_memory_gib": 1.0}).save(path)
    return path


@pytest.fixture
def single_process_group():
    init_single_process_group()
    yield
    dist.destroy_process_group()


def test_world_size_mismatch_is_refused_before_training(plan_file, capsys):
    assert main(["execute", str(plan_file), "--nproc-per-node", "3"]) == 2
    err = capsys.readouterr().err
    assert "the plan needs 2 ranks, launched 3" in err and "--nproc-per-node 2" in err


def test_world_size_mismatch_under_torchrun_is_refused(plan_file, monkeypatch):
    from executor.launch import LaunchOptions, run_plan
    from executor.train import RunConfig
    from planner.plan import load_plan

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SoapError, match="the plan needs 2 ranks, launched 4"):
        run_plan(load_plan(plan_file), RunConfig(), LaunchOptions())
    assert not dist.is_initialized()


def test_resume_without_a_checkpoint_is_an_error(plan_file, tmp_path, capsys):
    assert main(["execute", str(plan_file), "--checkpoint-dir", str(tmp_path / "none"), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_resume_from_a_corrupt_checkpoint_is_an_error(plan_file, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-00000003").mkdir(parents=True)
    (ckpt / "latest").write_text("step-00000003\n")
    assert main(["execute", str(plan_file), "--checkpoint-dir", str(ckpt), "--resume"]) == 2
    assert "missing or corrupt" in capsys.readouterr().err


@pytest.mark.slow
def test_execute_launches_the_plans_ranks_and_prints_one_json_object(plan_file, tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(5000, dtype=np.int64) % 96)
    report = tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "soap", "execute", str(plan_file), "--steps", "2", "--data", str(tokens),
         "--report", str(report), "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))
    assert result["step_time_s"] > 0 and result["peak_memory_gib"] > 0
    assert result["predicted_step_time_s"] == 0.5
    assert result["parallelism"]["dp"] == 2 and result["parallelism"]["zero"] == 3
    assert json.loads(report.read_text())["losses"] == result["losses"]
    assert "predicted 0.5 s" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "gpt2"])  # rotary buffers; tied embeddings
def test_on_cuda_an_offloaded_optimizer_trains_like_one_on_the_device(family, tmp_path):
    """FSDP2's CPUOffloadPolicy refuses parameters allocated on the GPU: an offload plan's parameters are
    materialized in host memory, its buffers on the GPU (the first lent GPU to run an offload plan, an H200 on
    2026-11-28, failed before its first step). Same seeded weights and data: the same losses."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    losses = {}
    for offload in (False, True):
        plan_path, report = tmp_path / f"plan-{offload}.json", tmp_path / f"run-{offload}.json"
        make_plan(family, micro_batch=2, precision="bf16", offload_optimizer=offload).save(plan_path)
        proc = subprocess.run([sys.executable, "-m", "soap", "execute", str(plan_path), "--steps", "3", "--report",
                               str(report), "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[offload] = json.loads(report.read_text())["losses"]
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)


def test_weights_load_from_a_local_hf_checkpoint(tmp_path, single_process_group):
    """A tied GPT-2 saved with save_pretrained (Conv1D, fused c_attn) gives the HF model's own loss."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from executor.data import TokenSource
    from executor.train import RunConfig, train

    fields = tiny_config("gpt2")
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    hf.save_pretrained(tmp_path / "ckpt")
    plan = make_plan("gpt2", micro_batch=4)
    batch = TokenSource(vocab_size=96, global_batch=4, seq_len=16, task="causal-lm", seed=0).batch_for_step(0)
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).item()
    loaded = train(plan, RunConfig(steps=1, weights=str(tmp_path / "ckpt"), progress=False)).losses[0]
    seeded = train(plan, RunConfig(steps=1, progress=False)).losses[0]
    assert loaded == pytest.approx(expected, rel=1e-5)
    assert seeded != pytest.approx(expected, rel=1e-4)  # both random at HF's scales: the losses differ by 3.5e-4


@pytest.mark.parametrize("data", [None, "tokens.npy"])
def test_training_on_synthetic_tokens_says_so(single_process_group, tmp_path, capsys, data):
    from executor.train import RunConfig, train

    if data:
        np.save(tmp_path / data, np.arange(500, dtype=np.int64) % 96)
    train(make_plan("llama"), RunConfig(steps=1, progress=True, data=data and str(tmp_path / data)))
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("data: synthetic")]
    assert notices == ([] if data else ["data: synthetic token ids (seed 0); pass --data FILE or --dataset PATH "
                                        "--tokenizer DIR to train on text"])


def test_memory_snapshot_records_one_steady_step_on_cuda_and_says_so_on_cpu(single_process_group, tmp_path,
                                                                            capsys, monkeypatch):
    import executor.train as train_module
    from executor.train import RunConfig, train

    train(make_plan("llama"), RunConfig(steps=2, progress=False, memory_snapshot=str(tmp_path / "snap")))
    assert "--memory-snapshot: the allocator history is CUDA's" in capsys.readouterr().err
    assert not (tmp_path / "snap").exists()
    # on CUDA: the allocator's history recorded around the block, written as rank0.pickle, then switched off
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(("record", k)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    with train_module._memory_snapshot(str(tmp_path / "snap"), torch.device("cuda")):
        pass
    assert [c[0] for c in calls] == ["record", "dump", "record"]
    assert calls[1][1] == str(tmp_path / "snap" / "rank0.pickle") and calls[2][1] == {"enabled": None}


def test_fsdp2_on_a_head_with_a_bias_trains_without_warnings(single_process_group):
    import warnings

    from executor.train import RunConfig, train

    plan = make_plan("bert", offload_optimizer=True)  # FSDP2 (offload), on one rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(plan, RunConfig(steps=1, progress=False))
    assert [str(w.message) for w in caught if "FSDP2" in str(w.message)] == []


def test_missing_weights_directory_is_an_error(plan_file, tmp_path, capsys):
    assert main(["execute", str(plan_file), "--weights", str(tmp_path / "nothing")]) == 2
    assert "--weights" in capsys.readouterr().err


def test_parallelize_keeps_a_real_models_weights(single_process_group):
    import soap
    from executor.model import build_meta_model

    plan = make_plan("llama", micro_batch=4)
    torch.manual_seed(0)
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = tiny_config("llama")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    before = model.model.embed_tokens.weight.detach().clone()
    parallel = soap.parallelize(model, plan)
    assert parallel.schedule is None and parallel.model is model
    torch.testing.assert_close(parallel.model.model.embed_tokens.weight, before)
    assert build_meta_model(plan.model.config, plan.model.task).model.embed_tokens.weight.is_meta


def test_parallelize_needs_a_process_group():
    from executor.api import parallelize
    from executor.model import build_meta_model

    plan = make_plan("llama", micro_batch=4)
    with pytest.raises(SoapError, match="initialized process group"):
        parallelize(build_meta_model(plan.model.config, plan.model.task), plan)


def test_the_reported_step_leaves_the_warm_up_step_out():
    """The report's step time is the median of the steps after the first where others ran (the first carries
    cuBLAS's heuristics, the allocator's growth and compilation), as `soap calibrate`'s validation times it."""
    from executor.train import RunResult

    def report(times: list[float]) -> dict:
        return RunResult(losses=[1.0] * len(times), step_times_s=times, tokens_per_step=400,
                         peak_memory_per_rank_gib=[1.0], memory_source="process peak RSS", predicted_step_time_s=None,
                         predicted_peak_memory_gib=None, parallelism={}).to_json()

    assert report([5.12, 3.99])["step_time_s"] == 3.99
    assert report([5.5, 4.27, 4.19])["step_time_s"] == pytest.approx(4.23)
    assert report([5.5, 4.27, 4.19])["tokens_per_s"] == pytest.approx(400 / 4.23)
    assert report([0.5])["step_time_s"] == 0.5 and report([])["step_time_s"] == 0.0
