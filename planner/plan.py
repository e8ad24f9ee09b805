"""`Plan` and plan.json: a versioned, validated, self-contained record of one parallelization.

plan.json is read by people and by `soap execute` on another machine, so it holds everything:
the model config inline (with its hash), the cluster profile inline, the batch, the mesh, per-block and
per-op SOAP placements, pipeline stages and schedule, the training techniques, the predicted metrics
and the launch command. Loading validates every field (pydantic, `extra="forbid"`), refuses unknown
schema versions, and never pickles or evals. Saving is atomic (write a temporary file, then rename).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from costmodel.plan_rules import (compile_violation, executed_pipeline_violation, model_violation, optimizer_violation,
                                  peft_violation, recompute_violation)
from costmodel.strategy import (
    ATTENTION_IMPLS,
    CROSS_ENTROPY_IMPLS,
    MESH_DIM_NAMES,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    ParallelDims,
    Strategy,
    TrainingConfig,
)
from tracer.api import model_dims
from tracer.errors import SoapError
from tracer.files import write_atomic
from tracer.peft import PEFT_METHODS, PeftSpec

if TYPE_CHECKING:
    from costmodel.profiles import ClusterSpec
    from costmodel.simulator.result import SimResult
    from tracer.ir import OpGraph

SCHEMA_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def config_hash(config: dict[str, Any]) -> str:
    """sha256 of the config's canonical JSON, so a tampered inline config is detected on load."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


class PeftRecord(_Strict):
    """`tracer.peft.PeftSpec` in plan.json."""

    method: Literal[PEFT_METHODS]  # type: ignore[valid-type]
    rank: int = Field(ge=1)
    alpha: float = Field(gt=0)
    targets: tuple[str, ...] = ()
    """Module names that get adapters; empty: peft's "all-linear"."""
    dropout: float = Field(default=0.0, ge=0, lt=1)

    @classmethod
    def of(cls, spec: PeftSpec | None) -> PeftRecord | None:
        return None if spec is None else cls(**spec.to_dict())


class ModelSpecRecord(_Strict):
    name: str
    """Preset name, path, Hub id, or a module's class name."""
    source: Literal["preset", "file", "hub", "module"]
    task: Literal["causal-lm", "masked-lm", "seq-cls", "seq2seq-lm"]
    config: dict[str, Any]
    """The HF config as `PretrainedConfig.to_dict()` gives it."""
    config_hash: str
    peft: PeftRecord | None = None
    """LoRA/QLoRA fine-tuning of this model (absent: every parameter trains)."""

    def peft_spec(self) -> PeftSpec | None:
        return None if self.peft is None else PeftSpec(**{**self.peft.model_dump(), "targets": tuple(self.peft.targets)})

    @model_validator(mode="after")
    def _hash_matches(self) -> ModelSpecRecord:
        if config_hash(self.config) != self.config_hash:
            raise ValueError("model.config_hash does not match model.config (the config was edited)")
        return self


class ClusterRecord(_Strict):
    name: str
    gpus: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    profile: dict[str, Any]
    """The cluster profile JSON inline (with its device profile), as costmodel loads it."""


class MeshRecord(_Strict):
    names: tuple[str, ...]
    degrees: tuple[int, ...]

    @model_validator(mode="after")
    def _check(self) -> MeshRecord:
        if self.names != MESH_DIM_NAMES:
            raise ValueError(f"mesh.names must be {list(MESH_DIM_NAMES)}")
        if len(self.degrees) != len(self.names) or any(d < 1 for d in self.degrees):
            raise ValueError("mesh.degrees must be one positive integer per mesh dimension")
        return self


class ParallelismRecord(_Strict):
    """The contract's `parallelism` object, plus the fields the executor needs."""

    dp: int = Field(ge=1)
    dp_replicate: int = Field(ge=1)
    dp_shard: int = Field(ge=1)
    zero: int = Field(ge=0, le=3)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    cp: int = Field(ge=1)
    ep: int = Field(default=1, ge=1)
    sequence_parallel: bool = False
    micro_batch: int = Field(ge=1)
    grad_accum: int = Field(ge=1)
    num_microbatches: int = Field(ge=1)
    schedule: Literal[SCHEDULES]  # type: ignore[valid-type]
    virtual_stages: int = Field(default=1, ge=1)
    recompute: Literal[RECOMPUTE]  # type: ignore[valid-type]
    precision: Literal[PRECISIONS]  # type: ignore[valid-type]
    optimizer: Literal[OPTIMIZERS]  # type: ignore[valid-type]
    offload_optimizer: bool = False
    attention: Literal[ATTENTION_IMPLS] = "sdpa"  # type: ignore[valid-type]
    compile: bool = False
    cross_entropy: Literal[CROSS_ENTROPY_IMPLS] = "upcast"  # type: ignore[valid-type]
    """The loss (`TrainingConfig.cross_entropy`, `executor.cross_entropy`). Absent: "upcast", the loss soap
    executed before the field existed, so that a plan written then runs and is priced as it ran. "megatron"
    (an export's nearest plan for Megatron-LM) is priced, not executed."""


class OpPlacement(_Strict):
    """One op's SOAP configuration, e.g. {"sample": 4, "parameter": 2}, and its TP style."""

    op: str
    """The op's name relative to its block instance, e.g. `self_attn.q_proj:linear`."""
    soap: dict[Literal["sample", "operator", "attribute", "parameter"], int]
    style: str | None = None
    """torch.distributed.tensor.parallel style for the op's module: colwise, rowwise, sequence_parallel,
    vocab_parallel (None: replicated or following its neighbours)."""
    placement: str = ""
    """The same for people: `Sample x4, Parameter x2` (or `replicated`)."""
    collectives: tuple[str, ...] = ()
    """What the split implies, e.g. `fwd all_reduce over tp (leave TP region)`."""

    @model_validator(mode="after")
    def _degrees(self) -> OpPlacement:
        for role, degree in self.soap.items():
            if degree < 1:
                raise ValueError(f"placement of {self.op}: {role} degree {degree} must be >= 1")
        return self


class BlockPlacement(_Strict):
    id: str
    """The block id (e.g. `model.layers`), or `<prologue>` / `<epilogue>` for non-block ops."""
    module_type: str
    count: int = Field(ge=1)
    recompute: str
    ops: tuple[OpPlacement, ...]


class StageRecord(_Strict):
    index: int = Field(ge=0)
    rank: int = Field(ge=0)
    """The pipeline rank that runs this stage (stage index % pp for looped schedules)."""
    modules: tuple[str, ...]
    """Module FQNs in the stage, e.g. `model.embed_tokens`, `model.layers.0` ... `lm_head`."""
    layers: tuple[int, int] | None = None
    """[first, end) positions in the layer sequence (costmodel.simulator.stages.layer_sequence)."""


class Plan(_Strict):
    schema_version: int
    model: ModelSpecRecord
    cluster: ClusterRecord
    global_batch: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    mesh: MeshRecord
    parallelism: ParallelismRecord
    tp_plan: dict[str, str] = Field(default_factory=dict)
    """`dict[module_fqn_pattern, style]`, relative to one block, as parallelize_module takes it."""
    blocks: tuple[BlockPlacement, ...] = ()
    stages: tuple[StageRecord, ...] = ()
    predicted: dict[str, Any] = Field(default_factory=dict)
    """The contract's metrics: step_time_s, tokens_per_s, mfu, peak_memory_gib, breakdown_s, ..."""
    launch: str = ""

    def __str__(self) -> str:
        """A few lines for `print(plan)`; `repr(plan)` stays the complete record."""
        p, m = self.parallelism, self.predicted
        degrees = ", ".join(f"{name} {getattr(p, name)}" for name in ("dp", "tp", "pp", "cp", "ep")
                            if getattr(p, name) > 1) or "one rank"
        batch = (f"{p.schedule}, {p.num_microbatches} micro-batches of {p.micro_batch}" if p.pp > 1
                 else f"micro-batch {p.micro_batch}" + (f" x {p.grad_accum} accumulated" if p.grad_accum > 1 else ""))
        lines = [f"Plan: {self.model.name} ({self.model.task}) on {self.cluster.gpus} x {self.cluster.name}",
                 f"  {degrees}; zero {p.zero}; {batch}; recompute {p.recompute}; {p.precision}; {p.optimizer}"
                 + ("; offload" if p.offload_optimizer else "") + ("; compile" if p.compile else ""),
                 f"  global batch {self.global_batch} x {self.seq_len} tokens"]
        if "step_time_s" in m:
            lines.append(f"  predicted {m['step_time_s']:.4g} s/step, {m.get('tokens_per_s', 0):,.0f} tokens/s, "
                         f"peak {m.get('peak_memory_gib', 0):.1f} GiB")
        return "\n".join(lines)

    @model_validator(mode="before")
    @classmethod
    def _version_first(cls, data: Any) -> Any:
        if isinstance(data, dict) and "schema_version" in data and data["schema_version"] != SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {data['schema_version']!r} is not supported (this soap reads {SCHEMA_VERSION})"
            )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        p = self.parallelism
        if self.mesh.degrees != (p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp):
            raise ValueError(
                f"mesh.degrees {list(self.mesh.degrees)} disagree with parallelism "
                f"(pp, dp_replicate, dp_shard, cp, tp) = {[p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp]}"
            )
        if p.dp != p.dp_replicate * p.dp_shard:
            raise ValueError(f"parallelism.dp={p.dp} must equal dp_replicate*dp_shard={p.dp_replicate * p.dp_shard}")
        world = p.pp * p.dp * p.cp * p.tp
        if world != self.cluster.gpus:
            raise ValueError(
                f"mesh.degrees multiply to {world} (pp*dp*cp*tp) but cluster.gpus is {self.cluster.gpus}; "
                "the degrees must multiply to the world size"
            )
        if p.dp * p.micro_batch * p.num_microbatches != self.global_batch:
            raise ValueError(
                f"global_batch={self.global_batch} must equal dp*micro_batch*num_microbatches="
                f"{p.dp * p.micro_batch * p.num_microbatches}"
            )
        reason = executed_pipeline_violation(p.schedule, pp=p.pp, virtual_stages=p.virtual_stages,
                                             num_microbatches=p.num_microbatches, grad_accum=p.grad_accum,
                                             zero=p.zero)
        if reason:
            raise ValueError(reason)
        dims = model_dims(SimpleNamespace(**self.model.config), [])
        if dims.heads and dims.num_layers:  # a user's nn.Module may come without an HF config
            reason = model_violation(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, num_layers=dims.num_layers,
                                     heads=dims.heads, kv_heads=dims.kv_heads, vocab=dims.vocab,
                                     seq_len=self.seq_len, num_experts=dims.num_experts,
                                     encoder_decoder=dims.is_encoder_decoder)
            if reason:
                raise ValueError(f"parallelism: {reason}")
        reason = (compile_violation(compile=p.compile, encoder_decoder=dims.is_encoder_decoder)
                  or recompute_violation(recompute=p.recompute, encoder_decoder=dims.is_encoder_decoder))
        if reason:
            raise ValueError(reason)
        reason = optimizer_violation(p.optimizer, tp=p.tp, dp=p.dp, cp=p.cp, pp=p.pp, zero=p.zero,
                                     offload=p.offload_optimizer)
        if reason:
            raise ValueError(f"parallelism: {reason}")
        reason = peft_violation(self.model.peft.method if self.model.peft else None, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                                zero=p.zero, offload=p.offload_optimizer, precision=p.precision, compile=p.compile,
                                recompute=p.recompute)
        if reason:
            raise ValueError(f"parallelism under model.peft: {reason}")
        if p.pp > 1:
            if len(self.stages) != p.pp * p.virtual_stages:
                raise ValueError(f"stages: expected pp*virtual_stages={p.pp * p.virtual_stages} stages, got {len(self.stages)}")
            for position, stage in enumerate(self.stages):
                if stage.index != position:
                    raise ValueError(f"stages[{position}].index is {stage.index}; stages must be listed in order")
                if not stage.modules or (stage.layers is not None and stage.layers[1] <= stage.layers[0]):
                    raise ValueError(f"stages[{stage.index}] has no layers; every pipeline stage needs at least one")
        return self

    # --- conversions -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.cluster.gpus

    def strategy(self) -> Strategy:
        """The costmodel's view of this plan (mesh + training configuration)."""
        p = self.parallelism
        dims = ParallelDims(
            dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, pp=p.pp, ep=p.ep
        )
        train = TrainingConfig(
            global_batch=self.global_batch,
            seq_len=self.seq_len,
            micro_batch=p.micro_batch,
            num_microbatches=p.num_microbatches,
            grad_accum=p.grad_accum,
            schedule=p.schedule,
            virtual_stages=p.virtual_stages,
            zero=p.zero,
            sequence_parallel=p.sequence_parallel,
            recompute=p.recompute,
            recompute_per_block=tuple((b.id, b.recompute) for b in self.blocks if b.recompute != p.recompute),
            precision=p.precision,
            optimizer=p.optimizer,
            offload_optimizer=p.offload_optimizer,
            attention=p.attention,
            compile=p.compile,
            cross_entropy=p.cross_entropy,
            peft=self.model.peft.method if self.model.peft else None,
        )
        return Strategy(dims=dims, train=train, op_splits=self.op_splits())

    def op_splits(self) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
        """`Strategy.op_splits` from the per-op placements of the repeated blocks: every op named with its
        (attribute, parameter) degrees, where the planner's per-op split search can choose them (tp > 1,
        no expert parallelism; see `planner.block_splits.chosen_op_splits`). The simulator prices an op
        named with its Megatron default as the default, so this reproduces the planned placements."""
        p = self.parallelism
        if p.tp == 1 or p.ep > 1:
            return ()
        return tuple((o.op, (("attribute", o.soap.get("attribute", 1)), ("parameter", o.soap.get("parameter", 1))))
                     for block in self.blocks if not block.id.startswith("<") for o in block.ops)

    def to_json(self) -> str:
        """Deterministic JSON text: the same plan always gives the same bytes."""
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"

    def save(self, path: str | os.PathLike[str]) -> None:
        write_atomic(path, self.to_json(), what="plan file")


def parallelism_record(strategy: Strategy) -> ParallelismRecord:
    d, t = strategy.dims, strategy.train
    return ParallelismRecord(
        dp=d.dp, dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, zero=t.zero, tp=d.tp, pp=d.pp, cp=d.cp,
        ep=d.ep, sequence_parallel=t.sequence_parallel, micro_batch=t.micro_batch, grad_accum=t.grad_accum,
        num_microbatches=t.num_microbatches, schedule=t.schedule, virtual_stages=t.virtual_stages,
        recompute=t.recompute, precision=t.precision, optimizer=t.optimizer,
        offload_optimizer=t.offload_optimizer, attention=t.attention, compile=t.compile,
        cross_entropy=t.cross_entropy,
    )


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate plan.json; every problem becomes a SoapError naming the field."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SoapError(f"plan file {str(p)!r} does not exist; write one with `soap plan MODEL --gpus N -o {p}`") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise SoapError(f"cannot read plan file {str(p)[:80]!r} ({reason}); write one with "
                        "`soap plan MODEL --gpus N -o plan.json`") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SoapError(f"{p} is not valid JSON ({exc}); regenerate it with `soap plan`") from None
    except RecursionError:
        raise SoapError(f"{p} is nested too deeply to be a plan; regenerate it with `soap plan`") from None
    return plan_from_dict(data, origin=str(p))


def plan_from_dict(data: Any, *, origin: str = "plan") -> Plan:
    if not isinstance(data, dict):
        raise SoapError(f"{origin}: a plan must be a JSON object")
    if "schema_version" not in data:
        raise SoapError(f"{origin}: schema_version is missing; regenerate the plan with `soap plan`")
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise SoapError(f"{origin}: invalid plan: {_first_error(exc)}") from None


# --- building a plan from a simulation -------------------------------------------------------------


def block_records(graph: OpGraph, strategy: Strategy) -> tuple[BlockPlacement, ...]:
    """Per-block and per-op SOAP placements, as `costmodel.placement` assigns them; listed are the ops
    that carry parameters, FLOPs or collectives (the mask arithmetic and views follow their neighbours)."""
    from costmodel.opcost import activation_itemsize
    from costmodel.placement import ActivationShape, block_placements

    t, dims = strategy.train, graph.dims
    shape = ActivationShape(micro_batch=t.micro_batch, seq_len=t.seq_len, hidden=dims.hidden,
                            itemsize=activation_itemsize(t.precision), kv_heads=dims.kv_heads,
                            head_dim=dims.head_dim, experts_per_token=dims.experts_per_token)
    records = []
    segments = list(graph.segments())
    for index, seg in enumerate(segments):
        if seg.block_id is None:
            rid = "<prologue>" if index == 0 else "<epilogue>" if index == len(segments) - 1 else f"<between-{index}>"
            module_type, recompute = rid, "none"
        else:
            rid, module_type, recompute = seg.block_id, graph.block(seg.block_id).module_type, t.recompute_for(seg.block_id)
        ops = tuple(
            OpPlacement(
                op=_relative_op_name(p.op.name, seg.block_id), soap=p.split.soap(), style=p.split.style,
                placement=p.split.describe(),
                collectives=tuple(f"{c.phase} {c.kind} over {c.group} ({c.reason})" for c in p.collectives),
            )
            for p in block_placements(seg.ops, strategy, shape)
            if p.op.params or p.op.fwd_flops > 0 or p.collectives
        )
        records.append(BlockPlacement(id=rid, module_type=module_type, count=seg.repeat, recompute=recompute, ops=ops))
    return tuple(records)


def _relative_op_name(name: str, block_id: str | None) -> str:
    from costmodel.placement import block_container

    container = block_container(block_id) if block_id else ""
    if not container or not name.startswith(container + "."):
        return name
    rest = name[len(container) + 1:]  # "0.self_attn.q_proj:linear" or "0:add"
    module, _, op = rest.partition(":")
    return f"{module.split('.', 1)[1]}:{op}" if "." in module else f":{op}"


def stage_records_for(graph: OpGraph, strategy: Strategy, bounds: Sequence[int] | None) -> tuple[StageRecord, ...]:
    from costmodel.schedule import build_schedule
    from costmodel.simulator.stages import balanced_bounds, layer_sequence, stage_modules

    d, t = strategy.dims, strategy.train
    if d.pp == 1:
        return ()
    layers = layer_sequence(graph)
    bounds = tuple(bounds) if bounds is not None else balanced_bounds(layers, d.pp * t.virtual_stages)
    stage_to_rank = build_schedule(t.schedule, d.pp, t.num_microbatches // t.grad_accum, t.virtual_stages).stage_to_rank
    modules = stage_modules(layers, bounds)
    return tuple(
        StageRecord(index=k, rank=stage_to_rank[k], modules=modules[k], layers=(bounds[k], bounds[k + 1]))
        for k in range(len(bounds) - 1)
    )


def stage_bounds(plan: Plan, graph: OpGraph) -> tuple[int, ...] | None:
    """The plan's stage bounds over `graph`'s layer sequence (from `layers`, else from module names)."""
    if not plan.stages:
        return None
    from costmodel.simulator.stages import layer_sequence

    layers = layer_sequence(graph)
    if all(s.layers is not None for s in plan.stages):
        bounds = (0, *(s.layers[1] for s in plan.stages))  # type: ignore[index]
    else:
        owner = {m: s.index for s in plan.stages for m in s.modules}
        stage_of, current = [], 0
        for layer in layers:
            current = next((owner[m] for m in layer.modules if m in owner), current)
            stage_of.append(current)
        bounds = (0, *(sum(1 for s in stage_of if s <= k) for k in range(len(plan.stages))))
    if bounds[-1] != len(layers):
        raise SoapError(f"stages: the plan's stages cover {bounds[-1]} layers but the model has {len(layers)}; "
                        "the plan does not match its model config")
    return bounds


def plan_from_simulation(
    *,
    model: ModelSpecRecord,
    graph: OpGraph,
    cluster: ClusterSpec,
    strategy: Strategy,
    result: SimResult,
    stages: Sequence[int] | None = None,
    gpus: int | None = None,
    launch: str = "",
) -> Plan:
    """A complete Plan from a simulated strategy (`stages`: the bounds given to `simulate`; `gpus`:
    the world size, by default the product of the strategy's degrees)."""
    from costmodel.placement import tp_plan
    from costmodel.profiles import cluster_to_dict

    d, t = strategy.dims, strategy.train
    return Plan(
        schema_version=SCHEMA_VERSION,
        model=model,
        cluster=ClusterRecord(name=cluster.name, gpus=gpus or d.world_size, gpus_per_node=cluster.gpus_per_node,
                              profile=cluster_to_dict(cluster)),
        global_batch=t.global_batch,
        seq_len=t.seq_len,
        mesh=MeshRecord(names=MESH_DIM_NAMES, degrees=d.mesh_shape),
        parallelism=parallelism_record(strategy),
        tp_plan=dict(sorted(tp_plan(graph.ops, strategy).items())),
        blocks=block_records(graph, strategy),
        stages=stage_records_for(graph, strategy, stages),
        predicted=json.loads(json.dumps(result.to_contract(), sort_keys=True)),
        launch=launch,
    )
