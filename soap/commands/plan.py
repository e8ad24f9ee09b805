"""`soap plan MODEL --gpus N`: search for the fastest plan that fits, explain it, write plan.json."""

from __future__ import annotations

import argparse
import json
import sys
import threading

from costmodel.strategy import EXECUTED_CROSS_ENTROPY, OPTIMIZERS, PRECISIONS, RECOMPUTE, SCHEDULES
from tracer.errors import SoapError
from tracer.peft import PEFT_METHODS


PIN_ARGS = ("tp", "pp", "dp", "cp", "zero", "micro_batch", "grad_accum", "recompute", "schedule", "precision",
            "optimizer", "ep", "virtual_stages", "offload", "compile", "cross_entropy")
"""The pinned flags' argparse destinations (`planner.api.PIN_NAMES`)."""


def add_request_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that shape a plan request besides the model, the GPU count and the cluster: task, batch,
    sequence length, the pins and the memory limit (shared by `soap plan` and `soap compare`)."""
    p.add_argument("--task", help="causal-lm, masked-lm, seq-cls or seq2seq-lm (default: from the config)")
    add_pin_flags(p)
    p.add_argument("--mem-limit", type=float, metavar="GIB", help="usable memory per GPU in GiB (default: the device's)")


def add_pin_flags(p: argparse.ArgumentParser) -> None:
    """The batch, sequence and pin flags (`PIN_ARGS`) that `soap plan`, `soap compare` and `soap tune` share."""
    p.add_argument("--global-batch", type=int, help="samples (sequences) per optimizer step")
    p.add_argument("--seq-len", type=int, help="tokens per sample")
    p.add_argument("--precision", choices=(*PRECISIONS, "auto"),
                   help="pin the precision (default bf16, fp16 where the device lacks it); auto also searches fp8 "
                   "where the device has it")
    p.add_argument("--optimizer", choices=(*OPTIMIZERS, "auto"), default="adamw",
                   help="optimizer (default adamw); auto lets the search pick adamw, adamw8bit or adafactor")
    for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("dp", "data (replicate x shard)"), ("cp", "context")):
        p.add_argument(f"--{name}", type=int, help=f"pin the {what} parallel degree")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="pin the ZeRO stage of the data-parallel group")
    p.add_argument("--micro-batch", type=int, help="pin the samples per micro-batch")
    p.add_argument("--grad-accum", type=int, help="pin the gradient-accumulation steps")
    p.add_argument("--recompute", choices=RECOMPUTE, help="pin activation checkpointing")
    p.add_argument("--schedule", choices=SCHEDULES, help="pin the pipeline schedule")
    p.add_argument("--ep", type=int, help="pin the expert parallel degree (MoE models; ranks borrowed from dp_shard x cp)")
    p.add_argument("--virtual-stages", type=int, metavar="V",
                   help="pin the pipeline stages per rank (> 1 needs --pp > 1 and a multi-stage schedule)")
    for name, what in (("offload", "optimizer offload: state and step on the CPU"),
                       ("compile", "torch.compile of each block")):
        p.add_argument(f"--{name}", nargs="?", const="on", choices=("on", "off"), metavar="on|off",
                       help=f"pin {what} (--{name} alone: on); default: searched")
        p.add_argument(f"--no-{name}", dest=name, action="store_const", const="off", help=f"same as --{name} off")
    p.add_argument("--cross-entropy", choices=EXECUTED_CROSS_ENTROPY, default="chunked",
                   help="the loss: chunked (default; the gradient made in the forward, a slice of tokens at a "
                   "time, 1.25-3x the fp32 logits at its peak) or upcast (cross_entropy on an fp32 copy, as "
                   "transformers and torchtitan compute it: 3x)")
    add_peft_flags(p)


def add_peft_flags(p: argparse.ArgumentParser) -> None:
    """--peft and its LoRA settings (tracer.peft.PeftSpec): the model trains with adapters."""
    p.add_argument("--peft", choices=PEFT_METHODS, help="fine-tune with LoRA adapters (qlora: over a 4-bit NF4 base)")
    p.add_argument("--lora-rank", type=int, metavar="R", help="adapter rank (default 8)")
    p.add_argument("--lora-alpha", type=float, metavar="A", help="adapter scaling alpha (default 16)")
    p.add_argument("--lora-targets", metavar="M,...",
                   help="module names that get adapters (default: peft's all-linear, the attention and MLP "
                   "projections)")
    p.add_argument("--lora-dropout", type=float, metavar="P", help="dropout on the adapters' input (default 0)")


def peft_of(args: argparse.Namespace) -> dict | None:
    """The --peft settings as `soap.plan(peft=...)` takes them; None without --peft."""
    settings = {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
                "targets": args.lora_targets}
    given = {k: v for k, v in settings.items() if v is not None}
    if args.peft is None:
        if given:
            raise SoapError(f"--lora-{next(iter(given))} needs --peft lora or --peft qlora")
        return None
    return {"method": args.peft, **given}


def pins_of(args: argparse.Namespace) -> dict:
    """The pins, and `peft` when --peft is given."""
    peft = peft_of(args)
    return {k: getattr(args, k) for k in PIN_ARGS} | ({"peft": peft} if peft else {})


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="search for the fastest plan that fits in memory",
        description="Search the SOAP space (data, tensor, pipeline, context parallelism and the single-device "
        "techniques) for the fastest plan that fits; pinned flags fix their dimension. Defaults: sequence "
        "length = min(the model's maximum positions, 4096); global batch = about 4M tokens per step "
        "(2^22 / seq samples), rounded up to a multiple of the GPU count.",
    )
    p.add_argument("model", metavar="MODEL", help="preset name, config.json path or directory, or Hub id")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--cluster", default="dgx-h100", help="cluster profile name or JSON file (default dgx-h100)")
    p.add_argument("--gpus-per-node", type=int, help="override the cluster's GPUs per node")
    add_request_arguments(p)
    p.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help="spend this long refining the plan with simulator-guided MCMC")
    p.add_argument("--seed", type=int, default=0, help="seed of the MCMC refinement (default 0)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow configs that ship their own code (auto_map); runs that code")
    p.add_argument("-o", "--output", metavar="plan.json", help="write the plan here")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--export", action="append", metavar="FORMAT[=PATH]",
                   help="also write the plan as accelerate, torchtitan, deepspeed or megatron configuration "
                   "(repeatable; default PATH next to -o, see `soap export --help`)")
    return p


PROGRESS_DELAY_S = 1.0
"""A plan that finishes sooner shows no progress bar."""


class DelayedProgress:
    """A rich progress bar on stderr that appears once the plan has taken `PROGRESS_DELAY_S` (a timer
    thread starts it, so it shows during a long trace too) and is erased when the plan ends. Called as
    `planner.search.Progress`. Nothing is drawn where stderr is not a terminal, and rich is imported
    only when the bar appears, so quick plans pay nothing."""

    def __init__(self, delay_s: float = PROGRESS_DELAY_S) -> None:
        self._lock = threading.Lock()
        self._state: tuple[str, int, int | None] = ("starting", 0, None)
        self._bar = self._task = None
        self._closed = False
        self._timer = threading.Timer(delay_s, self._show)
        self._timer.daemon = True
        self._timer.start()

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        self._state = (phase, done, total)
        if self._bar is not None:
            task = next(t for t in self._bar.tasks if t.id == self._task)
            task.total = total  # None: a pulsing bar (rich's update() reads None as "unchanged")
            self._bar.update(self._task, description=phase, completed=done)

    def _show(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        with self._lock:
            if self._closed or not console.is_terminal:
                return
            bar = Progress(SpinnerColumn(), TextColumn("[bold]soap plan[/bold] {task.description}"), BarColumn(),
                           MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True)
            phase, done, total = self._state
            self._task = bar.add_task(phase, total=total, completed=done)
            bar.start()
            self._bar = bar

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._closed = True
            if self._bar is not None:
                self._bar.stop()


SLOW_STEP_S = {"GPU": 60.0, "CPU process": 10.0}
"""A predicted step longer than this (per kind of rank) under the default batch gets a hint to choose the
batch."""


def default_batch_hint(plan) -> str | None:
    """One line when the default batch (about 4M tokens, sized for GPU clusters) makes a step slow or runs on
    CPU processes; None otherwise."""
    from planner.report import plan_device

    step = plan.predicted.get("step_time_s", 0.0)
    if step <= SLOW_STEP_S.get(plan_device(plan).rank_noun, 60.0):
        return None
    return (f"batch: the default {plan.global_batch:,} sequences of {plan.seq_len} "
            f"({plan.global_batch * plan.seq_len:,} tokens, a GPU-cluster size) take {step:,.0f} s per step here; "
            "choose one with --global-batch (and --seq-len)")


def positions_note(plan) -> str | None:
    """One line when the plan's sequence is longer than the positions the model's config declares (a RoPE
    model runs past them, untrained there; learned position tables refuse it when traced)."""
    from types import SimpleNamespace

    from tracer.inputs import max_positions

    positions = max_positions(SimpleNamespace(**plan.model.config))
    if positions is None or plan.seq_len <= positions:
        return None
    return (f"note: --seq-len {plan.seq_len} is longer than the {positions} positions {plan.model.name} declares "
            "(max_position_embeddings); it was not trained past them: for long-context training set rope_scaling "
            "and max_position_embeddings in a copy of its config.json")


def vocabulary_note(plan) -> str | None:
    """One line when the model's vocabulary is not a multiple of 8 and the device's profile prices what that
    costs (a `matmul-unaligned` factor, `costmodel.opcost.unaligned_matmul`): the LM head's GEMMs leave
    cuBLAS's aligned kernels, which padding the vocabulary avoids (nanoGPT's 50,257 -> 50,304)."""
    from costmodel.opcost import ALIGNMENT_ELEMENTS
    from costmodel.profiles import UNALIGNED_MATMUL
    from planner.report import plan_device

    vocab = plan.model.config.get("vocab_size")
    if not isinstance(vocab, int) or vocab % ALIGNMENT_ELEMENTS == 0:
        return None
    factors = [key for key in plan_device(plan).kernel_factors if key.startswith(f"{UNALIGNED_MATMUL}/")]
    if not factors:
        return None
    padded = -(-vocab // 64) * 64
    return (f"note: the vocabulary ({vocab:,}) is not a multiple of {ALIGNMENT_ELEMENTS}, so the LM head's GEMMs run "
            f"on slow unaligned kernels (priced as measured, {UNALIGNED_MATMUL}); padding it to {padded:,} "
            f"(model.resize_token_embeddings({vocab}, pad_to_multiple_of=64)) avoids that")


def run(args: argparse.Namespace) -> int:
    from planner.api import plan_report
    from planner.report import render_summary, report_json
    from tracer.files import check_writable

    pins = pins_of(args)
    if args.output:
        check_writable(args.output, what="-o")
    exports = None
    if args.export:
        from pathlib import Path

        from soap.commands.export import parse_exports

        exports = parse_exports(args.export, directory=Path(args.output).parent if args.output else ".")
    progress = DelayedProgress()
    try:
        report = plan_report(
            args.model, gpus=args.gpus, cluster=args.cluster, gpus_per_node=args.gpus_per_node, task=args.task,
            global_batch=args.global_batch, seq_len=args.seq_len, mem_limit_gib=args.mem_limit,
            time_budget_s=args.time_budget, seed=args.seed, trust_remote_code=args.trust_remote_code,
            progress=progress, **pins,
        )
    finally:
        progress.close()
    if args.output:
        report.plan.save(args.output)
    if args.json:
        print(json.dumps(report_json(report), sort_keys=True))
    else:
        render_summary(report, output=args.output)
    if args.seq_len is not None:
        note = positions_note(report.plan)
        if note:
            print(note, file=sys.stderr)
    note = vocabulary_note(report.plan)
    if note:
        print(note, file=sys.stderr)
    if args.global_batch is None:
        hint = default_batch_hint(report.plan)
        if hint:
            print(hint, file=sys.stderr)
    if args.output and not args.json:
        print(f"wrote {args.output}", file=sys.stderr)
    if exports:
        from soap.commands.export import write_exports

        write_exports(report.plan, exports)
    return 0
