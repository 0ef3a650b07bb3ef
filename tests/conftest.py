"""Shared pytest setup: the `gpu` marker skips where there is no CUDA device; pytest-xdist workers share the cores."""
import os
import pytest, torch

pytest_plugins = ["s3_server"]  # the `s3_server` fixture: a real SeaweedFS S3 server on 127.0.0.1 (tests/s3_server.py)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_configure(config):
    # under `pytest -n N` each worker gets its share of the cores: N workers x all cores each would oversubscribe them
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1: torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
