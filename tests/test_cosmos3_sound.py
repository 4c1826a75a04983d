"""cosmos3 sound tokenizer: manifests, reference vs upstream goldens, optimized decoder (folded weight norm, chunked
with halo) vs reference, bad input, WAV artifacts."""

import json
import wave
from pathlib import Path

import pytest
import torch

from manifests.cosmos3.sound import Cosmos3SoundConfig, canonical_key_shapes, list_variants, load_variant
from safetensors.torch import load_file
from parity.families import cosmos3_sound as vae_checks
from parity.golden import load_case

import optimized.models.cosmos3.sound as opt
import reference.cosmos3.sound as ref
from optimized.runtime import artifacts

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden" / "cosmos3_sound"
CASES = sorted(p for p in GOLDEN.iterdir() if p.is_dir())


def test_variants():
    assert {"tiny", "avae"} <= set(list_variants())
    avae = load_variant("avae")
    assert (avae.hop, avae.latent_fps, avae.latent_dim, avae.audio_channels, avae.sampling_rate) == (1920, 25.0, 64, 2, 48000)


@pytest.mark.upstream
@pytest.mark.slow  # diffusers import; fast counterpart: test_golden
@pytest.mark.parametrize("variant", ["tiny", "avae"])
def test_canonical_keys_equal_diffusers(variant):
    import warnings
    from diffusers import Cosmos3AVAEAudioTokenizer
    cfg = load_variant(variant)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        m = Cosmos3AVAEAudioTokenizer(**cfg.to_diffusers_config())
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == canonical_key_shapes(cfg)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden(case):
    c = load_case(case)
    results = vae_checks.PROBES[c.meta["probe"]](c, ("reference", "optimized"))
    assert results and all(r.passed for r in results), [(r.name, r.metrics) for r in results if not r.passed]


def test_c0_and_fault():
    assert vae_checks.run_sound_c0([], None, "cpu", ["fp32"], 0, None, lambda m: None).passed
    r = vae_checks.run_sound_c0([], None, "cpu", ["fp32"], 0, "perturbed-weight", lambda m: None)
    assert not r.passed and all(c.divergence == "decoder.block.1" for c in r.checks if not c.passed)


def test_encoder_c0_rows_and_fault_named_at_the_layer():
    clean = vae_checks.run_sound_c0([], None, "cpu", ["fp32"], 0, None, lambda m: None)
    rows = [c for c in clean.checks if "/sound_encode/" in c.name]
    assert {c.name.rsplit("/", 1)[1] for c in rows} == {"posterior_mean", "posterior_std"} and all(c.passed for c in rows)
    r = vae_checks.run_sound_c0([], None, "cpu", ["fp32"], 0, "encoder-perturbed-weight", lambda m: None)
    failed = [c for c in r.checks if not c.passed]
    assert failed and all("/sound_encode/" in c.name for c in failed)   # the decoder rows are untouched
    assert {c.divergence for c in failed} == {vae_checks.FAMILY.fault("encoder-perturbed-weight").divergence}


def test_optimized_encoder_matches_the_upstream_goldens():
    """The optimized encoder alone against diffusers' posterior (mean, std and the seeded sample)."""
    for name in ("tiny_sound_encode", "tiny_sound_encode_batch2"):
        case = load_case(GOLDEN / name)
        cfg = Cosmos3SoundConfig.from_diffusers_config(json.loads((case.path / "upstream" / "config.json").read_text()))
        state = load_file(case.path / "upstream" / "diffusion_pytorch_model.safetensors")
        fast = opt.load_fast_sound_encoder(cfg, state)
        mean, std = fast.encode(case.inputs["audio"])
        sample = fast.sample(mean, std, torch.Generator().manual_seed(case.meta["params"]["sample_seed"]))
        for key, got in (("posterior_mean", mean), ("posterior_std", std), ("posterior_sample", sample)):
            want = case.outputs[key]
            assert got.shape == want.shape and (got - want).norm() / want.norm() < 1e-5, (name, key)


def test_encoder_bad_audio():
    cfg = load_variant("tiny")
    fast = opt.load_fast_sound_encoder(cfg, vae_checks.sound_random_state(cfg, 1))
    with pytest.raises(ValueError, match="audio must be"):
        fast.encode(torch.zeros(1, cfg.encoder_channels + 1, 40))
    bad = torch.zeros(1, cfg.encoder_channels, 40)
    bad[0, 0, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        fast.encode(bad)


def test_chunked_streaming_equals_whole_and_length():
    cfg = load_variant("tiny")
    state = vae_checks.sound_random_state(cfg, 1)
    fast = opt.load_fast_sound_decoder(cfg, state)
    z = torch.randn(2, cfg.latent_dim, 50)
    whole = fast.decode(z)
    assert whole.shape == (2, 2, 50 * cfg.hop)
    starts = [s for s, _ in fast.decode_chunks(z, 9)]
    assert starts == [i * 9 * cfg.hop for i in range(6)]
    assert torch.allclose(fast.decode_chunked(z, 9), whole, atol=1e-6)
    assert torch.allclose(ref.load_sound_tokenizer(cfg, state).decode(z), whole, atol=1e-6)


def test_bad_latents():
    cfg = load_variant("tiny")
    state = vae_checks.sound_random_state(cfg, 1)
    z = torch.randn(cfg.latent_dim, 4)
    z[1, 1] = float("nan")
    for decode in (ref.load_sound_tokenizer(cfg, state).decode, opt.load_fast_sound_decoder(cfg, state).decode):
        with pytest.raises(ValueError, match="NaN or Inf"):
            decode(z)
        with pytest.raises(ValueError, match="latents must be"):
            decode(torch.zeros(3, cfg.latent_dim + 1, 4))


def test_wav_atomic(tmp_path):
    audio = torch.rand(2, 300) * 2 - 1
    p = artifacts.write_wav(audio, tmp_path / "a.wav", 150)
    with wave.open(str(p)) as w:
        assert (w.getnchannels(), w.getnframes(), w.getframerate(), w.getsampwidth()) == (2, 300, 150, 2)
    with pytest.raises(artifacts.ArtifactError):
        artifacts.write_wav(torch.full((2, 5), float("inf")), tmp_path / "b.wav", 150)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.wav"]


def test_cosmos3_decode_seam_both_sides():
    from manifests.wan import canonical_key_shapes as wan_keys
    from parity.weights import random_state_dict
    import optimized.models.wan as opt_wan
    import reference.wan as ref_wan
    vcfg, scfg = load_variant("tiny"), None
    from manifests.wan import load_variant as wan_variant
    vcfg = wan_variant("tiny-2.2")
    scfg = load_variant("tiny")
    vstate, sstate = random_state_dict(wan_keys(vcfg), 0), vae_checks.sound_random_state(scfg, 0)
    z = torch.randn(1, vcfg.z_dim, 2, 2, 2)
    s = torch.randn(scfg.latent_dim, 6)
    want_v, want_a = ref.decode_cosmos3_outputs(ref_wan.load_vae(vcfg, vstate), ref.load_sound_tokenizer(scfg, sstate), z, s)
    seen = []
    from optimized.models.cosmos3.vae_chain import decode_cosmos3_outputs
    got_v, got_a = decode_cosmos3_outputs(opt_wan.load_fast_vae(vcfg, vstate), opt.load_fast_sound_decoder(scfg, sstate),
                                              z, s, on_chunk=seen.append)
    assert len(seen) == 2 and got_v.shape == want_v.shape == (1, 3, 5, 32, 32) and got_a.shape == (2, 6 * scfg.hop)
    assert ((got_v - want_v).norm() / want_v.norm()) < 1e-5 and torch.allclose(got_a, want_a, atol=1e-6)
