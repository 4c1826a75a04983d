"""Where the public seedvr2 goldens live for tests (helpers shared by tests/test_seedvr2_*.py) and their integrity: golden/seedvr2/<case> in the repo if copied there, else
../shared/goldens/seedvr2/<case> beside the repo (CI has a read-only copy); tests skip with a reason otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
DIRS = (ROOT / "golden" / "seedvr2", ROOT.parent / "shared" / "goldens" / "seedvr2")


def golden_dir(case: str) -> Path:
    for d in DIRS:
        if (d / case / "case.json").is_file():
            return d / case
    pytest.skip(f"seedvr2 golden case {case!r} not found in {[str(d) for d in DIRS]}")


def golden_file(name: str) -> Path:
    for d in DIRS:
        if (d / name).is_file():
            return d / name
    pytest.skip(f"seedvr2 golden file {name!r} not found in {[str(d) for d in DIRS]}")


def load_case(case: str):
    d = golden_dir(case)
    meta = json.loads((d / "case.json").read_text())
    return d, meta, load_file(str(d / "inputs.safetensors")), load_file(str(d / "outputs.safetensors"))


def upstream_weights(d: Path, name: str = "upstream_weights.pth") -> dict[str, torch.Tensor]:
    return torch.load(d / name, weights_only=True, map_location="cpu")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("case", ["nadit3b_tiny_a", "nadit3b_tiny_b", "nadit7b_tiny", "vae_tiny", "pipeline_3b_tiny"])
def test_golden_files_match_their_recorded_sha256(case):
    import hashlib
    d, meta, _, _ = load_case(case)
    for name, digest in meta["file_sha256"].items():
        if (d / name).is_file():
            assert hashlib.sha256((d / name).read_bytes()).hexdigest() == digest, name
