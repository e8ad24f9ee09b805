"""The rules a plan must meet before torch will run it: one module, read by the search, the plan loader
and the executor.

Pipeline rules (`pipeline_violation`), exactly what the installed torch (2.13) enforces when a schedule
is constructed, in `torch/distributed/pipelining/schedules.py`; `m` is the micro-batch count of one
schedule run, `num_microbatches // grad_accum`, because that is the `n_microbatches` the executor hands
the schedule (`executor.pipeline.build_schedule`):

    schedule               stages per rank v   micro-batches m per run    torch source
    GPipe                  1                   any                        PipelineScheduleSingle
    1F1B                   1                   m >= pp                    Schedule1F1B.__init__
    Interleaved1F1B        any                 m % max(1, m // pp) == 0   ScheduleInterleaved1F1B.__init__
    InterleavedZeroBubble  any                 m % max(1, m // pp) == 0   ScheduleInterleavedZeroBubble.__init__
    LoopedBFS              any                 any                        ScheduleLoopedBFS
    ZBVZeroBubble          exactly 2           any                        ScheduleZBVZeroBubble.__init__

"v == 1" for GPipe and 1F1B is the single-stage schedules' signature (`PipelineScheduleSingle` takes one
stage). `grad_accum` must divide `num_microbatches` (`TrainingConfig.__post_init__`), since every run
takes the same count. tests/test_plan_rules.py constructs each torch schedule class on a fake process
group and checks that it raises exactly where `pipeline_violation` says it will.

Model and mesh rules (`model_violation`): `ParallelDims.check_model` (tp divides heads, tp and the KV
heads divide one another, tp divides the vocabulary when it is sharded, cp splits the sequence into 2·cp
chunks, pp <= layers), plus ep dividing the expert count. Encoder-decoder models (T5, BART) run
data-parallel only (`ENCODER_DECODER_SPLITS`): soap's executor has no tensor, pipeline or context
parallelism for their two stacks and cross-attention yet, so neither the search nor a plan file may ask
for them.

What soap's executor runs on top of torch's rules (`executed_pipeline_violation`, `compile_violation`):
every schedule above (`NOT_EXECUTED` is empty), but ZeRO-3 not under the split-backward schedules
(`SPLIT_BACKWARD_SCHEDULES`: FSDP keeps the blocks gathered there, which is ZeRO-2), and no compile of
encoder-decoder models (their compiled blocks train differently) and no activation checkpointing of them
(`recompute_violation`: T5 checkpointed trains differently). Compiled blocks do run under the
split-backward schedules: their input backward retains the graph for the weight backward, which a
compiled backward that donates its saved buffers refuses, so the executor compiles them without
donation there (`executor.api.compile_blocks`); tests/test_plans_execute.py holds both zero-bubble
schedules with compile to one process. TP groups may span nodes and may outnumber the KV heads (the
executor replicates K and V over TP then, `executor.tensor_parallel.replicate_kv_heads`): neither is a
rule here; keeping the search's TP inside an NVLink domain is the planner's choice (`planner.space`). torch's
Adafactor and bitsandbytes' 8-bit AdamW step plain parameters only (`optimizer_violation`: not under TP or
FSDP2).

Pipeline messages name the plan.json field (`parallelism.num_microbatches`, ...) and the fix; model
messages name the degree (`tp=3 does not divide 4 attention heads; ...`), which the plan loader prefixes
with `parallelism:`.
"""

from __future__ import annotations

from costmodel.strategy import ParallelDims, runs_on_fsdp2
from tracer.errors import SoapError

SINGLE_STAGE_SCHEDULES = frozenset({"GPipe", "1F1B"})
"""torch's `PipelineScheduleSingle` subclasses: one stage per rank."""

ROUNDS_SCHEDULES = frozenset({"Interleaved1F1B", "InterleavedZeroBubble"})
"""Schedules that split the micro-batches into max(1, m // pp) equal rounds."""


def pipeline_violation(schedule: str, *, pp: int, virtual_stages: int, num_microbatches: int,
                       grad_accum: int = 1) -> str | None:
    """Why torch would refuse `schedule` on `pp` ranks with these micro-batches, or None if it runs."""
    v, total, accum = virtual_stages, num_microbatches, grad_accum
    if pp < 1 or v < 1 or total < 1 or accum < 1:
        return (f"parallelism: pp={pp}, virtual_stages={v}, num_microbatches={total} and grad_accum={accum} "
                "must all be at least 1")
    if total % accum:
        return (f"parallelism.grad_accum={accum} does not divide parallelism.num_microbatches={total}; "
                "every schedule run takes the same number of micro-batches")
    if pp == 1:
        return None
    m = total // accum
    runs = f" ({total} micro-batches over {accum} runs)" if accum > 1 else ""
    if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        return (f"parallelism.virtual_stages={v}: schedule {schedule} runs one stage per rank; "
                "set virtual_stages to 1 or use Interleaved1F1B")
    if schedule == "ZBVZeroBubble" and v != 2:
        return f"parallelism.virtual_stages={v}: ZBVZeroBubble needs exactly 2 stages per rank"
    if schedule == "1F1B" and m < pp:
        return (f"parallelism.num_microbatches: {m} micro-batch(es) per schedule run{runs} is fewer than the "
                f"{pp} pipeline stages 1F1B needs; use at least {pp} per run (a smaller micro_batch or a "
                "smaller grad_accum), or schedule GPipe")
    if schedule in ROUNDS_SCHEDULES:
        rounds = max(1, m // pp)
        if m % rounds:
            return (f"parallelism.num_microbatches: {m} micro-batch(es) per schedule run{runs} is not a multiple "
                    f"of the {rounds} rounds (max(1, m // pp={pp})) that {schedule} needs; use a multiple of "
                    f"{pp} or at most {pp}")
    return None


NOT_EXECUTED: dict[str, str] = {}
"""Schedules torch accepts that soap's executor cannot run yet ({name: why}): the search leaves them out
and the plan loader and the executor refuse them, so soap never writes or starts a plan that does not
execute. Empty: every schedule above runs (tests/test_executor_multiprocess.py holds each to a single
process)."""


SPLIT_BACKWARD_SCHEDULES = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble"})
"""Schedules whose backward is split into input (I) and weight (W) actions, a weight backward running
after later forwards of its stage. FSDP2 must then keep the stage's blocks gathered from forward to
weight backward (`executor.pipeline.build_schedule` turns resharding after forward off): ZeRO-2, not 3."""


def executed_pipeline_violation(schedule: str, *, pp: int, virtual_stages: int, num_microbatches: int,
                                grad_accum: int = 1, zero: int = 0) -> str | None:
    """`pipeline_violation`, or why soap's executor cannot run `schedule` (`NOT_EXECUTED`, or ZeRO-3 under
    a split-backward schedule, which it runs as ZeRO-2): the rule the search, the plan loader and the
    executor apply."""
    reason = pipeline_violation(schedule, pp=pp, virtual_stages=virtual_stages, num_microbatches=num_microbatches,
                                grad_accum=grad_accum)
    if reason is None and pp > 1 and schedule in NOT_EXECUTED:
        return f"parallelism.schedule={schedule}: {NOT_EXECUTED[schedule]}; use Interleaved1F1B, 1F1B or GPipe"
    if reason is None and pp > 1 and zero == 3 and schedule in SPLIT_BACKWARD_SCHEDULES:
        return (f"parallelism.zero=3 with schedule {schedule}: its weight backward runs after later forwards, so "
                "FSDP keeps each stage's blocks gathered through the step, which is ZeRO-2; use zero 2, or "
                "Interleaved1F1B")
    return reason


def check_pipeline(schedule: str, *, pp: int, virtual_stages: int, num_microbatches: int,
                   grad_accum: int = 1, zero: int = 0) -> None:
    """`executed_pipeline_violation`, raised as a SoapError."""
    reason = executed_pipeline_violation(schedule, pp=pp, virtual_stages=virtual_stages,
                                         num_microbatches=num_microbatches, grad_accum=grad_accum, zero=zero)
    if reason:
        raise SoapError(reason)


ENCODER_DECODER_SPLITS = ("tp", "pp", "cp")
"""The degrees soap's executor cannot split an encoder-decoder model over (each must be 1)."""


def compile_violation(*, compile: bool, encoder_decoder: bool) -> str | None:
    """Why soap's executor cannot compile this model, or None. Compiling an encoder-decoder's blocks one
    by one (T5) changes its training: the tied embedding's gradient differs from the eager model's
    (found by benchmarks/plans_execute.py), so compile stays off for them until that is understood."""
    if compile and encoder_decoder:
        return ("parallelism.compile: compiling an encoder-decoder model's blocks changes its gradients in soap's "
                "executor (the tied embedding's); plan it with --compile off")
    return None


def recompute_violation(*, recompute: str, encoder_decoder: bool) -> str | None:
    """Why soap's executor cannot checkpoint this model's blocks, or None. HF's T5 under activation
    checkpointing (full or selective) trains differently from the same model without it: one process,
    fp32, SGD, the second step's loss differs by 2.6e-4 relative (found by the plans-execute CI sample;
    the relative position bias the first block computes and the later blocks reuse is the likely path
    lost), so encoder-decoders train without recompute until that is understood."""
    if recompute != "none" and encoder_decoder:
        return (f"parallelism.recompute={recompute}: activation checkpointing changes an encoder-decoder model's "
                "gradients in soap's executor (T5's shared position bias); plan it with --recompute none")
    return None


def model_violation(*, tp: int, pp: int, cp: int, ep: int = 1, num_layers: int, heads: int, kv_heads: int,
                    vocab: int, seq_len: int, num_experts: int = 0, encoder_decoder: bool = False) -> str | None:
    """Why a mesh cannot split this model, or None: `ParallelDims.check_model`, the expert count, and the
    data-parallel-only rule of encoder-decoder models."""
    if encoder_decoder:
        split = [f"{name}={degree}" for name, degree in zip(ENCODER_DECODER_SPLITS, (tp, pp, cp)) if degree > 1]
        if split:
            return (f"{', '.join(split)}: soap's executor runs encoder-decoder models with data parallelism "
                    "only (dp, ZeRO, recompute, precision); set tp, pp and cp to 1")
    try:
        ParallelDims(tp=tp, pp=pp, cp=cp).check_model(
            num_layers=num_layers, heads=heads, kv_heads=kv_heads, vocab=vocab, seq_len=seq_len
        )
    except SoapError as exc:
        return str(exc)
    if ep > 1 and (num_experts <= 1 or num_experts % ep):
        return f"ep={ep} does not divide the model's {num_experts} experts; pick a divisor of {num_experts}"
    return None


PEFT_SPLITS = ("tp", "cp", "ep")
"""Degrees soap's executor has not run with LoRA adapters (each must be 1 under --peft)."""
QLORA_SPLITS = ("pp",)
"""Further degrees QLoRA's 4-bit weights do not run under in soap's executor."""


def optimizer_violation(optimizer: str, *, tp: int = 1, dp: int = 1, cp: int = 1, pp: int = 1, zero: int = 0,
                        offload: bool = False) -> str | None:
    """Why soap's executor cannot step `optimizer` under these choices, or None. Two optimizers step plain
    tensors only, so not the DTensor parameters of TP or FSDP2 (`costmodel.strategy.runs_on_fsdp2`, offload
    included): torch's Adafactor (`torch.optim.Adafactor`) reduces each gradient over its rows and its columns in
    place, which a DTensor sharded along one of them cannot keep, and bitsandbytes' 8-bit AdamW calls its own
    update kernels, for which DTensor has no sharding rule; each failed its first step. They run on DDP, ZeRO-1,
    pipelines and context parallelism (tests/test_optimizer_layouts.py)."""
    if optimizer not in PLAIN_TENSOR_OPTIMIZERS:
        return None
    if tp > 1 or runs_on_fsdp2(dp=dp, cp=cp, tp=tp, pp=pp, zero=zero, offload=offload):
        what = "tp > 1" if tp > 1 else "offload" if offload else "FSDP2 (ZeRO 2/3, or a pipeline with data parallelism)"
        return (f"optimizer {optimizer} under {what}: {PLAIN_TENSOR_OPTIMIZERS[optimizer]} cannot step sharded "
                "(DTensor) parameters; use adamw, or DDP / ZeRO-1 without TP")
    return None


PLAIN_TENSOR_OPTIMIZERS = {"adafactor": "torch's Adafactor", "adamw8bit": "bitsandbytes' 8-bit AdamW"}
"""Optimizers that step plain tensors only (`optimizer_violation`), and whose they are."""


def peft_violation(method: str | None, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, zero: int = 0,
                   offload: bool = False, precision: str = "bf16", compile: bool = False,
                   recompute: str = "none") -> str | None:
    """Why soap's executor cannot fine-tune with PEFT `method` (lora, qlora; None: full training) under
    these choices, or None. LoRA runs under DP, FSDP2 (every ZeRO stage, frozen and trainable parameters in
    one unit), pipelines and recompute, each held to one process by tests/test_peft_execute.py; tensor,
    context and expert parallelism with adapters, fp8's float8 Linear layers (which replace the base
    linears peft wraps) and torch.compile of adapted blocks are not executed, so they are refused. QLoRA's
    bitsandbytes 4-bit weights (`Params4bit`) are not DTensors: they run on DDP only (ZeRO 0/1), without
    a pipeline or offload; and not under selective recompute, whose policy caches every other aten matmul
    output: bitsandbytes' 4-bit matmul is none, so the run caches other tensors than soap prices
    (measured: 45% less than predicted, benchmarks/peft_memory.py)."""
    if method is None:
        return None
    degrees = {"tp": tp, "cp": cp, "ep": ep, "pp": pp}
    split = [f"{name}={degrees[name]}" for name in PEFT_SPLITS + (QLORA_SPLITS if method == "qlora" else ())
             if degrees[name] > 1]
    if split:
        return (f"{', '.join(split)}: soap's executor runs {method} with data parallelism"
                + (", ZeRO 0/1 and recompute" if method == "qlora" else ", FSDP, pipelines and recompute")
                + " only; set " + " and ".join(s.split("=")[0] for s in split) + " to 1")
    if precision == "fp8":
        return f"precision fp8: its float8 Linear layers replace the linears {method} adapts; use bf16"
    if compile:
        return f"compile: soap's executor does not compile {method}-adapted blocks; plan it with --no-compile"
    if method == "qlora" and recompute == "selective":
        return ("recompute selective: its policy does not see bitsandbytes' 4-bit matmuls, so QLoRA caches "
                "other tensors than soap prices; use --recompute full or none")
    if method == "qlora" and (zero >= 2 or offload):
        what = f"zero={zero}" if zero >= 2 else "offload"
        return (f"{what}: QLoRA's 4-bit weights (bitsandbytes) do not shard with FSDP2 in soap's executor; "
                "use --zero 0 or 1 and --no-offload")
    return None
