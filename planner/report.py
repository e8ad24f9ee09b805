"""`PlanReport`: the chosen plan, its alternatives and baselines, and how `soap plan` shows them.

`report_json` is the `--json` object: the DESIGN contract's keys for the chosen plan (from the
simulator's `SimResult.to_contract()`, `memory_breakdown_gib` included), plus `alternatives` and
`baselines` (each with its parallelism, step time, tokens/s, peak memory and the chosen plan's speedup
over it), `why`, and the search's size. `render_summary` prints the same as rich tables, with the chosen
plan's memory per pipeline rank from `memory_table` (which `soap simulate` prints too). Nothing here
depends on wall time, so the same inputs print the same report.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from costmodel.allocator import MemoryLimit
from costmodel.memory import MEMORY_TERMS
from planner.plan import Plan
from planner.search import Priced

if TYPE_CHECKING:
    from rich.table import Table

    from costmodel.profiles import DeviceProfile
    from costmodel.simulator.result import RankMemory

GIB = 2**30


@dataclass(frozen=True)
class PlanReport:
    plan: Plan
    chosen: Priced
    alternatives: tuple[Priced, ...]
    baselines: tuple[tuple[str, Priced | None], ...]
    why: tuple[str, ...]
    model: str
    cluster: str
    gpus: int
    memory_limit_bytes: float
    candidates: int
    """Configurations estimated."""
    simulated: int
    """Configurations priced by full simulation."""
    limit: MemoryLimit | None = None
    """How the memory limit was set (`costmodel.allocator`); None for reports built without a request."""
    baselines_outside: tuple[str, ...] = ()
    """Baseline families the pins leave no member of (no baseline offloads: none under `--offload`)."""


def contract(p: Priced) -> dict[str, Any]:
    out = p.result.to_contract()
    out["parallelism"] = parallelism_of(p)
    return out


def parallelism_of(p: Priced) -> dict[str, Any]:
    d, t = p.candidate.mesh.dims, p.candidate.train
    return {
        "dp": d.dp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "zero": p.candidate.mesh.zero,
        "tp": d.tp, "pp": d.pp, "cp": d.cp, "ep": d.ep, "micro_batch": t.micro_batch, "grad_accum": t.grad_accum,
        "num_microbatches": t.num_microbatches, "schedule": t.schedule, "virtual_stages": t.virtual_stages,
        "recompute": t.recompute, "precision": t.precision, "optimizer": t.optimizer,
        "offload_optimizer": t.offload_optimizer, "sequence_parallel": t.sequence_parallel, "compile": t.compile,
    }


def describe(p: Priced) -> str:
    """A one-line name for a plan, e.g. `tp8 pp4 dp16 zero1 mb1 1F1B rc=selective compile bf16`."""
    d, t = p.candidate.mesh.dims, p.candidate.train
    parts = [f"{name}{degree}" for name, degree in (("tp", d.tp), ("pp", d.pp), ("cp", d.cp), ("ep", d.ep)) if degree > 1]
    parts.append(f"dp{d.dp}")
    zero = p.candidate.mesh.zero
    if d.dp > 1:
        parts.append("hsdp" if zero == 3 and d.dp_replicate > 1 else f"zero{zero}")
    parts.append(f"mb{t.micro_batch}x{t.num_microbatches}")
    if d.pp > 1:
        parts.append(t.schedule + (f"(v{t.virtual_stages})" if t.virtual_stages > 1 else ""))
    if t.recompute != "none":
        parts.append(f"rc={t.recompute}")
    if t.offload_optimizer:
        parts.append("offload")
    if t.compile:
        parts.append("compile")
    parts.append(t.precision)
    if t.optimizer != "adamw":
        parts.append(t.optimizer)
    return " ".join(parts)


def _row(p: Priced, chosen: Priced) -> dict[str, Any]:
    r = p.result
    return {
        "plan": describe(p), "parallelism": parallelism_of(p), "step_time_s": r.step_time_s,
        "tokens_per_s": r.tokens_per_s, "peak_memory_gib": r.peak_memory_bytes / GIB,
        "mfu": r.to_contract()["mfu"], "speedup_of_chosen": r.step_time_s / chosen.step_time_s,
    }


def report_json(report: PlanReport) -> dict[str, Any]:
    out = contract(report.chosen)
    out.update(
        model=report.model, cluster=report.cluster, gpus=report.gpus,
        memory_limit_gib=report.memory_limit_bytes / GIB, plan=describe(report.chosen),
        memory_margin=report.limit.margin if report.limit else 0.0,
        memory_limit_source=("mem-limit" if report.limit.given else "device less margin") if report.limit else None,
        alternatives=[_row(p, report.chosen) for p in report.alternatives],
        baselines=[
            {"name": name, **(_row(p, report.chosen) if p else {"fits": False})}
            | ({"outside_pins": True} if name in report.baselines_outside else {}) for name, p in report.baselines
        ],
        why=list(report.why), candidates_estimated=report.candidates, candidates_simulated=report.simulated,
    )
    return out


def _host_memory(p: Priced, noun: str = "GPU") -> str:
    host = max(m.at_peak.host for m in p.result.memory)
    return f" + {host / GIB:.1f} GiB host (offloaded) per {noun}" if host else ""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 'es' if noun.endswith('s') else 's'}"


def memory_kind(device: DeviceProfile) -> str:
    """What the predicted peak stands for: the allocator's reserved bytes where the device profile has a
    fitted reserve, else the bytes tensors hold (allocated)."""
    if getattr(device, "predicts_reserved_memory", False):
        return "reserved (allocator reserve fitted from runs)"
    return f"allocated (no allocator reserve fitted for {device.name})"


def memory_table(memory: Sequence[RankMemory], limit_bytes: float, device: DeviceProfile) -> Table:
    """Per pipeline rank (the stages it holds), its memory at its peak by term in GiB, the device total,
    and that total as a share of the limit; host memory is per GPU and outside the total."""
    from rich.table import Table

    rank = getattr(device, "rank_noun", "GPU")
    table = Table(title=f"Memory per {rank} at its peak, GiB (limit {limit_bytes / GIB:.1f} GiB)", title_justify="left",
                  caption=f"peak = {memory_kind(device)}; host = offloaded, not in the total",
                  caption_justify="left")
    for col in ("rank", "stages", *MEMORY_TERMS, "total", "of limit"):
        table.add_column(col, justify="left" if col in ("rank", "stages") else "right")
    for m in memory:
        gib = m.at_peak.as_gib()
        share = f"{m.at_peak.total / limit_bytes:.0%}" if limit_bytes > 0 else "-"
        table.add_row(str(m.rank), ",".join(map(str, m.stages)),
                      *(f"{gib[term]:.2f}" for term in (*MEMORY_TERMS, "total")), share)
    return table


def plan_device(plan: Plan) -> DeviceProfile:
    """The device profile a plan.json carries inline."""
    from costmodel.profiles import cluster_from_dict

    return cluster_from_dict(plan.cluster.profile).device


def render_summary(report: PlanReport, *, output: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, highlight=False)
    if not console.is_terminal:
        console.width = 140
    c = report.chosen
    m = contract(c)
    limit = report.memory_limit_bytes / GIB
    noun = plan_device(report.plan).rank_noun
    console.print(f"[bold]{report.model}[/bold] on {_count(report.gpus, noun)} ({report.cluster}): "
                  f"[bold]{describe(c)}[/bold]")
    console.print(
        f"  step {m['step_time_s']:.3f} s · {m['tokens_per_s']:,.0f} tokens/s · MFU {100 * m['mfu']:.1f}% · "
        f"memory {m['peak_memory_gib']:.1f} / {limit:.1f} GiB per {noun}" + _host_memory(c, noun)
    )
    if report.limit is not None:
        console.print(f"  memory {report.limit.describe()}")
    b = m["breakdown_s"]
    console.print("  breakdown: " + ", ".join(f"{k.replace('_', ' ')} {v:.3f} s" for k, v in b.items()))
    for line in report.why:
        console.print(f"  why: {line}")
    console.print(memory_table(c.result.memory, report.memory_limit_bytes, plan_device(report.plan)))

    table = Table(title="Top alternatives", title_justify="left")
    for col in ("plan", "step s", "tokens/s", "GiB/GPU" if noun == "GPU" else "GiB/process", "slower by"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for p in report.alternatives:
        table.add_row(describe(p), f"{p.step_time_s:.3f}", f"{p.result.tokens_per_s:,.0f}",
                      f"{p.peak_memory_bytes / GIB:.1f}", f"{p.step_time_s / c.step_time_s:.2f}x")
    if report.alternatives:
        console.print(table)

    table = Table(title="Baselines", title_justify="left")
    for col in ("baseline", "plan", "step s", "tokens/s", "speedup of chosen"):
        table.add_column(col, justify="left" if col in ("baseline", "plan") else "right")
    for name, p in report.baselines:
        if p is None:
            table.add_row(name, "outside the pins" if name in report.baselines_outside else "does not fit", "-", "-",
                          "-")
        else:
            table.add_row(name, describe(p), f"{p.step_time_s:.3f}", f"{p.result.tokens_per_s:,.0f}",
                          f"{p.step_time_s / c.step_time_s:.2f}x")
    console.print(table)
    console.print(f"  searched {report.candidates:,} configurations, simulated {report.simulated}")
