"""The kernel measurements of a lent GPU, re-rendered from their files into docs/benchmarks.md.

    python -m benchmarks.gpu_kernels_docs

`benchmarks/sdpa_backends.py` and `benchmarks/qlora_dequant.py` ran on the lent H100 and H200 of 2026-11-27 and
wrote `benchmarks/data/h100-2026-11-27-kernels/*.json`. This renders their tables (the scripts' own `table`) and
what soap took from them, each number computed here from the files:
- FlashAttention-2's time over cuDNN's, the geometric mean over sequence lengths: the measured value of
  `executor.validation.external.FLASH_OVER_CUDNN` (the fit's `attention/flash_attention` prior);
- bitsandbytes' dequantization of a Llama-3-8B layer (its seven projections, GPU time) against its price on the
  datasheet H200 at `costmodel.peft.NF4_DEQUANTIZE_RATE`, and the in-step cost over two dequantizations.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DATA = Path(__file__).resolve().parent / "data" / "h100-2026-11-27-kernels"
LAYER = {"q_proj, o_proj": 2, "k_proj, v_proj": 2, "gate_proj, up_proj": 2, "down_proj": 1}
"""How many of each weight shape one Llama-3-8B layer has."""


def flash_over_cudnn(result: dict) -> tuple[float, float, float]:
    """(geometric mean, least, most) of FlashAttention-2's time over cuDNN's, per sequence length."""
    seconds = {(r["seq"], r["backend"]): r["seconds"] for r in result["rows"]}
    ratios = [seconds[seq, "FLASH_ATTENTION"] / seconds[seq, "CUDNN_ATTENTION"]
              for seq in dict.fromkeys(s for s, _ in seconds)]
    return math.exp(sum(map(math.log, ratios)) / len(ratios)), min(ratios), max(ratios)


def layer_dequantization(result: dict, cluster: str = "dgx-h200") -> tuple[float, float, float]:
    """(measured GPU seconds, priced seconds, in-step seconds) of one layer's seven dequantizations."""
    from costmodel.peft import dequantize_seconds
    from costmodel.profiles import load_cluster

    device = load_cluster(cluster).device
    rows = result["rows"]
    measured = sum(LAYER[r["weight"]] * r["kernel_s"] for r in rows)
    priced = sum(LAYER[r["weight"]] * dequantize_seconds(r["shape"][0] * r["shape"][1], device=device,
                                                          precision="bf16") for r in rows)
    return measured, priced, sum(LAYER[r["weight"]] * r["in_step_s"] for r in rows)


def repriced(result: dict, cluster: str) -> dict:
    """`result` with each weight priced by today's cost model on `cluster` (the files hold the price of the day)."""
    from costmodel.peft import dequantize_seconds
    from costmodel.profiles import load_cluster

    device = load_cluster(cluster).device
    rows = [{**r, "priced_s": dequantize_seconds(r["shape"][0] * r["shape"][1], device=device, precision="bf16")}
            for r in result["rows"]]
    return {**result, "cluster": cluster, "rows": rows}


def body() -> str:
    from benchmarks import qlora_dequant, sdpa_backends
    from costmodel.peft import NF4_DEQUANTIZE_RATE
    from executor.validation.external import FLASH_OVER_CUDNN

    sdpa = json.loads((DATA / "sdpa-backends.json").read_text())
    mean, least, most = flash_over_cudnn(sdpa)
    h100 = repriced(json.loads((DATA / "dequant-h100.json").read_text()), "dgx-h100")
    h200 = [repriced(json.loads((DATA / name).read_text()), "dgx-h200")
            for name in ("dequant-h200.json", "dequant-h200-repeat.json")]
    layers = [layer_dequantization(r) for r in h200]
    lines = [
        "Two calls on lent machines (`benchmarks/gpu_session_kernels.sh` on an H100 80GB HBM3 at 700 W, then "
        "`benchmarks/qlora_dequant.py` twice on an H200), torch 2.11.0+cu130; the files are in "
        "`benchmarks/data/h100-2026-11-27-kernels/` (`benchmarks/gpu_kernels_docs.py` renders them). The same H100 "
        "call ran the GPU-marked tests: 24 passed, 1 skipped (it needs two GPUs).", "",
        "**SDPA kernels** (`benchmarks/sdpa_backends.py`), each pinned with `sdpa_kernel`:", "",
        sdpa_backends.table(sdpa), "",
        f"torch 2.11 picks cuDNN's kernels at every length. FlashAttention-2 takes {least:.2f}-{most:.2f}x their time, "
        f"{mean:.2f}x on the geometric mean (`external.FLASH_OVER_CUDNN` = {FLASH_OVER_CUDNN}): the measured value "
        "the corpus fit pulls `attention/flash_attention` toward (torchtitan's rows ran FlashAttention-2; see \"The "
        "corpus with soap's own H100 runs\").", "",
        "**bitsandbytes' dequantize_4bit** (`benchmarks/qlora_dequant.py`; nf4, blocksize 64, double quantization) "
        "on the H100, with soap's host-bound timer only (priced: today's price):", "", qlora_dequant.table(h100), "",
        "On the H200, with the GPU's own kernel time (torch.profiler) and the cost in a step (a forward and "
        "backward of 4,096 tokens through `bitsandbytes.matmul_4bit` beyond the same through the bf16 weight):", "",
        qlora_dequant.table(h200[0]), "", "Repeated:", "", qlora_dequant.table(h200[1]), "",
        "The timer reads about the same time a call at every size: it measures bitsandbytes' host work around three "
        "launches, which a training step hides behind its GEMMs. The GPU's own time of one Llama-3-8B layer's seven "
        "dequantizations: " + " and ".join(f"{m * 1e6:.0f} us" for m, _, _ in layers)
        + f" in the two runs, priced {layers[0][1] * 1e6:.0f} us on `dgx-h200` at "
        f"`costmodel.peft.NF4_DEQUANTIZE_RATE` = {NF4_DEQUANTIZE_RATE} of a copy's rate (priced as a copy, 1.0, "
        "before); in a step the layer's 4-bit forward and backward cost "
        + " and ".join(f"{s / m:.2f}x" for m, _, s in layers)
        + " that, the two dequantizations each pass makes. The QLoRA steps of the H100 re-priced at this rate: "
        "\"LoRA and QLoRA on one H100\".",
    ]
    return "\n".join(lines)


def main() -> None:
    from benchmarks.report import update_section

    text = body()
    print(text)
    update_section("gpu-kernels-2026-11-27", "Kernels on a lent GPU: SDPA backends and QLoRA's dequantization", text,
                   machine="NVIDIA H100 80GB HBM3 and H200 (lent, one call each), torch 2.11.0+cu130, bitsandbytes "
                           "0.50.2; rendered on the CPU machine")


if __name__ == "__main__":
    main()
