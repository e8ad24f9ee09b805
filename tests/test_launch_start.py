"""How the launcher starts ranks (`executor.launch.start_method`): forked from a preloaded forkserver on a CPU
host, spawned on a CUDA host; a forked rank still sees the launching process's environment as it is at
launch time, as a spawned one does."""

from __future__ import annotations

import os

import pytest
from exec_helpers import make_plan

import executor.launch as launch
from executor.launch import LaunchOptions, adopt_environment, run_plan, start_method
from tracer.errors import SoapError


class EnvironmentRun:
    """A run configuration whose first field read raises with what the rank's environment holds."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        import torch

        seen = {key: os.environ.get(key, "unset") for key in ("SOAP_TEST_MARK", "SOAP_TEST_GONE", "RANK")}
        raise RuntimeError(f"environment {seen} threads {torch.get_num_threads()}")


def test_a_cpu_host_forks_ranks_from_the_forkserver_and_a_cuda_host_spawns_them(monkeypatch):
    import torch

    assert start_method(make_plan("gpt2")) == "forkserver"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert start_method(make_plan("gpt2")) == "spawn"


def test_the_agent_s_variables_win_and_the_launcher_s_current_ones_are_kept(monkeypatch):
    monkeypatch.setattr(launch, "SERVER_ENVIRON", {"KEPT": "old", "GONE": "x", "RANK": "0"})
    monkeypatch.setattr(os, "environ", {"KEPT": "old", "GONE": "x", "RANK": "3", "LOCAL_RANK": "1"})
    adopt_environment({"KEPT": "new", "ADDED": "y", "RANK": "0"})
    assert os.environ == {"KEPT": "new", "ADDED": "y", "RANK": "3", "LOCAL_RANK": "1"}


@pytest.mark.slow
def test_a_forked_rank_sees_the_environment_of_each_launch(monkeypatch):
    """Two launches from this process: the forkserver started at the first (or earlier), yet the second
    launch's rank sees the variable as set then, not one removed since, its own RANK, and as many threads
    as OMP_NUM_THREADS says then."""
    plan = make_plan("llama")
    seen = []
    for mark in ("first", "second"):
        monkeypatch.setenv("SOAP_TEST_MARK", mark)
        monkeypatch.setenv("OMP_NUM_THREADS", "1" if mark == "first" else "2")
        if mark == "first":
            monkeypatch.setenv("SOAP_TEST_GONE", "present")
        else:
            monkeypatch.delenv("SOAP_TEST_GONE")
        with pytest.raises(SoapError) as info:
            run_plan(plan, EnvironmentRun(), LaunchOptions())
        seen.append(str(info.value))
    assert "'SOAP_TEST_MARK': 'first', 'SOAP_TEST_GONE': 'present', 'RANK': '0'} threads 1" in seen[0], seen[0]
    assert "'SOAP_TEST_MARK': 'second', 'SOAP_TEST_GONE': 'unset', 'RANK': '0'} threads 2" in seen[1], seen[1]
