"""Shared test settings: no Hub access, ever; GPU tests skip without CUDA."""

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Runs executed by tests go to a throwaway runs log, not the user's ~/.cache/soap/runs.jsonl.
os.environ.setdefault("SOAP_RUNS_LOG", os.path.join(tempfile.mkdtemp(prefix="soap-test-runs-"), "runs.jsonl"))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
