"""Logic both sides share (manifests/) checked against upstream directly: a bug there makes the reference and the
optimized side agree with each other, so no parity level can see it; only upstream can.

- `uses_cfg` of the cosmos3 and Wan requests vs the pipelines' own `do_classifier_free_guidance` (cosmos3:
  `!= 1`, Wan: `> 1`), over guidance values on both sides of 1;
- the Wan VAE's stage dims (`encoder_dims` / `decoder_dims`, which size both sides' VAEs) vs the channels of an
  `AutoencoderKLWan` built from `to_diffusers_config()` (meta device: no weights), every variant;
- UniPC's schedule fields (`manifests/solvers.py:UniPCConfig`) are exactly the knobs upstream's scheduler takes;
- two experts: which expert runs each step (each side's boundary rule, timesteps on / next to the boundary, int and
  float) and which guidance it applies (the shared `uses_cfg` / `guidance_for_expert`), read from
  `WanPipeline.__call__` run on stand-in transformers and a stand-in scheduler, for every two-expert variant and
  two other boundary ratios; the boundary's `num_train_timesteps` is the schedulers'.
(SDE windows have no upstream implementation to compare with.)
"""

from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace

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


# ------------------------------------------------------------------------------------------------
# Two experts: which expert runs each step and which guidance it applies, read from WanPipeline.__call__ itself
# ------------------------------------------------------------------------------------------------

class _Expert(torch.nn.Module):
    """A transformer stand-in: predicts the mean of its text context everywhere (the cond embeddings are 1, the
    negative ones 0), so the prediction the pipeline hands its scheduler is the guidance it applied (1 without
    CFG); records (expert, timestep) per call."""

    def __init__(self, expert: int, calls: list):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the pipeline a device
        self.expert, self.calls = expert, calls
        self.config = SimpleNamespace(patch_size=(1, 2, 2), in_channels=4)

    dtype, device = torch.float32, torch.device("cpu")   # read by the pipeline (DiffusionPipeline.device)

    def cache_context(self, *args, **kwargs):
        return contextlib.nullcontext()

    def forward(self, hidden_states, timestep, encoder_hidden_states, attention_kwargs=None, return_dict=False):
        self.calls.append((self.expert, timestep.clone()))
        return (torch.full_like(hidden_states, float(encoder_hidden_states.mean())),)


class _GivenTimesteps:
    """A scheduler stand-in with the given timesteps: records each step's model output and leaves the sample as is."""
    order = 1

    def __init__(self, timesteps: torch.Tensor, num_train_timesteps: int):
        self._timesteps, self.applied = timesteps, []
        self.config = SimpleNamespace(num_train_timesteps=num_train_timesteps)

    def set_timesteps(self, n, device=None):
        assert n == len(self._timesteps)
        self.timesteps, self.sigmas = self._timesteps, torch.zeros(n + 1)

    def set_begin_index(self, index):
        pass

    def step(self, model_output, t, sample, return_dict=False):
        self.applied.append(float(model_output.flatten()[0]))
        return (sample,)


def _upstream_steps(boundary_ratio: float, timesteps: torch.Tensor, g: float, g2: float | None):
    """WanPipeline.__call__ (two experts) on stand-ins: per step (expert of the cond call, number of calls, the
    guidance applied)."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    calls: list = []
    sched = _GivenTimesteps(timesteps, UniPCMultistepScheduler().config.num_train_timesteps)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=sched, transformer=_Expert(1, calls),
                       transformer_2=_Expert(2, calls), boundary_ratio=boundary_ratio)
    pipe.set_progress_bar_config(disable=True)
    pipe(prompt_embeds=torch.ones(1, 3, 8), negative_prompt_embeds=torch.zeros(1, 3, 8), height=16, width=16,
         num_frames=5, num_inference_steps=len(timesteps), guidance_scale=g, guidance_scale_2=g2,
         output_type="latent")
    per_step = len(calls) // len(timesteps)
    assert per_step * len(timesteps) == len(calls)
    return [(calls[i * per_step][0], per_step, sched.applied[i]) for i in range(len(timesteps))]


def _two_expert_configs():
    from manifests.wan.model import WanModelConfig, list_model_variants, load_model_variant

    out = [(name, load_model_variant(name)) for name in list_model_variants() if load_model_variant(name).two_experts]
    base = load_model_variant("tiny-2.2-t2v-a14b")
    out += [(f"boundary {r}", WanModelConfig.from_dict({**base.to_dict(), "boundary_ratio": r})) for r in (0.5, 0.9)]
    return out


GUIDANCE_PAIRS = ((4.0, 2.5), (2.0, 6.0), (3.0, None), (1.0, 4.0), (0.5, 3.0), (5.0, 1.0))


@pytest.mark.parametrize("timestep_dtype", (torch.int64, torch.float32))
def test_wan_experts_and_their_guidance_are_upstreams(timestep_dtype):
    """For every two-expert variant and two other boundary ratios, timesteps on the boundary, one below it (int:
    by 1; float: by 1/16) and one above: each side's expert choice and the shared request's `uses_cfg` /
    `guidance_for_expert` give what WanPipeline does at every step, for six guidance pairs (guidance_2 larger,
    smaller, None, and guidance_scale <= 1 with guidance_2 > 1: upstream then runs no CFG at all)."""
    pytest.importorskip("diffusers")
    from manifests.wan.sampling import WanGenerateRequest
    from optimized.models.wan.denoise import expert_schedule
    from reference.wan.pipeline import WanReferencePipeline

    for name, cfg in _two_expert_configs():
        b = cfg.boundary_ratio * cfg.num_train_timesteps
        below = b - 1 if timestep_dtype == torch.int64 else b - 0.0625
        above = b + 1 if timestep_dtype == torch.int64 else b + 0.25
        ts = torch.tensor([999, above, b, below, 1], dtype=timestep_dtype)
        for g, g2 in GUIDANCE_PAIRS:
            steps = _upstream_steps(cfg.boundary_ratio, ts, g, g2)
            req = WanGenerateRequest(text_ids=torch.tensor([1]), negative_text_ids=torch.tensor([2]), num_frames=5,
                                     height=16, width=16, guidance_scale=g, guidance_scale_2=g2)
            ours = expert_schedule(cfg, ts)
            for i, (expert, n_calls, applied) in enumerate(steps):
                where = f"{name}, t {ts[i].item()}, guidance {g} / {g2}"
                assert WanReferencePipeline.expert_at(SimpleNamespace(cfg=cfg), ts[i]) == expert, where
                assert ours[i] == expert, where
                assert req.uses_cfg == (n_calls == 2), where
                assert (req.guidance_for_expert(expert) if req.uses_cfg else 1.0) == applied, where
            assert [e for e, _, _ in steps] == [1, 1, 1, 2, 2], name   # the case covers both sides of the boundary


def test_wan_boundary_reads_upstreams_train_timesteps():
    """Upstream's boundary is boundary_ratio * the scheduler's num_train_timesteps (1000 for both Wan schedulers):
    every variant's `num_train_timesteps`, which both sides multiply by, is that."""
    pytest.importorskip("diffusers")
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
    from manifests.wan.model import list_model_variants, load_model_variant

    upstream = {UniPCMultistepScheduler().config.num_train_timesteps,
                FlowMatchEulerDiscreteScheduler().config.num_train_timesteps}
    assert len(upstream) == 1
    for name in list_model_variants():
        assert load_model_variant(name).num_train_timesteps in upstream, name
