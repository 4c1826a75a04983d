"""Wan VAE: manifests, reference vs upstream goldens, optimized chunked loops vs reference, faults, bad input,
streaming / cancellation / memory reservation, atomic artifacts."""

import json
import math
from pathlib import Path

import pytest
import torch

from manifests import ManifestError
from manifests.wan import WanVAEConfig, canonical_key_shapes, list_variants, load_variant
from parity.families.wan import vae as fam
from parity.golden import load_case
from parity.weights import random_state_dict

import optimized.models.wan as opt
from optimized.runtime.scheduler import RequestFailed, RequestRejected, WorkUnitScheduler, run_request, stream_request
import reference.wan as ref
from optimized.runtime import artifacts

ROOT = Path(__file__).resolve().parents[1]
CASES = sorted(p for p in (ROOT / "golden" / "wan").iterdir()  # the VAE cases only (DiT / UMT5 / pipeline cases too)
               if p.is_dir() and json.loads((p / "case.json").read_text())["probe"].startswith("wan.vae"))
rel = lambda a, b: ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=["tiny-2.1", "tiny-2.2"])
def sides(request):
    cfg = load_variant(request.param)
    state = random_state_dict(canonical_key_shapes(cfg), 0)
    return cfg, ref.load_vae(cfg, state), opt.load_fast_vae(cfg, state)


def test_variants_and_released_sizes():
    assert {"tiny-2.1", "tiny-2.2", "wan2.1", "wan2.2"} <= set(list_variants())
    w21, w22 = load_variant("wan2.1"), load_variant("wan2.2")
    assert (w21.z_dim, w21.spatial_compression, w21.temporal_compression) == (16, 8, 4)
    assert (w22.z_dim, w22.spatial_compression, w22.temporal_compression, w22.patch_size) == (48, 16, 4, 2)
    n = lambda c: sum(math.prod(s) for s in canonical_key_shapes(c).values())
    assert 126e6 < n(w21) < 128e6 and 700e6 < n(w22) < 710e6   # Wan2.1_VAE.pth ~ 127M, Wan2.2_VAE.pth ~ 705M params


def test_config_refuses_bad_values():
    with pytest.raises(ManifestError, match="latents_mean"):
        WanVAEConfig.from_dict({**load_variant("tiny-2.1").to_dict(), "latents_mean": [0.0]})
    with pytest.raises(ManifestError, match="attn_scales"):
        WanVAEConfig.from_diffusers_config({"attn_scales": [0.5]})


@pytest.mark.upstream
@pytest.mark.slow  # importing diffusers takes ~30 s; fast counterpart: test_reference_parameter_names_are_canonical
@pytest.mark.parametrize("variant", ["tiny-2.1", "tiny-2.2", "wan2.1", "wan2.2"])
def test_canonical_keys_equal_diffusers(variant):
    from diffusers import AutoencoderKLWan
    cfg = load_variant(variant)
    with torch.device("meta"):
        m = AutoencoderKLWan(**cfg.to_diffusers_config())
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == canonical_key_shapes(cfg)
    assert WanVAEConfig.from_diffusers_config(dict(m.config)) == cfg


def test_reference_parameter_names_are_canonical(sides):
    cfg, model, _ = sides
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == canonical_key_shapes(cfg)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_both_sides(case):
    c = load_case(case)
    results = fam.PROBES[c.meta["probe"]](c, ("reference", "optimized"))
    assert results and all(r.passed for r in results), [(r.name, r.metrics) for r in results if not r.passed]


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_decode_any_chunk_size_is_lossless(sides, chunk):
    cfg, model, fast = sides
    z = torch.randn(1, cfg.z_dim, 5, 2, 3, generator=torch.Generator().manual_seed(3))
    want = model.decode(z).detach()
    got = run_request(opt.WanVaeDecodeKernel(fast), opt.DecodeRequest("r", z, chunk))
    assert got.shape == (1, 3, 17, 2 * cfg.spatial_compression, 3 * cfg.spatial_compression)
    assert rel(got, want) < 1e-5


def test_encode_chunked_matches_reference_and_posterior(sides):
    cfg, model, fast = sides
    s = cfg.spatial_compression
    video = torch.rand(1, 3, 9, s, 2 * s, generator=torch.Generator().manual_seed(4)) * 2 - 1
    want = model.encode(video)
    got = run_request(opt.WanVaeEncodeKernel(fast), opt.EncodeRequest("e", video, 2))
    assert rel(got.mean, want.mean) < 1e-5 and rel(got.logvar, want.logvar) < 1e-5
    assert torch.equal(got.mode(), got.mean)
    a, b = got.sample(torch.Generator().manual_seed(0)), want.sample(torch.Generator().manual_seed(0))
    assert rel(a, b) < 1e-5 and not torch.equal(a, got.mean)
    z = ref.normalize_latents(cfg, want.mean)
    assert torch.allclose(ref.denormalize_latents(cfg, z), want.mean, atol=1e-6)


def test_c0_passes_and_planted_faults_are_localised():
    report = fam.run_c0(["tiny-2.2"], None, "cpu", ["fp32"], 0, None, progress=lambda m: None)
    assert report.passed, [c.name for c in report.checks if not c.passed]
    expect = {"perturbed-weight": "decoder.up_blocks.1", "rep-context": "decoder.up_blocks.0",
              "dropped-cache": "decoder.conv_in"}
    for fault, layer in expect.items():
        r = fam.run_c0(["tiny-2.2"], None, "cpu", ["fp32"], 0, fault, progress=lambda m: None)
        assert not r.passed
        first = next(c for c in r.checks if not c.passed and c.name.endswith(("chunk1", "chunk2")))
        assert first.divergence.startswith(layer), (fault, first.divergence)


@pytest.mark.parametrize("bad, match", [
    ("frames", "4k\\+1"), ("hw", "multiples"), ("nan", "NaN"),
])
def test_bad_video_input_is_refused(sides, bad, match):
    cfg, model, fast = sides
    s = cfg.spatial_compression
    video = torch.zeros(1, 3, 8 if bad == "frames" else 5, s + (3 if bad == "hw" else 0), s)
    if bad == "nan":
        video[0, 0, 2, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=match):
        model.encode(video)
    with pytest.raises(ValueError, match=match):
        opt.WanVaeEncodeKernel(fast).init_state(opt.EncodeRequest("e", video))


def test_nonfinite_latent_leaves_no_artifact(sides, tmp_path):
    cfg, model, fast = sides
    z = torch.randn(1, cfg.z_dim, 3, 2, 2)
    z[0, 0, 2, 1, 1] = float("inf")
    out = tmp_path / "frames"
    with pytest.raises(ValueError, match="NaN or Inf"):
        with artifacts.FrameSink(out) as sink:
            for ev in stream_request(opt.WanVaeDecodeKernel(fast), opt.DecodeRequest("r", z)):
                sink.add(ev.frames)
    with pytest.raises(ValueError, match="NaN or Inf"):
        model.decode(z)
    assert list(tmp_path.iterdir()) == []


def test_stream_cancel_and_reservation(sides, tmp_path):
    cfg, _, fast = sides
    z = torch.randn(1, cfg.z_dim, 4, 2, 2)
    kernel = opt.WanVaeDecodeKernel(fast)
    sched = WorkUnitScheduler(1 << 30)
    events = list(stream_request(kernel, opt.DecodeRequest("r", z, 1), scheduler=sched))
    assert [e.video_frames for e in events] == [(0, 1), (1, 5), (5, 9), (9, 13)]
    assert all(e.reserved_bytes > 0 for e in events) and sched.reserved_bytes == 0
    assert sched.peak_bytes == max(e.reserved_bytes for e in events)
    steps = iter(range(100))
    out = tmp_path / "clip"
    with pytest.raises(RequestFailed, match="cancelled"):
        with artifacts.FrameSink(out) as sink:
            for ev in stream_request(kernel, opt.DecodeRequest("r", z, 1), cancelled=lambda: next(steps) >= 2):
                sink.add(ev.frames)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    need = kernel.plan_step(kernel.init_state(opt.DecodeRequest("r", z, 1))).resources.device_bytes
    with pytest.raises(RequestRejected, match="never fit"):
        next(stream_request(kernel, opt.DecodeRequest("r", z, 1), memory_budget_bytes=need - 1))
    plan = kernel.plan_step(kernel.init_state(opt.DecodeRequest("r", z, 2)))
    assert plan.resources.device_bytes > need and plan.cancel_boundary and plan.loop_id == "wan.vae_decode"


def test_png_frames_roundtrip_and_wav(tmp_path):
    from skimage.io import imread
    video = torch.rand(1, 3, 2, 5, 7) * 2 - 1
    artifacts.write_png_frames(video, tmp_path / "f")
    img = imread(tmp_path / "f" / "frame_00001.png")
    assert img.shape == (5, 7, 3)
    assert (torch.from_numpy(img).permute(2, 0, 1) == artifacts.to_uint8_frames(video)[1].permute(2, 0, 1)).all()
    with pytest.raises(artifacts.ArtifactError):
        artifacts.write_png_frames(video, tmp_path / "f")   # never overwrites
    with pytest.raises(artifacts.ArtifactError):
        artifacts.write_png_frames(torch.full((3, 1, 2, 2), float("nan")), tmp_path / "g")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.mark.skipif(artifacts.ffmpeg_exe() is None, reason="needs the optional video extra (imageio-ffmpeg)")
def test_mp4(tmp_path):
    p = artifacts.write_mp4(torch.rand(3, 4, 16, 16) * 2 - 1, tmp_path / "a.mp4", fps=8)
    assert p.stat().st_size > 0
