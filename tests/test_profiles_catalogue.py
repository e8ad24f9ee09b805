"""The 2026 catalogue (issue 32): every new device and cluster profile loads, names a source for every
number, says it is datasheet-only until runs calibrate it and which measured profile its efficiency terms
come from, and plans every shipped preset."""

from __future__ import annotations

import pytest

from costmodel.profiles import cluster_to_dict, list_clusters, list_devices, load_cluster, load_device
from planner.api import plan_report
from tracer.errors import SoapError
from tracer.spec import PRESET_DIR

from test_profiles import _numbers_and_curves  # noqa: E402 - tests/ is on the path (conftest)

NEW_CLUSTERS = {
    "dgx-b200": "b200", "dgx-b300": "b300", "gb200-nvl72": "gb200", "gb300-nvl72": "gb300",
    "h100-pcie-8": "h100-pcie", "h100-nvl-8": "h100-nvl", "h200-nvl-8": "h200-nvl", "mi300x-8": "mi300x",
    "mi325x-8": "mi325x", "mi355x-8": "mi355x", "l4-8": "l4", "a10g-8": "a10g", "rtx-4090-8": "rtx-4090",
    "rtx-6000-ada-8": "rtx-6000-ada",
}
BORROWED_FROM = ("h100-sxm-fitted", "a100-sxm-80g")
PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
SMALL_SEARCH = dict(seq_len=512, global_batch=64, cp=1, zero=3, recompute="full", micro_batch=1, compile="off")
"""Pins that leave the search a handful of configurations: the test is that each profile prices every
model end to end (estimate, simulation, memory), not which plan wins."""
ATTEMPTS = ((8, dict(tp=1, pp=1)), (64, dict(tp=1, pp=1)), (64, {}), (512, {}))
"""GPU counts (and further pins) tried in turn until the preset fits: 70B in fp32 on 24 GiB cards needs
tensor parallelism, 405B on them hundreds of GPUs."""


@pytest.mark.parametrize("name", sorted(NEW_CLUSTERS))
def test_every_new_profile_loads_with_a_source_for_every_number(name):
    assert name in list_clusters() and NEW_CLUSTERS[name] in list_devices()
    cluster = load_cluster(name)
    assert cluster.device.name == NEW_CLUSTERS[name]
    items = list(_numbers_and_curves(cluster_to_dict(cluster)))
    assert len(items) >= 14
    for path, item in items:
        assert item["source"].strip() and "not recorded" not in item["source"], (name, path)
    device = load_device(NEW_CLUSTERS[name])
    assert "Datasheet-only" in device.description and any(b in device.description for b in BORROWED_FROM)
    assert "Datasheet-only" in cluster.description
    for key in ("kernel_overhead_us", "context_overhead_gib"):
        assert device.sources[key].startswith("borrowed from"), (name, key)


def test_efficiency_never_reaches_the_datasheet_peak():
    for device in set(NEW_CLUSTERS.values()):
        d = load_device(device)
        assert 0 < d.matmul_efficiency.at(1e13) < 0.9 and d.memory_efficiency.at(1e10) < 0.95, device


def test_nvl72_racks_are_trays_of_four_in_a_domain_of_72():
    for name in ("gb200-nvl72", "gb300-nvl72"):
        cluster = load_cluster(name)
        assert (cluster.gpus_per_node, cluster.nvlink_domain, cluster.domain_size) == (4, 72, 72)
        assert cluster.intra_node.bandwidth == pytest.approx(900e9)


def test_blackwell_numbers_match_the_hardware_reference():
    b200 = load_device("b200")
    assert b200.peak_flops["bf16"] == pytest.approx(2250e12) and b200.memory_bandwidth == pytest.approx(8e12)
    assert b200.matmul_efficiency.at(1.1e12) == pytest.approx(1745 / 2250, abs=0.002)
    assert load_device("mi300x").matmul_efficiency.at(1.1e12) == pytest.approx(668.4 / 1307, abs=0.002)
    assert "bf16" not in load_device("a10g").peak_flops  # no sourced A10G bf16 rate: it plans in fp32


@pytest.mark.parametrize("preset", PRESETS)
def test_every_new_cluster_plans_every_shipped_preset(preset):
    for name in NEW_CLUSTERS:
        errors = []
        for gpus, pins in ATTEMPTS:
            try:
                # encoder-decoders train without recompute (costmodel.plan_rules.recompute_violation)
                search = {**SMALL_SEARCH, "recompute": "none"} if preset.startswith("t5") else SMALL_SEARCH
                report = plan_report(preset, gpus=gpus, cluster=name, ep=1 if "mixtral" in preset else None,
                                     **search, **pins)
            except SoapError as exc:
                errors.append(f"{gpus}: {exc}")
                continue
            assert report.chosen.result.tokens_per_s > 0
            break
        else:
            pytest.fail(f"{preset} plans on no count of {name}: {errors}")


def test_a_borrowed_term_is_the_lenders_current_one():
    """Devices without runs of their own borrow the fitted H100's terms (`benchmarks/borrow_fitted.py`, run after
    each refit of `dgx-h100`): a borrowed number that differs from the lender's is a stale copy of an older fit (the
    H200 default once kept the 2026-11-26 fit's launch overhead and collective factor a day after the refit). The
    Hopper-only lower-right attention class stays with the Hopper profiles."""
    import json
    from pathlib import Path

    from benchmarks.borrow_fitted import LENDER, PREFIX, _lent
    from costmodel.context_attention import HOPPER_PROFILES, LOWER_RIGHT_CLASS

    devices = Path(__file__).resolve().parents[1] / "profiles" / "devices"
    lender = json.loads((devices / f"{LENDER}.json").read_text())
    borrowers = 0
    for path in sorted(devices.glob("*.json")):
        data = json.loads(path.read_text())
        for key, field in data.items():
            if not (isinstance(field, dict) and str(field.get("source", "")).startswith(PREFIX)):
                continue
            borrowers += 1
            theirs = {k: v for k, v in field.items() if k != "source"}
            mine = {k: v for k, v in _lent(lender[key], path.stem, key).items() if k != "source"}
            assert theirs == mine, (path.stem, key)
            if key == "kernel_factors":
                lower_right = any(k.startswith(LOWER_RIGHT_CLASS) for k in theirs["factors"])
                assert lower_right == (path.stem in HOPPER_PROFILES), path.stem
    assert borrowers >= 20
