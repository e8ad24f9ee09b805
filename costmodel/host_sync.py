"""Synchronization of per-layer collectives: each one waits for the slowest host of its group.

Model. A TP, SP or CP collective inside a layer (Megatron's all-reduce after attention and after the MLP,
forward, backward and a full recompute's forward again: 6 per layer and micro-batch at tp > 1) is
synchronous: no rank of its group of n leaves it before the last one has entered it. When the step is set by
the hosts (an eager framework dispatching small kernels, `costmodel.simulator.pricing`'s host-bound floor),
each rank's host reaches the collective after its own share of dispatch work, and those times scatter from
rank to rank (Python, the allocator, interrupts, the other ranks' threads on the same CPUs). With rank r's
arrival at mu + sigma Z_r, Z_r independent standard normal, the collective ends on average

    mu + sigma E[max(Z_1, ..., Z_n)] = mu + sigma e_n

so each synchronous collective adds sigma e_n to the critical path (`sync_wait`), e_n the expected maximum of n
standard normal draws (`expected_max_normal`):

    e_n = integral x n phi(x) Phi(x)^(n-1) dx:   e_1 = 0, e_2 = 0.564, e_4 = 1.029, e_8 = 1.424

(the group waits longer the more hosts it waits for, and no wait at all at n = 1). Every collective starts from
the last one's synchronization, so the draws of successive collectives are independent and the waits add.
That assumes each collective re-synchronizes its ranks: no rank runs ahead past it (true when what paces the
step sits behind the collective, a GPU stream waiting on it or a host that blocks on its result; a host that
queues kernels far ahead of its GPU hides the wait, and then sigma fits near 0). e_n grows ever slower with n
(roughly sqrt(2 ln n)), so the term cannot make 8 ranks cost much more than 4 when 4 cost no more than 2.

Parameter. sigma is one number per software stack (`DeviceProfile.host_jitter_s`; profile key
`host_jitter_us`): it belongs to the framework that dispatches the kernels and the host it runs on, not to the
GPU, like `host_dispatch_s`. It is fitted on a stack's runs without TP beyond 2 and judged on the larger
groups (benchmarks/vtrain_tp.py). 0 (every shipped profile): no wait, the simulator as before.

In a pipelined run (`chain_wait`). A pipeline's blocking stage hand-offs drain each rank's launch queue: after a
rank has waited for its neighbour stage, its GPU runs at its host's pace (nothing is queued ahead). A
synchronous ring collective of n ranks then goes round at the pace of its ranks' hosts, each step waiting for
the next rank to have launched its part, so the wait grows with the length of the ring rather than as the
maximum of n draws:

    wait per collective = n delta                                              (pp > 1 only)

delta one number per stack (`DeviceProfile.pipelined_sync_s`; profile key `pipelined_sync_us`), 0 in every
shipped profile. What the form follows: on the Ultra-Scale Playbook's 1B grid (nanotron, 1-64 nodes of 8 H100,
benchmarks/playbook_grid.py) the pipelined runs with TP measured, beyond their priced step, per TP collective
and micro-batch 0.65 / 1.36 / 2.67 / 6.5 / 22.5 ms at tp 2 / 4 / 8 / 16 / 32 (median over micro-batches up to
4 at 1-16 nodes): about 0.33 ms per rank inside a node, the same at pp 2, 4 and 8, and the same across micro-batch sizes
(so not bandwidth), while the same TP degrees without a pipeline measured 0.9-1.1x their priced step (no
wait). The mechanism (drained queues, ring steps at host pace) is this module's reading of that law, not a
measurement of it; what it leaves out: at micro-batches of 16 and more the measured wait falls (more GPU work
per collective refills the queue), which a constant delta over-charges; and across nodes (tp 16, 32) the wait
per rank grows (0.41, 0.70 ms).

Constraints. sigma >= 0, delta >= 0; the wait is added to the activation collectives' time in the chunk's forward and
backward (`costmodel.simulator.pricing._UnitPricer._comm`), on the critical path as those collectives are. The
fast estimator (`planner.estimate`) leaves it out, so it stays at or below the simulator.
"""

from __future__ import annotations

import math
from functools import lru_cache

_GRID_POINTS = 4001
_GRID_LIMIT = 10.0
"""Integration over [-10, 10] standard deviations: the tails beyond carry less than 1e-20 of the mass."""


@lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal draws] (module docstring), by the trapezoid rule; 0 at n = 1."""
    if n < 1:
        raise ValueError(f"a group has at least one rank, got {n}")
    if n == 1:
        return 0.0
    step = 2 * _GRID_LIMIT / (_GRID_POINTS - 1)
    total = 0.0
    for i in range(_GRID_POINTS):
        x = -_GRID_LIMIT + i * step
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        weight = 0.5 if i in (0, _GRID_POINTS - 1) else 1.0
        total += weight * x * n * density * cdf ** (n - 1)
    return total * step


def sync_wait(collectives: int, group_size: int, jitter_s: float) -> float:
    """Seconds `collectives` synchronous collectives on a group of `group_size` ranks add to the critical path
    when each rank's host arrives with standard deviation `jitter_s` (module docstring)."""
    if jitter_s < 0:
        raise ValueError(f"host jitter must be >= 0, got {jitter_s}")
    if collectives <= 0 or jitter_s == 0:
        return 0.0
    return collectives * jitter_s * expected_max_normal(group_size)


def chain_wait(collectives: int, group_size: int, delta_s: float) -> float:
    """Seconds `collectives` synchronous collectives on a group of `group_size` ranks add to the critical path of a
    pipelined run when each rank's host paces its ring step by `delta_s` (module docstring: n delta each)."""
    if delta_s < 0:
        raise ValueError(f"the pipelined wait per rank must be >= 0, got {delta_s}")
    if collectives <= 0 or delta_s == 0 or group_size <= 1:
        return 0.0
    return collectives * group_size * delta_s
