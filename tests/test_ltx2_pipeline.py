"""ltx2 pipeline loop: both sides against diffusers' LTX2Pipeline goldens (golden/ltx2_pipe, per-step latents of both
modalities), C1 (reference one request at a time vs the optimized loop batched), its negative controls, and the
request contract's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import optimized.models.ltx2 as opt
import reference.ltx2 as ref
from manifests.errors import ManifestError
from manifests.ltx2 import Ltx2Config
from manifests.ltx2.connectors import Ltx2ConnectorsConfig
from manifests.ltx2.sampling import Ltx2Media, Ltx2Request, Ltx2SchedulerConfig
from optimized.models.ltx2.connectors import load_connectors as fast_connectors
from optimized.models.ltx2.pipeline import Ltx2Prompt
from optimized.models.ltx2.pipeline import generate_latents as fast_generate
from parity.families.ltx2.c1 import FAULTS, run_c1
from reference.ltx2.connectors import load_connectors as ref_connectors
from reference.ltx2.pipeline import generate_latents as ref_generate

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "ltx2_pipe"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "case.json").is_file())
REQUEST_FIELDS = ("height", "width", "num_frames", "frame_rate", "num_inference_steps", "guidance_scale",
                  "audio_guidance_scale", "guidance_rescale", "audio_guidance_rescale", "seed")


def _case(name: str):
    case = GOLDEN / name
    meta = json.loads((case / "case.json").read_text())
    up = case / "upstream"
    tcfg = Ltx2Config.from_diffusers_config(json.loads((up / "transformer" / "config.json").read_text()))
    ccfg = Ltx2ConnectorsConfig.from_diffusers_config(json.loads((up / "connectors" / "config.json").read_text()))
    sched = Ltx2SchedulerConfig.from_diffusers(json.loads((up / "scheduler_config.json").read_text()))
    p = meta["params"]
    req = Ltx2Request(**{k: p[k] for k in REQUEST_FIELDS})
    media = Ltx2Media(latent_channels=p["latent_channels"], audio_latent_channels=p["audio_latent_channels"],
                      mel_bins=p["mel_bins"])
    weights = (load_file(str(up / "transformer" / "diffusion_pytorch_model.safetensors")),
               load_file(str(up / "connectors" / "diffusion_pytorch_model.safetensors")))
    return meta, tcfg, ccfg, sched, req, media, weights, load_file(str(case / "inputs.safetensors")), \
        load_file(str(case / "outputs.safetensors"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("side", ["reference", "optimized"])
@pytest.mark.parametrize("name", CASES)
def test_golden_latents_and_steps(name, side):
    meta, tcfg, ccfg, sched, req, media, (tw, cw), inp, out = _case(name)
    tol = meta["tolerance"]["rel_l2"]
    got: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if side == "reference":
            v, a = ref_generate(ref.load_model(tcfg, tw), ref_connectors(ccfg, cw), req, inp["prompt_embeds"],
                                inp["prompt_attention_mask"], inp["negative_prompt_embeds"],
                                inp["negative_prompt_attention_mask"], inp, media, sched, trace=got.__setitem__)
        else:
            v, a = fast_generate(opt.load_model(tcfg, tw), fast_connectors(ccfg, cw), [req],
                                 [Ltx2Prompt(inp["prompt_embeds"], inp["prompt_attention_mask"],
                                             inp["negative_prompt_embeds"], inp["negative_prompt_attention_mask"])],
                                 inp, media, sched, trace=got.__setitem__)
    got["video_latents"], got["audio_latents"] = v, a
    assert set(out) <= set(got)
    for key, want in out.items():      # every stored tensor is checked, steps in order
        assert got[key].shape == want.shape, key
        assert _rel(got[key], want) < tol, (key, _rel(got[key], want))


@pytest.mark.parametrize("bug", ["no_terminal_stretch", "no_rescale", "audio_guided_like_video"])
def test_golden_catches_a_planted_loop_bug(bug):
    """Negative controls for the golden check: a loop run with one realistic porting bug leaves the tolerance."""
    import dataclasses
    meta, tcfg, ccfg, sched, req, media, (tw, cw), inp, out = _case("tiny23_t2v" if bug.startswith("audio")
                                                                    else "tiny_t2v")
    if bug == "no_terminal_stretch":
        sched = dataclasses.replace(sched, shift_terminal=None)
    elif bug == "no_rescale":
        req = dataclasses.replace(req, guidance_rescale=0.0, audio_guidance_rescale=0.0)
    else:
        req = dataclasses.replace(req, audio_guidance_scale=req.guidance_scale)
    with torch.no_grad():
        v, a = ref_generate(ref.load_model(tcfg, tw), ref_connectors(ccfg, cw), req, inp["prompt_embeds"],
                            inp["prompt_attention_mask"], inp["negative_prompt_embeds"],
                            inp["negative_prompt_attention_mask"], inp, media, sched)
    worst = max(_rel(v, out["video_latents"]), _rel(a, out["audio_latents"]))
    assert worst > 10 * meta["tolerance"]["rel_l2"], worst


def test_c1_passes_batched():
    report = run_c1(variants=["tiny"])
    assert report.checks and all(c.passed for c in report.checks), [(c.name, c.detail) for c in report.checks]
    assert "2 requests batched" in report.checks[0].detail


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_c1_faults_fail_and_name_the_step(fault):
    report = run_c1(variants=["tiny"], fault=fault)
    assert not any(c.passed for c in report.checks)
    assert {c.divergence for c in report.checks} == {FAULTS[fault]}


@pytest.mark.parametrize("change, words", [
    ({"height": 100}, "divisible by 32"), ({"num_frames": 10}, r"8 k \+ 1"), ({"stg_scale": 1.0}, "stg_scale"),
    ({"modality_scale": 3.0}, "modality_scale"), ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"guidance_scale": float("nan")}, "guidance_scale"), ({"seed": -1}, "seed")])
def test_request_refusals_name_the_field(change, words):
    with pytest.raises(ManifestError, match=words):
        Ltx2Request(**change).validate()


def test_request_upstream_semantics():
    r = Ltx2Request(num_frames=121, frame_rate=24.0, guidance_scale=1.0, audio_guidance_scale=None)
    assert r.latent_grid(Ltx2Media()) == (16, 16, 24)
    assert r.audio_frames(Ltx2Media()) == round(121 / 24 * 25)        # 16000 / 160 / 4 = 25 latents a second
    assert not r.do_cfg and r.audio_guidance == 1.0
    assert Ltx2Request(guidance_scale=1.0, audio_guidance_scale=7.0).do_cfg      # either modality turns CFG on
    with pytest.raises(ManifestError, match="time_shift_type"):
        Ltx2SchedulerConfig.from_diffusers({"time_shift_type": "linear"})
