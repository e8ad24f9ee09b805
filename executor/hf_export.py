"""Give back a Hugging Face model: a transformers-loadable directory (config.json + model.safetensors).

Two ways in, one way out:
- `save_hf(directory, parallel)` at the end of `soap execute --save-hf DIR`, on every rank: each
  parameter (and persistent buffer) of the rank's parts is made whole (`DTensor.full_tensor()`: FSDP2,
  TP and expert-parallel shards alike, collectives over the parameter's own mesh, so every rank of a
  pipeline stage calls them in the same order), moved to the CPU, and one rank per distinct set of
  pipeline stages sends its full tensors to rank 0 (`gather_object`), which writes the directory.
- `export_dcp_checkpoint(checkpoint, plan, directory)` (`soap export-hf`), in one process: the model
  tensors of a DCP checkpoint written by `executor.checkpoint.save_checkpoint` (keys `model.FQN`, full
  tensors whatever layout saved them) are read without a process group.

Both end in `write_hf_directory(directory, tensors, plan)`, where `tensors` is {soap FQN: full tensor}
of the plan's normalized model (`executor.model.build_meta_model`):
1. undo the normalization (`executor.model.normalize_for_tp`): its renames
   `soap_checkpoint_keys = {soap FQN: (HF key, transform HF tensor -> soap tensor)}` are index
   operations (transposes, column slices), so each HF key's inverse is found by running the transforms
   on `arange(numel).reshape(HF shape)`: the result says which HF element each soap element came from,
   and the soap tensors are scattered back (GPT-2's q/k/v Linears into one transposed `c_attn` Conv1D);
2. drop tied copies: a parameter the HF model ties to an earlier one (`tied_aliases`, e.g. GPT-2's
   `lm_head.weight`) is saved once, under the name HF keeps (pipeline stages hold their own copies,
   kept equal by training);
3. check the names and shapes against the un-normalized HF model built from the same config, and write
   `config.json` (with `use_cache` back on and the model class in `architectures`) and
   `model.safetensors` (metadata `format: pt`, as `save_pretrained` writes it).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tracer.errors import SoapError

WRAPPER_SEGMENTS = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""FQN segments added by wrappers (DDP, torch.compile, checkpoint wrappers), not by the model."""


def model_fqn(name: str) -> str:
    """`name` without wrapper segments: the FQN the unwrapped model gives the tensor."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def full_local_state(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """{model FQN: full CPU tensor} of every parameter and persistent buffer of `parts`; a collective over
    each DTensor's mesh (every rank holding the same parts must call it)."""
    from torch.distributed.tensor import DTensor

    state: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, tensor in _persistent_tensors(part):
            fqn = model_fqn(name)
            if fqn in state:
                continue
            value = tensor.detach()
            if isinstance(value, DTensor):
                value = value.full_tensor()
            state[fqn] = value.cpu().clone()
    return state


def _persistent_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = list(module.named_parameters())
    for fqn, sub in module.named_modules():
        prefix = f"{fqn}." if fqn else ""
        out += [(prefix + n, b) for n, b in sub._buffers.items()
                if b is not None and n not in sub._non_persistent_buffers_set]
    return out


def save_hf(directory: str | Path, parallel: Any, *, merge: bool = False) -> Path | None:
    """Write the trained `parallel` model (an `executor.api.ParallelModel`) as an HF directory; call on
    every rank. Rank 0 writes and returns the directory; the other ranks return None. A PEFT plan writes
    its adapter and base (and with `merge` the merged model, `executor.peft_export`)."""
    state = full_local_state(parallel.parts)
    if parallel.plan.model.peft is not None and parallel.plan.model.peft.method == "qlora":
        from executor.peft_export import dequantized_base

        state = dequantized_base(state, parallel.parts)
    stages = tuple(parallel.stage_indices)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, stages)
    sender = everyone.index(stages) == dist.get_rank()  # the first rank holding these stages sends them
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state if sender else {}, gathered, dst=0)
    written = None
    if dist.get_rank() == 0:
        merged: dict[str, torch.Tensor] = {}
        for part in gathered or []:
            for fqn, value in part.items():
                merged.setdefault(fqn, value)
        written = write_hf_directory(directory, merged, parallel.plan, merge=merge)
    dist.barrier()
    return written


def export_dcp_checkpoint(checkpoint: str | Path, plan: Any, directory: str | Path) -> Path:
    """Convert a DCP checkpoint of `plan` (a step directory, or a `--checkpoint-dir` with `latest`) into an
    HF directory, in this process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from executor.checkpoint import latest_checkpoint

    path = Path(checkpoint)
    if not (path / ".metadata").is_file():
        path = latest_checkpoint(path)
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - any read failure is a bad checkpoint for the user
        raise SoapError(f"{path}: not a readable DCP checkpoint ({type(exc).__name__}: {exc})") from None
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.items() if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    if not state:
        raise SoapError(f"{path}: the checkpoint holds no model.* tensors; was it written by `soap execute`?")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return write_hf_directory(directory, {key[len("model."):]: value for key, value in state.items()}, plan)


def _meta_models(plan: Any) -> tuple[nn.Module, nn.Module]:
    """The plan's normalized meta model (what soap trains) and the HF model of its config and task (what
    is saved), both on the meta device."""
    import tracer

    from executor.model import build_meta_model

    template = build_meta_model(plan.model.config, plan.model.task)
    return template, tracer.build_model(tracer.resolve_spec(template.config, task=plan.model.task), device="meta")


def hf_state_dict(tensors: dict[str, torch.Tensor], template: nn.Module,
                  hf_model: nn.Module) -> dict[str, torch.Tensor]:
    """{HF key: tensor} from {soap FQN: full tensor}: `template`'s renames undone, tied copies dropped,
    checked against `hf_model` (module docstring, steps 1-3)."""
    from executor.model import tied_aliases

    expected = {k: v for k, v in hf_model.state_dict().items() if k not in tied_aliases(hf_model)}
    renames: dict[str, tuple[str, Any]] = getattr(template, "soap_checkpoint_keys", {})
    out: dict[str, torch.Tensor] = {}
    by_key: dict[str, list[tuple[str, Any]]] = {}
    for fqn, (key, transform) in renames.items():
        by_key.setdefault(key, []).append((fqn, transform))
    for key, pieces in by_key.items():
        if key not in expected:
            raise SoapError(f"cannot undo soap's rename into {key!r}: the HF model has no such tensor")
        if any(fqn not in tensors for fqn, _ in pieces):
            missing = next(fqn for fqn, _ in pieces if fqn not in tensors)
            raise SoapError(f"the trained model has no tensor {missing!r}; was it trained with this plan?")
        out[key] = _invert(pieces, tensors, expected[key].shape, key)
    renamed = set(renames)
    for fqn, value in tensors.items():
        if fqn not in renamed and fqn in expected:
            out[fqn] = value.contiguous()
    missing = sorted(set(expected) - set(out))
    if missing:
        raise SoapError(f"the trained model lacks {len(missing)} tensor(s) of the HF model, e.g. {missing[0]!r}; "
                        "was it trained with this plan?")
    for key, value in out.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise SoapError(f"{key}: trained shape {tuple(value.shape)}, the HF model's is "
                            f"{tuple(expected[key].shape)}; was it trained with this plan?")
    return out


def _invert(pieces: list[tuple[str, Any]], tensors: dict[str, torch.Tensor], shape: torch.Size,
            key: str) -> torch.Tensor:
    numel = shape.numel()
    probe = torch.arange(numel, dtype=torch.int64).reshape(shape)
    first = tensors[pieces[0][0]]
    flat = torch.empty(numel, dtype=first.dtype)
    covered = torch.zeros(numel, dtype=torch.bool)
    for fqn, transform in pieces:
        index = transform(probe).reshape(-1)
        flat[index] = tensors[fqn].reshape(-1).to(first.dtype)
        covered[index] = True
    if not bool(covered.all()):
        raise SoapError(f"cannot undo soap's rename into {key!r}: its pieces do not cover the HF tensor")
    return flat.reshape(shape)


def write_hf_directory(directory: str | Path, tensors: dict[str, torch.Tensor], plan: Any, *,
                       merge: bool = False) -> Path:
    """Write `config.json` and `model.safetensors` of `tensors` ({soap FQN: full tensor}, trained with
    `plan`) into `directory`; a PEFT plan's adapter, base and (`merge`) merged model instead
    (`executor.peft_export`)."""
    if plan.model.peft is not None:
        from executor.peft_export import write_peft_directory

        return write_peft_directory(directory, tensors, plan, merge=merge)
    template, hf_model = _meta_models(plan)
    return write_model(directory, hf_state_dict(tensors, template, hf_model), template.config, hf_model)


def write_model(directory: str | Path, state: dict[str, torch.Tensor], hf_config: Any, hf_model: nn.Module) -> Path:
    """Write `state` ({HF key: tensor}) as `config.json` and `model.safetensors` into `directory`."""
    from safetensors.torch import save_file

    from tracer.files import permissions_for_new_file, write_atomic

    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SoapError(f"cannot create {root}: {exc.strerror}") from None
    config = hf_config.to_dict()
    config["use_cache"] = True
    config["architectures"] = [type(hf_model).__name__]
    config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    tmp = root / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, permissions_for_new_file(root / "model.safetensors"))  # save_file makes it owner-only
    tmp.replace(root / "model.safetensors")
    write_atomic(root / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n", what="--save-hf")
    return root
