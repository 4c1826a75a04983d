"""Released Wan VAE sizes (wan2.1 = Wan2.1_VAE.pth, z16; wan2.2 = Wan2.2_VAE.pth, z48): diffusers' AutoencoderKLWan,
built on the meta device (no weights allocated) from the released configs as diffusers' conversion script states
them, gives the real release key/shape sets. Both manifests must map them key for key onto the canonical layout:

  diffusers   the AutoencoderKLWan state_dict() names (identity)
  original    the same set through the documented inverse mapping (tests/test_wan_convert.py original_key) onto
              the original WanVAE_ names of the .pth releases
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from converters import load_manifest
from converters.engine import plan_conversion
from converters.families import get_family
from converters.readers import TensorInfo
from manifests.wan import WanVAEConfig, canonical_key_shapes, load_variant
from tests.test_wan_convert import original_key

pytestmark = pytest.mark.upstream

FAMILY = get_family("wan")
RELEASED = ("wan2.1", "wan2.2")


def released_diffusers_config(variant: str) -> dict:
    """diffusers scripts/convert_wan_to_diffusers.py: convert_vae() builds AutoencoderKLWan() (its defaults are the
    Wan2.1 release); convert_vae_22() builds it from vae22_diffusers_config (structure below; the latent
    statistics are data, taken from the variant)."""
    if variant == "wan2.1":
        return {}
    cfg = load_variant(variant)
    return {"base_dim": 160, "z_dim": 48, "is_residual": True, "in_channels": 12, "out_channels": 12,
            "decoder_base_dim": 256, "scale_factor_temporal": 4, "scale_factor_spatial": 16, "patch_size": 2,
            "latents_mean": list(cfg.latents_mean), "latents_std": list(cfg.latents_std)}


@pytest.fixture(scope="module")
def release_sets() -> dict[str, dict[str, tuple[int, ...]]]:
    pytest.importorskip("diffusers")
    from diffusers import AutoencoderKLWan

    out = {}
    for v in RELEASED:
        with torch.device("meta"):
            model = AutoencoderKLWan(**released_diffusers_config(v))
        assert WanVAEConfig.from_diffusers_config(dict(model.config)) == load_variant(v)   # the variant IS the release
        out[v] = {k: tuple(t.shape) for k, t in model.state_dict().items()}
        del model
    return out


def _plan(fmt: str, variant: str, keys: dict[str, tuple[int, ...]]):
    return plan_conversion(FAMILY, load_manifest("wan", fmt), load_variant(variant),
                           {k: TensorInfo(k, Path(f"{variant}.pth"), "float32", s) for k, s in keys.items()})


def _check(plan, keys, variant) -> None:
    want = canonical_key_shapes(load_variant(variant))
    assert {e.target: e.shape for e in plan.entries} == want              # every canonical key, its shape
    assert sorted(e.source_key for e in plan.entries) == sorted(keys)      # from every release key, once
    assert not plan.dropped and not plan.sidecars and plan.parts["complete"]
    assert all(e.op == "rename" for e in plan.entries)


@pytest.mark.parametrize("variant", RELEASED)
def test_diffusers_release_keyset(release_sets, variant):
    keys = release_sets[variant]
    _check(_plan("diffusers", variant, keys), keys, variant)
    params = sum(math.prod(s) for s in keys.values())
    assert (126e6 < params < 128e6) if variant == "wan2.1" else (700e6 < params < 710e6)


@pytest.mark.parametrize("variant", RELEASED)
def test_original_release_keyset(release_sets, variant):
    cfg = load_variant(variant)
    keys = {original_key(k, cfg): s for k, s in release_sets[variant].items()}
    assert len(keys) == len(release_sets[variant])
    _check(_plan("original", variant, keys), keys, variant)
    # the decoder indices diffusers' script hard-codes for the releases
    dec = [k.split(".") for k in keys if k.startswith("decoder.upsamples.")]
    if variant == "wan2.1":
        assert {int(p[2]) for p in dec} == set(range(15))
        assert {int(p[2]) for p in dec if p[3] in ("resample", "time_conv")} == {3, 7, 11}
        assert {int(p[2]) for p in dec if p[3] == "shortcut"} == {4}
    else:
        assert {int(p[4]) for p in dec if p[5] in ("resample", "time_conv")} == {3}
        enc = [k.split(".") for k in keys if k.startswith("encoder.downsamples.")]
        assert {int(p[4]) for p in enc if p[5] in ("resample", "time_conv")} == {2}
