"""Every checkpoint manifest's parity post-check resolves (no family converts with "parity: not run"), and the two
post-checks added for seedvr2 and the cosmos3 sound tokenizer run C0 on the converted weights themselves: a NaN
planted in a converted weight fails them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.cli import main as fvconvert
from converters.hooks import get_post_check

ROOT = Path(__file__).resolve().parents[1]


def test_every_manifest_names_a_post_check_that_exists():
    names = set()
    for path in sorted((ROOT / "manifests").glob("*/checkpoints/*.json")):
        manifest = json.loads(path.read_text())
        family = manifest.get("family", path.parts[-3])
        names.add((manifest.get("parity") or {}).get("post_check", family))
    assert {"seedvr2", "cosmos3.sound"} <= names
    from tests.test_parity_registry import UNWIRED_POST_CHECKS   # named there, one by one, until an entry wires them
    for name in sorted(names - UNWIRED_POST_CHECKS):
        assert callable(get_post_check(name)), name


def _report(out: Path) -> dict:
    return json.loads((out / "conversion_report.json").read_text())["parity"]


def _poison(out: Path) -> None:
    f = out / "model.safetensors"
    state = load_file(str(f))
    key = sorted(k for k, v in state.items() if v.ndim >= 2)[0]
    state[key] = state[key].clone()
    state[key].view(-1)[0] = float("nan")
    save_file(state, str(f))


@pytest.mark.parametrize("family, fmt, src, config", [
    ("seedvr2", "official_pth", "golden/seedvr2/nadit/upstream/nadit3b.pth", "3b"),
    ("cosmos3", "diffusers-sound", "golden/cosmos3_sound/tiny_sound_encode/upstream", None),
])
def test_post_check_runs_c0_on_the_converted_weights(tmp_path, family, fmt, src, config):
    argv = [family, "--from", fmt, str(ROOT / src), str(tmp_path / "out"), "-q"]
    if config is not None:   # seedvr2's official .pth carries no config: the case's own (golden/seedvr2/nadit)
        cfg = json.loads((ROOT / "golden/seedvr2/nadit/case.json").read_text())["params"]["models"][config]["config"]
        (tmp_path / "cfg.json").write_text(json.dumps(cfg))
        argv += ["--config", str(tmp_path / "cfg.json")]
    assert fvconvert(argv) == 0
    parity = _report(tmp_path / "out")
    assert parity["status"] == "pass" and parity["checks"] > 0 and not parity["failed"]
    # the check reads the converted directory: a NaN written into it fails the same check run on it
    shutil.copytree(tmp_path / "out", tmp_path / "poisoned")
    _poison(tmp_path / "poisoned")
    name = "seedvr2" if family == "seedvr2" else "cosmos3.sound"
    assert get_post_check(name)(tmp_path / "poisoned")["status"] in ("fail", "error")
