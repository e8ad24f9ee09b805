"""Carry the fitted H100's efficiency terms to the profiles that borrow them, after each refit.

    SOAP_PROFILES_DIR=profiles python -m benchmarks.published_runs    # refits dgx-h100 (device h100-sxm-fitted)
    python -m benchmarks.borrow_fitted                                 # then this

Devices with no published runs of their own (B200, B300, GB200/GB300, H100 PCIe/NVL, H200 NVL, the AMD parts,
...) take the fitted H100's measured-run terms where their datasheet has none: every field whose source
begins "borrowed from h100-sxm-fitted" is replaced by the fitted H100's current value, its source kept after
the prefix, so no profile carries a stale copy of an older fit.

`h200-sxm-fitted` (the device of the default `dgx-h200`) is `h200-sxm`'s datasheet figures (memory, peaks,
bandwidth) with every efficiency term borrowed, including the matmul curve: an H200 is the H100's GH100 die
with HBM3e, and soap calibrate measured the same dense bf16 rate on both (h100-x1-measured 782.5 TFLOP/s,
h200-x1-measured 793.2). `dgx-h200`'s links are the fitted `dgx-h100`'s (the same NVLink4/NVSwitch node and
8x400G NDR fabric); the datasheet profile stays as `dgx-h200-datasheet`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
LENDER = "h100-sxm-fitted"
PREFIX = f"borrowed from {LENDER}"
BORROWED_BY_H200 = ("matmul_efficiency", "memory_efficiency", "dtype_efficiency", "kernel_overhead_us",
                    "collective_call_overhead_us", "context_overhead_gib", "kernel_factors", "compile_factors",
                    "activation_collective_factor", "host_dispatch_us", "optimizer_factors")


def _read(kind: str, name: str) -> dict:
    return json.loads((PROFILES / kind / f"{name}.json").read_text())


def _write(kind: str, name: str, data: dict) -> None:
    (PROFILES / kind / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")


def _lent(field: dict, borrower: str, key: str) -> dict:
    """`field` of the lender as `borrower` takes it. A Hopper-only kernel class (`costmodel.context_attention`'s
    lower-right causal kernel: FlashAttention-2 over the cuDNN kernels torch picks on Hopper) stays with the Hopper
    profiles; another GPU's causal kernels were not timed against each other."""
    from costmodel.context_attention import HOPPER_PROFILES, LOWER_RIGHT_CLASS, LOWER_RIGHT_SOURCE

    out = copy.deepcopy(field)
    source = str(field.get("source", ""))
    if key == "kernel_factors" and borrower not in HOPPER_PROFILES:
        out["factors"] = {k: v for k, v in out.get("factors", {}).items() if not k.startswith(f"{LOWER_RIGHT_CLASS}/")}
        source = source.replace(f"; {LOWER_RIGHT_SOURCE}", "").replace(LOWER_RIGHT_SOURCE, "")
    out["source"] = f"{PREFIX} ({source})"
    return out


def refresh() -> list[str]:
    lender = _read("devices", LENDER)
    changed = []
    for path in sorted((PROFILES / "devices").glob("*.json")):
        if path.stem in (LENDER, "h200-sxm-fitted"):
            continue
        data = json.loads(path.read_text())
        borrowed = [k for k, v in data.items() if isinstance(v, dict) and str(v.get("source", "")).startswith(PREFIX)
                    and k in lender]
        for key in borrowed:
            data[key] = _lent(lender[key], path.stem, key)
        if borrowed:
            path.write_text(json.dumps(data, indent=2) + "\n")
            changed.append(path.stem)
    return changed


def h200() -> None:
    lender = _read("devices", LENDER)
    device = _read("devices", "h200-sxm")
    device["name"] = "h200-sxm-fitted"
    device["description"] = (f"{device.get('description', 'NVIDIA H200 SXM')}: datasheet memory, peaks and bandwidth; "
                             f"efficiency terms of the H100 fitted to published runs ({LENDER})")
    for key in BORROWED_BY_H200:
        if key in lender:
            device[key] = _lent(lender[key], device["name"], key)
    _write("devices", "h200-sxm-fitted", device)
    datasheet = _read("clusters", "dgx-h200-datasheet")
    fitted_links = _read("clusters", "dgx-h100")["links"]
    cluster = copy.deepcopy(datasheet)
    cluster.update(name="dgx-h200", device="h200-sxm-fitted",
                   description="NVIDIA DGX/HGX H200: the DGX H100 node and fabric with H200 GPUs; compute terms and "
                               "links of the H100 fitted to published runs (dgx-h100), datasheet memory and bandwidth")
    links = copy.deepcopy(fitted_links)
    for level in links.values():
        for key, value in level.items():
            if isinstance(value, dict) and "source" in value:
                value["source"] = f"as dgx-h100 (same NVLink4 NVSwitch node and 8x400G NDR fabric): {value['source']}"
    cluster["links"] = links
    _write("clusters", "dgx-h200", cluster)


def main() -> None:
    h200()
    for name in refresh():
        print(f"refreshed {name}")
    print("wrote h200-sxm-fitted and dgx-h200")


if __name__ == "__main__":
    main()
