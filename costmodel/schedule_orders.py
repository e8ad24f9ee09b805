"""Compute orders of torch.distributed.pipelining's schedules, ported so planning never imports torch.

For every pipeline rank, the forwards and backwards it runs, in order, exactly as torch 2.13's
generators produce them with the `None` no-op slots removed (those slots only align ranks in torch's
lock-step display; the simulator and `dry_run` wait on real dependencies instead):

    GPipe                  `ScheduleGPipe._get_pipeline_order`                    -> `gpipe`
    LoopedBFS              `ScheduleLoopedBFS._calculate_single_rank_operations`  -> `looped_bfs`
    Interleaved1F1B        `ScheduleInterleaved1F1B._calculate_single_rank_operations` (via
                           `_get_1f1b_rank_ops`, warm-up factor 2)                -> `interleaved`
    InterleavedZeroBubble  `ScheduleInterleavedZeroBubble._calculate_single_rank_operations` (warm-up
                           factor 1, backward split into I and W) then `_add_bubbles_to_actions`,
                           which only inserts `None` slots and so leaves the order unchanged
                                                                                  -> `interleaved`
    ZBVZeroBubble          `ScheduleZBVZeroBubble._calculate_single_rank_operations` -> `zbv`

Importing torch.distributed.pipelining costs about 3 s on a 2-core machine, more than the rest of a
warm `soap plan gpt2 --gpus 8`. tests/test_schedule.py compares every generator here with torch's
over a grid of (pp, micro-batches, stages per rank), so a torch upgrade that changes an order fails
there rather than drifting silently.

The interleaved schedules split the micro-batches into `rounds = max(1, m // pp)` rounds of
`m // rounds`; torch requires `m % rounds == 0`, and `interleaved` raises the same condition as a
SoapError.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from costmodel.schedule import B, F, I, W, Action, action
from tracer.errors import SoapError


def gpipe(pp: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards, in micro-batch order."""
    return [[action(rank, F, mb) for mb in range(m)] + [action(rank, B, mb) for mb in range(m)] for rank in range(pp)]


def looped_bfs(pp: int, m: int, v: int) -> list[list[Action]]:
    """Every micro-batch through one local stage before the next; backwards in reverse."""
    ranks = []
    for rank in range(pp):
        stages = range(rank, pp * v, pp)
        acts = [action(s, F, mb) for s in stages for mb in range(m)]
        acts += [action(s, B, mb) for s in reversed(stages) for mb in reversed(range(m))]
        ranks.append(acts)
    return ranks


def interleaved(name: str, pp: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved1F1B (depth first, Megatron's) or InterleavedZeroBubble (the same with I/W split)."""
    rounds = max(1, m // pp)
    if m % rounds:
        raise SoapError(f"{name} needs num_microbatches ({m}) divisible by max(1, m // pp) = {rounds}")
    per_round = m // rounds
    zero_bubble = name == "InterleavedZeroBubble"
    ranks = []
    for rank in range(pp):
        warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)

        def forward_stage(step: int, rank: int = rank) -> int:
            return (step // per_round) % v * pp + rank

        def backward_stage(step: int, rank: int = rank, warmup: int = warmup) -> int:
            return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

        ranks.append(_one_f_one_b_ops(m * v, warmup, forward_stage, backward_stage, rank if zero_bubble else None))
    return ranks


def _one_f_one_b_ops(
    ops: int, warmup: int, forward_stage: Callable[[int], int], backward_stage: Callable[[int], int],
    one_f_one_b_before_w: int | None,
) -> list[Action]:
    """torch's `_get_1f1b_rank_ops` without the no-op slots: `warmup` forwards, then forward/backward
    pairs, then the remaining backwards. `one_f_one_b_before_w` is None for a full backward (B), else
    the number of pairs before each backward input (I) is followed by the oldest pending weight
    gradient (W); the Ws still pending at the end follow in order."""
    fwd_mb: dict[int, int] = defaultdict(int)
    bwd_mb: dict[int, int] = defaultdict(int)
    weight_mb: dict[int, int] = defaultdict(int)
    backward_steps: list[int] = []
    weights_done = 0
    acts: list[Action] = []

    def take(counter: dict[int, int], stage: int) -> int:
        counter[stage] += 1
        return counter[stage] - 1

    def weight() -> None:
        nonlocal weights_done
        stage = backward_stage(backward_steps[weights_done])
        acts.append(action(stage, W, take(weight_mb, stage)))
        weights_done += 1

    backward_kind = B if one_f_one_b_before_w is None else I
    fwd_bwd = ops - warmup
    for step in range(warmup + fwd_bwd + warmup):  # torch's cooldown is as long as the warm-up
        if step < warmup + fwd_bwd:
            stage = forward_stage(step)
            acts.append(action(stage, F, take(fwd_mb, stage)))
        if step >= warmup:
            stage = backward_stage(step)
            acts.append(action(stage, backward_kind, take(bwd_mb, stage)))
            backward_steps.append(step)
            if one_f_one_b_before_w is not None and step - warmup >= one_f_one_b_before_w:
                weight()
    while one_f_one_b_before_w is not None and weights_done < len(backward_steps):
        weight()
    return acts


def zbv(pp: int, m: int) -> list[list[Action]]:
    """ZBVZeroBubble: two stages per rank in a V (rank r holds stages r and 2pp-1-r), I/W split."""
    n_micro = max(2 * pp - 1, m)  # torch fills the pipeline with phantom micro-batches, dropped below
    ranks = []
    for rank in range(pp):
        chunk0, chunk1 = rank, 2 * pp - 1 - rank
        f0 = f1 = b0 = b1 = 0
        acts: list[Action] = []
        for _ in range(2 * (pp - rank) - 1):
            acts.append(action(chunk0, F, f0))
            f0 += 1
        for _ in range(rank):
            acts += [action(chunk1, F, f1), action(chunk0, F, f0)]
            f1 += 1
            f0 += 1
        for _ in range(pp - rank):
            acts += [action(chunk1, F, f1), action(chunk1, I, b1), action(chunk1, W, b1)]
            f1 += 1
            b1 += 1
        while f1 < f0 or f0 < n_micro:
            if f0 < n_micro:
                acts.append(action(chunk0, F, f0))
                f0 += 1
            acts += [action(chunk0, I, b0), action(chunk0, W, b0), action(chunk1, F, f1),
                     action(chunk1, I, b1), action(chunk1, W, b1)]
            b0 += 1
            f1 += 1
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(rank):
            acts += [action(chunk0, I, b0), action(chunk1, I, b1)]
            b0 += 1
            b1 += 1
        for _ in range(pp - rank):
            acts += [action(chunk0, I, b0), action(chunk0, W, w0)]
            b0 += 1
            w0 += 1
        acts += [action(chunk1, W, mb) for mb in range(w1, b1)]
        acts += [action(chunk0, W, mb) for mb in range(w0, b0)]
        ranks.append([a for a in acts if a.microbatch < m])
    return ranks
