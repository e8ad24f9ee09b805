"""Room for the caching allocator (costmodel.allocator): the search plans to the device's memory less a
margin, says so in the plan and its --json, and --mem-limit overrides it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from costmodel.allocator import DEFAULT_MARGIN, planning_limit
from costmodel.profiles import load_cluster, load_device
from planner.api import plan_report
from tracer.errors import SoapError


def test_the_limit_is_the_device_less_the_margin_on_a_gpu_and_the_whole_host_on_a_cpu():
    h100 = load_device("h100-sxm")
    limit = planning_limit(h100)
    assert limit.bytes == pytest.approx(h100.memory_bytes * (1 - DEFAULT_MARGIN)) and not limit.given
    assert "caching allocator" in limit.describe()
    given = planning_limit(h100, 50.0)
    assert given.bytes == 50 * 2**30 and given.margin == 0 and given.given
    assert planning_limit(load_device("local-cpu")).margin == 0
    with pytest.raises(SoapError, match="mem-limit"):
        planning_limit(h100, -1.0)


def test_a_plan_near_the_device_memory_is_not_picked_unless_the_limit_allows_it():
    """gpt2-xl on one GPU whose memory is sized so that the fastest plan fills 95% of it: the search keeps the
    margin and picks another plan; --mem-limit at the device's size gives the 95% plan back."""
    kwargs = dict(gpus=1, precision="bf16", global_batch=32, seq_len=1024, offload="off", recompute="none",
                  compile="off")
    free = plan_report("gpt2-xl", cluster="dgx-h100", mem_limit_gib=1e4, **kwargs)
    peak = free.chosen.result.peak_memory_bytes
    h100 = load_cluster("dgx-h100")
    capacity = peak / 0.95
    sized = replace(h100, device=replace(h100.device, memory_bytes=capacity))
    margin = plan_report("gpt2-xl", cluster=sized, **kwargs)
    whole = plan_report("gpt2-xl", cluster=sized, mem_limit_gib=capacity / 2**30, **kwargs)
    assert margin.limit.margin == DEFAULT_MARGIN and whole.limit.given
    assert whole.chosen.result.peak_memory_bytes == pytest.approx(peak)
    assert margin.chosen.result.peak_memory_bytes <= capacity * (1 - DEFAULT_MARGIN)
    assert margin.chosen.result.step_time_s >= whole.chosen.result.step_time_s


def test_the_margin_is_printed_and_in_the_json():
    run = subprocess.run([sys.executable, "-m", "soap", "plan", "gpt2", "--gpus", "1", "--json"],
                         capture_output=True, text=True, check=True)
    out = json.loads(run.stdout)
    assert out["memory_margin"] == DEFAULT_MARGIN and out["memory_limit_source"] == "device less margin"
    assert out["memory_limit_gib"] == pytest.approx(80 * (1 - DEFAULT_MARGIN))
    text = subprocess.run([sys.executable, "-m", "soap", "plan", "gpt2", "--gpus", "1", "--mem-limit", "40"],
                          capture_output=True, text=True, check=True).stdout
    assert "limit 40.0 GiB from --mem-limit" in text
