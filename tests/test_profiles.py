"""Profile loading: every shipped profile validates with its sources; bad input is a one-line SoapError."""

import json
import math
import shutil

import pytest

from costmodel import profiles
from costmodel.profiles import (
    EfficiencyCurve,
    cluster_from_dict,
    cluster_to_dict,
    list_clusters,
    list_devices,
    load_cluster,
    load_device,
)
from soap.cli import main
from tracer.errors import SoapError

SHIPPED_DEVICES = {"h100-sxm", "h200-sxm", "a100-sxm-80g", "a100-sxm-40g", "a100-sxm-80g-fitted",
                   "a100-sxm-80g-native", "a100-sxm-40g-native", "v100-sxm2-16g", "v100-sxm2-16g-native", "l40s"}
SHIPPED_CLUSTERS = {"dgx-h100", "dgx-h100-datasheet", "dgx-h200", "dgx-h200-datasheet", "dgx-a100-80g",
                    "dgx-a100-80g-datasheet", "dgx-a100-80g-vtrain", "dgx-a100-40g", "dgx-a100-40g-datasheet",
                    "dgx1-v100-16g", "dgx1-v100-16g-datasheet", "l40s-pcie"}


def _numbers_and_curves(obj, path=""):
    """Every {"value", "source"} number and {"points", "source"} curve inside a profile document."""
    if isinstance(obj, dict):
        if "value" in obj or "points" in obj:
            yield path, obj
            return
        for key, value in obj.items():
            if key not in ("fit", "notes"):
                yield from _numbers_and_curves(value, f"{path}.{key}")


def test_every_shipped_profile_loads_and_every_number_names_its_source():
    assert SHIPPED_DEVICES <= set(list_devices())
    assert SHIPPED_CLUSTERS <= set(list_clusters())
    for name in SHIPPED_CLUSTERS:
        data = cluster_to_dict(load_cluster(name))
        items = list(_numbers_and_curves(data))
        assert len(items) >= 14
        for path, item in items:
            assert item["source"].strip() and "not recorded" not in item["source"], (name, path)


def test_shipped_numbers_match_the_hardware_reference():
    h100 = load_device("h100-sxm")
    assert h100.peak_flops["bf16"] == pytest.approx(989e12)
    assert h100.memory_bandwidth == pytest.approx(3.35e12)
    assert h100.matmul_efficiency.at(1.1e12) == pytest.approx(798 / 989, abs=0.002)
    assert not load_device("a100-sxm-80g").supports_fp8
    assert "bf16" not in load_device("v100-sxm2-16g").peak_flops
    dgx = load_cluster("dgx-h100-datasheet")
    assert dgx.intra_node.bandwidth == pytest.approx(450e9) and dgx.intra_node.sharp
    assert dgx.intra_node.bandwidth * dgx.intra_node.efficiency.at(1e9) == pytest.approx(370e9, rel=0.01)
    pcie = load_cluster("l40s-pcie")
    assert pcie.intra_node.bandwidth < 64e9 and not pcie.intra_node.sharp


def test_inline_form_round_trips_with_sources():
    for name in SHIPPED_CLUSTERS:
        cluster = load_cluster(name)
        data = json.loads(json.dumps(cluster_to_dict(cluster)))
        again = cluster_from_dict(data)
        assert again == cluster
        assert again.device.sources == cluster.device.sources
        assert cluster_to_dict(again) == data


def test_curve_interpolates_in_log_space_and_clamps():
    curve = EfficiencyCurve(((1e3, 0.1), (1e5, 0.5), (1e9, 0.9)))
    assert curve.at(1.0) == 0.1
    assert curve.at(1e12) == 0.9
    assert curve.at(1e4) == pytest.approx(0.3)
    assert curve.at(1e7) == pytest.approx(0.7)
    assert curve.at(math.sqrt(1e3 * 1e5)) == pytest.approx(0.3)


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    """A private copy of the shipped profiles, so tests can add files without touching the repo."""
    for kind in ("devices", "clusters"):
        (tmp_path / kind).mkdir()
        for path in (profiles.PROFILES_DIR / kind).glob("*.json"):
            if path.stem != "local-cpu":
                shutil.copy(path, tmp_path / kind / path.name)
    monkeypatch.setattr(profiles, "PROFILES_DIR", tmp_path)
    return tmp_path


def _write_device(folder, mutate):
    data = json.loads((profiles.PROFILES_DIR / "devices" / "h100-sxm.json").read_text())
    mutate(data)
    path = folder / "bad-device.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.update(surprise=1), "unknown key(s) surprise"),
        (lambda d: d["memory_bandwidth_gbps"].pop("source"), "memory_bandwidth_gbps: missing key(s) source"),
        (lambda d: d["memory_bandwidth_gbps"].update(value=-5), "memory_bandwidth_gbps.value: must be positive"),
        (lambda d: d["memory_bandwidth_gbps"].update(value=0), "memory_bandwidth_gbps.value: must be positive"),
        (lambda d: d["matmul_efficiency"]["points"].append([1e13, 1.2]), "matmul_efficiency.points[5]"),
        (lambda d: d["memory_efficiency"]["points"].append([10, 0.5]), "x must increase"),
        (lambda d: d["peak_tflops"].pop("fp32"), "peak_tflops: missing key(s) fp32"),
        (lambda d: d.update(schema_version=2), "unsupported version"),
    ],
)
def test_malformed_device_profile_names_file_and_field(tmp_path, mutate, field):
    path = _write_device(tmp_path, mutate)
    with pytest.raises(SoapError) as err:
        load_device(str(path))
    message = str(err.value)
    assert str(path) in message and field in message and "\n" not in message


def test_cluster_with_negative_link_bandwidth_is_refused(tmp_path):
    data = json.loads((profiles.PROFILES_DIR / "clusters" / "dgx-h100.json").read_text())
    data["links"]["inter_node"]["bandwidth_gbps"]["value"] = -50
    path = tmp_path / "neg.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SoapError, match=r"links\.inter_node\.bandwidth_gbps\.value: must be positive"):
        load_cluster(str(path))


def test_unknown_names_list_the_choices(profile_dir):
    with pytest.raises(SoapError, match="unknown device 'h1000'.*h100-sxm"):
        load_device("h1000")
    with pytest.raises(SoapError, match="unknown cluster 'dgx-z'.*dgx-h100"):
        load_cluster("dgx-z")
    with pytest.raises(SoapError, match="does not exist"):
        load_cluster("no/such/cluster.json")


def test_local_cpu_is_unlisted_until_calibrated(profile_dir):
    assert "local-cpu" not in list_clusters()
    with pytest.raises(SoapError, match="soap calibrate"):
        load_cluster("local-cpu")
    device = json.loads((profile_dir / "devices" / "h100-sxm.json").read_text())
    device["name"] = "local-cpu"
    (profile_dir / "devices" / "local-cpu.json").write_text(json.dumps(device))
    cluster = json.loads((profile_dir / "clusters" / "dgx-h100.json").read_text())
    cluster.update(name="local-cpu", device="local-cpu")
    (profile_dir / "clusters" / "local-cpu.json").write_text(json.dumps(cluster))
    assert "local-cpu" in list_clusters()
    assert load_cluster("local-cpu").device.name == "local-cpu"


def test_cluster_file_finds_its_device_next_to_it(tmp_path):
    (tmp_path / "devices").mkdir()
    (tmp_path / "clusters").mkdir()
    device = json.loads((profiles.PROFILES_DIR / "devices" / "a100-sxm-80g.json").read_text())
    device["name"] = "my-gpu"
    (tmp_path / "devices" / "my-gpu.json").write_text(json.dumps(device))
    cluster = json.loads((profiles.PROFILES_DIR / "clusters" / "dgx-a100-80g.json").read_text())
    cluster.update(name="my-cluster", device="my-gpu")
    path = tmp_path / "clusters" / "my-cluster.json"
    path.write_text(json.dumps(cluster))
    assert load_cluster(str(path)).device.name == "my-gpu"


def test_cli_lists_profiles_as_one_json_object(capsys):
    assert main(["profiles", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = {c["name"] for c in data["clusters"]}
    assert SHIPPED_CLUSTERS <= names
    h100 = next(d for d in data["devices"] if d["name"] == "h100-sxm")
    assert h100["peak_bf16_tflops"] == pytest.approx(989) and h100["memory_gib"] == pytest.approx(80)


def test_cli_check_reports_a_bad_profile_as_error_and_exit_2(tmp_path, capsys):
    path = _write_device(tmp_path, lambda d: d["memory_bandwidth_gbps"].update(value=-1))
    assert main(["profiles", "--check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "memory_bandwidth_gbps" in err and "Traceback" not in err
    assert main(["profiles", "--check", str(tmp_path / "missing.json")]) == 2
    assert main(["profiles", "--check", str(profiles.PROFILES_DIR / "clusters" / "dgx-h100.json")]) == 0


def test_cli_check_reports_invalid_json(tmp_path, capsys):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    assert main(["profiles", "--check", str(path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_cli_check_names_an_unknown_profile(capsys):
    assert main(["profiles", "--check", "dgx-z"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no device or cluster profile named 'dgx-z'") and "dgx-h100" in err
    assert main(["profiles", "--check", "h100-sxm"]) == 0


def test_cli_show_prints_every_number_with_its_source(capsys):
    from soap.commands.profiles import provenance_rows

    assert main(["profiles", "--show", "dgx-h100", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["device"]["name"] == "h100-sxm-fitted"
    rows = provenance_rows(document)
    fields = {field for field, _, _ in rows}
    assert {"device.peak_tflops.bf16", "links.intra_node.bandwidth_gbps", "links.inter_node.efficiency"} <= fields
    assert all(source for _, _, source in rows)
    assert main(["profiles", "--show", "nope"]) == 2
