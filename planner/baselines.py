"""Baselines: the plans an expert would reach for, priced by the same simulator as the chosen plan.

Each baseline is a family of strategies; its plan is the family's fastest member that fits (best
micro-batch and recompute policy), at the chosen plan's precision and optimizer so the speedup
isolates the parallelization. Families (`baseline_families`):
- DDP: data parallel only, replicated state (tp = pp = cp = 1, ZeRO 0).
- FSDP / ZeRO-3: data parallel only, fully sharded state (tp = pp = cp = 1, ZeRO 3 over all ranks).
- Megatron grid: any tp x pp x dp (tp inside a node), cp = 1, replicated or ZeRO-1 (Megatron's
  distributed optimizer) state, 1F1B or interleaved 1F1B — the best of the grid.
- Rules of thumb (the multi-GPU guide's "Combinations", `rule_of_thumb_mesh`): DDP when the model fits
  on one GPU; else TP across the node (none when the node has no fast link: PP wins there) plus the
  fewest pipeline stages that fit (1F1B), ZeRO-1 data parallelism over the rest; else ZeRO data
  parallelism.
No baseline offloads optimizer state: where the pins leave a family no member (`--offload`: none), the report
says it is outside the pins, not that it does not fit. The search space contains every family, so the chosen plan
is never slower than a baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.search import Candidate
from planner.space import MeshChoice

FAST_LINK_BYTES_PER_S = 100e9
"""An intra-node link at least this fast (per GPU) counts as NVLink-class for the rules of thumb."""


@dataclass(frozen=True)
class Baseline:
    name: str
    description: str
    member: Callable[[Candidate], bool]


def _same_training(chosen: Candidate) -> Callable[[Candidate], bool]:
    t = chosen.train

    def same(c: Candidate) -> bool:
        return c.train.precision == t.precision and c.train.optimizer == t.optimizer and not c.train.offload_optimizer

    return same


def _data_parallel_only_mesh(mesh: MeshChoice) -> bool:
    d = mesh.dims
    return d.tp == 1 and d.pp == 1 and d.cp == 1 and d.ep == 1


def _data_parallel_only(c: Candidate) -> bool:
    return _data_parallel_only_mesh(c.mesh)


def rule_of_thumb_mesh(candidates: Sequence[Candidate], *, intra_node_bandwidth: float) -> tuple[int, ...] | None:
    """The mesh sort key the guide's rules pick among fitting candidates, or None."""
    keys = sorted({c.mesh.sort_key for c in candidates})
    if not keys:
        return None
    by_key = {c.mesh.sort_key: c.mesh for c in candidates}
    pure = [k for k in keys if _data_parallel_only_mesh(by_key[k])]
    ddp = [k for k in pure if by_key[k].zero == 0]
    if ddp:
        return ddp[0]
    fast = intra_node_bandwidth >= FAST_LINK_BYTES_PER_S
    grid = [k for k in keys if by_key[k].dims.cp == 1 and by_key[k].zero in (0, 1)]
    widest_tp = max((by_key[k].dims.tp for k in grid), default=1) if fast else 1
    with_tp = [k for k in grid if by_key[k].dims.tp == widest_tp]
    if with_tp:
        fewest_stages = min(by_key[k].dims.pp for k in with_tp)
        staged = [k for k in with_tp if by_key[k].dims.pp == fewest_stages]
        return min(staged, key=lambda k: (-by_key[k].zero, k))
    zero = [k for k in pure if by_key[k].dims.dp_replicate == 1]
    return min(zero, key=lambda k: (by_key[k].zero, k)) if zero else None


def baseline_mesh(mesh: MeshChoice, *, widest_tp: int) -> bool:
    """Meshes the DDP, ZeRO-3 and rules-of-thumb baselines draw from: pure data parallelism, or the
    widest TP with ZeRO 0/1 and no CP (any pipeline depth). The search always estimates them."""
    d = mesh.dims
    return _data_parallel_only_mesh(mesh) or (d.cp == 1 and mesh.zero in (0, 1) and d.tp == widest_tp)


def baseline_families(
    chosen: Candidate, candidates: Sequence[Candidate], *, intra_node_bandwidth: float
) -> list[Baseline]:
    same = _same_training(chosen)
    pool = [c for c in candidates if same(c)]
    rule = rule_of_thumb_mesh(pool, intra_node_bandwidth=intra_node_bandwidth)
    return [
        Baseline(
            "DDP", "data parallel, replicated state",
            lambda c: same(c) and _data_parallel_only(c) and c.mesh.zero == 0,
        ),
        Baseline(
            "FSDP / ZeRO-3", "data parallel, fully sharded state",
            lambda c: same(c) and _data_parallel_only(c) and (c.mesh.zero == 3 or c.mesh.dims.dp == 1)
            and c.mesh.dims.dp_replicate == 1,
        ),
        Baseline(
            "Megatron grid", "best tp x pp x dp, ZeRO-1 or replicated, 1F1B/interleaved",
            lambda c: same(c) and c.mesh.dims.cp == 1 and c.mesh.zero in (0, 1)
            and c.mesh.dims.dp_replicate in (1, c.mesh.dims.dp) and c.train.schedule in ("1F1B", "Interleaved1F1B"),
        ),
        Baseline(
            "rules of thumb", "the multi-GPU guide's combinations",
            lambda c: rule is not None and same(c) and c.mesh.sort_key == rule and c.train.schedule == "1F1B",
        ),
    ]
