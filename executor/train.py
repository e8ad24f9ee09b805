"""The training loop of `soap execute`, run on every rank of an initialized process group.

Per step: the global batch of the step (`executor.data`), this rank's slice of it, forward/backward
over the plan's micro-batches (a loop with pp == 1, the pipeline schedule `grad_accum` times with
pp > 1), the optimizer step, then the loss (all-reduced), the step time (wall clock, synchronized on
CUDA) and tokens/s; at the end each rank's peak memory (CUDA max allocated, or the process's peak RSS
on the CPU), gathered; `peak_memory_gib` is their max. On CUDA the caching allocator's reserved peak
(`max_memory_reserved`, what runs out first) is gathered too: the report then holds
`peak_memory_allocated_gib` and `peak_memory_reserved_gib` (max over ranks), which `soap calibrate
--from-runs` fits the device's `allocator_reserve_fraction` from. Rank 0 shows a progress bar on stderr
and, at the end, measured against predicted. A `Watchdog` (`executor.watchdog`) is told each activity
(building the model, a micro-batch, a pipeline action, the optimizer step, a collective) so that a rank
that stops making progress is named with what it waited on. With `save_hf` the trained model is written
after the last step as a transformers directory (`executor.hf_export`). With `memory_snapshot` (CUDA) the
caching allocator's history of one steady step (the second run, after compilation and the optimizer's first
states) is written per rank as `rank{R}.pickle`, the file https://pytorch.org/memory_viz draws and
`benchmarks.memory_snapshot_peak` reads (torchtitan's `enable_memory_snapshot`).
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from executor.api import ParallelModel, check_world_size, parallelize
from executor.checkpoint import check_resumable, load_checkpoint, run_record, save_checkpoint, saved_run_record
from executor.data import ScaledTokenLoss, Slicer, TokenSource
from executor.data_parallel import build_optimizer
from executor.hf_export import save_hf
from executor.mesh import device_for_rank
from executor.model import build_meta_model, forward_inputs
from executor.pipeline import PipelineProgress
from executor.watchdog import NoWatchdog, Watchdog
from planner.plan import Plan


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How to run a plan (everything the plan itself does not say)."""

    steps: int = 10
    """Optimizer steps to run (in total, counting those before a resumed checkpoint)."""
    seed: int = 0
    """Seeds the initial weights (per FQN), the synthetic data and dropout."""
    lr: float = 1e-3
    """Learning rate of the planned optimizer (constant)."""
    data: str | None = None
    """A .npy / .bin file of token ids; None trains on synthetic tokens."""
    weights: str | None = None
    """A local HF checkpoint directory (safetensors) to start from; None: random weights."""
    checkpoint_dir: str | None = None
    """Where DCP checkpoints go; None: no checkpoints."""
    checkpoint_every: int = 0
    """Save every N steps (and after the last one); 0: only after the last step."""
    resume: bool = False
    """Continue from the newest checkpoint in `checkpoint_dir`."""
    save_hf: str | None = None
    """After the last step, write the trained model here as a transformers-loadable directory
    (`executor.hf_export.save_hf`); None: don't."""
    merge: bool = False
    """With `save_hf` and a PEFT plan: also write the model with its adapters merged (`DIR/merged`)."""
    progress: bool = True
    """Show the progress bar (rank 0, stderr)."""
    memory_snapshot: str | None = None
    """A directory: record the CUDA caching allocator's history (with Python stacks) over one steady step and
    write it there as `rank{R}.pickle`; None: don't. Ignored off CUDA, with a note on stderr."""
    timeout_s: float | None = None
    """Seconds a rank may go without progress inside a step before the run is ended (the setup and the
    first step get at least `executor.watchdog.WARMUP_S`); None: derived from the plan's predicted step
    time (`executor.watchdog.limits_for`)."""


def steady_step_s(step_times_s: list[float]) -> float:
    """The median step, the first left out where others ran: it carries the warm-up (cuBLAS's heuristics, the
    allocator's growth, compilation). A lent H100's 8B LoRA step of 3.99 s read 4.55 s as the median of two
    steps with the first (5.12 s) in it (`benchmarks/data/h100-2026-11-27`)."""
    timed = step_times_s[1:] or step_times_s
    return statistics.median(timed) if timed else 0.0


@dataclass
class RunResult:
    """What rank 0 reports: the `--json` object of `soap execute`."""

    losses: list[float]
    step_times_s: list[float]
    tokens_per_step: int
    peak_memory_per_rank_gib: list[float]
    memory_source: str
    predicted_step_time_s: float | None
    predicted_peak_memory_gib: float | None
    parallelism: dict[str, Any]
    first_step: int = 0
    replans: list[dict[str, Any]] = field(default_factory=list)
    """Each change of layout in the run's life, oldest first (`layout_change`): carried from checkpoint to
    checkpoint, so a run re-planned twice (a node lost, then one joined) lists both."""
    extra: dict[str, Any] = field(default_factory=dict)
    peak_memory_reserved_per_rank_gib: list[float] | None = None
    """CUDA's `max_memory_reserved` per rank (None off CUDA); `peak_memory_per_rank_gib` is then the allocated peak."""

    @property
    def step_time_s(self) -> float:
        return steady_step_s(self.step_times_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "losses": self.losses,
            "step_time_s": self.step_time_s,
            "step_times_s": self.step_times_s,
            "tokens_per_s": self.tokens_per_step / self.step_time_s if self.step_time_s else 0.0,
            "predicted_step_time_s": self.predicted_step_time_s,
            "peak_memory_gib": max(self.peak_memory_per_rank_gib),
            "peak_memory_per_rank_gib": self.peak_memory_per_rank_gib,
            "peak_memory_source": self.memory_source,
            "predicted_peak_memory_gib": self.predicted_peak_memory_gib,
            "first_step": self.first_step,
            "parallelism": self.parallelism,
            "replans": self.replans,
            **self._allocator_peaks(),
        }

    def _allocator_peaks(self) -> dict[str, Any]:
        if self.peak_memory_reserved_per_rank_gib is None:
            return {}
        return {"peak_memory_allocated_gib": max(self.peak_memory_per_rank_gib),
                "peak_memory_reserved_gib": max(self.peak_memory_reserved_per_rank_gib),
                "peak_memory_reserved_per_rank_gib": self.peak_memory_reserved_per_rank_gib}


def train(plan: Plan, config: RunConfig, *, local_rank: int = 0,
          watchdog: Watchdog | NoWatchdog | None = None, replanned_from: Plan | None = None) -> RunResult:
    """Run `config.steps` steps of `plan` on this rank; every rank returns the same result. `watchdog`
    (started by the caller) is told what the rank does, step by step (`executor.watchdog`).
    `replanned_from`: the plan `plan` was re-planned from (an elastic worker group in a world of another
    size); the run records the change against the checkpoint it resumes, or against this plan when it
    resumes none."""
    watch = watchdog or NoWatchdog()
    check_world_size(plan, dist.get_world_size())
    p = plan.parallelism
    device = device_for_rank(local_rank)
    torch.manual_seed(config.seed)
    loss_fn = ScaledTokenLoss(p.cross_entropy)
    watch.activity("in building and parallelizing the model (process groups, sharding, initial weights)",
                   warmup=True)
    model = build_meta_model(plan.model.config, plan.model.task, plan=plan)
    vocab = model.config.vocab_size
    parallel = parallelize(model, plan, seed=config.seed, weights=config.weights, loss_fn=loss_fn, device=device)
    watch.set_stages(parallel.stage_indices)
    optimizers = [build_optimizer(plan, list(part.parameters()), lr=config.lr, mesh=parallel.mesh)
                  for part in parallel.parts]
    source = TokenSource(vocab_size=vocab, global_batch=plan.global_batch, seq_len=plan.seq_len,
                         task=plan.model.task, seed=config.seed, data_file=config.data)
    slicer = Slicer(dp_rank=parallel.mesh.dp_rank, per_rank=p.micro_batch * p.num_microbatches,
                    cp_rank=parallel.mesh.cp_rank, cp=p.cp)
    watch.activity("in loading the checkpoint", warmup=True)
    start, saved, job = 0, {}, elastic_job()
    if _should_resume(config, job):
        check_resumable(plan, config.checkpoint_dir)
        saved = saved_run_record(config.checkpoint_dir)
        start = load_checkpoint(config.checkpoint_dir, parallel.parts, optimizers)
    previous = saved if "parallelism" in saved else run_record(replanned_from) if replanned_from else None
    replans = [*saved.get("replans", []), *layout_change(previous, plan, start)]
    losses: list[float] = []
    times: list[float] = []
    tokens = plan.global_batch * plan.seq_len
    if config.progress and dist.get_rank() == 0 and not config.data:
        print(f"data: synthetic token ids (seed {config.seed}); pass --data FILE or --dataset PATH --tokenizer DIR "
              "to train on text", file=sys.stderr)
    with _progress(config.progress and dist.get_rank() == 0, config.steps, start, tokens) as advance:
        snapshot_step = min(start + 1, config.steps - 1) if config.memory_snapshot else None
        for step in range(start, config.steps):
            begin = _now(device)
            with _memory_snapshot(config.memory_snapshot if step == snapshot_step else None, device):
                loss = train_step(parallel, optimizers, loss_fn, source.batch_for_step(step), slicer, device,
                                  watch=_StepWatch(watch, step, first=step == start))
            times.append(_now(device) - begin)
            losses.append(loss)
            advance(step, loss, times[-1])
            done = step + 1
            if config.checkpoint_dir and (done == config.steps or
                                          (config.checkpoint_every and done % config.checkpoint_every == 0)):
                watch.activity(f"in saving the checkpoint after step {step}", warmup=True)
                save_checkpoint(config.checkpoint_dir, done, parallel.parts, optimizers,
                                run=run_record(plan, job=job, replans=replans))
    if config.save_hf:
        watch.activity("in gathering the trained model and writing it as an HF directory (--save-hf)", warmup=True)
        save_hf(config.save_hf, parallel, merge=config.merge)
    watch.activity("on all_gather of the ranks' peak memory after the last step")
    memory, memory_source = _peak_memory_gib(device)
    reserved = _gather_gib(torch.cuda.max_memory_reserved(device), device) if device.type == "cuda" else None
    return RunResult(
        losses=losses, step_times_s=times, tokens_per_step=plan.global_batch * plan.seq_len,
        peak_memory_per_rank_gib=memory, memory_source=memory_source, peak_memory_reserved_per_rank_gib=reserved,
        predicted_step_time_s=plan.predicted.get("step_time_s"),
        predicted_peak_memory_gib=plan.predicted.get("peak_memory_gib"),
        parallelism=p.model_dump(), first_step=start, replans=replans,
    )


def layout_change(previous: dict | None, plan: Plan, step: int) -> list[dict[str, Any]]:
    """[the re-plan] when `plan`'s layout differs from `previous` (a checkpoint's run record, or the
    record of the plan it was re-planned from), else []: old and new world size and parallelism, and the
    step the new layout starts from (the resumed checkpoint's, 0 without one)."""
    if previous is None:
        return []
    now = plan.parallelism.model_dump(mode="json")
    if (previous.get("world_size"), previous.get("parallelism")) == (plan.world_size, now):
        return []
    return [{"from_ranks": previous.get("world_size"), "to_ranks": plan.world_size,
             "from": previous.get("parallelism"), "to": now, "resumed_from_step": step}]


def train_step(parallel: ParallelModel, optimizers: list, loss_fn: ScaledTokenLoss, batch: Any, slicer: Slicer,
               device: torch.device, *, watch: _StepWatch | None = None) -> float:
    """One optimizer step on this rank; returns the global mean loss of the step."""
    watch = watch or _StepWatch(NoWatchdog(), 0, first=False)
    plan = parallel.plan
    p = plan.parallelism
    loss_fn.set_step(num_labels=batch.num_labels, ranks_averaging=p.dp * p.cp)
    ids = slicer.local(batch.input_ids).to(device)
    labels = slicer.local(batch.labels).to(device)
    runtime = parallel.precision
    if p.pp == 1:
        model = parallel.model
        positions = slicer.position_ids(plan.seq_len, device)
        m = p.micro_batch
        for k in range(p.num_microbatches):
            watch.activity(f"in the forward and backward of micro-batch {k}")
            last = k == p.num_microbatches - 1
            sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
            # loss_parallel (vocab-sharded logits under TP) must hold for the loss and its backward
            with sync, parallel.loss_parallel():
                with runtime.autocast():
                    inputs = forward_inputs(parallel.parts[0], ids[k * m:(k + 1) * m], labels[k * m:(k + 1) * m],
                                            positions)
                    logits = model(**inputs, use_cache=False).logits
                # the loss outside autocast (it computes in fp32 either way): leaving autocast frees its cache of
                # 16-bit weight copies, which recomputed blocks make again in backward, before the loss makes its
                # working set (`costmodel.memory.held_autocast_copies`; on a lent H100 the chunked loss's peak,
                # in its forward, held 1.6 GiB of them for four Llama-3-8B layers). The logits are dropped once
                # the loss holds what it saved: nothing holds them through backward (torchtitan's `del pred`;
                # `costmodel.memory_activations.loss_tensors` prices it)
                loss = loss_fn(logits, labels[k * m:(k + 1) * m])
                del logits
                (runtime.scaler.scale(loss) if runtime.scaler else loss).backward()
    else:
        rows = p.micro_batch * (p.num_microbatches // p.grad_accum)
        losses: list[torch.Tensor] = []
        for run in range(p.grad_accum):
            chunk = slice(run * rows, (run + 1) * rows)
            args = (ids[chunk],) if parallel.has_first_stage else ()
            target = labels[chunk] if parallel.has_last_stage else None
            run_losses: list[torch.Tensor] = []
            watch.pipeline(parallel.schedule.soap_progress, run)
            # each stage's forward runs under autocast (`PrecisionRuntime.autocast_each_forward`), not the step
            parallel.schedule.step(*args, target=target, losses=run_losses if target is not None else None)
            losses.extend(run_losses)
        # the schedule's own losses: the loss function may also run during the stages' shape inference
        loss_fn.unscaled_sum = (sum((l.detach().cpu() for l in losses), torch.zeros(()))
                                / (loss_fn.factor * runtime.loss_scale))
    watch.activity("on all_reduce of the gradients of weights tied across pipeline stages")
    parallel.sum_tied_gradients()
    watch.activity("in the optimizer step")
    _reduce_partial_grads(parallel.parameters())
    for optimizer in optimizers:
        if runtime.scaler:
            runtime.scaler.step(optimizer)
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if runtime.scaler:
        runtime.scaler.update()
    total = loss_fn.unscaled_sum.to(device, torch.float64)
    watch.activity("on all_reduce of the step's loss")
    dist.all_reduce(total)
    return float(total) / (batch.num_labels * p.tp)


@dataclass(frozen=True)
class _StepWatch:
    """The watchdog's view of one step: each activity is named with the step (`... in step 2`); the
    first step of a run gets the warm-up limit (lazy initialization, shape inference, compilation)."""

    watchdog: Watchdog | NoWatchdog
    step: int
    first: bool

    def activity(self, what: str) -> None:
        self.watchdog.activity(f"{what} in step {self.step}", warmup=self.first)

    def pipeline(self, progress: PipelineProgress, run: int) -> None:
        """A schedule run starts: its actions beat the watchdog, which asks `progress` what it waits on."""
        progress.start_run()
        progress.beat = self.watchdog.beat
        runs = f", schedule run {run}" if run else ""
        self.watchdog.activity(lambda: f"{progress.waiting_on()} in step {self.step}{runs}", warmup=self.first)


def _reduce_partial_grads(params: list) -> None:
    """Sum partial DTensor gradients (sequence-parallel norm weights) once, before the optimizer.

    Left partial, every foreach optimizer op on them would all-reduce again."""
    from torch.distributed.tensor import DTensor, Partial

    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(isinstance(pl, Partial) for pl in grad.placements):
            param.grad = grad.redistribute(grad.device_mesh, param.placements)


@contextlib.contextmanager
def _memory_snapshot(directory: str | None, device: torch.device):
    """Record the caching allocator's alloc/free history with Python stacks while the block runs, then
    write it to `directory/rank{R}.pickle` (nothing without a directory; a note off CUDA)."""
    if directory is None:
        yield
        return
    if device.type != "cuda":
        if dist.get_rank() == 0:
            print("--memory-snapshot: the allocator history is CUDA's; this run is on the CPU, nothing written",
                  file=sys.stderr)
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=500_000, context="alloc", stacks="python")
    try:
        yield
        torch.cuda.synchronize(device)
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(Path(directory) / f"rank{dist.get_rank()}.pickle"))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _peak_memory_gib(device: torch.device) -> tuple[list[float], str]:
    """Every rank's peak memory (GiB), gathered on all ranks."""
    if device.type == "cuda":
        nbytes, source = torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    else:
        nbytes, source = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"
    return _gather_gib(nbytes, device), source


def _gather_gib(nbytes: float, device: torch.device) -> list[float]:
    """Every rank's `nbytes` in GiB, gathered on all ranks."""
    where = device if device.type == "cuda" else "cpu"
    peaks = [torch.zeros((), dtype=torch.float64, device=where) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor(nbytes / 2**30, dtype=torch.float64, device=where))
    return [float(p) for p in peaks]


@contextlib.contextmanager
def _progress(enabled: bool, steps: int, start: int, tokens_per_step: int) -> Any:
    if not enabled:
        yield lambda *args: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                  TimeRemainingColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task("train", total=steps, completed=start, status="")

        def advance(step: int, loss: float, seconds: float) -> None:
            bar.update(task, advance=1, status=f"loss {loss:.4f}  {seconds * 1e3:.0f} ms/step  "
                                                f"{tokens_per_step / seconds:,.0f} tok/s")

        yield advance


def elastic_job() -> str | None:
    """The elastic job these workers belong to (the rendezvous id, `TORCHELASTIC_RUN_ID`; a random one on
    a single node), or None outside torch's agent or under its placeholder id `none`."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    return job if job and job != "none" else None


def _should_resume(config: RunConfig, job: str | None = None) -> bool:
    """`--resume`, or a worker group the elastic agent started again: it continues from the last complete
    checkpoint when one exists, instead of training from step 0 again.

    A group is started again after a failure (`TORCHELASTIC_RESTART_COUNT` > 0) or when nodes left or
    joined; the agent does not count the second, and each node counts its own failures, so in a re-formed
    group some nodes may say 0 and others 1. Every rank must decide alike, so under an elastic `job` (the
    same on every node) the group resumes exactly when the newest checkpoint was written by that job; the
    restart count decides only without one (torch's placeholder id `none`)."""
    if config.resume:
        return True
    if not (config.checkpoint_dir and (Path(config.checkpoint_dir) / "latest").is_file()):
        return False
    if job is not None:
        return saved_run_record(config.checkpoint_dir).get("job") == job
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
