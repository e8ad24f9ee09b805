"""Distributed checkpoints (torch.distributed.checkpoint), saved atomically.

Layout of `--checkpoint-dir D`:
    D/step-00000006/   one DCP checkpoint (model and optimizer state of every rank, and the step)
    D/latest           the name of the newest complete checkpoint
    D/step-N/soap-run.json   the run it belongs to (`run_record`): global batch, sequence length, model
                             config hash (`check_resumable` refuses a plan that would not continue its data
                             order); the layout that wrote it and the run's re-plans so far; the elastic
                             job (`TORCHELASTIC_RUN_ID`) whose re-formed worker groups resume it
Saving writes into `D/.tmp-step-N`, waits for every rank, then rank 0 renames it to `D/step-N`,
rewrites `latest` atomically and deletes older checkpoints. A crash mid-save leaves only a `.tmp-*`
directory behind, and `latest` still names the last good checkpoint. State dicts use
`get_state_dict` with flattened optimizer state, so FSDP/TP/PP shards are saved under their FQNs and
can be loaded back into the same plan.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from tracer.files import write_atomic
from tracer.errors import SoapError

RUN_FILE = "soap-run.json"

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    state: dict = {}
    for part, optimizer in zip(parts, optimizers):
        if type(optimizer).__name__ in ("ZeroRedundancyOptimizer", "OptimizerPair"):  # OptimizerPair: zero 1 under ep
            raise SoapError("checkpoints are not supported with zero=1 (ZeroRedundancyOptimizer); re-plan with --zero 2")
        model_sd, optim_sd = get_state_dict(part, optimizer, options=OPTIONS)
        state.update({f"model.{k}": v for k, v in model_sd.items()})
        state.update({f"optim.{k}": v for k, v in optim_sd.items()})
    return state


def run_record(plan, *, job: str | None = None, replans: list[dict] | None = None) -> dict:
    """What a resumed run must share with the checkpointed one to continue its data order and model (global
    batch, sequence length, config hash), and what it continues: the layout and world size that wrote the
    checkpoint (a run resumed under another one records a re-plan), the re-plans so far, and the elastic
    job that wrote it (`job`: a worker group the agent re-formed resumes a checkpoint of its own job)."""
    return {"global_batch": plan.global_batch, "seq_len": plan.seq_len, "config_hash": plan.model.config_hash,
            "world_size": plan.world_size, "parallelism": plan.parallelism.model_dump(mode="json"),
            "job": job, "replans": list(replans or [])}


def saved_run_record(directory: str | Path) -> dict:
    """The run record of the newest checkpoint in `directory`; {} when there is none (or it is unreadable:
    a checkpoint written before run records)."""
    try:
        pointer = (Path(directory) / "latest").read_text().strip()
        saved = json.loads((Path(directory) / pointer / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def check_resumable(plan, directory: str | Path) -> None:
    """A SoapError, before anything runs, when `plan` cannot continue the newest checkpoint in `directory`:
    another model, or another global batch or sequence length (step k of the saved run covered samples
    [k B, (k+1) B) of the data; another B would skip or repeat data and change the optimization). Another
    layout (degrees, ranks, schedule) is fine: DCP reshards. A checkpoint without a run record passes."""
    path = latest_checkpoint(directory)
    saved = saved_run_record(directory)
    if not saved:
        return
    if saved.get("config_hash") not in (None, plan.model.config_hash):
        raise SoapError(f"--resume: checkpoint {path} was written for another model (config hash "
                        f"{saved['config_hash']}, this plan's is {plan.model.config_hash}); resume with its plan")
    old = (saved.get("global_batch"), saved.get("seq_len"))
    if None not in old and old != (plan.global_batch, plan.seq_len):
        raise SoapError(
            f"--resume: checkpoint {path} was written with a global batch of {old[0]} x {old[1]} tokens and this plan "
            f"has {plan.global_batch} x {plan.seq_len}: it would not continue the run's data order (step k covered "
            f"samples [{old[0]}k, {old[0]}(k+1))) nor its optimization; re-plan keeping the batch "
            f"(`soap replan OLD_PLAN --gpus N`), or start a new run in another --checkpoint-dir")


def save_checkpoint(directory: str | Path, step: int, parts: list[nn.Module],
                    optimizers: list[torch.optim.Optimizer], *, run: dict | None = None) -> Path:
    root = Path(directory)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _state(parts, optimizers)
    state["step"] = torch.tensor(step)
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        if run is not None:
            (tmp / RUN_FILE).write_text(json.dumps(run, sort_keys=True) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        write_atomic(root / "latest", final.name + "\n", what="--checkpoint-dir")
        for old in root.glob("step-*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def latest_checkpoint(directory: str | Path) -> Path:
    """The newest complete checkpoint in `directory`, or a SoapError saying what is wrong."""
    root = Path(directory)
    pointer = root / "latest"
    if not pointer.is_file():
        raise SoapError(f"--resume: no checkpoint in {root} (no `latest` file); run without --resume first "
                        "or point --checkpoint-dir at a directory written by `soap execute`")
    path = root / pointer.read_text().strip()
    if not (path / ".metadata").is_file():
        raise SoapError(f"--resume: checkpoint {path} is missing or corrupt (no DCP .metadata); "
                        "delete it and `latest`, or resume from another directory")
    return path


def load_checkpoint(directory: str | Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> int:
    """Load the newest checkpoint into `parts` / `optimizers` in place; returns the step it was saved at."""
    path = latest_checkpoint(directory)
    state = _state(parts, optimizers)
    state["step"] = torch.tensor(0)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:  # noqa: BLE001 - any read failure is a bad checkpoint for the user
        raise SoapError(f"--resume: cannot load {path} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                        "was it written with the same plan?") from None
    for part, optimizer in zip(parts, optimizers):
        model_sd, optim_sd = get_state_dict(part, optimizer, options=OPTIONS)
        set_state_dict(
            part, optimizer,
            model_state_dict={k: state[f"model.{k}"] for k in model_sd},
            optim_state_dict={k: state[f"optim.{k}"] for k in optim_sd},
            options=OPTIONS,
        )
    return int(state["step"])
