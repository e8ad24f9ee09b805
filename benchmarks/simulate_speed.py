"""How long one `simulate` call takes for llama-3.1-405b on 16,384 GPUs (tp 8, pp 16, dp 128, seq 8192).

Tracing is timed separately (it happens once per model, not per candidate). `simulate` is timed
cold (first call in the process: it imports torch's pipelining module for multi-stage schedules)
and warm (median of the next runs), for several pipeline schedules. Run it on a quiet machine:

    flock -x /tmp/soap-cpu.lock python -m benchmarks.simulate_speed
"""

from __future__ import annotations

import statistics
import time

from benchmarks.report import update_section

MODEL, SEQ, GPUS = "llama-3.1-405b", 8192, 16384
WARM_RUNS = 5


def main() -> None:
    import tracer
    from costmodel.profiles import load_cluster
    from costmodel.simulator import simulate
    from costmodel.strategy import ParallelDims, Strategy, TrainingConfig

    start = time.perf_counter()
    graph = tracer.trace(MODEL, seq_len=SEQ)
    trace_s = time.perf_counter() - start
    cluster = load_cluster("dgx-h100")
    dims = ParallelDims(tp=8, pp=16, dp_shard=128)
    assert dims.world_size == GPUS
    rows = []
    for schedule, v in (("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)):
        train = TrainingConfig(global_batch=2048, seq_len=SEQ, micro_batch=1, num_microbatches=16, schedule=schedule,
                               virtual_stages=v, zero=1, sequence_parallel=True, recompute="full")
        strategy = Strategy(dims=dims, train=train)
        t0 = time.perf_counter()
        result = simulate(graph, strategy, cluster)
        cold = time.perf_counter() - t0
        warm = []
        for _ in range(WARM_RUNS):
            t0 = time.perf_counter()
            simulate(graph, strategy, cluster)
            warm.append(time.perf_counter() - t0)
        c = result.to_contract()
        rows.append(
            f"| {schedule} (v={v}) | {cold:.3f} | {statistics.median(warm):.3f} | {len(result.events):,} | "
            f"{c['step_time_s']:.2f} | {c['mfu']:.1%} | {c['breakdown_s']['bubble']:.2f} | {c['peak_memory_gib']:.1f} |"
        )
        print(rows[-1], flush=True)
    body = "\n".join([
        f"`simulate(graph, strategy, cluster)` for {MODEL} at sequence length {SEQ} on {GPUS:,} GPUs of `dgx-h100` "
        f"(tp 8, pp 16, dp 128 with ZeRO-1, sequence parallel, full recompute, 16 micro-batches of 1 per data-parallel rank, "
        f"global batch 2048). One representative rank per pipeline rank is simulated. Tracing the model "
        f"(done once, not per candidate) took {trace_s:.1f} s and is not included below.",
        "",
        "| schedule | cold call (s) | warm call, median of 5 (s) | timeline events | predicted step (s) | MFU | bubble (s) | peak memory (GiB) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "The cold call of the first multi-stage schedule includes importing torch.distributed.pipelining "
        "(the schedule generators come from torch). Produced by `benchmarks/simulate_speed.py`.",
    ])
    update_section("simulate-speed", "Simulator speed at 16,384 GPUs", body)


if __name__ == "__main__":
    main()
