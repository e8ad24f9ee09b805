"""Benchmark and shipping step: soap against the published H100 runs of ../shared/published-runs/.

    flock -x /tmp/soap-cpu.lock python -m benchmarks.published_runs [--dry-run | --keep-profile]

1. Every corpus row is planned as published (`executor.validation.run_records`): the torchtitan rows (torch-native,
   the stack soap's executor runs) on `grand-teton-h100` (their 96 GB, 500 W H100s), the NeMo rows
   (Transformer Engine) on `dgx-h100-datasheet` (datasheet figures, assumed efficiencies).
2. `soap calibrate --from-runs`'s fit (`executor.validation.external.refit_external`) on all of them:
   multipliers per kernel class and precision, compile, kernel launch, link level and activation
   collectives, and a factor per stack for the NeMo rows.
3. For every row: published tokens/s per GPU against soap before the fit (the datasheet profiles), in-sample
   and leave-one-run-out (a fit without that row), and peak memory against the published peak; then the
   MAPE per stack, and leave-one-model / GPU-count / stack-out errors.
4. The fitted `dgx-h100-datasheet` is written as `dgx-h100` (device `h100-sxm-fitted`), the default cluster,
   with the unaligned-GEMM factor measured on an H100 (`benchmarks.unaligned_gemm`: no corpus row has one) and
   the host-bound floor of soap's executor fitted on its own H100 runs (`benchmarks.gpu_repredict.host_floor`:
   every corpus row is compute-bound, none constrains it):
   torch-native predictions calibrated on published runs. `SOAP_PROFILES_DIR=profiles` writes the shipped
   files; without it they land in the user's profile folder, where they shadow the shipped ones.
5. Out of sample (`another_model`): the Ultra-Scale Playbook's one-node rows (30 configurations of its 1B model on
   8 H100, nanotron: a model and a stack the fit never saw) predicted by the fitted profile as it is, every term
   out of sample; then with the one number that belongs to nanotron, not to the device: its host time per
   dispatched kernel (`DeviceProfile.host_dispatch_s`, `benchmarks.vtrain_tp.fit_host`), fitted on the tp 1-2
   rows and judged on the tp 4-8 rows. Not fitted on: joined to the fit they move the torch-native launch
   overhead x11 (0.33 -> 3.8), because the torchtitan rows, all 8B and compute-bound, hardly constrain it and
   nanotron's host-bound small-micro-batch TP rows then set it for the device.
Writes section `published-runs` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "published-runs"
FILES = (("torchtitan-llama3-8b-h100.json", "grand-teton-h100"), ("nvidia-dgxc-8b-15b-h100.json", "dgx-h100-datasheet"))
TARGET = "dgx-h100-datasheet"
FITTED, FITTED_DEVICE = "dgx-h100", "h100-sxm-fitted"  # the shipped default H100 cluster is this fit
DESCRIPTION = ("NVIDIA DGX/HGX H100: 8 GPUs per node on NVSwitch (NVLink4, NVLS SHARP), 8x400G NDR InfiniBand per node; "
               "dgx-h100-datasheet refitted by soap calibrate --from-runs to the published H100 runs of "
               "../shared/published-runs (benchmarks/published_runs.py), each fitted number naming its runs"
               "; its compute terms are fitted mostly on torchtitan's 500 W H100 96GB HBM2e rows: on a 700 W H100 80GB (2026-11-26) soap's executor ran the 8B's GEMMs 1.6x faster and its memory-bound kernels 2.3x slower than this profile prices, which nearly cancel on an 8B step (docs/benchmarks.md, 'One H100, 2026-11-26'; h100-x1-measured prices them as measured)")
PLAYBOOK = "nanotron-playbook-1b-h100.json"
FLOOR_FIT_TP = 2
"""`another_model` fits nanotron's host floor on the rows of tp up to this and judges it on the others."""
MEMORY_TOLERANCE = 0.15
NOT_WRITTEN = (" (not written by this run: the shipped file is an earlier fit of this corpus, whose multipliers its "
               "sources name; rewriting it moves every default plan)")


def another_model(profile: dict) -> list[str]:
    """Markdown lines: the Playbook's one-node rows on the fitted cluster `profile` (inline form), step 5 of the
    module docstring: per tp degree the rows' mean signed and absolute tokens/s error, without and with
    nanotron's host floor, and the group's rank correlation and pick/best."""
    import numpy as np

    from benchmarks.vtrain_tp import fit_host, step_times, with_host
    from costmodel.profiles import cluster_from_dict
    from executor.validation.grid import graph_key, group_scores, load_grid, price_row

    cluster = cluster_from_dict(profile)
    ran, _ = load_grid(CORPUS / PLAYBOOK, cluster=cluster.name)
    rows = [r for r in ran if r.nodes == 1]
    graphs: dict = {}
    priced = [price_row(r, cluster, graphs=graphs) for r in rows]
    plans = [(p.plan, graphs[graph_key(p.plan, cluster)]) for p in priced]
    fitted_on = [i for i, r in enumerate(rows) if r.tp <= FLOOR_FIT_TP]
    host = fit_host([rows[i] for i in fitted_on], [plans[i] for i in fitted_on], cluster)
    runs = {"fitted profile as it is": [p.tokens_per_s_per_gpu for p in priced],
            f"with nanotron's host floor, {host * 1e6:.0f} us/kernel fitted on tp <= {FLOOR_FIT_TP}":
            [r.batch * r.seq / (t * r.gpus) for r, t in zip(rows, step_times(plans, with_host(cluster, host)))]}
    degrees = sorted({r.tp for r in rows})
    lines = ["| profile | " + " | ".join(f"tp{d} ({sum(r.tp == d for r in rows)} rows)" for d in degrees)
             + " | all | rank correlation / pick/best |", "|---|" + "---:|" * (len(degrees) + 2)]
    for title, tokens in runs.items():
        errors = np.array([t / r.measured_tokens_per_s_per_gpu - 1 for r, t in zip(rows, tokens)])
        cells = [f"{100 * errors[[r.tp == d for r in rows]].mean():+.1f}% / "
                 f"{100 * np.abs(errors[[r.tp == d for r in rows]]).mean():.1f}%" for d in degrees]
        score = group_scores(rows, tokens)[0]
        lines.append(f"| {title} | " + " | ".join(cells) + f" | {100 * errors.mean():+.1f}% / "
                     f"{100 * np.abs(errors).mean():.1f}% | {score.spearman:.2f} / {score.pick_best:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print, but write neither the profile nor docs")
    parser.add_argument("--keep-profile", action="store_true",
                        help="write docs but not the profile (the shipped dgx-h100 moves every default plan)")
    args = parser.parse_args()

    from benchmarks.report import update_section
    from executor.validation.external import group_ranks, load_records, mape, refit_external, write_fitted

    start = time.perf_counter()
    records = load_records([f"{CORPUS / name}:{cluster}" for name, cluster in FILES], cluster=None)
    refit = refit_external(records, target=TARGET, progress=lambda name: print(f"planned {name}", file=sys.stderr))
    elapsed = time.perf_counter() - start
    stack = {r.name: r.stack for r in records}
    stacks = sorted(set(stack.values()), key=lambda s: s != "torch-native")
    loo = {q.name: q for q in refit.leave_out["run"]}

    def errors(predictions) -> str:
        return " / ".join(f"{mape([q for q in predictions if stack[q.name] == s]):.1f}%" for s in stacks)

    rows = ["| run | stack | GPUs | published tok/s/GPU | soap before | fitted (in-sample) | leave-one-out | LOO error | "
            "published memory GiB | soap memory GiB | memory error |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    memory_errors = []
    for record, before, inside in zip(records, refit.before, refit.in_sample):
        out = loo[record.name]
        memory = ""
        if record.memory_gib:
            error = inside.predicted_memory_gib / record.memory_gib - 1
            memory_errors.append(error)
            memory = f"{record.memory_gib:.1f} ({record.memory_kind}) | {inside.predicted_memory_gib:.1f} | {error:+.1%}"
        else:
            memory = " | | "
        rows.append(f"| {record.name} | {record.stack} | {record.gpus} | {record.measured_tokens_per_s_per_gpu:,.0f} | "
                    f"{before.predicted_tokens:,.0f} | {inside.predicted_tokens:,.0f} | {out.predicted_tokens:,.0f} | "
                    f"{out.error:+.1%} | {memory} |")
    summary = ["| tokens/s per GPU, MAPE | " + " | ".join(stacks) + " |", "|---|" + "---:|" * len(stacks),
               "| soap before the fit (datasheet profiles) | " + errors(refit.before).replace(" / ", " | ") + " |",
               "| fitted, in-sample | " + errors(refit.in_sample).replace(" / ", " | ") + " |"]
    for grouping, predictions in refit.leave_out.items():
        summary.append(f"| leave one {grouping} out | " + errors(predictions).replace(" / ", " | ") + " |")
    within = sum(abs(e) <= MEMORY_TOLERANCE for e in memory_errors)
    fitted = ["| multiplier | value | runs it scales |", "|---|---:|---:|"]
    fitted += [f"| {name} | {value:.3g} | {len(refit.fit.runs[name])} |" for name, value in refit.fit.multipliers.items()]
    from benchmarks.gpu_repredict import host_floor, with_host_floor
    from benchmarks.unaligned_gemm import with_unaligned

    from benchmarks.fp32_gemm import with_fp32_gemms
    from benchmarks.techniques_h200 import with_optimizers
    from costmodel.context_attention import with_lower_right

    floor, _ = host_floor()
    # measured on soap's own runs, not fitted here: no corpus row has an unaligned GEMM, a host-bound step, an unfused
    # optimizer, soap's context-parallel kernels (the published rings keep the one-kernel price) or an fp32/tf32 GEMM
    device = with_fp32_gemms(with_optimizers(with_host_floor(with_unaligned(refit.profile["device"]), floor)))
    device["kernel_factors"] = with_lower_right(device.get("kernel_factors"))
    profile = {**refit.profile, "device": device}
    written = () if args.dry_run or args.keep_profile else write_fitted(profile, name=FITTED, device_name=FITTED_DEVICE,
                                                         description=DESCRIPTION)
    outside = another_model(profile)
    ranks = ["| group (model, GPUs, cluster) | runs | rank correlation | pick/best |", "|---|---:|---:|---:|"]
    ranks += [f"| {g.group} | {g.runs} | {'n/a' if g.spearman is None else f'{g.spearman:+.2f}'} | "
              f"{g.pick_over_best:.2f} |" for g in group_ranks(refit.prepared, refit.leave_out["run"])]
    body = "\n".join([
        f"`benchmarks/published_runs.py`: the {len(records)} rows of `../shared/published-runs/` (torchtitan's Llama 3.1 8B "
        "runs, torch-native, on `grand-teton-h100`: H100 96 GB at 500 W; NVIDIA's NeMo Llama 3.1 8B and Nemotron-4 15B runs, "
        "Transformer Engine, on `dgx-h100-datasheet`), each planned as published and simulated; then `soap calibrate --from-runs`'s "
        "fit on all of them (`executor.validation.external`). Leave-one-out: the row's tokens/s predicted by a fit "
        f"without it, re-simulated on the refitted profile. Planning, fitting and {sum(len(v) for v in refit.leave_out.values())} "
        f"held-out predictions took {elapsed:.0f} s.",
        "",
        *summary,
        "",
        "Leave one model / GPU count / stack out removes every row of that group from the fit: a model, GPU count or stack "
        "the fit never saw. All torch-native rows are Llama 3.1 8B and 7 of 10 are at 8 GPUs, so leaving either out leaves "
        "terms (attention, fp8, compile) without a torch-native row to fit them; a held-out stack has no stack factor and "
        "is predicted as the other stack. Every fit keeps each kernel class no faster than its datasheet peak, stack factor "
        "included (`executor.validation.external._peak_ceilings`): without that, a fit on one NeMo model's rows, which "
        "cannot tell Transformer Engine's factor from the device's matmul multiplier, priced its fp8 GEMMs at 2.7x the "
        "fp8 peak, and leaving out a model erred 16.8% on the NeMo rows. Leaving out Llama 3.1 8B leaves no "
        "torch-native row and no row of the 500 W cluster in the fit: its torch-native error is a fit on the Nemotron "
        "rows alone carried to a stack and cluster it never saw (the datasheet profile errs 39.5% there), which "
        "this corpus cannot check a fit against; soap's own runs on one H100, five models, can "
        "(`benchmarks/gpu_repredict.py`: leave one model out).",
        "",
        *fitted,
        "",
        "Would the fit pick the fastest run? Per group of rows sharing model, GPU count and cluster, the leave-one-run-out "
        "predictions' rank correlation with the measured tokens/s, and pick/best: the measured tokens/s of the row "
        "predicted fastest over the group's best (1.00: the fit picks the best run).",
        "",
        *ranks,
        "",
        "Another model and stack, never fitted on (module docstring, step 5): the Ultra-Scale Playbook's 1B on one "
        f"node of 8 H100 (nanotron; `{PLAYBOOK}`), each row priced as published on the fitted profile. Cells: mean "
        "signed / mean absolute tokens/s error per tp degree; then the group's rank correlation and pick/best. "
        "The rows that run near the top (tp 1-2 at micro-batch 2 or more) stay within about 10% on the fitted "
        "device terms alone; nanotron's small-micro-batch TP rows are host-bound (its dispatch, not the GPU, sets "
        "their pace), which the stack's host floor carries.",
        "",
        *outside,
        "",
        "Each multiplier scales the profile's term as written in the fitted profile: `matmul/<precision>`, `attention` and "
        "`memory-bound` the kernel classes' time (`kernel_factors`; `matmul/fp8` is fp8's over `matmul/bf16`'s, the "
        "written fp8 factor their product), `compile` the memory-bound classes under "
        "torch.compile (`compile_factors`), `kernel-launch` the per-kernel overhead, `intra-node` / `inter-node` the "
        "links' time, `activation` the TP/CP activation collectives; `stack:nemo-te` (matmul, attention) and "
        "`stack:nemo-te/memory-bound` are the NeMo/Transformer Engine stack's own factors, reported and not written "
        f"(soap predicts its torch-native executor). Fitted profile: `{FITTED}` (device `{FITTED_DEVICE}`)"
        f"{'' if written else NOT_WRITTEN}.",
        "",
        f"Memory: {within} of {len(memory_errors)} rows that publish a peak are within {MEMORY_TOLERANCE:.0%} "
        f"(mean |error| {100 * sum(abs(e) for e in memory_errors) / max(len(memory_errors), 1):.1f}%). The published "
        "peak is torchtitan's reserved memory; soap's is its simulated peak of the HF model, allocated (no allocator "
        "reserve fitted: no row reports both peaks). Every row peaks in the loss's backward, after the blocks, so "
        "torch.compile's rule (`costmodel.memory_activations.compiled_keep`: a compiled block keeps what Inductor's "
        "partitioner saves) leaves these selective and full-recompute rows as eager. "
        "The loss's working set is what soap's executor keeps, as torchtitan does (`del pred`; measured on CPU, "
        "`tests/test_memory.py`): 3.0 x the fp32 logits, the logits not held through backward. Selective "
        "checkpointing is torchtitan's `selective_ac_option = 'op'`, the executor's policy and the rows' (each block "
        "keeps its input, every other weight matmul's output and the SDPA output; measured against the policy on "
        "CPU, `tests/test_selective_checkpointing.py`); under torch.compile less the cached output the partitioner "
        "drops (each block's down projection, [tokens, hidden] at 2 bytes: 4.0 GiB at 16k tokens over 32 layers; "
        "`compiled_selective_dropped`, measured in `tests/test_compile_memory.py`).",
        "",
        *rows,
    ])
    print(body)
    if not args.dry_run:
        update_section("published-runs", "Published H100 runs: predicted vs published, fitted, leave-one-out", body)


if __name__ == "__main__":
    main()
