"""Exports: a soap `Plan` written as the configuration of a tool users already run.

Formats (one module each): `accelerate` (config YAML plus `TrainingArguments` fields), `torchtitan`
(job TOML), `deepspeed` (ds_config JSON) and `megatron` (Megatron-LM / NeMo arguments). Each module
has two pure functions:
- `adjust(plan) -> Adjustment`: the parallelism fields the target cannot express, changed to the
  nearest ones it can (`planner.exports.layout`), and one phrase per change;
- `render(plan, path) -> dict[path, text]`: the files, from a plan the target can express.
`planner.exports.nearest.nearest_plan` turns an `Adjustment` into a complete `Plan` (re-simulated, so
its step time can be shown beside soap's). Writing the files and tracing the model is the CLI's job
(`soap/commands/export.py`). Imports: costmodel, tracer and planner.plan; never executor.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from tracer.errors import SoapError

FORMATS: tuple[str, ...] = ("accelerate", "torchtitan", "deepspeed", "megatron")
DEFAULT_FILES = {
    "accelerate": "accelerate_config.yaml",
    "torchtitan": "torchtitan.toml",
    "deepspeed": "ds_config.json",
    "megatron": "megatron_args.txt",
}


def format_module(name: str):
    """The module of export format `name` (`planner.exports.<name>`)."""
    if name not in FORMATS:
        raise SoapError(f"unknown export format {name!r}; choose one of {', '.join(FORMATS)} "
                        "(as FORMAT or FORMAT=PATH)")
    return import_module(f"planner.exports.{name}")


def parse_export(spec: str, *, directory: str | Path = ".") -> tuple[str, Path]:
    """`FORMAT[=PATH]` as (format, path); without PATH the format's default file name in `directory`."""
    name, sep, path = spec.partition("=")
    name = name.strip().lower()
    format_module(name)
    if sep and not path:
        raise SoapError(f"--export {spec!r} names no path; write {name}=PATH or just {name}")
    return name, Path(path) if path else Path(directory) / DEFAULT_FILES[name]
