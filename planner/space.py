"""The search space: every strategy soap may choose for one model on one cluster.

A strategy is a mesh and a training configuration (`costmodel.strategy.Strategy`):

    gpus = pp x dp x cp x tp,      dp = dp_replicate x dp_shard,
    global_batch = dp x micro_batch x num_microbatches.

Mesh rules (`mesh_choices`):
- tp divides the heads; tp and the KV heads divide one another; tp divides the NVLink domain (a node
  unless the cluster declares `nvlink_domain`; TP stays inside it) unless the cluster says
  `tp_across_nodes` or tp is pinned: a pinned tp may span nodes, priced on the inter-node link;
- cp needs the sequence divisible by 2·cp (load-balanced causal chunks) and, unless pinned, at least
  MIN_CP_SHARD_TOKENS tokens per rank;
- pp <= layers (stages need not hold equal layer counts: `planner.stages` balances them);
- dp divides the global batch;
- the sample-parallel group either replicates (ZeRO 0, DDP), shards over all of dp (ZeRO 1/2/3),
  or shards inside a node and replicates across nodes (HSDP: ZeRO 3 with dp_shard = the data ranks
  that fit in one node);
- MoE models: expert parallelism ep divides the expert count and borrows ranks from dp_shard x cp.
`costmodel.plan_rules` states the divisibility and schedule rules; the search filters on them instead of
raising.

Training rules (`training_choices`), per mesh:
- micro_batch divides the per-rank batch global_batch / dp (and holds at most MAX_MICROBATCH_TOKENS
  tokens unless pinned or 1); with pp == 1 every micro-batch is a
  gradient-accumulation step; with pp > 1 one schedule run takes them all (grad_accum = 1 unless
  pinned) and, where the batch allows, a run has at least pp micro-batches;
- schedules (pp > 1): GPipe, 1F1B, Interleaved1F1B with v in {2, 4} (v·pp <= layers and a
  micro-batch count divisible by pp) and the zero-bubble schedules the simulator prices, each only
  where `costmodel.plan_rules.executed_pipeline_violation` says torch and soap's executor run it (1F1B needs at least pp
  micro-batches per schedule run, ...);
- recompute none / selective / full; precision bf16 (fp16 where the device lacks bf16), plus fp8
  only when `precision="auto"` and the device supports it (fp8 changes numerics, so it is opt-in like
  the optimizer); the optimizer only when `optimizer="auto"`; optimizer offload on/off.
- torch.compile (`compile_choices`): off, or as pinned; an fp8 plan compiles unless pinned off (`fp8_compiles`:
  eager, torchao's float8 Linears ran 3.4x slower than bf16). Unpinned, compile is not a dimension the
  enumeration doubles: `planner.search` simulates the best plans again with compile on, and only where
  the device's measured `compile_factors` make some kernel class faster (`DeviceProfile.compile_pays`);
  compile only lowers memory in soap's model (`costmodel.memory_activations.compiled_keep`), and on a tie
  the plan without it wins.

Pins fix a dimension; `validate_pins` rejects impossible pins with the numbers, before any search. The
pins and their ecosystem names: tp, pp, dp, cp, zero; ep (torchtitan's expert_parallel_degree: ranks the
experts are spread over, borrowed from dp_shard x cp); virtual_stages (torchtitan's pipeline stages per
rank, for Interleaved1F1B-style schedules); offload (optimizer state and step on the CPU, FSDP2's
CPUOffloadPolicy); compile (torch.compile per block, accelerate's and torchtitan's `compile`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from costmodel.plan_rules import (NOT_EXECUTED, compile_violation, executed_pipeline_violation, model_violation,
                                  optimizer_violation, peft_violation, recompute_violation)
from costmodel.strategy import (
    EXECUTED_CROSS_ENTROPY,
    MULTI_STAGE_SCHEDULES,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    ParallelDims,
    TrainingConfig,
)
from tracer.errors import SoapError
from tracer.ir import ModelDims

SEARCHED_SCHEDULES: tuple[tuple[str, int], ...] = (
    ("1F1B", 1),
    ("GPipe", 1),
    ("Interleaved1F1B", 2),
    ("Interleaved1F1B", 4),
    ("ZBVZeroBubble", 2),
)
"""(schedule, virtual stages per rank) tried when pp > 1; ZBV's V shape always runs two stages per rank."""

MIN_CP_SHARD_TOKENS = 512
"""Unpinned context parallelism keeps at least this many tokens per rank: shorter shards leave the
attention kernels too small to hide the K/V exchange, so such meshes are never competitive."""

MAX_MICROBATCH_TOKENS = 1 << 17
"""Unpinned micro-batches stop growing at this many tokens: matmuls are at full efficiency long before."""

AUTO_OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw8bit", "adafactor")
"""Optimizers searched under `optimizer="auto"` (SGD changes training too much to pick silently)."""


@dataclass(frozen=True, kw_only=True)
class Pins:
    """Dimensions the user fixed; None leaves a dimension to the search."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    """The whole data-parallel degree (replicate x shard)."""
    cp: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    recompute: str | None = None
    schedule: str | None = None
    precision: str | None = None
    """A name from costmodel.strategy.PRECISIONS, "auto" to search the half precision and fp8, or None
    for the half precision alone."""
    optimizer: str = "adamw"
    """A name from costmodel.strategy.OPTIMIZERS, or "auto" to search AUTO_OPTIMIZERS."""
    ep: int | None = None
    """Expert-parallel degree (MoE models): divides the expert count and dp_shard x cp."""
    virtual_stages: int | None = None
    """Pipeline stages per rank (> 1 needs pp > 1 and a multi-stage schedule)."""
    offload: bool | None = None
    """Optimizer state and step on the CPU (True), on the device (False), or searched (None)."""
    compile: bool | None = None
    """torch.compile each block (True), never (False), or searched (None)."""
    cross_entropy: str = "chunked"
    """The loss the plan computes (`TrainingConfig.cross_entropy`): the executor's chunked one, or "upcast"
    (`F.cross_entropy(logits.float())`) to plan for a stack that computes that."""

    def __post_init__(self) -> None:
        for name in ("offload", "compile"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise SoapError(f"--{name}={value!r} must be on or off (True or False)")
        for name in ("tp", "pp", "dp", "cp", "micro_batch", "grad_accum", "ep", "virtual_stages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise SoapError(f"--{name.replace('_', '-')}={value!r} must be a positive integer")
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise SoapError(f"--zero={self.zero!r} must be 0, 1, 2 or 3")
        for value, allowed, what in (
            (self.recompute, RECOMPUTE, "recompute"),
            (self.schedule, SCHEDULES, "schedule"),
            (self.precision, (*PRECISIONS, "auto"), "precision"),
            (self.optimizer, (*OPTIMIZERS, "auto"), "optimizer"),
            (self.cross_entropy, EXECUTED_CROSS_ENTROPY, "cross-entropy"),
        ):
            if value is not None and value not in allowed:
                raise SoapError(f"unknown --{what} {value!r}; choose one of {', '.join(allowed)}")


@dataclass(frozen=True, kw_only=True)
class SpaceRequest:
    """What the search space depends on: the model's shape, the cluster's layout and the pins."""

    gpus: int
    gpus_per_node: int
    tp_across_nodes: bool
    """The search may choose TP groups that leave an NVLink domain (a pinned tp always may)."""
    dims: ModelDims
    seq_len: int
    global_batch: int
    precisions: tuple[str, ...]
    """Precisions the device runs (the keys of its peak FLOP/s table)."""
    pins: Pins = field(default_factory=Pins)
    schedules: tuple[tuple[str, int], ...] = SEARCHED_SCHEDULES
    """(schedule, virtual stages) pairs the simulator can price."""
    nvlink_domain: int | None = None
    """GPUs sharing one NVLink fabric when more than a node (`ClusterSpec.nvlink_domain`)."""
    peft: str | None = None
    """The PEFT method (lora, qlora) or None for full training: `costmodel.plan_rules.peft_violation`
    trims the space to what the executor runs with adapters."""

    @property
    def domain_size(self) -> int:
        return self.nvlink_domain or self.gpus_per_node


@dataclass(frozen=True)
class MeshChoice:
    """A mesh plus how its sample-parallel group treats model state."""

    dims: ParallelDims
    zero: int

    @property
    def sort_key(self) -> tuple[int, ...]:
        """A total order: (pp, dp_replicate, dp_shard, cp, tp, zero, ep)."""
        d = self.dims
        return (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp, self.zero, d.ep)


def divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted({*small, *(n // d for d in small)}))


def _rule_violation(req: SpaceRequest, *, tp: int, pp: int, cp: int) -> str | None:
    """Why (tp, pp, cp) breaks a model or cluster rule, or None. Wraps `costmodel.plan_rules.model_violation`.

    The cluster rule keeps the search's TP groups inside one NVLink domain (a node unless the cluster
    declares `nvlink_domain`): tp divides the domain, or the whole job fits in one. It binds the search
    only: a pinned tp may span domains (priced on the inter-node link, `costmodel.simulator.pricing`),
    and a cluster with `tp_across_nodes` lets the search try such groups too."""
    d = req.dims
    if tp != req.pins.tp and not req.tp_across_nodes:
        reason = tp_domain_violation(tp, gpus=req.gpus, domain=req.domain_size)
        if reason:
            return reason
    return model_violation(tp=tp, pp=pp, cp=cp, num_layers=d.num_layers, heads=d.heads, kv_heads=d.kv_heads,
                           vocab=d.vocab, seq_len=req.seq_len, encoder_decoder=d.is_encoder_decoder) \
        or peft_violation(req.peft, tp=tp, pp=pp, cp=cp)


def tp_domain_violation(tp: int, *, gpus: int, domain: int) -> str | None:
    """Why TP groups of `tp` consecutive ranks would leave an NVLink domain of `domain` GPUs, or None."""
    if tp == 1 or gpus <= domain and gpus % tp == 0 or domain % tp == 0:
        return None
    if tp > domain:
        return f"tp={tp} would span NVLink domains of {domain} GPUs; this cluster keeps TP inside one (pin --tp to try it)"
    return f"tp={tp} does not divide the {domain} GPUs of an NVLink domain, so some TP groups would span two"


def validate_pins(req: SpaceRequest) -> None:
    """Reject pins no strategy can satisfy, naming the numbers and the fix."""
    p, n = req.pins, req.gpus
    if not isinstance(n, int) or n < 1:
        raise SoapError(f"--gpus={n!r} must be a positive integer")
    if req.global_batch < 1 or req.seq_len < 1:
        raise SoapError(f"global batch ({req.global_batch}) and sequence length ({req.seq_len}) must be positive")
    reason = compile_violation(compile=bool(p.compile), encoder_decoder=req.dims.is_encoder_decoder)
    if reason:
        raise SoapError(reason.replace("parallelism.compile", "--compile on"))
    reason = recompute_violation(recompute=p.recompute or "none", encoder_decoder=req.dims.is_encoder_decoder)
    if reason:
        raise SoapError(reason.replace("parallelism.recompute=", "--recompute "))
    if p.schedule in NOT_EXECUTED:
        raise SoapError(f"--schedule {p.schedule}: {NOT_EXECUTED[p.schedule]}; use Interleaved1F1B, 1F1B or GPipe")
    for name in ("tp", "pp", "dp", "cp"):
        value = getattr(p, name)
        if value is not None and n % value:
            raise SoapError(f"--{name} {value} does not divide --gpus {n}; pick a divisor of {n}")
    pinned = [getattr(p, k) for k in ("tp", "pp", "dp", "cp") if getattr(p, k) is not None]
    product = 1
    for v in pinned:
        product *= v
    if n % product or (len(pinned) == 4 and product != n):
        raise SoapError(f"pinned degrees multiply to {product}, which does not fit --gpus {n}")
    reason = _rule_violation(req, tp=p.tp or 1, pp=p.pp or 1, cp=p.cp or 1)
    if reason:
        raise SoapError(reason)
    reason = peft_violation(req.peft, ep=p.ep or 1, zero=p.zero or 0, offload=bool(p.offload),
                            compile=bool(p.compile), precision=p.precision or "bf16", recompute=p.recompute or "none")
    if reason:
        raise SoapError(f"--peft {req.peft}: {reason}")
    # a pinned ZeRO 2/3 asks for sharding over data parallelism: over as many ranks as are left, unless pinned
    dp = p.dp or (n // ((p.tp or 1) * (p.pp or 1) * (p.cp or 1)) if (p.zero or 0) >= 2 else 1)
    reason = optimizer_violation(p.optimizer, tp=p.tp or 1, dp=dp, cp=p.cp or 1, pp=p.pp or 1,
                                 zero=p.zero or 0, offload=bool(p.offload))
    if reason:
        raise SoapError(f"--optimizer {reason.removeprefix('optimizer ')}")
    if p.dp is not None and req.global_batch % p.dp:
        raise SoapError(f"--dp {p.dp} does not divide the global batch {req.global_batch}; change --global-batch")
    if p.precision is not None and p.precision not in (*req.precisions, "tf32", "auto"):
        raise SoapError(
            f"this device has no {p.precision} support (it runs {', '.join(req.precisions)}); pick another --precision"
        )
    if p.precision == "tf32" and "tf32" not in req.precisions:
        raise SoapError("this device has no tf32 support; use --precision fp32")
    if p.pp and p.pp > 1 and p.schedule == "1F1B" and p.micro_batch:
        most = req.global_batch // (p.micro_batch * (p.grad_accum or 1) * (p.dp or 1))
        if most < p.pp:
            raise SoapError(
                f"--schedule 1F1B needs at least {p.pp} micro-batches per schedule run with --pp {p.pp}, but "
                f"--global-batch {req.global_batch} at --micro-batch {p.micro_batch} leaves at most {most}; "
                "lower --micro-batch, raise --global-batch or use --schedule GPipe"
            )
    _validate_expert_pin(req)
    _validate_virtual_stages_pin(req)
    if p.micro_batch is not None and p.grad_accum is not None and req.global_batch % (p.micro_batch * p.grad_accum):
        raise SoapError(
            f"--micro-batch {p.micro_batch} x --grad-accum {p.grad_accum} does not divide the global batch {req.global_batch}"
        )


def _validate_expert_pin(req: SpaceRequest) -> None:
    """--ep: the model has experts, ep divides their count, and ep ranks can be borrowed from the data and
    context ranks (dp_shard x cp) the other pins leave."""
    p, experts = req.pins, req.dims.num_experts
    if p.ep is None or p.ep == 1:
        return
    if experts <= 1:
        raise SoapError(f"--ep {p.ep}: the model is dense (no experts), so there is nothing to spread; drop --ep")
    if experts % p.ep:
        good = ", ".join(str(e) for e in divisors(experts) if e > 1)
        raise SoapError(f"--ep {p.ep} does not divide the {experts} experts; pick one of {good}")
    room = req.gpus // ((p.tp or 1) * (p.pp or 1))
    if room % p.ep:
        raise SoapError(
            f"--ep {p.ep} borrows ranks from dp_shard x cp, but --gpus {req.gpus} over tp={p.tp or 1} x pp={p.pp or 1} "
            f"leaves {room}, which {p.ep} does not divide; lower --ep or --tp/--pp")
    if (p.zero == 0 or p.dp == 1) and p.cp is not None and p.cp % p.ep:
        why = "--zero 0 shards nothing" if p.zero == 0 else "--dp 1 leaves no data ranks"
        raise SoapError(
            f"--ep {p.ep} borrows from dp_shard x cp, but {why}, and cp={p.cp} alone is not divisible by {p.ep}; "
            "use --zero 1, 2 or 3 with --dp of at least the expert degree, or lower --ep")


def _validate_virtual_stages_pin(req: SpaceRequest) -> None:
    """--virtual-stages: more than one stage per rank needs a pipeline, a multi-stage schedule and enough
    layers for pp x v stages; ZBVZeroBubble runs exactly two."""
    p, v = req.pins, req.pins.virtual_stages
    if v is None or v == 1:
        if v == 1 and p.schedule == "ZBVZeroBubble":
            raise SoapError("--virtual-stages 1: ZBVZeroBubble runs exactly 2 stages per rank; use --virtual-stages 2")
        return
    if p.pp == 1 or req.gpus == 1:
        raise SoapError(f"--virtual-stages {v} needs a pipeline, but pp is 1; pin --pp 2 or more, "
                        "or drop --virtual-stages")
    if p.schedule is not None and p.schedule not in MULTI_STAGE_SCHEDULES:
        raise SoapError(f"--virtual-stages {v}: schedule {p.schedule} runs one stage per rank; use --schedule "
                        "Interleaved1F1B (or drop --virtual-stages)")
    if p.schedule == "ZBVZeroBubble" and v != 2:
        raise SoapError(f"--virtual-stages {v}: ZBVZeroBubble runs exactly 2 stages per rank; use --virtual-stages 2")
    layers = req.dims.num_layers
    if 2 * v > layers or (p.pp and p.pp * v > layers):
        pp = p.pp or 2
        raise SoapError(f"--virtual-stages {v} with pp={pp} needs {pp * v} stages, more than the {layers} layers; "
                        f"use --virtual-stages {max(1, layers // pp)} or less")


def mesh_choices(req: SpaceRequest) -> list[MeshChoice]:
    """Every mesh (with its ZeRO stage) that satisfies the model, cluster and pins, in a fixed order."""
    return sorted((mesh for mesh, reason in _meshes(req) if reason is None), key=lambda m: m.sort_key)


def mesh_refusal(req: SpaceRequest) -> str | None:
    """Why the pins leave no mesh where the pinned degrees do divide the GPUs but a model, cluster or PEFT rule
    refuses every such mesh: the reason on the plainest one (the fewest unpinned ranks in tp, cp, pp and ep, which
    the pins alone decide most). None where a mesh stands, or none divides."""
    refused = []
    for mesh, reason in _meshes(req):
        if reason is None:
            return None
        refused.append((unpinned_ranks(req.pins, mesh.dims), reason))
    return min(refused, key=lambda r: r[0])[1] if refused else None


def unpinned_ranks(pins: Pins, dims: ParallelDims, axes: tuple[str, ...] = ("tp", "cp", "pp", "ep")) -> int:
    """The ranks the pins leave to the search along `axes`: the product of each unpinned axis's degree (a pinned
    one counts 1). The fewer, the more the pins alone decide the mesh: refusals are reported on such a one."""
    return math.prod(1 if getattr(pins, axis) else getattr(dims, axis) for axis in axes)


def _meshes(req: SpaceRequest) -> Iterator[tuple[MeshChoice, str | None]]:
    """Every mesh the pinned degrees divide the GPUs into, with why a rule refuses it (None: it stands). A
    (tp, cp, pp) that a model or cluster rule refuses comes once, as DDP without experts split, before its sharding
    and expert degree are chosen."""
    p, n = req.pins, req.gpus
    for tp in (p.tp,) if p.tp else divisors(n):
        cps = [c for c in divisors(n // tp) if c == 1 or req.seq_len // c >= MIN_CP_SHARD_TOKENS]
        for cp in (p.cp,) if p.cp else cps:
            for pp in (p.pp,) if p.pp else divisors(n // (tp * cp)):
                if n % (tp * cp * pp) or (pp == 1 and (p.virtual_stages or 1) > 1):
                    continue
                dp = n // (tp * cp * pp)
                if (p.dp and dp != p.dp) or req.global_batch % dp:
                    continue
                rule = _rule_violation(req, tp=tp, pp=pp, cp=cp)
                if rule:
                    plain = ParallelDims(dp_replicate=dp, dp_shard=1, cp=cp, tp=tp, pp=pp, ep=1)
                    yield MeshChoice(dims=plain, zero=p.zero or 0), rule
                    continue
                for zero, shard in _sharding_choices(req, dp=dp, inner=tp * cp):
                    if p.zero is not None and zero != p.zero:
                        continue
                    experts = _expert_choices(req, shard * cp)
                    if not experts:  # the pinned ep borrows more ranks than this sharding has
                        dims = ParallelDims(dp_replicate=dp // shard, dp_shard=shard, cp=cp, tp=tp, pp=pp, ep=1)
                        yield MeshChoice(dims=dims, zero=zero), _expert_refusal(req, zero=zero, shard=shard, cp=cp)
                    for ep in experts:
                        dims = ParallelDims(dp_replicate=dp // shard, dp_shard=shard, cp=cp, tp=tp, pp=pp, ep=ep)
                        yield MeshChoice(dims=dims, zero=zero), peft_violation(req.peft, ep=ep, zero=zero)


def _expert_refusal(req: SpaceRequest, *, zero: int, shard: int, cp: int) -> str:
    """Why the pinned expert degree has no place on a mesh: it must divide the experts and the ranks it borrows,
    ZeRO's data-parallel shards times cp (`_expert_choices`)."""
    ep, experts = req.pins.ep, req.dims.num_experts
    if experts % ep:
        return f"ep={ep} does not divide the model's {experts} experts"
    if zero == 0:
        return (f"ep={ep} spreads experts over ZeRO's data-parallel shards x cp; ZeRO 0 (DDP) shards nothing and cp is "
                f"{cp}: use --zero 1, 2 or 3")
    return f"ep={ep} needs ZeRO's data-parallel shards x cp ({shard} x {cp}) divisible by {ep}"


def _expert_choices(req: SpaceRequest, borrowable: int) -> list[int]:
    """Expert-parallel degrees for MoE models: divisors of the expert count that divide dp_shard x cp."""
    experts = req.dims.num_experts
    if experts <= 1:
        return [1]
    return [e for e in divisors(experts) if borrowable % e == 0 and (req.pins.ep is None or e == req.pins.ep)]


def _sharding_choices(req: SpaceRequest, *, dp: int, inner: int) -> list[tuple[int, int]]:
    """(zero stage, dp_shard) pairs: DDP, ZeRO 1/2/3 over all of dp, and HSDP inside a node."""
    if dp == 1:
        return [(req.pins.zero or 0, 1)]
    choices = [(0, 1), (1, dp), (2, dp), (3, dp)]
    per_node = max(1, req.gpus_per_node // inner)
    hsdp = max((s for s in divisors(dp) if s <= per_node), default=1)
    if 1 < hsdp < dp:
        choices.append((3, hsdp))
    return choices


def precision_choices(req: SpaceRequest) -> tuple[str, ...]:
    if req.pins.precision not in (None, "auto"):
        return (req.pins.precision,)
    half = half_precision(req)
    fp8 = req.pins.precision == "auto" and "fp8" in req.precisions and not peft_violation(req.peft, precision="fp8")
    return (half, "fp8") if fp8 else (half,)


def half_precision(req: SpaceRequest) -> str:
    """The default training precision: bf16, else fp16, else fp32 (what the device runs)."""
    return "bf16" if "bf16" in req.precisions else "fp16" if "fp16" in req.precisions else "fp32"


def optimizer_choices(req: SpaceRequest) -> tuple[str, ...]:
    return AUTO_OPTIMIZERS if req.pins.optimizer == "auto" else (req.pins.optimizer,)


def _schedule_candidates(req: SpaceRequest) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs the pins allow: those the simulator prices, or the pinned schedule."""
    pinned_v = req.pins.virtual_stages
    candidates = [(name, v) for name, v in req.schedules
                  if (not req.pins.schedule or name == req.pins.schedule) and (pinned_v is None or v == pinned_v)]
    if (req.pins.schedule or pinned_v) and not candidates:
        name = req.pins.schedule or ("Interleaved1F1B" if pinned_v > 1 else "1F1B")
        candidates = [(name, pinned_v or (2 if name in MULTI_STAGE_SCHEDULES else 1))]
    return candidates


def _pair_refusal(req: SpaceRequest, name: str, v: int, *, pp: int, num_microbatches: int, grad_accum: int,
                  zero: int) -> str | None:
    """Why `name` at `v` stages per rank cannot run this micro-batching, or None: more stages than layers,
    micro-batches that pp does not divide, or `costmodel.plan_rules.executed_pipeline_violation`'s reason."""
    layers = req.dims.num_layers
    if v > 1 and pp * v > layers:
        return f"{name} with {v} stages per rank needs {pp * v} stages at pp={pp}, more than the model's {layers} layers"
    if v > 1 and num_microbatches % pp:
        return f"{name} needs a multiple of pp={pp} micro-batches per rank, and the batch makes {num_microbatches}"
    return executed_pipeline_violation(name, pp=pp, virtual_stages=v, num_microbatches=num_microbatches,
                                       grad_accum=grad_accum, zero=zero)


def schedule_choices(req: SpaceRequest, *, pp: int, num_microbatches: int,
                     grad_accum: int = 1, zero: int = 0) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs for one micro-batching: those the simulator prices (or the pinned
    schedule) that `_pair_refusal` allows (v·pp <= layers; `costmodel.plan_rules.executed_pipeline_violation`)."""
    if pp == 1:
        return [(req.pins.schedule or "1F1B", 1)]
    return [(name, v) for name, v in _schedule_candidates(req)
            if _pair_refusal(req, name, v, pp=pp, num_microbatches=num_microbatches, grad_accum=grad_accum,
                             zero=zero) is None]


def schedule_refusal(req: SpaceRequest, *, pp: int, num_microbatches: int, grad_accum: int = 1,
                     zero: int = 0) -> str | None:
    """Why the pinned schedule (or virtual stages) runs in none of `schedule_choices`'s pairs for this micro-batching,
    or None: the first pair's `_pair_refusal`."""
    if pp == 1 or not (req.pins.schedule or req.pins.virtual_stages):
        return None
    reasons = [_pair_refusal(req, name, v, pp=pp, num_microbatches=num_microbatches, grad_accum=grad_accum, zero=zero)
               for name, v in _schedule_candidates(req)]
    return reasons[0] if reasons and all(reasons) else None


def micro_batching(req: SpaceRequest, *, dp: int, pp: int) -> list[tuple[int, int, int]]:
    """(micro_batch, num_microbatches, grad_accum) per data-parallel rank, honouring the pins.

    With pp > 1 only splittings with at least pp micro-batches per schedule run are offered, while any
    exist: fewer leave pipeline ranks idle for most of the run (and 1F1B refuses them), so a pipeline
    with one micro-batch is never a plan the search proposes when the batch allows better."""
    local = req.global_batch // dp
    p = req.pins
    out = []
    for mb in divisors(local):
        if p.micro_batch and mb != p.micro_batch:
            continue
        if not p.micro_batch and mb > 1 and mb * req.seq_len > MAX_MICROBATCH_TOKENS:
            break
        count = local // mb
        accum = count if pp == 1 else (p.grad_accum or 1)
        if p.grad_accum and accum != p.grad_accum:
            continue
        if count % accum:
            continue
        out.append((mb, count, accum))
    filled = [(mb, count, accum) for mb, count, accum in out if count // accum >= pp]
    return filled if pp > 1 and filled else out


@dataclass(frozen=True)
class TrainingHead:
    """A training configuration less its recompute policy and offload (the memory-for-time knobs)."""

    micro_batch: int
    num_microbatches: int
    grad_accum: int
    schedule: str
    virtual_stages: int
    precision: str
    optimizer: str


def training_heads(req: SpaceRequest, mesh: MeshChoice) -> list[TrainingHead]:
    d = mesh.dims
    optimizers = [o for o in optimizer_choices(req) if optimizer_violation(
        o, tp=d.tp, dp=d.dp, cp=d.cp, pp=d.pp, zero=mesh.zero) is None]
    return [
        TrainingHead(mb, count, accum, schedule, v, precision, optimizer)
        for mb, count, accum in micro_batching(req, dp=d.dp, pp=d.pp)
        for schedule, v in schedule_choices(req, pp=d.pp, num_microbatches=count, grad_accum=accum, zero=mesh.zero)
        for precision in precision_choices(req)
        for optimizer in optimizers
    ]


def recompute_choices(req: SpaceRequest) -> tuple[str, ...]:
    if req.pins.recompute:
        return (req.pins.recompute,)
    return tuple(r for r in RECOMPUTE if recompute_violation(recompute=r, encoder_decoder=req.dims.is_encoder_decoder)
                 is None and peft_violation(req.peft, recompute=r) is None)


def offload_choices(req: SpaceRequest, optimizer: str | None = None) -> tuple[bool, ...]:
    """Optimizer offload off then on, or as pinned; off alone where `optimizer` cannot step offloaded state."""
    if req.pins.offload is not None:
        return (req.pins.offload,)
    refused = peft_violation(req.peft, offload=True) or (optimizer and optimizer_violation(optimizer, offload=True))
    return (False,) if refused else (False, True)


def compile_choices(req: SpaceRequest, compile_pays: bool) -> tuple[bool, ...]:
    """torch.compile as pinned; unpinned, off, and on too where the device's compile factors make some
    kernel class faster (`compile_pays`). Off comes first, so it wins ties."""
    if req.pins.compile is not None:
        return (req.pins.compile,)
    allowed = compile_violation(compile=True, encoder_decoder=req.dims.is_encoder_decoder) is None \
        and peft_violation(req.peft, compile=True) is None
    return (False, True) if compile_pays and allowed else (False,)


def fp8_compiles(req: SpaceRequest, precision: str) -> bool:
    """fp8 plans compile unless compile is pinned or cannot run. torchao's float8 Linears eagerly dispatch their
    amax, scale and cast ops one by one (`costmodel.opcost.fp8_cast_kernels`): on a lent H100 (2026-11-26) four
    Llama-3-8B layers ran 1.61x slower in eager fp8 than in bf16 and 1.08x faster compiled
    (`benchmarks/fp8_h100.py`); on a lent H200 GPT-2 ran 3.4x slower eagerly (its Linears then converted too)."""
    return precision == "fp8" and req.pins.compile is None and compile_violation(
        compile=True, encoder_decoder=req.dims.is_encoder_decoder) is None


def training_config(req: SpaceRequest, mesh: MeshChoice, head: TrainingHead, *, recompute: str,
                    offload: bool) -> TrainingConfig:
    return TrainingConfig(
        global_batch=req.global_batch, seq_len=req.seq_len, micro_batch=head.micro_batch,
        num_microbatches=head.num_microbatches, grad_accum=head.grad_accum, schedule=head.schedule,
        virtual_stages=head.virtual_stages, zero=mesh.zero, sequence_parallel=mesh.dims.tp > 1,
        recompute=recompute, precision=head.precision, optimizer=head.optimizer, offload_optimizer=offload,
        compile=bool(req.pins.compile) or fp8_compiles(req, head.precision), peft=req.peft,
        cross_entropy=req.pins.cross_entropy,
    )


def frugal_configs(req: SpaceRequest, mesh: MeshChoice, heads: list[TrainingHead] | None = None
                   ) -> Iterator[TrainingConfig]:
    """A mesh's most memory-frugal training configurations (of `heads`, default all): the smallest
    micro-batch, the strongest recompute policy allowed, model state offloaded unless --offload is pinned
    off (a caller drops offload with `dataclasses.replace` where host memory cannot take it). The memory
    bound of the search, the infeasibility error's floor and the host-memory error all start from these."""
    heads = training_heads(req, mesh) if heads is None else heads
    smallest = min((h.micro_batch for h in heads), default=None)
    recompute = recompute_choices(req)[-1]
    for head in heads:
        if head.micro_batch == smallest:
            yield training_config(req, mesh, head, recompute=recompute,
                                  offload=offload_choices(req, head.optimizer)[-1])


def training_choices(req: SpaceRequest, mesh: MeshChoice) -> Iterator[TrainingConfig]:
    """Every training configuration of one mesh, in a fixed order."""
    for head in training_heads(req, mesh):
        for recompute in recompute_choices(req):
            for offload in offload_choices(req, head.optimizer):
                yield training_config(req, mesh, head, recompute=recompute, offload=offload)
