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

from costmodel.schedule import B, F, I, W, Action, action_run
from tracer.errors import SoapError


def gpipe(pp: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards, in micro-batch order."""
    return [action_run(rank, F, m) + action_run(rank, B, m) for rank in range(pp)]


def looped_bfs(pp: int, m: int, v: int) -> list[list[Action]]:
    """Every micro-batch through one local stage before the next; backwards in reverse."""
    ranks = []
    for rank in range(pp):
        stages = range(rank, pp * v, pp)
        acts = [a for s in stages for a in action_run(s, F, m)]
        acts += [a for s in reversed(stages) for a in reversed(action_run(s, B, m))]
        ranks.append(acts)
    return ranks


def interleaved(name: str, pp: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved1F1B (depth first, Megatron's) or InterleavedZeroBubble (the same with I/W split)."""
    rounds = max(1, m // pp)
    if m % rounds:
        raise SoapError(f"{name} needs num_microbatches ({m}) divisible by max(1, m // pp) = {rounds}")
    per_round = m // rounds
    zero_bubble = name == "InterleavedZeroBubble"
    ops = m * v
    ranks = []
    for rank in range(pp):
        warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
        # forward step s runs local stage (s // per_round) % v; backward step t (from the end of the warm-up)
        # runs them in reverse; a stage's micro-batches count up over the steps that run it
        f_runs = [action_run(k * pp + rank, F, m) for k in range(v)]
        b_runs = [action_run(k * pp + rank, I if zero_bubble else B, m) for k in range(v)]
        forwards = [f_runs[(s // per_round) % v][s // (per_round * v) * per_round + s % per_round] for s in range(ops)]
        backward_at = [(v - 1 - (t // per_round) % v, t // (per_round * v) * per_round + t % per_round)
                       for t in range(ops)]
        backwards = [b_runs[k][mb] for k, mb in backward_at]
        weights = None
        if zero_bubble:
            w_runs = [action_run(k * pp + rank, W, m) for k in range(v)]
            weights = [w_runs[k][mb] for k, mb in backward_at]
        ranks.append(_one_f_one_b_ops(forwards, backwards, warmup, weights, rank))
    return ranks


def _one_f_one_b_ops(forwards: list[Action], backwards: list[Action], warmup: int, weights: list[Action] | None,
                     one_f_one_b_before_w: int) -> list[Action]:
    """torch's `_get_1f1b_rank_ops` without the no-op slots: `warmup` forwards, then forward/backward
    pairs, then the remaining backwards (its cooldown is as long as the warm-up). With `weights` (the
    backward split into input gradients I and weight gradients W), the t-th backward input is followed by
    the weight gradient of backward t - `one_f_one_b_before_w` (the oldest pending), and the Ws still
    pending at the end follow in order."""
    ops = len(forwards)
    if weights is None:
        steady = [forwards[0]] * (2 * (ops - warmup))
        steady[0::2], steady[1::2] = forwards[warmup:], backwards[:ops - warmup]
        return forwards[:warmup] + steady + backwards[ops - warmup:]
    acts = forwards[:warmup]
    lag = one_f_one_b_before_w
    for t in range(ops):
        if warmup + t < ops:
            acts.append(forwards[warmup + t])
        acts.append(backwards[t])
        if t >= lag:
            acts.append(weights[t - lag])
    acts += weights[max(0, ops - lag):]
    return acts


def zbv(pp: int, m: int) -> list[list[Action]]:
    """ZBVZeroBubble: two stages per rank in a V (rank r holds stages r and 2pp-1-r), I/W split."""
    n_micro = max(2 * pp - 1, m)  # torch fills the pipeline with phantom micro-batches, dropped below
    ranks = []
    for rank in range(pp):
        chunk0, chunk1 = rank, 2 * pp - 1 - rank
        F0, I0, W0 = (action_run(chunk0, kind, n_micro) for kind in (F, I, W))
        F1, I1, W1 = (action_run(chunk1, kind, n_micro) for kind in (F, I, W))
        f0 = f1 = b0 = b1 = 0
        acts: list[Action] = []
        for _ in range(2 * (pp - rank) - 1):
            acts.append(F0[f0])
            f0 += 1
        for _ in range(rank):
            acts += [F1[f1], F0[f0]]
            f1 += 1
            f0 += 1
        for _ in range(pp - rank):
            acts += [F1[f1], I1[b1], W1[b1]]
            f1 += 1
            b1 += 1
        while f1 < f0 or f0 < n_micro:
            if f0 < n_micro:
                acts.append(F0[f0])
                f0 += 1
            acts += [I0[b0], W0[b0], F1[f1], I1[b1], W1[b1]]
            b0 += 1
            f1 += 1
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(rank):
            acts += [I0[b0], I1[b1]]
            b0 += 1
            b1 += 1
        for _ in range(pp - rank):
            acts += [I0[b0], W0[w0]]
            b0 += 1
            w0 += 1
        acts += W1[w1:b1]
        acts += W0[w0:b0]
        ranks.append([a for a in acts if a.microbatch < m])
    return ranks
