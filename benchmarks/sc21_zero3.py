"""ZeRO-3 at scale, the SC'21 case (issue 28 item 4): a 175B GPT on 384-1,536 A100 80GB, ZeRO-3 vs PTD-P.

    flock -x /tmp/soap-cpu.lock python -m benchmarks.sc21_zero3 [--dry-run]

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21),
Table 4: GPT-3 175B (96 layers, hidden 12288, 96 heads, seq 2048, vocabulary 51,200), global batch 1,536,
fp16, full recompute, on DGX A100 80GB nodes (8 x 200 Gb/s HDR InfiniBand). DeepSpeed ZeRO-3 without model
parallelism (micro-batch 4, 2, 1 at 384, 768, 1,536 GPUs: one micro-batch per GPU per step) and PTD-P
(tensor 8 x pipeline 12, micro-batch 1). Published TFLOP/s per GPU, by the paper's formula
96 B s l h^2 (1 + s/6h + V/16lh), recompute included: `PUBLISHED`.

Every configuration is priced as published (`executor.validation.grid.price_row`) twice: as its stack ran
it (ZeRO-3: `deepspeed-2021`, per-tensor gathers, `costmodel.param_gathers`; PTD-P: `megatron-lm`,
gradients accumulated locally) and as soap's executor would run it (torch-native: FSDP2 per-block
gathers; FSDP2 beside TP and PP). The predicted step is turned into TFLOP/s per GPU by the paper's own
formula, so both columns count the same FLOPs. Clusters: `dgx-a100-80g-datasheet` (the A100 default until
2026-11-26) and `dgx-a100-80g` as shipped (the A100's measured hardware with soap's executor's terms,
`benchmarks/native_profiles.py`): the ranking must not hang on the datasheet. Writes section `sc21-zero3` of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

CLUSTER, DATASHEET = "dgx-a100-80g", "dgx-a100-80g-datasheet"
MODEL = {"model_type": "gpt2", "n_embd": 12288, "n_layer": 96, "n_head": 96, "vocab_size": 51200,
         "n_positions": 2048, "architectures": ["GPT2LMHeadModel"]}
SEQ, BATCH, LAYERS, HIDDEN, VOCAB = 2048, 1536, 96, 12288, 51200
GPUS = (384, 768, 1536)
PUBLISHED = {"zero3": {384: 144, 768: 88, 1536: 44}, "ptd-p": {384: 153, 768: 149, 1536: 141}}
"""TFLOP/s per GPU, SC'21 Table 4."""
STACKS = {"zero3": "deepspeed-2021", "ptd-p": "megatron-lm"}


def paper_flops() -> float:
    """FLOPs per step by the paper's formula (eq. 3), recompute included: 96 B s l h^2 (1 + s/6h + V/16lh)."""
    return 96 * BATCH * SEQ * LAYERS * HIDDEN**2 * (1 + SEQ / (6 * HIDDEN) + VOCAB / (16 * LAYERS * HIDDEN))


def records(scheme: str, stack: str):
    """The published configurations of `scheme` at every GPU count, as `stack` runs them."""
    from executor.validation.run_records import RunRecord

    out = []
    for gpus in GPUS:
        tflops = PUBLISHED[scheme][gpus]
        common = dict(model=MODEL, gpus=gpus, seq=SEQ, global_batch=BATCH, precision="fp16", recompute="full",
                      cluster=CLUSTER, stack=stack, step_time_s=paper_flops() / (tflops * 1e12 * gpus))
        if scheme == "zero3":
            out.append(RunRecord(name=f"zero3 {gpus}", dp=gpus, tp=1, pp=1, zero=3, micro_batch=BATCH // gpus, **common))
        else:
            out.append(RunRecord(name=f"ptd-p {gpus}", tp=8, pp=12, dp=gpus // 96, zero=1, micro_batch=1,
                                 pp_schedule="1F1B", **common))
    return out


def predicted_tflops(scheme: str, stack: str, cluster, graphs: dict) -> dict[int, float]:
    from executor.validation.grid import price_row

    return {r.gpus: paper_flops() / (price_row(r, cluster, graphs=graphs).step_s * r.gpus) / 1e12
            for r in records(scheme, stack)}


def table(cluster, graphs: dict) -> tuple[list[str], dict]:
    rows = {
        ("zero3", "DeepSpeed ZeRO-3 (2021), per-tensor gathers"): STACKS["zero3"],
        ("zero3", "ZeRO-3 on soap's executor (FSDP2, per-block)"): "torch-native",
        ("ptd-p", "PTD-P tp8 pp12 (Megatron-LM)"): STACKS["ptd-p"],
        ("ptd-p", "PTD-P tp8 pp12 on soap's executor"): "torch-native",
    }
    out, lines = {}, ["| plan, as run by | " + " | ".join(f"{g} GPUs" for g in GPUS) + " |",
                      "|---|" + "---|" * len(GPUS)]
    for (scheme, label), stack in rows.items():
        tflops = predicted_tflops(scheme, stack, cluster, graphs)
        out[(scheme, stack)] = tflops
        lines.append(f"| {label} | " + " | ".join(f"{tflops[g]:.0f} ({PUBLISHED[scheme][g]})" for g in GPUS) + " |")
    return lines, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print, but do not write docs")
    args = parser.parse_args()

    from costmodel.profiles import load_cluster

    start = time.perf_counter()
    datasheet, shipped = load_cluster(DATASHEET), load_cluster(CLUSTER)
    graphs: dict = {}
    body = [
        "SC'21 Table 4 (Narayanan et al.): GPT-3 175B, batch 1,536, seq 2048, fp16, full recompute, on 384, 768 "
        "and 1,536 A100 80GB. Predicted TFLOP/s per GPU (the paper's formula applied to soap's step time), "
        "published in brackets. `python -m benchmarks.sc21_zero3`; the arithmetic is in "
        "`costmodel/param_gathers.py`.",
        "",
    ]
    results = {}
    for title, cluster in ((f"`{DATASHEET}` (the default until 2026-11-26)", datasheet),
                           (f"`{CLUSTER}` as shipped (measured hardware, soap's executor's terms)", shipped)):
        lines, results[title] = table(cluster, graphs)
        body += [f"On {title}:", "", *lines, ""]
    copies = {us: predicted_tflops("zero3", STACKS["zero3"],
                                   replace(datasheet, device=replace(datasheet.device, kernel_overhead_s=us * 1e-6)),
                                   graphs)
              for us in (3, 10)}
    body += ["Sensitivity to the list-output copy (the device's per-kernel floor, 7 us on the datasheet), DeepSpeed "
             "ZeRO-3 on the datasheet cluster: " + "; ".join(f"{us} us: " + " / ".join(f"{t[g]:.0f}" for g in GPUS)
                                                    for us, t in copies.items())
             + " TFLOP/s at " + " / ".join(map(str, GPUS)) + " GPUs.", ""]
    first, second = results.values()
    z_ds, z_own, p_mega = first[("zero3", STACKS["zero3"])], first[("zero3", "torch-native")], first[("ptd-p", STACKS["ptd-p"])]
    p_own = first[("ptd-p", "torch-native")]
    body += [
        f"Priced as DeepSpeed ran it, ZeRO-3 falls {z_ds[384]:.0f} -> {z_ds[768]:.0f} -> {z_ds[1536]:.0f} TFLOP/s "
        f"(published 144 -> 88 -> 44) while PTD-P holds {p_mega[384]:.0f} -> {p_mega[768]:.0f} -> "
        f"{p_mega[1536]:.0f} (153 -> 149 -> 141): 3,456 per-tensor gathers per micro-batch (12 tensors x 96 layers "
        "x forward, recompute and backward), each a ring of n-1 latency steps plus n list-output copies, "
        "blocking compute. On soap's executor (FSDP2, one prefetched gather per block, recompute under the "
        f"backward's gather) ZeRO-3 stays compute-bound: {z_own[384]:.0f} / {z_own[768]:.0f} / {z_own[1536]:.0f}, "
        "so soap still plans ZeRO-3 above the 3-D plan for its own executor, where the arithmetic says it is "
        f"faster. At 384 GPUs the published pair is 6% apart (144 vs 153); priced as run, soap puts ZeRO-3 "
        f"{100 * (1 - z_ds[384] / p_mega[384]):.0f}% below the 3-D plan there, a margin inside its error (both "
        "plans are predicted about 25% too fast on the datasheet A100 at 384 and 768 GPUs). On the shipped A100 "
        "the same four rows read " + ", ".join(f"{second[key][384]:.0f}" for key in second) + " at 384 GPUs: "
        "DeepSpeed's ZeRO-3 slower (the list-output copies at the per-kernel floor vTrain's rows fitted, "
        f"{shipped.device.kernel_overhead_s * 1e6:.1f} us; the sensitivity line above), Megatron's 3-D plan faster "
        f"(its TP activation collectives at vTrain's fitted x{shipped.device.activation_collective_factor:.2f}), "
        "both further above the published rows: the ranking holds, and no A100 run at this scale checks the "
        "level (the shipped A100's eager memory-bound terms are soap's executor's; these stacks fuse theirs, "
        "which would make them faster still). Megatron-LM and DeepSpeed hold the "
        "fp16 model in half (`TrainingConfig.half_model`); soap's executor runs fp16 as autocast over fp32 "
        f"weights, and on that trace its own PTD-P's step prices {p_mega[768] / p_own[768]:.1f}x the half model's "
        "at micro-batch 1 (weight casts every micro-batch, the GELU and norms in fp32), which no measurement here "
        "checks.",
        "",
        f"_{time.perf_counter() - start:.0f} s._",
    ]
    text = "\n".join(body)
    print(text)
    if not args.dry_run:
        from benchmarks.report import update_section

        update_section("sc21-zero3", "ZeRO-3 at scale: SC'21's 175B on 384-1,536 A100", text)


if __name__ == "__main__":
    main()
