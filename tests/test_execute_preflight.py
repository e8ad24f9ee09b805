"""`soap execute` checks the plan against this host before it starts anything (issue 26, item 5).

A GPU plan on a host without a GPU, a world larger than one node launched as one node, and more
memory than the host has each end in one `error:` line (exit 2) naming the fix, before any worker
process starts; `executor.preflight.check_host` is also tested against hosts described by hand (a GPU
host, a small GPU, a big CPU host), which this machine cannot be.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from executor.preflight import Host, check_host, check_world_size
from planner.plan import load_plan
from tracer.errors import SoapError

GIB = 2**30
NO_GPU = Host(gpus=0, gpu_memory_bytes=None, available_memory_bytes=20 * GIB)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The README's plan (llama-3-8b on one 8-GPU H100 node), a 1,024-GPU plan, and a tiny CPU plan."""
    import soap

    out = tmp_path_factory.mktemp("preflight")
    paths = {}
    for name, model, kwargs in (("readme", "llama-3-8b", dict(gpus=8)),
                                ("1024", "llama-3-70b", dict(gpus=1024)),
                                ("tiny-cpu", "gpt2", dict(gpus=2, cluster="local-cpu", global_batch=4, seq_len=32))):
        paths[name] = out / f"{name}.json"
        soap.plan(model, **kwargs).save(str(paths[name]))
    return paths


def _execute(path, *flags):
    """`soap execute PATH --steps 1 FLAGS` in a child; (exit code, stderr, the children's peak RSS in GiB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run([sys.executable, "-m", "soap", "execute", str(path), "--steps", "1", *flags],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(path.parent)})
    peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024 / GIB
    return proc.returncode, proc.stderr, peak


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_gpu_plan_on_a_host_without_gpus_is_refused_before_any_worker(plans):
    code, stderr, peak = _execute(plans["readme"])
    line = _one_error_line(stderr)
    assert code == 2
    assert "8 dgx-h100 GPU(s)" in line and "no GPU" in line and "--cluster local-cpu" in line and "--allow-cpu" in line
    assert not list(plans["readme"].parent.glob("soap-workers-*")), "a worker directory was made"
    assert peak < 1.0, f"the refused launch used {peak:.1f} GiB"


def test_a_cpu_smoke_run_of_a_big_plan_is_refused_for_host_memory(plans):
    code, stderr, peak = _execute(plans["readme"], "--allow-cpu")
    line = _one_error_line(stderr)
    assert code == 2 and "8 rank(s)" in line and "host memory" in line
    assert peak < 1.0


def test_a_world_larger_than_a_node_names_the_multi_node_flags(plans):
    code, stderr, _ = _execute(plans["1024"], "--allow-cpu")
    line = _one_error_line(stderr)
    assert code == 2 and "--nnodes 128 --nproc-per-node 8" in line


def test_check_host_rules(plans):
    readme, big, tiny = (load_plan(str(plans[k])) for k in ("readme", "1024", "tiny-cpu"))
    check_host(tiny, nproc_per_node=None, nnodes=1, allow_cpu=False, host=NO_GPU)  # a CPU plan runs here
    with pytest.raises(SoapError, match="no GPU"):
        check_host(readme, nproc_per_node=None, nnodes=1, allow_cpu=False, host=NO_GPU)
    h100s = Host(gpus=8, gpu_memory_bytes=80 * GIB, available_memory_bytes=1000 * GIB)
    check_host(readme, nproc_per_node=None, nnodes=1, allow_cpu=False, host=h100s)
    with pytest.raises(SoapError, match="torch sees 4 GPU"):
        check_host(readme, nproc_per_node=None, nnodes=1, allow_cpu=False,
                   host=Host(gpus=4, gpu_memory_bytes=80 * GIB, available_memory_bytes=None))
    with pytest.raises(SoapError, match=r"GiB per GPU and this host's GPUs have 24\.0 GiB"):
        check_host(readme, nproc_per_node=None, nnodes=1, allow_cpu=False,
                   host=Host(gpus=8, gpu_memory_bytes=24 * GIB, available_memory_bytes=None))
    with pytest.raises(SoapError, match="--nnodes 128 --nproc-per-node 8"):
        check_host(big, nproc_per_node=None, nnodes=1, allow_cpu=False, host=h100s)
    check_host(big, nproc_per_node=None, nnodes=128, allow_cpu=False, host=h100s)  # one node of 128
    big_cpu_host = Host(gpus=0, gpu_memory_bytes=None, available_memory_bytes=4096 * GIB)
    check_host(readme, nproc_per_node=None, nnodes=1, allow_cpu=True, host=big_cpu_host)


def test_a_wrong_world_size_names_the_plans_node_layout(plans):
    with pytest.raises(SoapError, match=r"--nnodes 128 --nproc-per-node 8, or re-plan with --gpus 8$") as info:
        check_world_size(load_plan(str(plans["1024"])), 8)
    assert "--nproc-per-node 1024" not in str(info.value)


def test_device_kind_travels_in_the_plan(plans):
    assert json.loads(plans["tiny-cpu"].read_text())["cluster"]["profile"]["device"]["kind"] == "cpu"
    assert "kind" not in json.loads(plans["readme"].read_text())["cluster"]["profile"]["device"]
