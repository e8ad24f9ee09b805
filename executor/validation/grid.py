"""A measured grid of one model's configurations on one cluster: load it, price each row as published, and
judge the ranking (the Ultra-Scale Playbook's 1B grid, ../shared/published-runs/nanotron-playbook-1b-h100.json).

A grid file is one JSON object: `model` (the short form of `executor.validation.run_records.hf_config`),
`stack`, `rows` (configurations that ran: `tokens_per_s_per_gpu`, `memory_gb` as published) and
`crashed_or_oom.rows` (configurations that did not run, no measurement). `load_grid` reads both as
`RunRecord`s; a crashed row is built without validation (it has nothing measured: `measured_*` of it fail).

Pricing (`price_row`): the record planned as published (`RunRecord.pins`, no memory limit, so a configuration
soap thinks too big is still priced; a pipeline with fewer micro-batches than stages as GPipe: 1F1B's
warm-up then holds every micro-batch, the same timeline; a stack that accumulates gradients locally across
micro-batches, `LOCAL_ACCUMULATION_STACKS`, gathers ZeRO-3 parameters per tensor, `TENSOR_GATHER_STACKS`,
holds a 16-bit model, `HALF_MODEL_STACKS`, or runs Megatron's softmax, `MEGATRON_SOFTMAX_STACKS`, priced so:
`as_run`) and simulated on the given cluster: step
time, tokens/s per GPU and the simulated peak memory (allocated, GiB). Graphs are cached per (model, seq,
precision, the regime's trace dtype: `graph_key`) in `graphs`.

Ranking (`group_scores`), per group of rows (a node count):
- Spearman's rank correlation of predicted against measured tokens/s per GPU;
- pick/best = measured tokens/s of the row predicted fastest / the best measured tokens/s in the group:
  what a user who ran soap's choice would get, against what the best configuration in the grid gave.
`geometric_mean` summarises either over groups.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from costmodel.profiles import ClusterSpec
from executor.validation.run_records import RunRecord
from tracer.errors import SoapError

GB = 1e9


def _record(row: dict[str, Any], model: dict[str, Any], stack: str, cluster: str | None,
            validate: bool) -> RunRecord:
    fields = {k: v for k, v in row.items() if v is not None}  # unknown keys (nodes, published_mfu_pct) are kept
    fields.update(model=model, stack=stack, cluster=row.get("cluster") or cluster)
    if row.get("memory_gb"):
        fields["memory_gib"] = row["memory_gb"] * GB / 2**30
    if not validate:
        defaults = {name: f.default for name, f in RunRecord.model_fields.items() if not f.is_required()}
        return RunRecord.model_construct(**{**defaults, **fields})
    return RunRecord.model_validate(fields)


def load_grid(path: str | Path, *, cluster: str | None = None) -> tuple[list[RunRecord], list[RunRecord]]:
    """(rows that ran, rows that crashed or ran out of memory) of a grid file (module docstring), every row
    with the file's model and stack; `cluster` names the soap cluster profile for rows that state none. The
    published `memory_gb` becomes `memory_gib` (GB / 1.074; the grid does not say allocated or reserved)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SoapError(f"cannot read grid {path}: {err}") from None
    if not isinstance(data, dict) or "model" not in data or not data.get("rows"):
        raise SoapError(f"{path}: a grid needs `model` and `rows`")
    stack = data.get("stack", "torch-native")
    crashed = (data.get("crashed_or_oom") or {}).get("rows", [])
    ran = [_record(row, data["model"], stack, cluster, True) for row in data["rows"]]
    return ran, [_record(row, data["model"], stack, cluster, False) for row in crashed]


LOCAL_ACCUMULATION_STACKS = ("nanotron", "megatron-deepspeed", "megatron-lm", "nemo-te")
"""Stacks whose data parallelism (ZeRO 0/1) accumulates gradients locally and syncs once per step, TP or not
(Megatron's and nanotron's own DP); soap's executor runs DP beside TP on FSDP2, which syncs every micro-batch."""


FIXED_TP_STACKS = ("nanotron",)
"""Stacks whose tensor parallelism is a fixed module placement (nanotron's own column/row-parallel linears with
sequence parallelism, Megatron's layout), priced with the Megatron default placement (`Strategy.op_splits` empty):
the planner's per-op split search (`planner.block_splits`) is soap's executor's, not theirs. (The Megatron-family
stacks run the same layout; their grids were priced before this and are not re-checked here.)"""


class StackPlan:
    """A plan as another stack runs it: the plan's own strategy with `train` fields replaced, and without the
    searched per-op splits where `megatron_tp` (simulated through `executor.validation.refit.simulate_on`, which
    reads `strategy()` and the plan's stages)."""

    def __init__(self, plan: Any, megatron_tp: bool = False, **train: Any) -> None:
        self.plan, self.megatron_tp, self.train = plan, megatron_tp, train

    def __getattr__(self, name: str) -> Any:
        if name == "plan":  # not set yet (unpickling builds the object before its __dict__): no recursion
            raise AttributeError(name)
        return getattr(self.plan, name)

    def strategy(self) -> Any:
        from dataclasses import replace

        strategy = self.plan.strategy()
        strategy = replace(strategy, train=replace(strategy.train, **self.train))
        return replace(strategy, op_splits=()) if self.megatron_tp else strategy


HALF_MODEL_STACKS = ("deepspeed-2021", "megatron-lm", "nanotron", "nemo-te")
"""Stacks whose fp16/bf16 runs hold the model in that type, fp32 master weights in the optimizer, no autocast
(`TrainingConfig.half_model`): Megatron-LM's `--fp16` (Float16Module), DeepSpeed's fp16 engine, nanotron
(its model built in the config's `dtype`, bf16 for the Playbook, with fp32 gradient accumulation and master
weights in the optimizer), and NeMo's Megatron-Core (Float16Module, fp32 main parameters in the distributed
optimizer; its fp8 runs hold the same bf16 model, Transformer Engine casting the GEMMs' operands). Priced as an
autocast run, a NeMo 8B row took autocast's casts of every Linear's input and weight (10% of its compute on the
datasheet H100), which Nemotron-4 15B's rows (FSDP2's bf16 regime) did not."""
TENSOR_GATHER_STACKS = ("deepspeed-2021",)
"""Stacks whose ZeRO-3 all-gathers each parameter tensor on its own, blocking compute, and again for a full
recompute (DeepSpeed's `partition_parameters._allgather_param` of 2021: `costmodel.param_gathers`, "tensor");
soap's executor gathers per block (FSDP2)."""


MEGATRON_SOFTMAX_STACKS = ("megatron-deepspeed",)
"""Stacks whose attention is Megatron's baddbmm, `FusedScaleMaskSoftmax` and bmm, the softmax falling back to
unfused PyTorch ops where its kernel is unavailable (`costmodel.fused_softmax`); soap's executor runs SDPA."""


CROSS_ENTROPY_BY_STACK = {"torch-native": "upcast", "nanotron": "megatron", "megatron-deepspeed": "megatron",
                          "megatron-lm": "megatron", "nemo-te": "megatron", "deepspeed-2021": "megatron"}
"""Each stack's loss (`TrainingConfig.cross_entropy`): torchtitan's `cross_entropy(pred.float())` (upcast);
Megatron's and nanotron's vocab-parallel cross-entropy, an fp32 softmax made and saved in place (megatron).
Only its memory differs (`costmodel.memory_activations.loss_tensors`)."""


FP8_CASTS_BY_STACK = {"nemo-te": "transformer-engine"}
"""Stacks whose fp8 GEMMs take another library's casts (`TrainingConfig.fp8_casts`): NeMo / Megatron-Core runs fp8
through Transformer Engine (fused cast-transposes, delayed scaling, the weight cast once a step); the others,
torchao's (soap's executor)."""


def as_run(plan: Any, record: RunRecord) -> Any:
    """`plan` as `record`'s stack runs it (`LOCAL_ACCUMULATION_STACKS`, `TENSOR_GATHER_STACKS`,
    `HALF_MODEL_STACKS`, `FIXED_TP_STACKS`, `MEGATRON_SOFTMAX_STACKS`, `CROSS_ENTROPY_BY_STACK`,
    `FP8_CASTS_BY_STACK`, and its context-parallel attention, `RunRecord.cp_attention`), else the plan itself."""
    train: dict[str, Any] = {"cp_attention": record.cp_attention} if (getattr(record, "cp", None) or 1) > 1 else {}
    if record.stack in CROSS_ENTROPY_BY_STACK:
        train["cross_entropy"] = CROSS_ENTROPY_BY_STACK[record.stack]
    if record.stack in FP8_CASTS_BY_STACK:
        train["fp8_casts"] = FP8_CASTS_BY_STACK[record.stack]
    if record.stack in MEGATRON_SOFTMAX_STACKS:
        train["megatron_softmax"] = True
    if record.stack in LOCAL_ACCUMULATION_STACKS:
        train["accumulate_locally"] = True
    if record.stack in TENSOR_GATHER_STACKS:
        train["param_gather"] = "tensor"
    if record.stack in HALF_MODEL_STACKS:
        train["half_model"] = True
    megatron_tp = record.stack in FIXED_TP_STACKS
    return StackPlan(plan, megatron_tp, **train) if train or megatron_tp else plan


@dataclass(frozen=True)
class RowPrice:
    """One row as soap prices it on a cluster."""

    name: str
    step_s: float
    tokens_per_s_per_gpu: float
    peak_memory_gib: float
    """Simulated peak per GPU (allocated), the largest over pipeline stages."""
    plan: Any
    first_rank_memory_gib: float = 0.0
    """Simulated peak of pipeline rank 0 (the first stage), the rank whose memory nanotron logs (`log_memory`)."""


def graph_key(plan: Any, cluster: ClusterSpec) -> tuple:
    """The key of `plan`'s graph in `price_row`'s `graphs` cache: (config hash, seq, precision, the dtype it is
    traced at, cluster). The dtype is the plan's precision regime (`planner.regimes.regime_dtype`, what
    `trace_plan_model` traces at): bf16 under FSDP2's mixed precision, autocast over fp32 parameters under DDP,
    16-bit for a stack that holds a 16-bit model. Until 2026-11-26 the key left the regime out, and every row
    of a grid took the graph of the first row traced at its precision, whichever regime that row ran in."""
    from planner.regimes import regime_dtype

    strategy = plan.strategy()
    dtype = regime_dtype(strategy.dims, strategy.train, cluster.device)
    return plan.model.config_hash, plan.seq_len, plan.parallelism.precision, dtype, cluster.name


def price_row(record: RunRecord, cluster: ClusterSpec, *, graphs: dict | None = None) -> RowPrice:
    """Plan `record` as published on `cluster` and simulate it (module docstring)."""
    from executor.validation.refit import simulate_on, trace_plan_model
    from planner.api import plan_report

    pins = record.pins()
    if pins.get("pp", 1) > 1 and record.batch // (record.data_parallel * record.micro_batch) < pins["pp"]:
        pins["schedule"] = "GPipe"  # fewer micro-batches than stages: 1F1B's warm-up holds them all, GPipe's timeline
    try:
        report = plan_report(record.model_spec(), cluster=cluster, mem_limit_gib=1e6, **pins)
    except SoapError as err:
        raise SoapError(f"{record.name}: {err}") from None
    plan = as_run(report.plan, record)
    graphs = {} if graphs is None else graphs
    key = graph_key(plan, cluster)
    if key not in graphs:
        graphs[key] = trace_plan_model(plan, cluster)
    sim = simulate_on(plan, graphs[key], cluster)
    tokens = record.batch * record.seq / (sim.step_time_s * record.gpus)
    memory = max(m.at_peak.total for m in sim.memory) / 2**30
    first = next(m.at_peak.total for m in sim.memory if m.rank == 0) / 2**30
    return RowPrice(name=record.name, step_s=sim.step_time_s, tokens_per_s_per_gpu=tokens, peak_memory_gib=memory,
                    plan=plan, first_rank_memory_gib=first)


def prepare_row(record: RunRecord, cluster: ClusterSpec, *, graphs: dict | None = None) -> Any:
    """`record` priced on `cluster` and its step split into the parts `soap calibrate --from-runs` fits
    (`executor.validation.external.Prepared`)."""
    from executor.validation.external import Prepared, step_terms

    graphs = {} if graphs is None else graphs
    price = price_row(record, cluster, graphs=graphs)
    plan = price.plan
    graph = graphs[graph_key(plan, cluster)]
    parts, _ = step_terms(plan, graph, cluster)
    return Prepared(record=record, plan=plan, graph=graph, cluster=cluster, parts=parts)


def spearman(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank); nan under 3 rows."""
    if len(predicted) < 3:
        return float("nan")
    a, b = _mean_ranks(predicted), _mean_ranks(measured)
    if a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def _mean_ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks 0..n-1, tied values sharing their mean rank (numpy only: scipy is no dependency)."""
    x = np.asarray(values, dtype=float)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    for value in np.unique(x):
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


@dataclass(frozen=True)
class GroupScore:
    group: str
    rows: int
    spearman: float
    pick_best: float
    picked: str
    best: str


def group_scores(records: Sequence[RunRecord], predicted: Sequence[float],
                 key: Callable[[RunRecord], Any] = lambda r: getattr(r, "nodes", r.gpus)) -> list[GroupScore]:
    """Per group (`key`, default the record's node count), rank correlation and pick/best (module docstring);
    `predicted` is tokens/s per GPU in the order of `records`."""
    groups: dict[Any, list[int]] = {}
    for i, record in enumerate(records):
        groups.setdefault(key(record), []).append(i)
    out = []
    for group, index in sorted(groups.items()):
        pred = [predicted[i] for i in index]
        meas = [records[i].measured_tokens_per_s_per_gpu for i in index]
        pick, best = int(np.argmax(pred)), int(np.argmax(meas))
        out.append(GroupScore(group=str(group), rows=len(index), spearman=spearman(pred, meas),
                              pick_best=meas[pick] / meas[best], picked=records[index[pick]].name,
                              best=records[index[best]].name))
    return out


def geometric_mean(values: Sequence[float]) -> float:
    kept = [v for v in values if v > 0 and math.isfinite(v)]
    return float(math.exp(np.mean(np.log(kept)))) if kept else float("nan")
