"""MODEL -> ModelSpec: what the user named, resolved to an HF config (or a module) and a training task.

MODEL may be
- a shipped preset name (`tracer/presets/<name>.json`, the published `config.json` of that model);
- a path to a `config.json`, or to a directory holding one;
- a Hub id, resolved through `AutoConfig.from_pretrained` (from the local cache when offline);
- a `transformers.PretrainedConfig`;
- an `nn.Module` instance or a zero-argument factory returning one (Python API only).

The task defaults from `config.architectures` (`...ForCausalLM`/`...LMHeadModel` -> causal-lm,
`...ForMaskedLM` -> masked-lm, `...ForSequenceClassification` -> seq-cls, `...ForConditionalGeneration`
of an encoder-decoder or `...ForSeq2SeqLM` -> seq2seq-lm, `...ForImageClassification` -> image-cls);
failing that, seq2seq-lm for encoder-decoders, image-cls for vision encoders, masked-lm for text
encoders and causal-lm for decoders.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracer.errors import SoapError
from tracer.files import read_json

PRESET_DIR = Path(__file__).resolve().parent / "presets"
TASKS = ("causal-lm", "masked-lm", "seq-cls", "seq2seq-lm", "image-cls")


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: enough to build it on any device and to trace it."""

    name: str
    """What the user called it: preset name, path, Hub id or the module's class name."""
    source: str
    """Where it came from: `preset`, `file`, `hub`, `config` or `module`."""
    config: Any
    """The `transformers.PretrainedConfig` (None for a plain module without `.config`)."""
    task: str
    """One of TASKS."""
    module: Any = None
    """An `nn.Module` instance or factory when the user passed one; None to build from `config`."""
    trust_remote_code: bool = False
    """Whether building may run code shipped with the config (`auto_map`)."""


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def resolve_spec(model: Any, *, task: str | None = None, trust_remote_code: bool = False) -> ModelSpec:
    """Resolve MODEL (see the module docstring) and its task; bad input raises SoapError."""
    if isinstance(model, ModelSpec):
        return model if task is None else _with_task(model, task)
    if task is not None and task not in TASKS:
        raise SoapError(f"unsupported task {task!r}; choose one of {', '.join(TASKS)}")
    import torch.nn as nn  # deferred: resolving a preset needs no torch

    if isinstance(model, nn.Module) or (callable(model) and not isinstance(model, (str, Path, type(None)))):
        return _module_spec(model, task, trust_remote_code)
    if isinstance(model, Path):
        model = str(model)
    if not isinstance(model, str):
        from transformers import PretrainedConfig

        if isinstance(model, PretrainedConfig):
            return _finish(type(model).__name__, "config", model, task, trust_remote_code)
        raise SoapError(f"cannot trace a {type(model).__name__}; pass a preset name, a config path, a Hub id, "
                        "a PretrainedConfig or an nn.Module")
    if not model.strip():
        raise SoapError("empty MODEL; pass a preset name (e.g. llama-3-8b), a config.json path or a Hub id")
    if _is_file(PRESET_DIR / f"{model}.json") and "/" not in model:
        return _finish(model, "preset", _config_from_file(PRESET_DIR / f"{model}.json", trust_remote_code),
                       task, trust_remote_code)
    try:
        path = Path(model).expanduser()
        is_dir, is_file = path.is_dir(), path.is_file()
    except (OSError, ValueError, RuntimeError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise SoapError(f"unknown model {model[:60]!r}: not a preset and not a usable path ({reason}); pass a "
                        "preset name, a config.json path or a Hub id") from None
    if is_dir:
        if not (path / "config.json").is_file():
            raise SoapError(f"directory {model} holds no config.json; point MODEL at an HF model directory")
        return _finish(model, "file", _config_from_file(path / "config.json", trust_remote_code), task,
                       trust_remote_code)
    if is_file:
        return _finish(model, "file", _config_from_file(path, trust_remote_code), task, trust_remote_code)
    if _looks_like_path(model):
        raise SoapError(f"no such file or directory: {model}")
    return _finish(model, "hub", _config_from_hub(model, trust_remote_code), task, trust_remote_code)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _looks_like_path(model: str) -> bool:
    return model.endswith(".json") or model.startswith((".", "/", "~")) or model.count("/") > 1


def _config_from_file(path: Path, trust_remote_code: bool) -> Any:
    data = read_json(path, what="config", fix="fix or re-download it")
    if not isinstance(data, dict) or "model_type" not in data:
        raise SoapError(f"{path} has no `model_type`; it must be a Hugging Face config.json")
    _check_remote_code(data, str(path), trust_remote_code)
    from transformers import AutoConfig

    if data.get("auto_map"):  # trusted remote code: let transformers import the config class beside the file
        if path.name != "config.json":
            raise SoapError(f"{path}: a remote-code config must be the config.json of its model directory")
        try:
            return AutoConfig.from_pretrained(str(path.parent), trust_remote_code=True, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - the shipped code is the user's
            raise SoapError(f"{path}: cannot load its remote-code config ({_first_line(exc)})") from None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise SoapError(f"{path}: model_type {model_type!r} is unknown to this transformers; upgrade transformers "
                        "or pass --trust-remote-code with a config that ships its code")
    try:
        return AutoConfig.for_model(**data)
    except Exception as exc:  # noqa: BLE001 - any config error is the user's file
        raise SoapError(f"{path}: invalid {model_type} config ({_first_line(exc)})") from None


def _config_from_hub(model_id: str, trust_remote_code: bool) -> Any:
    """The local cache first; the Hub only when not offline (HF_HUB_OFFLINE unset) and reachable."""
    import os

    from transformers import AutoConfig

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    config, where = None, "offline (HF_HUB_OFFLINE=1) and not in the local cache"
    for local_only in (True,) if offline else (True, False):
        if not local_only and not _hub_reachable():
            # huggingface_hub retries a dead network five times (about 25 s, a warning each) before failing
            where = f"not in the local cache, and the Hub ({_hub_host()}) cannot be reached from here"
            break
        try:
            config = AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code,
                                                local_files_only=local_only)
            break
        except ValueError as exc:
            if "trust_remote_code" in str(exc):
                raise SoapError(f"{model_id} needs remote code; pass --trust-remote-code if you trust it") from None
            if not local_only:
                raise SoapError(f"cannot resolve {model_id!r}: {_first_line(exc)}") from None
        except Exception:  # noqa: BLE001 - unknown ids and no network surface as OSError or HF errors
            where = "not found in the local cache or on the Hub"
    if config is None:
        raise SoapError(
            f"unknown model {model_id!r}: not a preset ({', '.join(preset_names())}), not a local path, and "
            f"{where}; pass a config.json path or a preset name"
        )
    _check_remote_code(config.to_dict(), model_id, trust_remote_code)
    return config


def _hub_host() -> str:
    import os
    from urllib.parse import urlparse

    return urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub's endpoint opens within `timeout_s` (name lookup included)."""
    import os
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((_hub_host(), port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _check_remote_code(data: dict, where: str, trust_remote_code: bool) -> None:
    if data.get("auto_map") and not trust_remote_code:
        raise SoapError(f"{where} needs remote code (auto_map); pass --trust-remote-code if you trust it")


def _module_spec(model: Any, task: str | None, trust_remote_code: bool) -> ModelSpec:
    import torch.nn as nn

    instance = model if isinstance(model, nn.Module) else None
    config = getattr(instance, "config", None) if instance is not None else None
    name = type(instance).__name__ if instance is not None else getattr(model, "__name__", "module")
    if config is not None:
        resolved = task or _default_task(config, getattr(instance, "__class__", type(None)).__name__)
    else:
        resolved = task or "causal-lm"
    return ModelSpec(name=name, source="module", config=config, task=resolved, module=model,
                     trust_remote_code=trust_remote_code)


def _finish(name: str, source: str, config: Any, task: str | None, trust_remote_code: bool) -> ModelSpec:
    resolved = task or _default_task(config)
    _check_task_fits(config, resolved, name)
    return ModelSpec(name=name, source=source, config=config, task=resolved, trust_remote_code=trust_remote_code)


def _with_task(spec: ModelSpec, task: str) -> ModelSpec:
    if task not in TASKS:
        raise SoapError(f"unsupported task {task!r}; choose one of {', '.join(TASKS)}")
    if spec.config is not None and spec.module is None:
        _check_task_fits(spec.config, task, spec.name)
    return ModelSpec(spec.name, spec.source, spec.config, task, spec.module, spec.trust_remote_code)


_ARCH_SUFFIXES = (
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForMaskedLM", "masked-lm"),
    ("ForSequenceClassification", "seq-cls"),
    ("ForSeq2SeqLM", "seq2seq-lm"),
    ("ForImageClassification", "image-cls"),
)


def _default_task(config: Any, class_name: str | None = None) -> str:
    names = [class_name] if class_name else list(getattr(config, "architectures", None) or [])
    for arch in names:
        if arch.endswith("ForConditionalGeneration"):
            return "seq2seq-lm" if getattr(config, "is_encoder_decoder", False) else "causal-lm"
        for suffix, task in _ARCH_SUFFIXES:
            if arch.endswith(suffix):
                return task
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq-lm"
    from transformers.models.auto import modeling_auto as ma

    model_type = getattr(config, "model_type", "")
    if model_type in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "masked-lm"
    if model_type in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal-lm"
    if model_type in ma.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return "image-cls"
    return "causal-lm"


def auto_class_for(task: str) -> Any:
    """The transformers Auto class that builds a model with the head `task` trains."""
    import transformers

    return getattr(transformers, {
        "causal-lm": "AutoModelForCausalLM",
        "masked-lm": "AutoModelForMaskedLM",
        "seq-cls": "AutoModelForSequenceClassification",
        "seq2seq-lm": "AutoModelForSeq2SeqLM",
        "image-cls": "AutoModelForImageClassification",
    }[task])


def _check_task_fits(config: Any, task: str, name: str) -> None:
    if getattr(config, "auto_map", None):
        return  # remote-code models register their own classes; building will tell
    mapping = auto_class_for(task)._model_mapping
    if type(config) not in mapping:
        raise SoapError(f"{name} ({config.model_type}) has no {task} head in transformers; "
                        f"choose another --task (e.g. {_default_task(config)})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
