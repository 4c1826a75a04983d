"""Logic both sides share (manifests/) checked against upstream directly: a bug there makes the reference and the
optimized side agree with each other, so no parity level can see it; only upstream can.

- `uses_cfg` of the cosmos3 and Wan requests vs the pipelines' own `do_classifier_free_guidance` (cosmos3:
  `!= 1`, Wan: `> 1`), over guidance values on both sides of 1;
- the Wan VAE's stage dims (`encoder_dims` / `decoder_dims`, which size both sides' VAEs) vs the channels of an
  `AutoencoderKLWan` built from `to_diffusers_config()` (meta device: no weights), every variant;
- UniPC's schedule fields (`manifests/solvers.py:UniPCConfig`) are exactly the knobs upstream's scheduler takes.
(SDE windows have no upstream implementation to compare with.)
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytestmark = pytest.mark.upstream

GUIDANCE = (0.0, 0.25, 0.5, 0.999, 1.0, 1.001, 2.0, 6.0, -1.0)


def _cfg_flag(pipeline_cls, scale: float) -> bool:
    pipe = pipeline_cls.__new__(pipeline_cls)  # the property only reads _guidance_scale: no components needed
    pipe._guidance_scale = scale
    return bool(pipe.do_classifier_free_guidance)


@pytest.mark.parametrize("scale", GUIDANCE)
def test_cosmos3_uses_cfg_is_upstreams(scale):
    pytest.importorskip("diffusers")
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline
    from manifests.cosmos3.sampling import Cosmos3GenerateRequest

    req = Cosmos3GenerateRequest(text_ids=torch.tensor([1]), negative_text_ids=torch.tensor([2]), latent_frames=1,
                                 latent_height=2, latent_width=2, guidance_scale=scale)
    assert req.uses_cfg == _cfg_flag(Cosmos3OmniPipeline, scale)


@pytest.mark.parametrize("scale", GUIDANCE)
def test_wan_uses_cfg_is_upstreams(scale):
    pytest.importorskip("diffusers")
    from diffusers import WanPipeline
    from manifests.wan.sampling import WanGenerateRequest

    fields = inspect.signature(WanGenerateRequest).parameters
    kw = {n: p.default for n, p in fields.items() if p.default is not inspect.Parameter.empty}
    req = WanGenerateRequest(**{**{n: None for n in fields if n not in kw}, **kw, "guidance_scale": scale})
    assert req.uses_cfg == _cfg_flag(WanPipeline, scale)


def _collapse(xs: list[int]) -> list[int]:
    out: list[int] = []
    for x in xs:
        if not out or out[-1] != x:
            out.append(x)
    return out


def test_wan_vae_stage_dims_are_upstreams():
    pytest.importorskip("diffusers")
    from diffusers import AutoencoderKLWan
    from manifests.wan.config import list_variants, load_variant

    def stages(block) -> list[int]:  # conv_in, then every residual block's output channels, in module order
        outs = [m.conv2.out_channels for m in block.modules() if type(m).__name__ == "WanResidualBlock"]
        return _collapse([block.conv_in.out_channels] + outs)

    for name in list_variants():
        cfg = load_variant(name)
        with torch.device("meta"):
            vae = AutoencoderKLWan(**cfg.to_diffusers_config())
        assert stages(vae.encoder) == _collapse(cfg.encoder_dims()), name
        assert stages(vae.decoder) == _collapse(cfg.decoder_dims()), name


def test_unipc_config_fields_are_upstream_scheduler_knobs():
    pytest.importorskip("diffusers")
    from dataclasses import fields

    from diffusers import UniPCMultistepScheduler
    from manifests.solvers import UniPCConfig

    upstream = set(inspect.signature(UniPCMultistepScheduler.__init__).parameters)
    ours = {f.name for f in fields(UniPCConfig)} - {"use_native_flow_schedule"}  # a pipeline flag, not a scheduler's
    assert ours <= upstream, sorted(ours - upstream)
    defaults = {n: p.default for n, p in inspect.signature(UniPCMultistepScheduler.__init__).parameters.items()}
    for f in fields(UniPCConfig):
        if f.name in ("solver_order", "solver_type", "lower_order_final", "num_train_timesteps"):
            assert getattr(UniPCConfig(), f.name) == defaults[f.name], f.name
