"""The wan golden cases that pin manifest-level facts still hold the situation each one claims, read from the
stored upstream outputs (not from this repo's code): a step on / just below the expert boundary at boundary ratios
0.5, 0.875 and 0.9; guidance <= 1 with guidance_2 > 1 (upstream ran no uncond pass); TI2V without an image
(every token gets t); CLIP images whose long edge has a fraction >= .5; the original-layout UMT5 with gate.0 and fc1
independent. A regenerated case that lost its situation (another shift, another size) fails here, not silently.
`fvparity golden` runs them on both sides (tests/test_wan_parity.py globs every wan case)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "wan"


def _case(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((GOLDEN / name / "case.json").read_text()), load_file(str(GOLDEN / name / "outputs.safetensors"))


@pytest.mark.parametrize("name, ratio, step, expert, exact", [
    ("pipe_a14b_boundary", 0.875, 1, 1, True), ("pipe_a14b_r05_on", 0.5, 2, 1, True),
    ("pipe_a14b_r09_below", 0.9, 1, 2, False), ("pipe_a14b_euler_below", 0.875, 1, 2, False)])
def test_boundary_cases_hold_a_step_on_or_just_below_the_boundary(name, ratio, step, expert, exact):
    meta, out = _case(name)
    p = meta["params"]
    assert p["boundary_ratio"] == p["model_config"]["boundary_ratio"] == ratio
    boundary = ratio * p["model_config"]["num_train_timesteps"]
    t = out["timesteps"][step].item()
    assert (t == boundary) if exact else (boundary - 1 <= t < boundary), (t, boundary)
    assert out["experts"][step].item() == expert
    experts = out["experts"].tolist()
    assert 1 in experts and 2 in experts and p["guidance_scale_2"] != p["guidance_scale"]  # both guidances apply


@pytest.mark.parametrize("name", ["pipe_a14b_g1", "pipe_a14b_g05"])
def test_unguided_two_expert_cases_ran_no_uncond_pass(name):
    meta, out = _case(name)
    p = meta["params"]
    assert p["guidance_scale"] <= 1 < p["guidance_scale_2"] and set(out["experts"].tolist()) == {1, 2}
    assert "negative_text_embeds" not in out   # the maker stores them only when upstream's DiT saw a second call


def test_ti2v_text_case_gives_every_token_the_step_timestep():
    meta, out = _case("pipe_ti2v_text")
    assert meta["params"]["expand_timesteps"] and meta["upstream"]["class"] == "WanPipeline"
    fed, ts = out["model_timesteps"], out["timesteps"]
    assert fed.dtype == torch.float32 and fed.dim() == 2
    assert torch.equal(fed, ts.float()[:, None].expand_as(fed))   # frame 0 included: no first-frame mask


def test_clip_images_with_a_fractional_long_edge():
    meta, _ = _case("proc_umt5")
    inputs = load_file(str(GOLDEN / "proc_umt5" / "inputs.safetensors"))
    fracs = {}
    for im in meta["params"]["clip_images"]:
        h, w = inputs[f"image_{im['name']}"].shape[:2]
        long_edge = 224 * max(h, w) / min(h, w)
        fracs[im["name"]] = (w > h, long_edge - int(long_edge))
    assert any(wide and f >= 0.5 for wide, f in fracs.values()), fracs
    assert any(not wide and f >= 0.5 for wide, f in fracs.values()), fracs


def test_original_umt5_case_has_independent_gate_and_fc1():
    meta = json.loads((GOLDEN / "umt5_original" / "case.json").read_text())
    assert meta["upstream_format"] == "original" and meta["probe"] == "wan.umt5"
    sd = torch.load(GOLDEN / "umt5_original" / "upstream" / "models_t5_umt5-xxl-enc-bf16.pth", weights_only=True)
    blocks = {k.split(".")[1] for k in sd if k.startswith("blocks.")}
    assert blocks and "token_embedding.weight" in sd and "norm.weight" in sd
    for i in blocks:
        gate, fc1 = sd[f"blocks.{i}.ffn.gate.0.weight"], sd[f"blocks.{i}.ffn.fc1.weight"]
        assert gate.shape == fc1.shape and (gate - fc1).norm() > 0.5 * fc1.norm()   # a swap changes the output
