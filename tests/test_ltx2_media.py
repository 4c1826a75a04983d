"""ltx2 media components at C0: the video VAE's decode (plain and timestep-conditioned) and encode, the audio VAE's
decode (plain and with attention) and encode, and the vocoder agree between reference and optimized on random weights; every planted fault fails C0 naming its module; the latent statistics
round-trip; bad configs are refused by name."""

import pytest
import torch

from manifests.errors import ManifestError
from manifests.ltx2.video_vae import (
    VARIANTS,
    VIDEO_VAE_GAINS,
    load_video_vae_variant,
    video_vae_key_shapes,
)
from optimized.models.ltx2 import video_vae as opt_vae
from parity.families.ltx2.media import MEDIA_FAULTS, run_media_c0
from parity.port.kit import gain_init
from parity.weights import random_state_dict
from reference.ltx2 import video_vae as ref_vae


def c0(fault=None):
    return run_media_c0(None, None, "cpu", ["fp32"], 0, fault, lambda m: None)


def test_media_c0_passes_on_every_forward():
    report = c0()
    names = [c.name for c in report.checks]
    assert report.passed, [(c.name, c.metrics) for c in report.checks]
    assert names == ["video_vae.decode/tiny/fp32/forward", "video_vae.decode/tiny-tc/fp32/forward",
                     "video_vae.decode_tc/tiny-tc/fp32/forward", "video_vae.encode/tiny/fp32/forward",
                     "video_vae.encode/tiny-tc/fp32/forward", "audio_vae.decode/tiny/fp32/forward",
                     "audio_vae.decode/tiny-attn/fp32/forward", "audio_vae.decode_attn/tiny-attn/fp32/forward",
                     "audio_vae.encode/tiny/fp32/forward", "audio_vae.encode/tiny-attn/fp32/forward",
                     "vocoder/tiny/fp32/forward"]


@pytest.mark.parametrize("fault", sorted(MEDIA_FAULTS))
def test_each_media_fault_fails_c0_naming_its_module(fault):
    forward, _, layer = MEDIA_FAULTS[fault]
    report = c0(fault)
    failed = [c for c in report.checks if not c.passed]
    assert failed and all(c.name.startswith(forward + "/") and c.divergence == layer for c in failed), \
        [(c.name, c.passed, c.divergence) for c in report.checks]


def _both(name, seed=0):
    cfg = load_video_vae_variant(name)
    state = random_state_dict(video_vae_key_shapes(cfg), seed, gain_init(VIDEO_VAE_GAINS))
    return cfg, ref_vae.load_video_vae(cfg, state), opt_vae.load_video_vae(cfg, state)


def test_latent_normalisation_round_trips_and_matches_the_formula():
    cfg, ref, opt = _both("tiny")
    z = torch.randn(1, cfg.latent_channels, 2, 2, 2)
    mean, std = ref.latents_mean.view(1, -1, 1, 1, 1), ref.latents_std.view(1, -1, 1, 1, 1)
    want = (z - mean) * cfg.scaling_factor / std          # LTX2Pipeline._normalize_latents
    for side in (ref, opt):
        torch.testing.assert_close(side.normalize(z), want)
        torch.testing.assert_close(side.denormalize(side.normalize(z)), z, rtol=1e-5, atol=1e-5)


def test_decoded_shape_is_what_both_sides_produce():
    for name in ("tiny", "tiny-tc"):
        cfg, ref, opt = _both(name)
        z = torch.randn(1, cfg.latent_channels, 2, 2, 3)
        t = torch.tensor([0.1])
        with torch.no_grad():
            assert tuple(ref.decode(z, t).shape) == tuple(opt.decode(z, t).shape) == cfg.decoded_shape(z.shape)


def test_timestep_conditioned_decoder_needs_a_timestep_and_uses_it():
    cfg, ref, opt = _both("tiny-tc")
    z = torch.randn(1, cfg.latent_channels, 2, 2, 2)
    for side in (ref, opt):
        with pytest.raises(ValueError, match="timestep"):
            side.decode(z)
    with torch.no_grad():
        a, b = opt.decode(z, torch.tensor([0.0])), opt.decode(z, torch.tensor([0.5]))
    assert (a - b).abs().max() > 1e-3


def test_encoder_moments_are_mean_then_one_repeated_logvar():
    cfg, _, opt = _both("tiny")
    video = torch.rand(1, 3, 5, 16, 16) * 2 - 1
    with torch.no_grad():
        m = opt.encode(video)
    L = cfg.latent_channels
    assert m.shape[1] == 2 * L
    assert torch.equal(m[:, L:], m[:, L:L + 1].expand_as(m[:, L:]))


@pytest.mark.parametrize("change, message", [
    ({"patch_size_t": 2}, "patch_size_t"),
    ({"decoder_inject_noise": (True, False, False)}, "inject_noise"),
    ({"downsample_type": ("conv", "spatiotemporal")}, "conv"),
    ({"layers_per_block": (1, 1)}, "layers_per_block"),
])
def test_unported_or_malformed_configs_are_refused_by_name(change, message):
    import dataclasses
    with pytest.raises(ManifestError, match=message):
        dataclasses.replace(VARIANTS["tiny"], **change).validate()


def test_strict_load_refuses_a_missing_key():
    cfg = load_video_vae_variant("tiny")
    state = random_state_dict(video_vae_key_shapes(cfg), 0, gain_init(VIDEO_VAE_GAINS))
    del state["latents_std"]
    with pytest.raises(Exception, match="latents_std"):
        opt_vae.load_video_vae(cfg, state)
    with pytest.raises(Exception, match="latents_std"):
        ref_vae.load_video_vae(cfg, state)


def test_released_size_shapes():
    """The released LTX-2 video VAE (upstream constructor defaults) as shapes only: 128 latent channels, 32x
    spatial / 8x temporal compression, encoder 2048 wide at the bottom."""
    cfg = load_video_vae_variant("upstream-default")
    shapes = video_vae_key_shapes(cfg)
    assert (cfg.spatial_ratio, cfg.temporal_ratio) == (32, 8)
    assert shapes["encoder.conv_in.conv.weight"] == (128, 48, 3, 3, 3)
    assert shapes["encoder.conv_out.conv.weight"] == (129, 2048, 3, 3, 3)
    assert shapes["decoder.conv_out.conv.weight"] == (48, 128, 3, 3, 3)
    assert cfg.decoded_shape((1, 128, 16, 16, 24)) == (1, 3, 121, 512, 768)


def test_audio_vae_decoded_shape_and_packed_statistics():
    """decode gives 4 T - 3 frames and mel_bins bins on both sides; the pipeline's audio latent statistics act on
    the packed [B, T, L * F] latents: (x - mean) / std, and pack / unpack are inverse."""
    from manifests.ltx2.audio_vae import (
        AUDIO_VAE_GAINS,
        audio_vae_key_shapes,
        load_audio_vae_variant,
    )
    from optimized.models.ltx2 import audio_vae as opt_avae
    from reference.ltx2 import audio_vae as ref_avae
    cfg = load_audio_vae_variant("tiny")
    state = random_state_dict(audio_vae_key_shapes(cfg), 0, gain_init(AUDIO_VAE_GAINS))
    ref, opt = ref_avae.load_audio_vae(cfg, state), opt_avae.load_audio_vae(cfg, state)
    z = torch.randn(1, cfg.latent_channels, 3, 4)
    with torch.no_grad():
        assert tuple(ref.decode(z).shape) == tuple(opt.decode(z).shape) == (1, 2, 9, 16) == cfg.decoded_shape(z.shape)
    packed = ref_avae.pack_audio_latents(z)
    assert packed.shape == (1, 3, cfg.latent_channels * 4)
    assert torch.equal(ref_avae.unpack_audio_latents(packed, 4), z)
    want = (packed - state["latents_mean"]) / state["latents_std"]
    for side in (ref, opt):
        torch.testing.assert_close(side.normalize(packed), want)
        torch.testing.assert_close(side.denormalize(side.normalize(packed)), packed, rtol=1e-5, atol=1e-5)


def test_vocoder_waveform_length_and_refused_configs():
    """Released kernels / strides give exactly T * 240 samples (24 kHz from 100 mel frames/s); the snake /
    anti-aliased vocoder (LTX-2.3) is refused by name."""
    import dataclasses

    from manifests.ltx2.vocoder import VARIANTS as VOC
    from manifests.ltx2.vocoder import load_vocoder_variant, vocoder_key_shapes
    from optimized.models.ltx2 import vocoder as opt_voc
    cfg = load_vocoder_variant("upstream-default")
    assert cfg.total_upsample_factor == 240 and cfg.output_sampling_rate == 24000
    for k, s in zip(cfg.upsample_kernel_sizes, cfg.upsample_factors):
        assert (10 - 1) * s - 2 * ((k - s) // 2) + k == 10 * s          # ConvTranspose1d output length
    with pytest.raises(ManifestError, match="snakebeta"):
        dataclasses.replace(VOC["tiny"], act_fn="snakebeta").validate()
    tiny = load_vocoder_variant("tiny")
    state = random_state_dict(vocoder_key_shapes(tiny), 0, gain_init(()))
    with torch.no_grad():
        wav = opt_voc.load_vocoder(tiny, state).vocode(torch.randn(1, 2, 9, 16))
    assert wav.shape == (1, 2, 37) and wav.abs().max() <= 1.0        # tiny kernels 4, 5 at stride 2: 2T, then 2T + 1; tanh
