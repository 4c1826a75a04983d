"""seedvr2 VAE (reference and optimized) and the one-step restoration against the upstream goldens (fp32)."""

from __future__ import annotations

import pytest
import torch

from manifests.seedvr2 import load_vae_variant, load_variant, vae_from_upstream_config
from optimized.models.seedvr2 import load_fast_nadit
from optimized.models.seedvr2.pipeline import RestorationLoop
from optimized.models.seedvr2.vae import load_fast_vae
from reference.seedvr2 import load_nadit
from reference.seedvr2.sampler import restore, uniform_trailing_timesteps, v_lerp_to_x0
from reference.seedvr2.vae import load_vae
from tests.test_seedvr2_goldens import load_case, rel_l2, upstream_weights
from tests.test_seedvr2_nadit import canonical

TOL = 1e-5


@pytest.mark.parametrize("side", ["reference", "optimized"])
def test_vae_matches_golden(side):
    d, meta, i, o = load_case("vae_tiny")
    cfg = vae_from_upstream_config(meta["config"]["model"])
    assert cfg == load_vae_variant("tiny")
    vae = (load_vae if side == "reference" else load_fast_vae)(cfg, upstream_weights(d))
    with torch.no_grad():
        assert rel_l2(vae.encode_moments(i["x"]), o["moments"]) <= TOL
        mean, std = vae.posterior(i["x"])
        assert rel_l2(mean, o["posterior_mean"]) <= TOL and rel_l2(std, o["posterior_std"]) <= TOL
        assert rel_l2(mean + std * i["posterior_noise"], o["posterior_sample"]) <= TOL
        assert rel_l2(vae.decode(o["posterior_mean"]), o["decoded"]) <= TOL


def test_schedule_facts():
    assert uniform_trailing_timesteps(1) == [1000.0]
    x, v = torch.randn(4), torch.randn(4)
    assert torch.equal(v_lerp_to_x0(x, v, 1000.0), x - v)


@pytest.mark.parametrize("side", ["reference", "optimized"])
def test_restoration_matches_golden(side):
    d, _, i, o = load_case("pipeline_3b_tiny")
    dit_state, vae_state = canonical(upstream_weights(d)), upstream_weights(d, "upstream_vae_weights.pth")
    args = (i["lq_video"], i["txt_pos"], i["noise"], i["vae_posterior_noise"])
    if side == "reference":
        r = restore(load_nadit(load_variant("tiny-3b"), dit_state), load_vae(load_vae_variant("tiny"), vae_state), *args)
        cond = o["cond_latent"]  # the DiT input upstream built: [noise | cond_latent | 1] (not stored: derivable)
        want_vid = torch.cat([i["noise"], cond, torch.ones(*cond.shape[:-1], 1)], -1).reshape(r.dit_vid.shape)
        assert rel_l2(r.dit_vid, want_vid) <= TOL
    else:
        r = RestorationLoop(load_fast_nadit(load_variant("tiny-3b"), dit_state),
                            load_fast_vae(load_vae_variant("tiny"), vae_state)).generate(*args)
    for name in ("cond_latent", "dit_vid_sample", "x0_latent", "decoded"):
        assert rel_l2(getattr(r, name), o[name]) <= TOL, name
    diff = (r.output_uint8.int() - o["output_uint8"].int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3  # off-by-one only at rounding ties
