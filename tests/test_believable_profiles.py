"""Believable by construction (issue 27): no default GPU profile predicts more than the published runs of its
class achieved. The bounds are `profiles/published-mfu.json` (`benchmarks/believable_mfu.py`: every non-fp8
row of ../shared/published-runs/, MFU counted as soap counts it, against the datasheet peak). Reference plans:
a 1B and an 8B Llama, bf16, the plan soap picks on one node and on 64 nodes, under the recompute mode the
class's runs all used where they state one (MFU does not count recompute's FLOPs: like with like). A class
with no eager run but a fused-kernel one (small GPT on one A100 node: vTrain's Megatron-DeepSpeed grid) is held
to the fused run's best, a looser ceiling: an eager stack does not outrun fused kernels. A class the corpus has
no run of (70B, H200, A100 40 GB, V100, multi-node A100) is not checked, and the test says which."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from costmodel.profiles import load_cluster
from planner.api import plan

ROOT = Path(__file__).resolve().parents[1]
BOUNDS = json.loads((ROOT / "profiles" / "published-mfu.json").read_text())["classes"]
LLAMA_1B = str(ROOT / "benchmarks" / "configs" / "llama-3.2-1b.json")
DEFAULT_GPU_CLUSTERS = {"dgx-h100": "h100", "dgx-a100-80g": "a100", "dgx-a100-80g-vtrain": "a100"}
"""The default profiles whose GPU the corpus has runs of (H100, A100 80 GB), and beside the A100 default the fit to
vTrain's grid alone, which it replaced (the datasheet one: test_the_a100_default_passes_where_its_datasheet_fails)."""
DATASHEET_PEAK = {"h100": 989e12, "a100": 312e12}
REFERENCE = [("1b", LLAMA_1B, 8, "one node"), ("1b", LLAMA_1B, 512, "multi-node"),
             ("8b", "llama-3-8b", 8, "one node"), ("8b", "llama-3-8b", 512, "multi-node")]


def _bound(gpu: str, model: str, scale: str, compiled: bool) -> dict | None:
    """The best `eager` run of the class: soap predicts its own torch-native executor, not fused-kernel stacks;
    a compiled plan is held to compiled runs, an eager one to eager runs. Where the class has no eager run, its
    best `fused` run (eager or compiled plans alike: torch.compile fuses less than hand-fused kernels)."""
    for key in ((gpu, model, scale, "eager", compiled), (gpu, model, scale, "fused", False)):
        found = next((c for c in BOUNDS if (c["gpu"], c["model"], c["scale"], c["family"], c["compile"]) == key), None)
        if found is not None:
            return found
    return None


def _mfu(model: str, gpus: int, cluster: str, gpu: str, compiled: bool,
         recompute: str | None = None) -> tuple[float, str]:
    """The predicted MFU of the plan soap picks (under the class's recompute mode, where its runs state one: like
    with like, since MFU does not count the FLOPs recompute adds), and the plan's non-default degrees."""
    pins = {"recompute": recompute} if recompute else {}
    p = plan(model, gpus=gpus, cluster=cluster, precision="bf16", seq_len=4096, compile="on" if compiled else "off",
             **pins)
    tflops = p.predicted["model_tflops_per_gpu"] * 1e12
    return tflops / DATASHEET_PEAK[gpu], " ".join(f"{k}={v}" for k, v in p.predicted["parallelism"].items()
                                                   if v not in (1, False, None, "sdpa"))


_TORCHTITAN = ("the class's only runs are torchtitan's FSDP with selective recompute on 500 W H100 96GB HBM2e (35.0% "
               "eager, 40.5% compiled at 8 GPUs; 34.0% / 39.6% at 128), where dgx-h100 is the 700 W DGX H100 (the "
               "fit, made on these rows, errs +6.3% on them in-sample, docs/benchmarks.md); under their selective "
               "recompute ")
_VTRAIN = ("the class's only runs are vTrain's Megatron-DeepSpeed GPTs (hidden 1024-2048, 12-24 layers, seq 1024, "
           "unfused attention: baddbmm, fused softmax, bmm) under full recompute, fp16 (46.8% at best; the fitted "
           "profile's tp1 rows err +1.9% on average, benchmarks/vtrain_a100.py); under their full recompute ")
KNOWN_GAPS = {
    ("dgx-h100", "8b", "one node", False): _TORCHTITAN + "soap picks FSDP over 8 at 38.8%",
    ("dgx-h100", "8b", "one node", True): _TORCHTITAN + "soap picks FSDP over 8 at 43.1%",
    ("dgx-h100", "8b", "multi-node", False): _TORCHTITAN + "soap predicts ZeRO-2 over 512 GPUs at 38.0%",
    ("dgx-h100", "8b", "multi-node", True): _TORCHTITAN + "soap predicts ZeRO-2 over 512 GPUs at 42.4%",
    ("dgx-a100-80g", "1b", "one node", True): _VTRAIN + "the default picks ZeRO-2 over 8 at 55.5% compiled (44.2% "
    "eager, inside): soap's blocks under torch.compile, their memory-bound kernels at the x0.31 measured on an "
    "H100 and an H200 (benchmarks/native_profiles.py), with flash attention at seq 4096, against a fused stack "
    "whose attention is not flash; no compiled A100 run is in the corpus to say which is right",
    ("dgx-a100-80g-vtrain", "1b", "one node", False): _VTRAIN + "the fit alone (Megatron-DeepSpeed's fused "
    "memory-bound kernels in the device's terms) predicts 56.4%: not the default",
    ("dgx-a100-80g-vtrain", "1b", "one node", True): _VTRAIN + "the fit alone predicts 56.4%: not the default",
}
"""Classes where the fitted default still predicts more than the corpus's best run (issue 27 stays open for them)."""

CASES = [pytest.param(cluster, gpu, ref[0], ref[1], ref[2], ref[3], compiled,
                      id=f"{cluster}-{ref[0]}-{ref[2]}gpus-{'compile' if compiled else 'eager'}",
                      marks=[pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[key])] if key in KNOWN_GAPS else [])
         for cluster, gpu in DEFAULT_GPU_CLUSTERS.items() for ref in REFERENCE for compiled in (False, True)
         if _bound(gpu, ref[0], ref[3], compiled) is not None
         for key in [(cluster, ref[0], ref[3], compiled)]]


@pytest.mark.parametrize("cluster, gpu, model_class, model, gpus, scale, compiled", CASES)
def test_the_default_profile_predicts_no_more_than_published_runs_reached(cluster, gpu, model_class, model, gpus,
                                                                          scale, compiled):
    bound = _bound(gpu, model_class, scale, compiled)
    mfu, chosen = _mfu(model, gpus, cluster, gpu, compiled, bound.get("recompute"))
    assert mfu <= bound["mfu_max"], (
        f"{cluster} predicts {mfu:.1%} MFU for a {model_class} on {gpus} GPUs ({chosen}); the best published "
        f"{scale} run of the class reached {bound['mfu_max']:.1%} ({bound['best_run']})")


def test_the_datasheet_profile_is_the_one_that_fails():
    """The check can fail: the datasheet H100 profile (assumed efficiencies) predicts an 8B above every eager run."""
    bound = _bound("h100", "8b", "one node", False)
    mfu, _ = _mfu("llama-3-8b", 8, "dgx-h100-datasheet", "h100", False, bound["recompute"])
    assert mfu > bound["mfu_max"]


def test_the_a100_default_passes_where_its_datasheet_fails():
    """The A100 default (vTrain's hardware terms, soap's executor's measured ones) predicts the 1B under the class's
    full recompute inside vTrain's best, where the datasheet profile it replaced predicts more."""
    bound = _bound("a100", "1b", "one node", False)
    assert bound["recompute"] == "full"
    native, _ = _mfu(LLAMA_1B, 8, "dgx-a100-80g", "a100", False, "full")
    datasheet, _ = _mfu(LLAMA_1B, 8, "dgx-a100-80g-datasheet", "a100", False, "full")
    assert native <= bound["mfu_max"] < datasheet


def test_the_bounds_cover_what_the_corpus_has():
    """Every default GPU profile is checked where the corpus has a run of its GPU; the rest are named here."""
    checked = {(c.values[1], c.values[2], c.values[5]) for c in CASES}
    assert ("h100", "8b", "one node") in checked and ("h100", "1b", "multi-node") in checked
    assert ("a100", "1b", "one node") in checked  # vTrain's Megatron-DeepSpeed grid (fused): its best run bounds it
    assert ("a100", "8b", "one node") not in checked  # no A100 run of an 8B
    assert load_cluster("dgx-h100").device.name == "h100-sxm-fitted"
    assert load_cluster("dgx-a100-80g").device.name == "a100-sxm-80g-native"  # benchmarks/native_profiles.py
