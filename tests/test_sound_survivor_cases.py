"""The cases that catch the two cosmos3-sound mutations that used to survive (parity/mutations/cosmos3-sound.json):

- `ref-volume-normalised-per-sample`: the batch-2 upstream encode golden `tiny_sound_encode_batch2` (per-sample
  gains 0.25 / 1.0; upstream divides by one peak over the whole batch). The batch-1 case cannot tell the two apart.
- `opt-weight-norm-in-run-dtype`: C0's `weight_norm_fold` row (the optimized side's load-time fold vs the reference's
  fp32 weight norm, cast once). The decoded bf16 waveform cannot tell the two apart: its error is bf16 noise either way.

Each bug is planted by patching the module at its seam (the method the catalogued edit changes) for the test only.
"""

import dataclasses
from pathlib import Path

import pytest
import torch

from manifests.cosmos3.sound import load_variant
from parity.families import cosmos3_sound as sound_checks
from parity.golden import load_case

import optimized.models.cosmos3.sound as opt_sound
import reference.cosmos3.sound as ref_sound

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "cosmos3_sound"


# ------------------------------------------------------------------------------------------------
# Planted bugs (module patches that restore themselves through monkeypatch)
# ------------------------------------------------------------------------------------------------

def plant_per_sample_volume(monkeypatch):
    """Reference encode normalising each sample by its own peak instead of the batch's (the catalogued edit)."""
    original = ref_sound.SoundTokenizer.encode

    def encode(self, audio):
        per_sample = audio / (audio.abs().amax(dim=(1, 2), keepdim=True) + 1e-5) * 0.95
        saved, self.cfg = self.cfg, dataclasses.replace(self.cfg, normalize_volume=False)
        try:
            return original(self, per_sample)
        finally:
            self.cfg = saved

    monkeypatch.setattr(ref_sound.SoundTokenizer, "encode", encode)


def plant_bf16_fold(monkeypatch):
    """Optimized decoder folding g * v / ||v|| in the run dtype instead of fp32 (the catalogued edit)."""
    original = opt_sound.FastSoundDecoder.__init__

    def init(self, cfg, p):
        original(self, cfg, p)
        for k in p:
            if k.endswith(".weight_v"):
                name = k[: -len(".weight_v")]
                v, g = p[k], p[f"{name}.weight_g"]
                self.w[name] = (g * v / v.flatten(1).norm(dim=1).view(-1, 1, 1)).to(self.dtype)

    monkeypatch.setattr(opt_sound.FastSoundDecoder, "__init__", init)


def _encode_checks(name: str):
    case = load_case(GOLDEN / name)
    return {r.name.split(":")[-1]: r for r in sound_checks.golden_sound_encode_probe(case, ("reference",))}


# ------------------------------------------------------------------------------------------------
# ref-volume-normalised-per-sample
# ------------------------------------------------------------------------------------------------

def test_batch2_case_has_different_loudness_per_sample():
    audio = load_case(GOLDEN / "tiny_sound_encode_batch2").inputs["audio"]
    peaks = audio.abs().amax(dim=(1, 2))
    assert audio.shape == (2, 2, 200) and peaks[0] < 0.3 * peaks[1]


def test_batch2_golden_passes_clean():
    checks = _encode_checks("tiny_sound_encode_batch2")
    assert set(checks) == {"posterior_mean", "posterior_std", "posterior_sample"}
    assert all(r.passed for r in checks.values()), {k: r.metrics.rel_l2 for k, r in checks.items()}


def test_batch2_golden_catches_per_sample_volume(monkeypatch):
    plant_per_sample_volume(monkeypatch)
    checks = _encode_checks("tiny_sound_encode_batch2")
    assert not checks["posterior_mean"].passed and checks["posterior_mean"].metrics.rel_l2 > 1e-2
    assert all(r.passed for r in _encode_checks("tiny_sound_encode").values())  # the batch-1 case does not see it


# ------------------------------------------------------------------------------------------------
# opt-weight-norm-in-run-dtype
# ------------------------------------------------------------------------------------------------

def _fold(seed: int, dtype: torch.dtype):
    cfg = load_variant("tiny")
    state = sound_checks.sound_random_state(cfg, seed)
    fast = opt_sound.load_fast_sound_decoder(cfg, state, dtype=dtype)
    return sound_checks.check_weight_norm_fold("fold", state, fast, dtype)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fold_check_clean_vs_bf16_fold(seed, monkeypatch):
    for dtype in (torch.float32, torch.bfloat16):
        clean = _fold(seed, dtype)
        assert clean.passed and clean.metrics.rel_l2 == 0.0, clean.detail
    plant_bf16_fold(monkeypatch)
    assert _fold(seed, torch.float32).passed  # in fp32 the planted fold is the same computation
    bad = _fold(seed, torch.bfloat16)
    share = float(bad.detail.split("% of elements")[0].split()[-1]) / 100
    assert not bad.passed and share > 25 * sound_checks.FOLD_MAX_FLIPPED, bad.detail
    assert bad.divergence and bad.divergence.startswith("decoder")


def test_c0_catches_bf16_fold_where_the_waveform_rows_cannot(monkeypatch):
    plant_bf16_fold(monkeypatch)
    report = sound_checks.run_sound_c0([], None, "cpu", ["bf16"], 0, None, lambda m: None)
    failed = [c.name for c in report.checks if not c.passed]
    assert failed == ["tiny/bf16/weight_norm_fold"], failed


def test_c0_decodes_a_batch_of_two_at_different_loudness():
    report = sound_checks.run_sound_c0([], None, "cpu", ["fp32"], 0, None, lambda m: None)
    assert report.passed
    whole = next(c for c in report.checks if c.name.endswith("sound_decode/whole"))
    assert whole.detail.startswith(f"[{len(sound_checks.C0_GAINS)}, ") and len(set(sound_checks.C0_GAINS)) > 1
