"""Shared test settings: no Hub access, ever; GPU tests skip without CUDA."""

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Runs executed by tests go to a throwaway runs log, not the user's ~/.cache/soap/runs.jsonl.
os.environ.setdefault("SOAP_RUNS_LOG", os.path.join(tempfile.mkdtemp(prefix="soap-test-runs-"), "runs.jsonl"))
# Profiles that `soap calibrate` writes go to a throwaway folder, and a user's own measured profiles (found by
# name before the shipped ones) do not change what the tests plan.
os.environ["SOAP_PROFILES_DIR"] = tempfile.mkdtemp(prefix="soap-test-profiles-")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
