"""ltx2 media goldens (tools/make_ltx2_media_goldens.py, diffusers 0.42.1 AutoencoderKLLTX2Video): both sides
reproduce upstream's posterior, decode (plain and timestep-conditioned), latent (de)normalisation and every block
output; a weight planted wrong in one block fails the case naming that block; and, with diffusers installed, the
kit's variants and key shapes equal upstream's constructor and the sides equal upstream live."""

from pathlib import Path

import pytest
import torch

from parity.families.ltx2.media import (
    AUDIO_VAE_LOADERS,
    VIDEO_VAE_LOADERS,
    VOCODER_LOADERS,
    audio_vae_probe,
    video_vae_probe,
    vocoder_probe,
)
from parity.golden import load_case, run_probe

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "ltx2_media"
VIDEO_CASES = ("video_vae_tiny", "video_vae_tc")


@pytest.mark.parametrize("name", VIDEO_CASES)
def test_video_vae_golden_passes_both_sides(name):
    checks = run_probe(video_vae_probe, load_case(GOLDEN / name), ("reference", "optimized"))
    assert checks and all(c.passed for c in checks), [(c.name, c.detail) for c in checks if not c.passed]
    names = {c.name for c in checks}
    for side in ("reference", "optimized"):
        for out in ("latent_mean", "latent_std", "video", "normalized", "denormalized",
                    "latent_mean@intermediates", "video@intermediates"):
            assert f"{name}/{side}:{out}" in names


@pytest.mark.parametrize("side", ["reference", "optimized"])
@pytest.mark.parametrize("key, module", [
    ("decoder.up_blocks.1.resnets.0.conv1.conv.weight", "decoder.up_blocks.1"),
    ("encoder.down_blocks.0.downsamplers.0.conv.conv.weight", "encoder.down_blocks.0"),
    ("decoder.mid_block.time_embedder.timestep_embedder.linear_1.weight", "decoder.mid_block"),
])
def test_a_planted_weight_fails_the_golden_naming_its_block(side, key, module, monkeypatch):
    """The negative control: one weight scaled on one side after loading; the case fails on that side only and
    the intermediates row names the block (upstream module name)."""
    real = VIDEO_VAE_LOADERS[side]

    def planted(cfg, state, *a, **kw):
        return real(cfg, {**state, key: state[key] * 1.5}, *a, **kw)

    monkeypatch.setitem(VIDEO_VAE_LOADERS, side, planted)
    checks = run_probe(video_vae_probe, load_case(GOLDEN / "video_vae_tc"), ("reference", "optimized"))
    failed = [c for c in checks if not c.passed]
    assert failed and all(f"/{side}:" in c.name for c in failed)
    rows = [c for c in failed if c.name.endswith("@intermediates")]
    assert rows and rows[0].divergence == module, [(c.name, c.divergence) for c in failed]


@pytest.mark.upstream
@pytest.mark.parametrize("variant", ["tiny", "tiny-tc", "upstream-default"])
def test_variants_and_key_shapes_equal_upstream(variant):
    diffusers = pytest.importorskip("diffusers")
    from manifests.ltx2.video_vae import load_video_vae_variant, video_vae_key_shapes
    cfg = load_video_vae_variant(variant)
    with torch.device("meta"):
        up = diffusers.AutoencoderKLLTX2Video(**cfg.to_dict())
    assert {k: tuple(v.shape) for k, v in up.state_dict().items()} == video_vae_key_shapes(cfg)
    if variant == "upstream-default":   # upstream's attribute counts every scaled block as spatial and temporal
        assert (cfg.spatial_ratio, cfg.temporal_ratio) == (32, 8) != (up.spatial_compression_ratio,
                                                                       up.temporal_compression_ratio)


@pytest.mark.upstream
@pytest.mark.parametrize("variant", ["tiny", "tiny-tc"])
def test_both_sides_equal_upstream_live(variant):
    diffusers = pytest.importorskip("diffusers")
    from manifests.ltx2.video_vae import load_video_vae_variant
    cfg = load_video_vae_variant(variant)
    torch.manual_seed(3)
    up = diffusers.AutoencoderKLLTX2Video(**cfg.to_dict()).eval()
    state = {k: v.detach().clone() for k, v in up.state_dict().items()}
    g = torch.Generator().manual_seed(4)
    video = torch.rand(1, 3, 5, 16, 16, generator=g) * 2 - 1
    z = torch.randn(1, cfg.latent_channels, 2, 2, 2, generator=g)
    t = torch.tensor([0.2]) if cfg.timestep_conditioning else None
    with torch.no_grad():
        want_mean, want_video = up.encode(video).latent_dist.mean, up.decode(z, t).sample
        for load in VIDEO_VAE_LOADERS.values():
            vae = load(cfg, state)
            torch.testing.assert_close(vae.latent_mean(vae.encode(video)), want_mean, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(vae.decode(z, t), want_video, rtol=1e-4, atol=1e-5)


def test_audio_vae_golden_passes_both_sides():
    checks = run_probe(audio_vae_probe, load_case(GOLDEN / "audio_vae_attn"), ("reference", "optimized"))
    assert checks and all(c.passed for c in checks), [(c.name, c.detail) for c in checks if not c.passed]
    names = {c.name for c in checks}
    for side in ("reference", "optimized"):
        for out in ("latent_mean", "latent_std", "mel", "normalized", "denormalized", "latent_mean@intermediates",
                    "mel@intermediates"):
            assert f"audio_vae_attn/{side}:{out}" in names


@pytest.mark.parametrize("key, module", [("decoder.up.1.attn.0.q.weight", "decoder.up.1"),
                                         ("encoder.down.0.downsample.conv.weight", "encoder.down.0")])
def test_a_planted_audio_weight_fails_the_golden_naming_its_stage(key, module, monkeypatch):
    real = AUDIO_VAE_LOADERS["optimized"]
    monkeypatch.setitem(AUDIO_VAE_LOADERS, "optimized",
                        lambda cfg, state, *a, **kw: real(cfg, {**state, key: state[key] * 1.5}, *a, **kw))
    checks = run_probe(audio_vae_probe, load_case(GOLDEN / "audio_vae_attn"), ("reference", "optimized"))
    failed = [c for c in checks if not c.passed]
    assert failed and all("/optimized:" in c.name for c in failed)
    rows = [c for c in failed if c.name.endswith("@intermediates")]
    assert rows and rows[0].divergence == module, [(c.name, c.divergence) for c in failed]


@pytest.mark.upstream
@pytest.mark.parametrize("variant", ["tiny", "tiny-attn", "upstream-default"])
def test_audio_variants_and_key_shapes_equal_upstream(variant):
    diffusers = pytest.importorskip("diffusers")
    from manifests.ltx2.audio_vae import audio_vae_key_shapes, load_audio_vae_variant
    cfg = load_audio_vae_variant(variant)
    with torch.device("meta"):
        up = diffusers.AutoencoderKLLTX2Audio(**cfg.to_dict())
    assert {k: tuple(v.shape) for k, v in up.state_dict().items()} == audio_vae_key_shapes(cfg)


def test_vocoder_golden_passes_both_sides():
    checks = run_probe(vocoder_probe, load_case(GOLDEN / "vocoder_tiny"), ("reference", "optimized"))
    assert checks and all(c.passed for c in checks), [(c.name, c.detail) for c in checks if not c.passed]
    assert {c.name for c in checks} >= {f"vocoder_tiny/{s}:waveform{o}" for s in ("reference", "optimized")
                                         for o in ("", "@intermediates")}


def test_a_planted_vocoder_weight_fails_the_golden_naming_its_stage(monkeypatch):
    real = VOCODER_LOADERS["optimized"]
    key = "upsamplers.1.weight"
    monkeypatch.setitem(VOCODER_LOADERS, "optimized",
                        lambda cfg, state, *a, **kw: real(cfg, {**state, key: state[key] * 1.5}, *a, **kw))
    checks = run_probe(vocoder_probe, load_case(GOLDEN / "vocoder_tiny"), ("reference", "optimized"))
    failed = [c for c in checks if not c.passed]
    assert failed and all("/optimized:" in c.name for c in failed)
    assert [c.divergence for c in failed if c.name.endswith("@intermediates")] == ["upsamplers.1"]


@pytest.mark.upstream
@pytest.mark.parametrize("variant", ["tiny", "upstream-default"])
def test_vocoder_variants_and_key_shapes_equal_upstream(variant):
    pytest.importorskip("diffusers")
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from manifests.ltx2.vocoder import load_vocoder_variant, vocoder_key_shapes
    cfg = load_vocoder_variant(variant)
    with torch.device("meta"):
        up = LTX2Vocoder(**cfg.to_dict())
    assert {k: tuple(v.shape) for k, v in up.state_dict().items()} == vocoder_key_shapes(cfg)


def _sweep_with_media_probes(case: str, monkeypatch) -> list[str]:
    """tests/test_golden_corruption.py's sweep (every stored tensor corrupted in turn must fail the case), with the
    media probes in the probe table (the ltx2 FAMILY does not register them yet: REQUEST_ltxmedia.md)."""
    from parity import families
    from parity.families.ltx2.media import MEDIA_GOLDEN_PROBES
    from tests.test_golden_corruption import sweep
    real = families.golden_probes
    monkeypatch.setattr(families, "golden_probes", lambda: {**real(), **MEDIA_GOLDEN_PROBES})
    return sweep(GOLDEN / case)


def test_every_stored_tensor_of_the_vocoder_golden_is_checked(monkeypatch):
    assert _sweep_with_media_probes("vocoder_tiny", monkeypatch) == []


@pytest.mark.slow
@pytest.mark.parametrize("case", ["video_vae_tiny", "video_vae_tc", "audio_vae_attn"])
def test_every_stored_tensor_of_the_vae_goldens_is_checked(case, monkeypatch):
    assert _sweep_with_media_probes(case, monkeypatch) == []
