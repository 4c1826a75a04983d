"""The public seedvr2 goldens (official SeedVR code) in the project's case format under golden/seedvr2/ (helpers
shared by tests/test_seedvr2_*.py, which still name the original cases), and `fvparity golden` on them: every case
passes both sides, strict outputs (a missing output fails, the posterior sample is optional)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden" / "seedvr2"
NADIT_IN = ("vid", "vid_shape", "txt", "txt_shape", "timestep")
# original case name -> (case folder, weights file in upstream/, index into case.json "calls")
ORIGINAL = {"nadit3b_tiny_a": ("nadit", "nadit3b.pth", 0), "nadit3b_tiny_b": ("nadit", "nadit3b.pth", 1),
            "nadit7b_tiny": ("nadit", "nadit7b.pth", 2), "vae_tiny": ("vae", "upstream_weights.pth", 0),
            "pipeline_3b_tiny": ("restore", "dit.pth", 0)}


def golden_file(name: str) -> Path:
    return GOLDEN / name


def load_case(case: str):
    """(upstream weights path, the original case.json, inputs, outputs) with the original tensor names."""
    folder, weights, call = ORIGINAL[case]
    d = GOLDEN / folder
    meta = json.loads((d / "case.json").read_text())
    i, o = load_file(str(d / "inputs.safetensors")), load_file(str(d / "outputs.safetensors"))
    if folder == "nadit":
        ks = [call] if call < 2 else [0, 1]
        i = {n: torch.cat([i[f"{n}_{k}"] for k in ks]) for n in NADIT_IN}
        tag = f"3b_{call}" if call < 2 else "7b"
        o = {n: o[f"{n}_{tag}"] for n in ("vid_sample", "emb", "txt_in") if f"{n}_{tag}" in o}
    return d / "upstream" / weights, meta["calls"][call], i, o


def upstream_weights(path: Path, name: str | None = None) -> dict[str, torch.Tensor]:
    if name is not None:  # the pipeline's VAE beside its DiT
        path = path.parent / {"upstream_vae_weights.pth": "vae.pth"}[name]
    return torch.load(path, weights_only=True, map_location="cpu")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def test_cases_are_in_the_repo_and_small():
    cases = sorted(p.parent.name for p in GOLDEN.glob("*/case.json"))
    assert cases == ["nadit", "restore", "vae", "windows"]
    size = sum(f.stat().st_size for f in GOLDEN.rglob("*") if f.is_file() and not f.is_symlink())
    assert size < 11e6, size
    for link in GOLDEN.glob("*/upstream/*.pth"):  # shared weights are relative links inside golden/seedvr2
        assert link.resolve().is_file() and GOLDEN in link.resolve().parents


def test_fvparity_golden_passes_both_sides(fvparity, tmp_path):
    out = tmp_path / "r.json"
    proc = fvparity("golden", *(str(GOLDEN / c) for c in ("nadit", "vae", "restore")), "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = {c["name"] for c in json.loads(out.read_text())["checks"]}
    for side in ("reference", "optimized"):
        assert {f"nadit/{side}:3b/vid_sample_0", f"nadit/{side}:3b/batched_per_sample", f"nadit/{side}:7b/vid_sample",
                f"vae/{side}:posterior_sample", f"restore/{side}:output_uint8"} <= names


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(GOLDEN / name, dst, symlinks=False)
    return dst


def test_missing_output_fails_and_sample_is_optional(fvparity, tmp_path):
    nadit, vae = _copy(tmp_path, "nadit"), _copy(tmp_path, "vae")
    o = load_file(str(nadit / "outputs.safetensors"))
    del o["vid_sample_7b"]
    save_file(o, str(nadit / "outputs.safetensors"))
    for f, drop in (("inputs", "posterior_noise"), ("outputs", "posterior_sample")):  # no posterior sample at all
        t = load_file(str(vae / f"{f}.safetensors"))
        del t[drop]
        save_file(t, str(vae / f"{f}.safetensors"))
    proc = fvparity("golden", str(vae), str(nadit), "--side", "reference")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fails = [l for l in proc.stdout.splitlines() if "FAIL" in l.split() and not l.startswith("golden")]
    assert len(fails) == 1 and fails[0].startswith("nadit/outputs:required") and "vid_sample_7b" in fails[0]
    assert any(l.startswith("vae/reference:decoded") for l in proc.stdout.splitlines())
