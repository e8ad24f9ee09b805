"""What the planner knows about MODEL before tracing, resolved without importing transformers when it can.

A preset name or a local config.json is read as plain JSON (`ModelRef.config` is a namespace over it):
its dimensions validate the pins at once, plan.json records it verbatim, and the model is traced by
name with the tracer's on-disk cache, so a repeated `soap plan` imports neither torch nor transformers.
Anything else (a Hub id, a PretrainedConfig, an nn.Module, an image model) goes through
`tracer.spec.resolve_spec`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tracer.errors import SoapError
from tracer.ir import OpGraph
from tracer.peft import PeftSpec


@dataclass(frozen=True)
class ModelRef:
    name: str
    source: str
    """preset, file, hub or module (plan.json's vocabulary)."""
    config: Any
    """A PretrainedConfig, a namespace over the raw config.json, or None for a plain module."""
    config_json: dict[str, Any]
    """The config as JSON, taken before tracing (building a model mutates an HF config, e.g. its
    dtype, so plan.json records the config as the user gave it)."""
    spec: Any = None
    """The resolved `tracer.spec.ModelSpec`, or None when MODEL was read as a file."""
    model: Any = None
    """What the user passed, for tracing by name."""
    peft: PeftSpec | None = None
    """LoRA/QLoRA settings: the model is traced (and trained) with adapters (tracer/peft.py)."""

    def trace(self, *, task: str | None, seq_len: int, dtype: str = "float32") -> OpGraph:
        import tracer

        if self.spec is None:
            return tracer.trace(self.model, task=task, batch=1, seq_len=seq_len, persistent_cache=True, dtype=dtype,
                                peft=self.peft)
        return tracer.trace(self.spec, task=self.spec.task, batch=1, seq_len=seq_len, dtype=dtype, peft=self.peft)


def _config_file(model: Any) -> tuple[Path, str] | None:
    if not isinstance(model, (str, Path)):
        return None
    from tracer.spec import PRESET_DIR

    name = str(model)
    for path, source in ((PRESET_DIR / f"{name}.json", "preset"), (Path(name).expanduser() / "config.json", "file"),
                         (Path(name).expanduser(), "file")):
        try:
            if path.is_file():
                return path, source
        except OSError:  # a name too long for a file: not a file, so resolve_spec names the problem
            return None
    return None


def _normalized(data: Any) -> dict[str, Any]:
    return json.loads(json.dumps(data, sort_keys=True, default=str))


def model_ref(model: Any, *, task: str | None, trust_remote_code: bool = False) -> ModelRef:
    found = _config_file(model)
    if found is not None:
        path, source = found
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SoapError(f"{path} is not valid JSON ({exc}); point MODEL at a Hugging Face config.json") from None
        if isinstance(raw, dict) and "model_type" in raw and "image_size" not in raw and not raw.get("auto_map"):
            return ModelRef(name=str(model), source=source, config=SimpleNamespace(**raw),
                            config_json=_normalized(raw), model=model)
    from tracer.spec import resolve_spec

    spec = resolve_spec(model, task=task, trust_remote_code=trust_remote_code)
    config_json = _normalized(spec.config.to_dict()) if spec.config is not None else {}
    source = spec.source if spec.source in ("preset", "file", "hub") else "module"
    return ModelRef(name=spec.name, source=source, config=spec.config, config_json=config_json, spec=spec, model=model)
