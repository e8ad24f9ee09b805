"""Executor overhead: `soap execute`'s training loop against the same run written by hand in plain torch.

Both run in one spawned group of 2 gloo ranks (one thread each), on the same model (a Llama of
hidden 256, 4 layers, vocab 4096), batch (4 sequences of 128 tokens per rank) and optimizer (AdamW,
foreach), for DDP and FSDP2 (zero 3). The hand-written loop does what a careful user's does: random
token batch, forward, cross-entropy, backward, optimizer step, and an all-reduce of the loss for
logging. The two alternate, and which of them runs first alternates from round to round; each run
reports the median step time over its steps after warm-up; the table gives the median over rounds
and soap / hand (target <= 1.05).

    flock -x /tmp/soap-cpu.lock python benchmarks/executor_overhead.py [--steps 12] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

CONFIG = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256,
              tie_word_embeddings=False)
SEQ, MICRO_BATCH, WARMUP = 128, 4, 2
LAYOUTS = {"DDP": dict(dp_replicate=2, zero=0), "FSDP (zero 3)": dict(dp_shard=2, zero=3)}


def _hand_written(layout: str, steps: int) -> list[float]:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(CONFIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    if layout == "DDP":
        model = DistributedDataParallel(model)
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    times = []
    for step in range(steps):
        begin = time.perf_counter()
        gen = torch.Generator().manual_seed(step * 2 + dist.get_rank())
        tokens = torch.randint(0, CONFIG["vocab_size"], (MICRO_BATCH, SEQ + 1), generator=gen)
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logged = loss.detach()
        dist.all_reduce(logged)
        times.append(time.perf_counter() - begin)
    return times


def _soap(layout: str, steps: int) -> list[float]:
    from exec_helpers import make_plan, tiny_config

    from executor.train import RunConfig, train

    config = tiny_config("llama", **{k: v for k, v in CONFIG.items() if k != "model_type"})
    plan = make_plan("llama", config=config, micro_batch=MICRO_BATCH, seq_len=SEQ, **LAYOUTS[layout])
    return train(plan, RunConfig(steps=steps, progress=False)).step_times_s


def _worker(rank: int, store: str, steps: int, rounds: int, out: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    medians: dict[tuple[str, str], list[float]] = {}
    runners = [("hand", _hand_written), ("soap", _soap)]
    for round_index in range(rounds):
        for layout in LAYOUTS:
            for name, fn in runners[::-1] if round_index % 2 else runners:  # alternate who runs first
                times = fn(layout, steps)[WARMUP:]
                medians.setdefault((layout, name), []).append(statistics.median(times))
    if rank == 0:
        import json

        Path(out).write_text(json.dumps({f"{k[0]}|{k[1]}": v for k, v in medians.items()}))
    dist.destroy_process_group()


def main() -> None:
    import json

    from benchmarks.report import update_section

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    out, store = tempfile.mktemp(), tempfile.mktemp()
    mp.spawn(_worker, args=(store, args.steps, args.rounds, out), nprocs=2)
    medians = {tuple(k.split("|")): v for k, v in json.loads(Path(out).read_text()).items()}
    rows = ["| layout | hand-written step (ms) | soap execute step (ms) | ratio soap / hand | ratio per round |",
            "| --- | ---: | ---: | ---: | --- |"]
    for layout in LAYOUTS:
        hand = statistics.median(medians[(layout, "hand")])
        soap = statistics.median(medians[(layout, "soap")])
        per_round = ", ".join(f"{s / h:.2f}" for h, s in zip(medians[(layout, "hand")], medians[(layout, "soap")]))
        rows.append(f"| {layout} | {hand * 1e3:.1f} | {soap * 1e3:.1f} | {soap / hand:.3f} | {per_round} |")
    body = (
        f"2 gloo ranks x 1 thread; Llama hidden 256, 4 layers, vocab 4096; {MICRO_BATCH} x {SEQ} tokens per rank; "
        f"AdamW (foreach); median step time after {WARMUP} warm-up steps, {args.steps} steps, median of "
        f"{args.rounds} alternating rounds. Target: ratio <= 1.05.\n\n" + "\n".join(rows)
    )
    print(body)
    update_section("executor-overhead", "Executor overhead against hand-written torch", body)


if __name__ == "__main__":
    main()
