"""Does the published corpus's fit generalize on torch-native once soap's own H100 runs join it?

    python -m benchmarks.own_runs_corpus

The published corpus (`benchmarks.published_runs`: torchtitan's Llama 3.1 8B on `grand-teton-h100`, NeMo's
Llama 3.1 8B and Nemotron-4 15B on `dgx-h100-datasheet`) has one torch-native model, so leaving it out of
`executor.validation.external`'s fit leaves no torch-native row to fit on. soap's own executor ran five model
families on one H100 80GB (`benchmarks/data/h100-runs-*.jsonl`, read by `benchmarks.gpu_repredict.runs`).
This script joins them to the corpus as run records and repeats the fit's leave-out checks.

1. Conversion (`own_record`): each logged run becomes a `RunRecord` (gpus 1, tp = pp = cp = dp = 1, stack
   torch-native; seq, micro-batch, grad_accum, global batch, precision, recompute, compile and ZeRO stage from
   the logged plan; the measured mean step time; memory `allocated`, torch.cuda.max_memory_allocated). Its model
   is the plan's inline HF config with `name` the family label of `gpu_repredict.model_of`
   (`run_records.hf_config` rebuilds it with `AutoConfig.for_model`). `as_run` checks that
   `external.prepare` planned each record as it ran: every parallelism field and the loss the priced strategy
   uses against the logged plan, and the simulated step of the prepared plan against that of the logged plan
   itself (`planner.plan.plan_from_dict`, its own graph) on the same cluster, which is 0 only when model, regime
   and placements agree too.
2. Cluster of the own runs (`OWN_CLUSTERS`). The fit's multipliers scale each run's parts relative to its
   own cluster profile, so they transfer between runs only when the profiles are alike in kind. `dgx-h100`,
   the shipped default, is itself the corpus's fit (matmul, compile, launch, links fitted on these very
   torchtitan rows): own runs priced on it carry the held-out rows' information into every leave-out fit, and
   their multipliers mean "over the corpus fit" where the torchtitan rows' mean "over a datasheet profile".
   `datasheet` is `dgx-h100-datasheet` (the profile the NeMo rows use) with only what soap measured on its
   own H100 runs and not on the corpus added, as `benchmarks.published_runs` adds it to its fit: the
   unaligned-GEMM factor (`benchmarks.unaligned_gemm.with_unaligned`) and the executor's host floor
   (`HOST_FLOOR_FROM`'s `host_dispatch_us`, fitted by `gpu_repredict.host_floor` on the own runs). It is
   written to a temporary file for `load_cluster`, never to a profile folder. Both are in sample for the own
   runs in two numbers: the unaligned-GEMM factor was measured on the gpt2-dgx-h100 run's own step, and the host
   floor was fitted on every own run (it binds on the small Llama's); neither touches a torchtitan row.
3. Evaluation (`evaluate`): `external.fit` in-sample, and `external.leave_out` by model and by GPU count,
   each prediction re-simulated on the refitted profile (`external.predict`), on (a) the corpus alone and
   (b) the corpus plus the own runs. The "model" grouping is made honest for (b) (`honest_key`): the own
   runs of four Llama-3-8B layers ("8b4l", the same layer shapes as Llama 3.1 8B) are grouped with the
   corpus's Llama 3.1 8B rows, so leaving out the 8B also leaves them out (the key `external.leave_out` is
   given). The corpus's two stacks' Llama 3.1 8B rows share one name and so one group.
4. Reported: tokens/s MAPE per stack (torch-native split into torchtitan's and the own rows), in-sample,
   leave one model out, leave one GPU count out; the torchtitan rows' error when the 8B group, or their GPU
   count, is left out (`titan_held_out`); the fitted multipliers of (b) against the corpus-only fit, and the
   products left on their datasheet-peak ceiling (`Fit.at_peak`).
5. Transfer (`transfer`): the torchtitan rows predicted by fits on the own runs alone, on their 8B-shaped runs
   alone and on their other families alone, beside the torchtitan rows' own in-sample fit: which multipliers the
   two torch-native sources ask for, and so whether one set of device multipliers can serve both.
6. The attention kernel (`stated_sdpa`): (c) is (b) on `datasheet` with torchtitan's rows stating the SDPA
   kernel they ran (`TORCHTITAN_SDPA`), so their attention takes a multiplier of its own over the own runs'
   (`external.part_parameters`, `attention/<backend>`) and every other term stays shared. That multiplier is
   also measured apart from any run, the two kernels timed on one H100 (`external.MEASURED_PRIORS`, x1.76): the fit
   pulls it toward that value as hard as one run would, and a fit without the 8B's rows (none of the rest states
   the kernel) predicts them with it.
7. `eight_b_mfu`: `soap plan llama-3-8b` on (a'), (a'') and (c) written over the datasheet H100, with soap's
   executor's attention and with FlashAttention-2's folded in: what each would predict were it shipped.
8. (a'') is (a') with the ratio of attention's multiplier to the GEMMs' measured on the lent H100
   (`external.ATTENTION_OVER_MATMUL`, `fit(ratios=...)`); `believable`: the believable-profile test's reference
   plans on the shipped `dgx-h100` and on (a''), with soap's executor's kernel, with FlashAttention-2's, and with
   FlashAttention-2 over torchtitan's 500 W H100s (the class's runs as they ran), against the published bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TORCHTITAN_CLUSTER = "grand-teton-h100"
EIGHT_B = "Llama 3.1 8B"
EIGHT_B_SHAPES = "Llama-3-8B, 4 layers"  # gpu_repredict.MODEL_OF's label of the "8b4l" runs
OWN_CLUSTERS = ("dgx-h100", "datasheet")
OWN_PREFIX = "own: "
HOST_FLOOR_FROM = "dgx-h100"
"""The shipped cluster whose device carries the host floor fitted on the own runs (`gpu_repredict.host_floor`)."""
PARALLELISM_FIELDS = ("tp", "pp", "cp", "dp", "ep", "zero", "micro_batch", "grad_accum", "num_microbatches",
                      "recompute", "precision", "compile", "optimizer", "offload_optimizer", "attention",
                      "sequence_parallel", "schedule", "virtual_stages")
TORCHTITAN_SDPA = "flash_attention"
"""The attention kernel of torchtitan's rows as variant (c) states it (module docstring, step 6): their benchmark
names torch 1963fc8, of December 2024, whose SDPA on H100 ran torch's own FlashAttention-2 kernels as we read
torch's release notes (2.5.0 made cuDNN's attention the H100 default, 2.5.1 made it opt-in again); soap's own H100
runs (torch 2.11) traced cuDNN's sm90 flash kernels (`benchmarks/data/h100-2026-11-26*`), and torch 2.11 chooses
cuDNN's kernels for the 8B's heads at every sequence length timed (`benchmarks/sdpa_backends.py`, 2026-11-27)."""
AS_RUN_TOLERANCE = 1e-3
"""Relative difference of simulated step (prepared plan against logged plan) within which a run counts as
planned as it ran."""


def datasheet_cluster(directory: Path) -> str:
    """The path of `dgx-h100-datasheet` with the own runs' unaligned-GEMM factor and host floor (module docstring,
    step 2), written under `directory`."""
    from benchmarks.gpu_repredict import with_host_floor
    from benchmarks.unaligned_gemm import with_unaligned
    from costmodel.profiles import cluster_to_dict, load_cluster

    profile = cluster_to_dict(load_cluster("dgx-h100-datasheet"))
    floor = load_cluster(HOST_FLOOR_FROM).device.host_dispatch_s
    profile["device"] = with_host_floor(with_unaligned(profile["device"]), floor)
    profile["name"] = "dgx-h100-datasheet+own-floor"
    path = directory / f"{profile['name']}.json"
    path.write_text(json.dumps(profile))
    return str(path)


def own_record(run: dict, cluster: str) -> Any:
    """One logged own run as a `RunRecord` (module docstring, step 1)."""
    from benchmarks.gpu_repredict import model_of
    from executor.validation.run_records import TORCH_NATIVE, RunRecord

    plan, p = run["plan"], run["parallelism"]
    if p["tp"] * p["pp"] * p["cp"] * p["dp"] * p.get("ep", 1) != 1:
        raise ValueError(f"{run['name']}: not a one-GPU run ({p})")
    return RunRecord(
        name=f"{OWN_PREFIX}{run['name'].removesuffix('.plan')}",
        model={"name": model_of(run), **plan["model"]["config"]}, gpus=1, cluster=cluster, stack=TORCH_NATIVE, seq=plan["seq_len"], micro_batch=p["micro_batch"],
        grad_accum=p["grad_accum"], global_batch=plan["global_batch"], precision=p["precision"],
        recompute=p["recompute"], torch_compile=p["compile"], zero=p["zero"], tp=1, pp=1, cp=1, dp=1,
        offload=p["offload_optimizer"], step_time_s=run["step_time_s"], memory_gib=run["peak_memory_gib"],
        memory_kind="allocated")


def as_run(prepared: Any, run: dict) -> tuple[list[str], float]:
    """What `external.prepare` planned differently from the logged run: the differing fields (parallelism,
    sequence, batch, task, the priced loss), and the relative difference of the simulated step of the prepared
    plan from the logged plan's on the same cluster."""
    from executor.validation.refit import simulate_on, trace_plan_model
    from planner.plan import plan_from_dict

    logged = plan_from_dict(run["plan"])
    mine, theirs = prepared.plan.parallelism, logged.parallelism
    diffs = [f"{f} {getattr(mine, f)} (ran {getattr(theirs, f)})" for f in PARALLELISM_FIELDS
             if getattr(mine, f) != getattr(theirs, f)]
    priced, ran = prepared.plan.strategy().train.cross_entropy, logged.strategy().train.cross_entropy
    if priced != ran:
        diffs.append(f"loss {priced} (ran {ran})")
    for name, a, b in (("seq", prepared.plan.seq_len, logged.seq_len),
                       ("global_batch", prepared.plan.global_batch, logged.global_batch),
                       ("task", prepared.plan.model.task, logged.model.task)):
        if a != b:
            diffs.append(f"{name} {a} (ran {b})")
    cluster = prepared.cluster
    ours = simulate_on(prepared.plan, prepared.graph, cluster).step_time_s
    theirs_s = simulate_on(logged, trace_plan_model(logged, cluster), cluster).step_time_s
    return diffs, ours / theirs_s - 1


def honest_key(key: Callable[[Any], str]) -> Callable[[Any], str]:
    """`key` (`external.GROUPINGS["model"]`) with the own 8B-shaped runs in the Llama 3.1 8B group (module
    docstring, step 3)."""
    def honest_model(record: Any) -> str:
        name = key(record)
        return EIGHT_B if name == EIGHT_B_SHAPES else name

    return honest_model


@dataclass(frozen=True)
class Evaluation:
    """One fit's checks (module docstring, step 3)."""

    prepared: tuple[Any, ...]
    fit: Any
    in_sample: tuple[Any, ...]
    leave_out: dict[str, tuple[Any, ...]]
    """Per grouping ("model" made honest, "gpus"), every run predicted by a fit without its group."""


def evaluate(prepared: Sequence[Any], ratios: dict | None = None) -> Evaluation:
    """The fit (with `ratios`, `external.fit`'s) in-sample and leaving out each model or GPU count."""
    from executor.validation import external

    result = external.fit(prepared, ratios=ratios)
    held = {"model": tuple(external.leave_out(prepared, "model", key=honest_key(external.GROUPINGS["model"]),
                                              ratios=ratios)),
            "gpus": tuple(external.leave_out(prepared, "gpus", ratios=ratios))}
    return Evaluation(prepared=tuple(prepared), fit=result,
                      in_sample=tuple(external.predict(p, result) for p in prepared), leave_out=held)


TORCH_NATIVE_OWN, TORCH_NATIVE_TITAN = "torch-native: own", "torch-native: torchtitan"
COLUMNS = ("torch-native", TORCH_NATIVE_TITAN, TORCH_NATIVE_OWN, "nemo-te")


def kind_of(record: Any) -> str:
    """The column a record's errors land in: its stack, torch-native split into torchtitan's and the own rows."""
    if record.stack != "torch-native":
        return record.stack
    return TORCH_NATIVE_OWN if record.name.startswith(OWN_PREFIX) else TORCH_NATIVE_TITAN


def mape_cells(predictions: Sequence[Any], records: dict[str, Any]) -> str:
    from executor.validation.external import mape

    cells = []
    for column in COLUMNS:
        chosen = [q for q in predictions if column in (records[q.name].stack, kind_of(records[q.name]))]
        cells.append(f"{mape(chosen):.1f}% ({len(chosen)})" if chosen else "-")
    return " | ".join(cells)


def titan_held_out(evaluation: Evaluation, grouping: str) -> list[Any]:
    """The torchtitan rows' predictions by the fits without their group (`Evaluation.leave_out`'s grouping: "model",
    the Llama 3.1 8B group; "gpus", their GPU count)."""
    names = {p.record.name for p in evaluation.prepared if p.record.cluster == TORCHTITAN_CLUSTER}
    return [q for q in evaluation.leave_out[grouping] if q.name in names]


def label(record: Any) -> str:
    """A torchtitan row in a few characters: GPUs, precision, compile, context parallelism, sequence."""
    return (f"{record.gpus}g {record.precision}{' c' if record.torch_compile else ''}"
            f"{f' cp{record.cp}' if (record.cp or 1) > 1 else ''} {record.seq // 1024}k")


OWN_FITS = ("(b)", "(c)")
"""The fits with the own runs in them."""
TRANSFER_MULTIPLIERS = ("matmul/bf16", "attention", "memory-bound", "compile", "kernel-launch")


def transfer(evaluation: Evaluation) -> list[tuple[str, Any, list[Any]]]:
    """The torchtitan rows predicted by fits on one part of the runs at a time: the own runs, their 8B-shaped
    runs, their other families, and (in-sample, for reference) the torchtitan rows themselves."""
    from executor.validation.external import fit, predict

    own = [p for p in evaluation.prepared if p.record.name.startswith(OWN_PREFIX)]
    titan = [p for p in evaluation.prepared if p.record.cluster == TORCHTITAN_CLUSTER]
    shapes = [p for p in own if p.record.model["name"] == EIGHT_B_SHAPES]
    subsets = {"own runs": own, "own 8b4l runs": shapes, "own runs of the other families":
               [p for p in own if p not in shapes], "torchtitan rows (in-sample)": titan}
    out = []
    for title, subset in subsets.items():
        result = fit(subset)
        out.append((title, result, [predict(p, result) for p in titan]))
    return out


def stated_sdpa(prepared: Sequence[Any]) -> list[Any]:
    """`prepared` with torchtitan's rows stating `TORCHTITAN_SDPA` (module docstring, step 6): the same parts, the
    attention part scaled by one more multiplier."""
    from dataclasses import replace

    return [replace(p, record=p.record.model_copy(update={"sdpa_backend": TORCHTITAN_SDPA}))
            if p.record.cluster == TORCHTITAN_CLUSTER else p for p in prepared]


H100_DENSE_PEAK = 989e12
"""The datasheet dense bf16 peak MFU is counted against (`benchmarks/believable_mfu.py`)."""


def picked_mfu(model: str, **request: Any) -> float:
    """The predicted MFU of the plan `soap plan` picks for `model` under `request` (model FLOPs over the H100's dense
    peak, `H100_DENSE_PEAK`)."""
    from planner.api import plan

    return plan(model, **request).predicted["model_tflops_per_gpu"] * 1e12 / H100_DENSE_PEAK


RATIO_FIT = "(a'') corpus, torchtitan's SDPA stated, attention over matmul measured"
BELIEVABLE = (("1b", str(Path(__file__).resolve().parent / "configs" / "llama-3.2-1b.json"), 8, "one node", False),
              ("8b", "llama-3-8b", 8, "one node", False), ("8b", "llama-3-8b", 8, "one node", True),
              ("8b", "llama-3-8b", 512, "multi-node", True))
"""Reference plans of the believable-profile test (model class, model, GPUs, scale, compiled)."""


def believable(evaluation: Evaluation, datasheet: str, directory: Path) -> list[str]:
    """The believable-profile test's reference plans (`BELIEVABLE`) on the shipped `dgx-h100` and on `evaluation`'s
    fit written over the datasheet H100 (`datasheet`), with soap's executor's attention and with the
    FlashAttention-2 the class's runs ran (torchtitan's torch; nanotron's flash-attn), and with that kernel over
    torchtitan's 500 W H100s, against the best published eager-stack run of the class: table rows."""
    from costmodel.profiles import cluster_to_dict, load_cluster
    from executor.validation.external import apply_fit

    paths = []
    for kernel, over in ((None, datasheet), (TORCHTITAN_SDPA, datasheet), (TORCHTITAN_SDPA, TORCHTITAN_CLUSTER)):
        profile = apply_fit(cluster_to_dict(load_cluster(over)), evaluation.fit, source="own_runs_corpus",
                            sdpa_backend=kernel)
        profile["name"] = f"own-runs-fit-a-ratio-{kernel or 'executor'}-{len(paths)}"
        paths.append(directory / f"{profile['name']}.json")
        paths[-1].write_text(json.dumps(profile))
    bounds = json.loads((Path(__file__).resolve().parents[1] / "profiles" / "published-mfu.json").read_text())
    rows = []
    for model_class, model, gpus, scale, compiled in BELIEVABLE:
        bound = next(c for c in bounds["classes"] if (c["gpu"], c["model"], c["scale"], c["family"], c["compile"])
                     == ("h100", model_class, scale, "eager", compiled))
        pins = {"recompute": bound["recompute"]} if bound.get("recompute") else {}
        cells = []
        for cluster in ("dgx-h100", *map(str, paths)):
            mfu = picked_mfu(model, gpus=gpus, cluster=cluster, precision="bf16", seq_len=4096,
                             compile="on" if compiled else "off", **pins)
            cells.append(f"{mfu:.1%}{' (over)' if mfu > bound['mfu_max'] else ''}")
        rows.append(f"| {model_class.upper()}, {gpus} GPUs, {'compiled' if compiled else 'eager'}, "
                    f"{bound.get('recompute') or 'no'} recompute | {bound['mfu_max']:.1%} ({bound['best_run']}) | "
                    + " | ".join(cells) + " |")
    return rows


EIGHT_B_GPUS = (8, 64)


def eight_b_mfu(evaluation: Evaluation, datasheet: str, directory: Path, fit: str = "(c)") -> list[str]:
    """`soap plan llama-3-8b` on a fit written over the datasheet H100 (`datasheet`, a cluster file): the MFU of the
    plan it picks on `EIGHT_B_GPUS` GPUs, compiled and eager, with soap's executor's attention (cuDNN's kernels) and
    with torchtitan's FlashAttention-2 multiplier folded in: table rows."""
    from executor.validation.external import apply_fit

    base = json.loads(Path(datasheet).read_text())
    rows = []
    for kernel in (None, TORCHTITAN_SDPA):
        profile = apply_fit(base, evaluation.fit, source="own_runs_corpus", sdpa_backend=kernel)
        slug = fit.strip("()").replace("'", "-prime")  # "(a')" -> a-prime: one file per fit and kernel
        profile["name"] = f"own-runs-fit-{slug}-{kernel or 'executor'}"
        path = directory / f"{profile['name']}.json"
        path.write_text(json.dumps(profile))
        cells = []
        for compiled in (True, False):
            for gpus in EIGHT_B_GPUS:
                mfu = picked_mfu("llama-3-8b", gpus=gpus, cluster=str(path), compile="on" if compiled else "off")
                cells.append(f"{mfu:.1%}")
        title = (f"torchtitan's FlashAttention-2 (x{evaluation.fit.multiplier(f'attention/{kernel}'):.3g})" if kernel
                 else "soap's executor's (cuDNN's, torch 2.11)")
        rows.append(f"| {fit} | {title} | " + " | ".join(cells) + " |")
    return rows


def report(results: dict[str, Evaluation], conversion: dict[str, list[str]], elapsed: float,
           mfu_rows: Sequence[str] = (), bound_rows: Sequence[str] = ()) -> str:
    from executor.validation.external import mape

    records = {p.record.name: p.record for e in results.values() for p in e.prepared}
    lines = [f"Own runs joined to the published corpus (`benchmarks/own_runs_corpus.py`; {elapsed:.0f} s). "
             "MAPE of tokens/s per GPU (rows in brackets); leave one model out groups the own `8b4l` runs "
             "with Llama 3.1 8B.", ""]
    for variant, rows in conversion.items():
        lines += [f"Own runs as run records on `{variant}`: planned as they ran? (prepared plan's simulated step "
                  "against the logged plan's; error of the profile before any fit; memory measured allocated / "
                  "simulated GiB)", "",
                  "| run | model | as run | sim. step vs logged plan | before fit | memory |",
                  "|---|---|---|---:|---:|---:|", *rows, ""]
    lines += ["| fit | check | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * len(COLUMNS)]
    for title, e in results.items():
        lines.append(f"| {title} | in-sample | {mape_cells(e.in_sample, records)} |")
        lines.append(f"| {title} | leave one model out | {mape_cells(e.leave_out['model'], records)} |")
        lines.append(f"| {title} | leave one GPU count out | {mape_cells(e.leave_out['gpus'], records)} |")
    for grouping, caption in (("model", "Torchtitan rows (500 W, 8-128 GPUs) predicted by the fit without the Llama "
                                         "3.1 8B group (its torchtitan, NeMo and own 8b4l rows):"),
                              ("gpus", "Torchtitan rows predicted by the fit without their GPU count (8: every "
                                       "long-sequence row):")):
        lines += ["", caption, "", "| fit | torchtitan MAPE | mean signed | per row |", "|---|---:|---:|---|"]
        for title, e in results.items():
            held = titan_held_out(e, grouping)
            signed = 100 * sum(q.error for q in held) / max(len(held), 1)
            lines.append(f"| {title} | {mape(held):.1f}% | {signed:+.1f}% | "
                         + ", ".join(f"{label(records[q.name])} {q.error:+.0%}" for q in held) + " |")
    for title, e in results.items():
        if not title.startswith("(b)"):
            continue
        lines += ["", f"Torchtitan rows predicted by fits on one part of {title} at a time:", "",
                  "| fitted on | torchtitan MAPE | mean signed | " + " | ".join(TRANSFER_MULTIPLIERS) + " | at peak |",
                  "|---|---:|---:|" + "---:|" * len(TRANSFER_MULTIPLIERS) + "---|"]
        for subset, result, predictions in transfer(e):
            signed = 100 * sum(q.error for q in predictions) / len(predictions)
            lines.append(f"| {subset} | {mape(predictions):.1f}% | {signed:+.1f}% | " + " | ".join(
                f"{result.multipliers[n]:.3g}" if n in result.multipliers else "-" for n in TRANSFER_MULTIPLIERS)
                + f" | {', '.join(' x '.join(p) for p in result.at_peak) or 'none'} |")
    names = list(dict.fromkeys(n for e in results.values() for n in e.fit.multipliers))
    lines += ["", "Fitted multipliers, in-sample (runs each scales); `at peak`: products left on their "
              "datasheet-peak ceiling (`Fit.at_peak`).", "",
              "| multiplier | " + " | ".join(results) + " |", "|---|" + "---:|" * len(results)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(
            f"{e.fit.multipliers[name]:.3g} ({len(e.fit.runs[name])})" if name in e.fit.multipliers else "-"
            for e in results.values()) + " |")
    lines.append("| at peak | " + " | ".join(", ".join(" x ".join(p) for p in e.fit.at_peak) or "none"
                                            for e in results.values()) + " |")
    if mfu_rows:
        lines += ["", "`soap plan llama-3-8b` on (a'), (a'') and (c) written over the datasheet H100: predicted "
                  "MFU of the plan it picks (model FLOPs over the 989 TFLOP/s dense peak), by the attention kernel "
                  "priced:", "",
                  "| fit | attention | " + " | ".join(f"{g} GPUs, {c}" for c in ("compiled", "eager")
                                                   for g in EIGHT_B_GPUS)
                  + " |", "|---|---|" + "---:|" * 2 * len(EIGHT_B_GPUS), *mfu_rows]
    if bound_rows:
        lines += ["", "The believable-profile check (`tests/test_believable_profiles.py`: the plan soap picks, "
                  "seq 4096, under the recompute the class's runs used) on the shipped `dgx-h100` and on (a'') "
                  "written over "
                  "the datasheet H100, against the best published run of the class (`profiles/published-mfu.json`):",
                  "", "| reference plan | best published run of the class | dgx-h100 (a) | (a'') | (a''), "
                  "FlashAttention-2's attention | (a''), FlashAttention-2, on the 500 W H100 (`grand-teton-h100`) |",
                  "|---|---|---:|---:|---:|---:|", *bound_rows]
    lines += ["", "Own rows, leave one model out (each family predicted by the fit without it):", "",
              "| run | " + " | ".join(t for t in results if t.startswith(OWN_FITS)) + " |",
              "|---|" + "---:|" * sum(t.startswith(OWN_FITS) for t in results)]
    own_names = list(dict.fromkeys(n for n, r in records.items() if n.startswith(OWN_PREFIX)))
    by = {t: {q.name: q for q in e.leave_out["model"]} for t, e in results.items() if t.startswith(OWN_FITS)}
    for name in own_names:
        lines.append(f"| {name} | " + " | ".join(f"{b[name].error:+.1%}" if name in b else "-" for b in by.values())
                     + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--own-cluster", choices=(*OWN_CLUSTERS, "both"), default="both",
                        help="profile the own runs are priced on (module docstring, step 2)")
    args = parser.parse_args()

    from benchmarks.gpu_repredict import runs
    from benchmarks.published_runs import CORPUS, FILES
    from executor.validation.external import ATTENTION_OVER_MATMUL, load_records, predict, prepare
    from tracer.errors import SoapError

    start = time.perf_counter()
    corpus = load_records([f"{CORPUS / name}:{cluster}" for name, cluster in FILES], cluster=None)
    graphs: dict = {}
    base = [prepare(r, graphs=graphs) for r in corpus]
    print(f"planned {len(base)} corpus records ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    results = {"(a) corpus": evaluate(base)}
    print(f"(a) evaluated ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    corpus_stated = results["(a') corpus, torchtitan's SDPA stated"] = evaluate(stated_sdpa(base))
    print(f"(a') evaluated ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    corpus_ratio = results[RATIO_FIT] = evaluate(stated_sdpa(base), ratios=ATTENTION_OVER_MATMUL)
    print(f"(a'') evaluated ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    logged = runs()
    variants = OWN_CLUSTERS if args.own_cluster == "both" else (args.own_cluster,)
    conversion: dict[str, list[str]] = {}
    mfu_rows: list[str] = []
    bound_rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="own-runs-corpus-") as tmp:
        for variant in variants:
            cluster = datasheet_cluster(Path(tmp)) if variant == "datasheet" else variant
            own, rows = [], []
            for run in logged:
                try:
                    record = own_record(run, cluster)
                    prepared = prepare(record, graphs=graphs)
                except (SoapError, ValueError) as err:
                    rows.append(f"| {run['name']} | not converted or planned: {err} | | | | |")
                    continue
                diffs, step = as_run(prepared, run)
                before = predict(prepared, None)
                ran = "yes" if not diffs and abs(step) <= AS_RUN_TOLERANCE else f"no: {'; '.join(diffs) or 'step'}"
                rows.append(f"| {record.name} | {record.model['name']} | {ran} | {step:+.2%} | {before.error:+.1%} | "
                            f"{record.memory_gib:.1f} / {before.predicted_memory_gib:.1f} |")
                own.append(prepared)
            conversion[variant] = rows
            results[f"(b) + own on {variant}"] = evaluate([*base, *own])
            print(f"(b) on {variant} evaluated ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
            if variant == "datasheet":
                stated = evaluate(stated_sdpa([*base, *own]))
                results[f"(c) + own on {variant}, torchtitan's SDPA stated"] = stated
                print(f"(c) evaluated ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
                mfu_rows = [*eight_b_mfu(corpus_stated, cluster, Path(tmp), "(a')"),
                            *eight_b_mfu(corpus_ratio, cluster, Path(tmp), "(a'')"),
                            *eight_b_mfu(stated, cluster, Path(tmp), "(c)")]
                bound_rows = believable(corpus_ratio, cluster, Path(tmp))
    body = "\n".join([report(results, conversion, time.perf_counter() - start, mfu_rows, bound_rows), "", READING])
    print(body)
    if args.own_cluster == "both":
        from benchmarks.report import update_section

        update_section("own-runs-corpus", "The corpus with soap's own H100 runs: does torch-native generalize?", body)


READING = """Reading it (2026-11-27, after FlashAttention-2 and cuDNN's attention kernels were timed on a lent H100).
What keeps torchtitan's rows apart from soap's own runs is mostly the attention kernel. In (b) one attention
multiplier serves both, and the fit bends the shared terms around the quarrel. (c) states the kernel torchtitan's
torch ran (FlashAttention-2, `TORCHTITAN_SDPA`; the own runs ran cuDNN's Hopper kernels): one multiplier more,
`attention/flash_attention`, every other term shared with the own runs and NeMo's rows. Timed alone on one H100
(torch 2.11, the 8B's heads, causal, forward and backward, seq 2k-32k; `benchmarks/sdpa_backends.py`),
FlashAttention-2 takes 1.65-1.82x cuDNN's time, 1.76x on the geometric mean; the fit takes that as a measurement
weighing one run (`external.MEASURED_PRIORS`). In sample it ends at x1.82: the ten torchtitan rows alone had asked
for x2.26 with the own runs' attention on its datasheet-peak ceiling (x0.807); with the measurement they agree with
it within 3%, and the own runs' attention sits at x0.99, off the ceiling. In sample: torchtitan 7.5%, own 4.3%,
NeMo 2.0%.

Leaving out the model, torchtitan's rows are predicted at 7.9% (-22% to +11% a row; 29.6% before the measurement,
40.1% on the corpus alone): with the 8B's rows out no row states FlashAttention-2, and the measured x1.76 prices
their attention. Leaving out a GPU count, 10.1% (7.2% before; the 8-GPU long-sequence rows at cp4 and cp8 come out
+26% and +33%, their attention ratio the one the 128-GPU rows cannot set). Torch-native as a whole, torchtitan's and
the own rows together: 6.6% leaving out a model, 11.1% a GPU count.

NeMo's leave-one-model-out in (c) is 19.4% (9.5% on the corpus alone; 57.1% before the activation collectives'
multiplier was bounded). With Nemotron-4 15B left out, only context-parallel rows set that multiplier (NeMo's 8B
at cp2, torchtitan's long sequences), and NeMo's 8B rows, about 12% slower than soap prices them, put their excess
there: x25.5 (x0.58 in the full fit), and the 15B rows, whose TP collectives are 6-19% of their priced step, came out
53-84% slow. A fit may now take it to x3 at most (`external.ACTIVATION_MAX`: every fit on runs that exercise
these collectives found x0.49-1.5); the 15B rows then come out 8-29% slow, the 8B rows without the 8B 16-19% slow.
The bound moves no fit that stayed under it ((a), (a'), (a'') unchanged). Neither soap's terms nor the corpus say
where NeMo's 8B spends that 12% (the ring's small kernels at 8k tokens cp2, measured 1.5x their price alone on the
H100, explain it only in part: charged to its attention, the NeMo in-sample error rises; Transformer Engine's fused
RMSNorm and rotary kernels, which soap prices as HF's op chains, are the other candidate).

(a') is the corpus alone with torchtitan's rows stating their kernel as (c) does, no own run (2026-11-27, after the
context-parallel kernels were timed: `benchmarks/cp_attention.py`). Its attention multiplier falls from (a)'s x1.8
to about x1.03, the kernel soap's executor runs (cuDNN's, its own runs' x0.99 in (c)), and FlashAttention-2 takes
about the measured x1.76 on top: the x1.8 of (a) was torchtitan's kernel on 500 W parts, charged to every H100
attention. It meets the leave-one-model-out bound for both stacks without any own run (torch-native 12.1% against
(a)'s 40.1%, NeMo 9.0%); leaving out a GPU count it halves torch-native's error (24.4% against 43.1%) but no more:
without the 8-GPU rows every torchtitan row left runs 8k tokens, where attention is a sixth of the step, and the fit
cannot tell attention's time from the GEMMs' (attention x0.55, matmul x1.74), so the long-sequence rows come out
+80% and +97%.

(a'') adds what the H100 measured about that split (2026-11-27): cuDNN's whole causal attention ran at 0.68-0.93 of
the datasheet profile's price at 4k-131k tokens, the 8B's GEMMs at 0.97-0.99 (through `h100-x1-measured`, fitted to
the lent H100's microbenchmarks), so attention's multiplier over the GEMMs' is x0.746 (log spread 0.12;
`external.ATTENTION_OVER_MATMUL`, `benchmarks.cp_attention.attention_over_matmul`), a pull on their ratio as strong
as one run's. In sample the corpus alone had put it at x0.67 ((a'): 1.03 over 1.53): they agree, and every check
moves by a point or less but leaving out a GPU count, which falls to 6.6% for torch-native (24.4% in (a'); the cp4
and cp8 rows +1% and +4%). (a'') is the one fit of this corpus inside every leave-out bound of issue 27 for both
stacks: torch-native 5.6% in sample, 13.1% leaving out the model, 6.6% a GPU count; NeMo 1.9%, 9.5%, 2.0%. It is not
the shipped profile: written over the datasheet H100 it predicts soap's executor on a 700 W DGX H100 (cuDNN's
kernels) above the best published runs of every class (the believable-profile table above: the 1B at 42.5% against
nanotron's 40.3%, the 8B at 41.6-48.5% against torchtitan's 35.0-40.5%). Priced as those runs ran, with
FlashAttention-2 (torchtitan's torch; nanotron's flash-attn), the 1B comes to 39.2%, inside; on torchtitan's 500 W
H100s too, the 8B comes to 34.6% eager and 40.3-41.5% compiled, within 1 point of the published 35.0% and
39.6-40.5%. Its excess over the published runs is the kernel and the power cap those runs had, each measured or
stated, not the fit.

The shipped `dgx-h100` stays the corpus fit (a), which errs 40-43% leaving out a model or a GPU count and stays
under the published 1B runs by pricing every H100 attention as torchtitan's FlashAttention-2 on 500 W parts ran it
(2.4-2.6x slower than cuDNN's kernels ran on the H100, `benchmarks/cp_attention.py`, its last column). Shipping (a'')
instead would predict soap's executor 10-13% faster than (a) on the 8B (53.1% compiled at 8 GPUs against 46.9%) and
fail the believable-profile test on the 1B; the test's bound is a run of another kernel and power. (c), with soap's
own 700 W runs of the 8B's layers (predicted within -8% to -0.5% leaving out their model), predicts 60%. The
published bound and soap's own measurements disagree about a 700 W DGX H100 running cuDNN's kernels: an 8-GPU DGX
H100 running the 8B through soap's executor (`benchmarks/dgx_8b_check.sh`) is what says which is right."""


if __name__ == "__main__":
    main()
