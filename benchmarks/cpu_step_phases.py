"""Where a validate-suite step goes on this CPU, phase by phase, measured against the simulator.

    flock -x /tmp/soap-cpu.lock python -m benchmarks.cpu_step_phases ["gpt2 ddp" "llama fsdp zero3" ...] [--write]

For each suite plan (pp == 1) it runs the executor's model in three settings, one torch thread per
process, timing each phase of the step (forward with the loss, backward, optimizer step) around the
calls the executor makes:
- solo: the plan's local work on one process (a one-rank copy of the plan: same micro-batch, same
  accumulation), the other core idle, which is how `soap calibrate` measures kernels;
- pair: the same on two independent processes at once (no communication): the cost of sharing the
  node (memory bandwidth, caches);
- plan: the plan itself on 2 gloo ranks (its communication and hooks included).
The simulator's figures come from its cost tables (`costmodel.simulator.pricing.price_step`): the sum
of the chunks' forward and backward (recompute included) compute, the optimizer step and the exposed
communication of its breakdown (`simulated_phases`). With --write the table goes to section
`cpu_step_phases` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("forward", "backward", "optimizer", "step")
NOTE = (
    'What to read in it: *alone* against *pair* is what two ranks computing at once cost each other '
    '(`concurrency_efficiency`); *alone* against its simulated figures is the kernel calibration inside a'
    ' real step (autograd and module overhead included); *plan* against *alone* is what communication and'
    " the parallel frameworks add: the collectives' own time, the framework's host time per collective "
    "(`collective_call_overhead_us`) and gloo's threads competing with compute for the ranks' cores "
    "(`communication_overlap`). Under TP the embedding, LM head and loss are vocab-parallel, as the "
    "simulator prices them: each rank runs the loss's log_softmax on its vocabulary shard only. Not in the "
    "model: TP's all-reduces wait 2-3 ms each in training against the 0.7 ms their microbenchmark gives."
)
"""What the table shows and what the model leaves out (written under it)."""
DEFAULT_CASES = ("gpt2 ddp", "llama fsdp zero3", "llama tp", "bert zero2")


def simulated_phases(built) -> dict[str, float]:
    """The simulator's step split into forward, backward, optimizer and exposed communication (seconds)."""
    from costmodel.simulator.pricing import price_step
    from planner.plan import stage_bounds

    plan = built.plan
    costs, _ = price_step(_graph(built), plan.strategy(), _cluster(), stage_bounds=stage_bounds(plan, _graph(built)))
    runs = costs.schedule.num_microbatches * costs.grad_accum
    stage = costs.stages[0]
    fwd = sum(c.fwd_s for c in stage.chunks) * runs
    bwd = sum(c.bwd_s for c in stage.chunks) * runs
    b = built.result.breakdown
    return {"forward": fwd, "backward": bwd, "optimizer": stage.optimizer_s, "exposed_comm": b.exposed_comm,
            "step": built.result.step_time_s,
            "comm_total": sum(c.grad_sync_s + 2 * c.param_gather_s + c.fwd_comm_s + c.bwd_comm_s
                              for c in stage.chunks) * runs}


_GRAPHS: dict = {}
_CLUSTER = []


def _cluster():
    from costmodel.profiles import load_cluster

    if not _CLUSTER:
        _CLUSTER.append(load_cluster(os.environ.get("SOAP_PHASES_CLUSTER", "local-cpu")))
    return _CLUSTER[0]


def _graph(built):
    from executor.validation.refit import trace_plan_model

    key = (built.case.family, built.case.seq_len)
    if key not in _GRAPHS:
        _GRAPHS[key] = trace_plan_model(built.plan, _cluster())
    return _GRAPHS[key]


def solo_case(case):
    """The case's local work as a one-rank plan (same micro-batch and accumulation, TP/FSDP/DDP off)."""
    from dataclasses import replace

    return replace(case, name=case.name + " (one rank)", dims={})


def _phase_step(parallel, optimizers, loss_fn, batch, slicer, device) -> dict[str, float]:
    """executor.train.train_step for pp == 1, with a clock between its phases."""
    import contextlib

    import torch.distributed as dist

    from executor.train import _reduce_partial_grads

    p = parallel.plan.parallelism
    loss_fn.set_step(num_labels=batch.num_labels, ranks_averaging=p.dp * p.cp)
    ids, labels = slicer.local(batch.input_ids), slicer.local(batch.labels)
    positions = slicer.position_ids(parallel.plan.seq_len, device)
    model, m = parallel.model, p.micro_batch
    t = {"forward": 0.0, "backward": 0.0}
    start = time.perf_counter()
    for k in range(p.num_microbatches):
        last = k == p.num_microbatches - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync, parallel.loss_parallel():
            a = time.perf_counter()
            logits = model(input_ids=ids[k * m:(k + 1) * m], position_ids=positions, use_cache=False).logits
            loss = loss_fn(logits, labels[k * m:(k + 1) * m])
            b = time.perf_counter()
            loss.backward()
            c = time.perf_counter()
        t["forward"] += b - a
        t["backward"] += c - b
    a = time.perf_counter()
    _reduce_partial_grads(parallel.parameters())
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    t["optimizer"] = time.perf_counter() - a
    total = loss_fn.unscaled_sum.to(device)
    dist.all_reduce(total)
    t["step"] = time.perf_counter() - start
    return t


def _run_plan(plan_json: str, steps: int, out: str, profile_ops: bool) -> None:
    import torch
    import torch.distributed as dist

    from executor.api import parallelize
    from executor.data import ScaledTokenLoss, Slicer, TokenSource
    from executor.data_parallel import build_optimizer
    from executor.model import build_meta_model
    from planner.plan import plan_from_dict

    plan = plan_from_dict(json.loads(plan_json))
    p = plan.parallelism
    device = torch.device("cpu")
    torch.manual_seed(0)
    loss_fn = ScaledTokenLoss()
    model = build_meta_model(plan.model.config, plan.model.task)
    parallel = parallelize(model, plan, seed=0, loss_fn=loss_fn, device=device)
    optimizers = [build_optimizer(plan, list(part.parameters()), lr=1e-3, mesh=parallel.mesh) for part in parallel.parts]
    source = TokenSource(vocab_size=model.config.vocab_size, global_batch=plan.global_batch, seq_len=plan.seq_len,
                         task=plan.model.task, seed=0)
    slicer = Slicer(dp_rank=parallel.mesh.dp_rank, per_rank=p.micro_batch * p.num_microbatches,
                    cp_rank=parallel.mesh.cp_rank, cp=p.cp)
    rows = [_phase_step(parallel, optimizers, loss_fn, source.batch_for_step(s), slicer, device) for s in range(steps)]
    ops = {}
    if profile_ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _phase_step(parallel, optimizers, loss_fn, source.batch_for_step(steps), slicer, device)
        for e in prof.key_averages():
            ops[e.key] = {"count": e.count, "self_us": e.self_cpu_time_total, "total_us": e.cpu_time_total}
    med = {k: statistics.median(r[k] for r in rows[1:]) for k in PHASES}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"phases": med, "ops": ops}, f)


def _rank_main(rank: int, world: int, groups: int, store: str, plan_json: str, steps: int, out: str,
               profile_ops: bool) -> None:
    """`groups` independent process groups of `world // groups` ranks each (pair: 2 groups of 1)."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    size = world // groups
    group = rank // size
    dist.init_process_group("gloo", init_method=f"file://{store}-{group}", rank=rank % size, world_size=size,
                            timeout=datetime.timedelta(seconds=300))
    _run_plan(plan_json, steps, f"{out}-{group}", profile_ops)
    dist.destroy_process_group()


def measure(plan_json: str, *, processes: int, groups: int, steps: int, profile_ops: bool = False) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="soap-phases-") as tmp:
        out = os.path.join(tmp, "out")
        os.environ["OMP_NUM_THREADS"] = "1"
        mp.spawn(_rank_main, args=(processes, groups, os.path.join(tmp, "store"), plan_json, steps, out, profile_ops),
                 nprocs=processes, join=True)
        return [json.load(open(f"{out}-{g}")) for g in range(groups)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("cases", nargs="*", default=list(DEFAULT_CASES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ops", action="store_true", help="dump torch.profiler op tables (rank 0) to /tmp")
    parser.add_argument("--write", action="store_true", help="write section cpu_step_phases of docs/benchmarks.md")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from executor.validation.suite import build_case, suite_cases

    cases = {c.name: c for c in suite_cases()}
    graphs: dict = {}
    report = []
    for name in args.cases:
        case = cases[name]
        built = build_case(case, _cluster(), graphs)
        solo = build_case(solo_case(case), _cluster(), graphs)
        measured = {
            "solo": measure(solo.plan.to_json(), processes=1, groups=1, steps=args.steps, profile_ops=args.ops)[0],
            "pair": measure(solo.plan.to_json(), processes=2, groups=2, steps=args.steps)[0],
            "plan": measure(built.plan.to_json(), processes=2, groups=1, steps=args.steps, profile_ops=args.ops)[0],
        }
        row = {"case": name, "simulated": simulated_phases(built), "simulated_solo": simulated_phases(solo),
               **{k: v["phases"] for k, v in measured.items()}}
        if args.ops:
            for k in ("solo", "plan"):
                Path(f"/tmp/soap-phases-ops-{name.replace(' ', '_')}-{k}.json").write_text(json.dumps(measured[k]["ops"]))
        report.append(row)
        print(json.dumps(row), flush=True)
    if args.write:
        from benchmarks.report import update_section

        update_section("cpu_step_phases", "Where a validate-suite step goes on this CPU (phases, 2 ranks)",
                       body(report, args.steps))


def body(report: list[dict], steps: int) -> str:
    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x * 1e3:.1f}"

    lines = [
        "`benchmarks/cpu_step_phases.py`: suite plans run phase by phase (a clock around the executor's forward + "
        "loss, backward and optimizer calls; median of the steps after the first, "
        f"{steps} steps), one torch thread per process, with the shipped `local-cpu` profile's predictions beside "
        "them. *alone*: the plan's local work as a one-rank plan, the other core idle (how `soap calibrate` times "
        "kernels); *pair*: the same on two independent processes at once (no communication); *plan*: the plan on "
        "2 gloo ranks. Simulated phases: the chunks' forward and backward compute summed over micro-batches, the "
        "optimizer step, and the step (exposed communication included); the one-rank plan is priced as one "
        "rank alone, the 2-rank plan with both ranks computing (`concurrency_efficiency`) and collectives taking "
        "turns with compute (`communication_overlap`).",
        "",
        "| plan | setting | forward ms sim / meas | backward ms sim / meas | optimizer ms sim / meas | step ms sim / meas |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in report:
        for key, sim in (("solo", r["simulated_solo"]), ("pair", None), ("plan", r["simulated"])):
            m = r[key]
            label = {"solo": "alone", "pair": "pair", "plan": "plan"}[key]
            cells = [f"{ms(sim and sim[k])} / {ms(m[k])}" for k in PHASES]
            lines.append(f"| {r['case']} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", NOTE])


if __name__ == "__main__":
    main()
