"""Run records from outside soap: what `soap calibrate --from-runs` reads besides soap's own runs log.

A user's cluster logs, a benchmark table, a paper: one record per training configuration that ran, with
what it measured. A file is either JSON Lines (one record per line) or one JSON object whose `rows` are the
records and whose other keys (`stack`, `cluster`, `source`, `memory_kind`, `sdpa_backend`) are defaults for every
row: the layout of `../shared/published-runs/`. Unknown keys are kept and ignored (notes, sources, releases).

    {"name": "Llama 3.1 8B BF16 8xH100 fsdp8",          # how errors and fitted sources name the run
     "model": "llama-3-8b",                              # a preset, a config.json path, an HF config as a
                                                         # dict ({"model_type": "llama", ...}), or the short
                                                         # form {"hidden", "ffn", "layers", "heads",
                                                         # "kv_heads", "vocab", "mlp"} of published tables
     "cluster": "grand-teton-h100",                      # a soap cluster profile (or --cluster)
     "gpus": 8, "tp": 1, "pp": 1, "cp": 1, "ep": null, "dp": 8,
     "zero": 3, "vp": null, "pp_schedule": null,         # null: not stated (see below)
     "micro_batch": 2, "global_batch": 16, "grad_accum": null, "seq": 8192,
     "precision": "bf16", "recompute": "selective", "torch_compile": false,
     "tokens_per_s_per_gpu": 5762, "step_time_s": null,  # at least one; the other follows
     "memory_gib": 82.4, "memory_kind": "reserved",      # peak per GPU: the allocator's reserved bytes
                                                         # (torch.cuda.max_memory_reserved, what runs out
                                                         # first) or its allocated bytes
     "stack": "torch-native",                            # the software that ran it
     "sdpa_backend": null}                               # its attention kernel where stated (see the field)

`null` is "not stated". A stated value is pinned as published; an unstated one falls back to the stack's
documented default where it has one (`STACK_DEFAULTS`: NeMo / Megatron-Core runs use the distributed
optimizer, ZeRO-1, and checkpoint nothing unless told) and is otherwise left to soap's search, which picks
the fastest choice that fits, as a tuned published run would have. `fsdp` (torchtitan's
data_parallel_shard_degree) stands for dp with ZeRO-3 when `dp` and `zero` are absent.

`soap`'s own predictions are for its executor, the torch-native stack; a record of another stack
(`nemo-te`: Transformer Engine's fused kernels) is fitted with a stack factor of its own
(`executor.validation.external`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tracer.errors import SoapError

TORCH_NATIVE = "torch-native"
STACK_DEFAULTS: dict[str, dict[str, Any]] = {
    "nemo-te": {"zero": 1, "recompute": "none"},
}
"""Values a stack uses when a record leaves them unstated. nemo-te: NeMo 2.0's LLM recipes set
`use_distributed_optimizer=True` (Megatron-Core's distributed optimizer shards optimizer state: ZeRO-1) and
leave activation recompute off unless `recompute_granularity` is set (NeMo 2.0 recipes, llm/recipes/*.py)."""
FILE_DEFAULTS = ("stack", "cluster", "memory_kind", "sdpa_backend")
SHORT_FORM_KEYS = {"hidden", "ffn", "layers", "heads", "vocab"}


class RunRecord(BaseModel):
    """One published or logged training configuration and what it measured (module docstring)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str
    model: str | dict[str, Any]
    gpus: int = Field(gt=0)
    seq: int = Field(gt=0)
    micro_batch: int = Field(gt=0)
    precision: Literal["fp32", "tf32", "fp16", "bf16", "fp8"]
    cluster: str | None = None
    tp: int | None = Field(default=None, gt=0)
    pp: int | None = Field(default=None, gt=0)
    cp: int | None = Field(default=None, gt=0)
    ep: int | None = Field(default=None, gt=0)
    dp: int | None = Field(default=None, gt=0)
    fsdp: int | None = Field(default=None, gt=0)
    zero: Literal[0, 1, 2, 3] | None = None
    vp: int | None = Field(default=None, gt=0)
    pp_schedule: str | None = None
    global_batch: int | None = Field(default=None, gt=0)
    grad_accum: int | None = Field(default=None, gt=0)
    recompute: Literal["none", "selective", "full"] | None = None
    torch_compile: bool | None = None
    offload: bool = False
    """Optimizer state and step on the host (published runs say so when they do)."""
    tokens_per_s_per_gpu: float | None = Field(default=None, gt=0)
    step_time_s: float | None = Field(default=None, gt=0)
    memory_gib: float | None = Field(default=None, gt=0)
    memory_kind: Literal["reserved", "allocated"] = "reserved"
    stack: str = TORCH_NATIVE
    cp_attention: Literal["ring", "all-gather"] = "ring"
    """How its context-parallel attention ran (`costmodel.context_attention`, priced so): a load-balanced ring, as
    every published stack runs it (Megatron-Core and Transformer Engine, torch's `context_parallel` under
    torchtitan), or soap's executor's all-gather layout; no effect at cp 1."""
    sdpa_backend: Literal["flash_attention", "efficient_attention", "cudnn_attention", "math"] | None = None
    """The kernel the run's attention ran, in `torch.nn.attention.SDPBackend`'s names, where it is not the one soap's
    executor runs on that device today: the fit gives a stated backend a multiplier of its own over the unstated
    runs' attention (`executor.validation.external`, `attention/<backend>`). Which kernel torch's SDPA dispatches to
    changes with its release: soap's own H100 runs (torch 2.11) ran cuDNN's sm90 flash kernels
    (`benchmarks/data/h100-2026-11-26*` traces), where torch of late 2024, by its release notes, ran its own
    FlashAttention-2."""

    @model_validator(mode="after")
    def _measured(self) -> RunRecord:
        if self.tokens_per_s_per_gpu is None and self.step_time_s is None:
            raise ValueError("needs tokens_per_s_per_gpu or step_time_s (what the run measured)")
        return self

    def stated(self, key: str) -> Any:
        """The record's value for `key`, else its stack's default, else None (the search decides)."""
        value = getattr(self, key)
        return STACK_DEFAULTS.get(self.stack, {}).get(key) if value is None else value

    @property
    def data_parallel(self) -> int:
        dp = self.dp or self.fsdp
        if dp is None:
            known = (self.tp or 1) * (self.pp or 1) * (self.cp or 1)
            dp = self.gpus // known
        return dp

    @property
    def batch(self) -> int:
        """Global batch in sequences: as stated, else one micro-batch (times grad_accum) per data-parallel rank."""
        return self.global_batch or self.data_parallel * self.micro_batch * (self.grad_accum or 1)

    @property
    def measured_step_s(self) -> float:
        if self.step_time_s is not None:
            return self.step_time_s
        return self.batch * self.seq / (self.tokens_per_s_per_gpu * self.gpus)

    @property
    def measured_tokens_per_s_per_gpu(self) -> float:
        if self.tokens_per_s_per_gpu is not None:
            return self.tokens_per_s_per_gpu
        return self.batch * self.seq / (self.step_time_s * self.gpus)

    def pins(self) -> dict[str, Any]:
        """The planner keywords (`planner.api.plan_report`) that pin this configuration as published."""
        zero = self.stated("zero")
        if zero is None and self.fsdp is not None and self.dp is None:
            zero = 3
        pins: dict[str, Any] = {
            "gpus": self.gpus, "seq_len": self.seq, "micro_batch": self.micro_batch, "precision": self.precision,
            "global_batch": self.batch, "tp": self.tp or 1, "pp": self.pp or 1, "cp": self.cp or 1,
            "dp": self.data_parallel, "zero": zero, "ep": self.ep, "virtual_stages": self.vp,
            "schedule": self.pp_schedule, "recompute": self.stated("recompute"), "compile": self.torch_compile,
            "offload": self.offload,
        }
        if self.grad_accum is not None and (self.pp or 1) == 1:
            pins["grad_accum"] = self.grad_accum
        return {k: v for k, v in pins.items() if v is not None}

    def model_spec(self) -> Any:
        """What the planner takes as MODEL: the preset or path as given, or an HF config built from the dict."""
        if isinstance(self.model, str):
            return self.model
        return hf_config(self.model, seq=self.seq)


def hf_config(model: dict[str, Any], *, seq: int) -> Any:
    """An HF PretrainedConfig from an inline dict: HF's own fields (with `model_type`), or the short form of
    published tables (a llama-style decoder; `mlp` naming "squared-relu" makes it Nemotron's non-gated MLP;
    `tie_word_embeddings` as stated, untied when absent)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in model.items() if k not in ("name", "arch_source")}
    if "model_type" in fields:
        model_type = fields.pop("model_type")
        try:
            return AutoConfig.for_model(model_type, **fields)
        except ValueError as err:
            raise SoapError(f"model_type {model_type!r}: {err}") from None
    missing = SHORT_FORM_KEYS - set(fields)
    if missing:
        raise SoapError(f"the model needs `model_type` (an HF config) or the short form's {', '.join(sorted(missing))}")
    common = dict(hidden_size=fields["hidden"], intermediate_size=fields["ffn"], num_hidden_layers=fields["layers"],
                  num_attention_heads=fields["heads"], num_key_value_heads=fields.get("kv_heads", fields["heads"]),
                  vocab_size=fields["vocab"], max_position_embeddings=max(seq, 4096),
                  tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)))
    mlp = str(fields.get("mlp", "gated-silu"))
    if "squared-relu" in mlp:
        return AutoConfig.for_model("nemotron", hidden_act="relu2", **common)
    if mlp not in ("gated-silu", "swiglu"):
        raise SoapError(f"the short form's mlp {mlp!r} is not known; give an HF config with model_type instead")
    return AutoConfig.for_model("llama", hidden_act="silu", **common)


@dataclass(frozen=True)
class RecordFile:
    path: Path
    records: tuple[RunRecord, ...]
    source: str | None


def read_records(path: str | Path, *, cluster: str | None = None, stack: str | None = None) -> RecordFile:
    """Every record of a JSON or JSONL file, with the file's defaults (and `cluster`/`stack` where neither the
    row nor the file states one) filled in. A bad record is one SoapError naming the file, the row and the field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise SoapError(f"cannot read run records {path}: {err.strerror or err}") from None
    source = None
    try:
        data = json.loads(text)
        rows = data.get("rows") if isinstance(data, dict) else data
        defaults = {k: data[k] for k in FILE_DEFAULTS if isinstance(data, dict) and data.get(k) is not None}
        source = data.get("source") if isinstance(data, dict) else None
        if isinstance(data, dict) and rows is None:
            rows = [data]
    except json.JSONDecodeError:
        defaults, rows = {}, []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise SoapError(f"{path}:{number}: not JSON ({err.msg})") from None
    if not isinstance(rows, list) or not rows:
        raise SoapError(f"{path}: no run records (expected JSON lines, or a JSON object with `rows`)")
    fallback = {k: v for k, v in (("cluster", cluster), ("stack", stack)) if v is not None}
    records = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise SoapError(f"{path}: row {index + 1} is not a JSON object")
        row = {**fallback, **defaults, **{k: v for k, v in row.items() if v is not None or k not in defaults}}
        try:
            records.append(RunRecord.model_validate(row))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "record"
            name = row.get("name", f"row {index + 1}")
            raise SoapError(f"{path}: {name}: {where}: {first['msg']}") from None
    return RecordFile(path=path, records=tuple(records), source=source)
