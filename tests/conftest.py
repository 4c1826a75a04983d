import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

torch.set_num_threads(1)  # xdist workers share 2 cores; one thread each keeps runs stable


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def pytest_collection_modifyitems(config, items):
    skip_upstream = pytest.mark.skip(reason="needs the optional upstream extra (diffusers 0.42.1)")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "upstream" in item.keywords and not has_module("diffusers"):
            item.add_marker(skip_upstream)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def run_cli(module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a CLI the way a user does (a fresh process), capturing both streams."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture
def fvparity():
    return lambda *args, **kw: run_cli("parity.cli", *args, **kw)
