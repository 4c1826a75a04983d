"""The Wan denoise LoopKernel (`wan.denoise`) and the shared optimized solvers.

Upstream-marked: the loop driven by the WorkUnitScheduler reproduces diffusers 0.42.1 WanPipeline /
WanImageToVideoPipeline latents (output_type="latent", tiny components sharing one set of canonical weights, the
prompts through the pipeline's own `_get_t5_prompt_embeds` on transformers UMT5 via an ids tokenizer stub) for
t2v UniPC + CFG, Euler without CFG, two experts, i2v (image branch) and ti2v; the functional Euler / UniPC states
reproduce diffusers' schedulers. Always run: batching across requests changes nothing, a prompt shared by K
requests is encoded once, and an expert switched one step late is caught.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from manifests.solvers import FlowMatchEulerConfig, UniPCConfig
from manifests.wan import WanGenerateRequest, load_model_variant
from optimized.models.wan import denoise
from optimized.models.wan.denoise import WanDenoiseJob, WanDenoiseLoop
from optimized.models.wan.instance import WanModelInstance
from optimized.runtime.scheduler import RequestRejected, WorkUnitScheduler
from optimized.solvers import euler, unipc

REL_L2 = 1e-5
_INSTANCES: dict[tuple[str, int], tuple] = {}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def model(variant: str, seed: int = 0):
    """(cfg, canonical weights, WanModelInstance), built once per test session."""
    if (variant, seed) not in _INSTANCES:
        cfg = load_model_variant(variant)
        weights = WanModelInstance.random_weights(cfg, seed)
        _INSTANCES[variant, seed] = cfg, weights, WanModelInstance(cfg, weights, weights_version=f"t:{variant}:{seed}")
    return _INSTANCES[variant, seed]


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed))


def make_request(cfg, **kw) -> WanGenerateRequest:
    s = cfg.vae.spatial_compression * 2
    base = dict(text_ids=ids(7, 1), negative_text_ids=ids(4, 2), num_frames=5, height=2 * s, width=2 * s,
                num_steps=3, guidance_scale=5.0, seed=7)
    g = torch.Generator().manual_seed(3)
    if cfg.task in ("i2v", "ti2v") and kw.get("image", True) is not None:
        base["image"] = torch.rand(3, kw.get("height", base["height"]), kw.get("width", base["width"]),
                                   generator=g) * 2 - 1
    if cfg.dit.has_image_branch:
        base["image_embeds"] = torch.randn(5, cfg.dit.image_dim, generator=g)
    base.update(kw)
    return WanGenerateRequest(**base)


def run_scheduled(loop: WanDenoiseLoop, requests: list, start_ticks: list[int] | None = None,
                  record_trajectory: bool = False, batch_sizes: list[int] | None = None) -> list[dict]:
    """Submit request i at scheduler tick start_ticks[i]; run until idle; results in submission order. The batch
    size of every step run is appended to `batch_sizes` when given."""
    sched = WorkUnitScheduler()
    start_ticks = start_ticks or [0] * len(requests)
    handles: dict[int, object] = {}
    if batch_sizes is not None:
        sched.bus.subscribe(lambda ev: batch_sizes.append(ev.data["batch_size"]), "trace.step")
    while len(handles) < len(requests) or not sched.idle:
        for i, r in enumerate(requests):
            if i not in handles and start_ticks[i] <= sched.tick_count:
                handles[i] = sched.submit(loop, WanDenoiseJob(r, record_trajectory))
        sched.tick()
    for rec in handles.values():
        assert rec.status == "completed", rec.error
    return [handles[i].result for i in range(len(requests))]


# ------------------------------------------------------------------------------------------------ upstream

class IdsTokenizer:
    """Stands in for the UMT5 tokenizer: prompt strings -> stored ids, padded to max_length as the real one pads."""

    def __init__(self, table: dict[str, torch.Tensor]):
        self.table = table

    def __call__(self, prompts, padding, max_length, truncation, add_special_tokens, return_attention_mask,
                 return_tensors):
        out_ids = torch.zeros(len(prompts), max_length, dtype=torch.int64)
        mask = torch.zeros(len(prompts), max_length, dtype=torch.int64)
        for row, p in enumerate(prompts):
            t = self.table[p][:max_length]
            out_ids[row, :len(t)], mask[row, :len(t)] = t, 1
        return SimpleNamespace(input_ids=out_ids, attention_mask=mask)


class StoredImageEncoder(torch.nn.Module):
    """Stands in for CLIP: `hidden_states[-2]` is the request's image_embeds (upstream refuses image + image_embeds)."""

    def __init__(self, image_embeds: torch.Tensor):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.embeds = image_embeds
        self.device, self.dtype = torch.device("cpu"), torch.float32  # read by DiffusionPipeline.device / dtype

    def forward(self, pixel_values, output_hidden_states):
        return SimpleNamespace(hidden_states=(self.embeds[None], None))


def upstream_components(cfg, weights):
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    def dit(c, state):
        d = dict(c.to_diffusers_config())
        d.pop("_class_name", None)
        m = WanTransformer3DModel(**d).eval()
        m.load_state_dict(state, strict=True)
        return m

    comps = {"transformer": dit(cfg.dit, weights["transformer"])}
    if cfg.dit_2 is not None:
        comps["transformer_2"] = dit(cfg.dit_2, weights["transformer_2"])
    te = UMT5EncoderModel(UMT5Config(**cfg.text_encoder.to_transformers_config())).eval()
    missing, unexpected = te.load_state_dict(weights["text_encoder"], strict=False)
    assert set(missing) <= {"encoder.embed_tokens.weight"} and not unexpected  # tied to shared.weight
    comps["text_encoder"] = te
    vd = dict(cfg.vae.to_diffusers_config())
    vd.pop("_class_name", None)
    vae = AutoencoderKLWan(**vd).eval()
    vae.load_state_dict(weights["vae"], strict=True)
    comps["vae"] = vae
    return comps


def upstream_scheduler(cfg, solver: str, shift: float):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
    if solver == "unipc":  # the Wan release scheduler config
        return UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=shift,
                                       num_train_timesteps=cfg.num_train_timesteps)
    return FlowMatchEulerDiscreteScheduler(shift=shift, num_train_timesteps=cfg.num_train_timesteps)


def run_upstream(cfg, weights, req: WanGenerateRequest) -> torch.Tensor:
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from diffusers.pipelines.wan import pipeline_wan_i2v
    if not hasattr(pipeline_wan_i2v, "ftfy"):  # i2v's basic_clean calls ftfy unguarded (upstream); identity on ASCII
        pipeline_wan_i2v.ftfy = SimpleNamespace(fix_text=lambda text: text)
    comps = upstream_components(cfg, weights)
    table = {"cond": req.text_ids}
    if req.negative_text_ids is not None:
        table["uncond"] = req.negative_text_ids
    solver = req.solver or cfg.solver
    shift = req.flow_shift if req.flow_shift is not None else cfg.flow_shift
    kw = dict(tokenizer=IdsTokenizer(table), text_encoder=comps["text_encoder"], vae=comps["vae"],
              scheduler=upstream_scheduler(cfg, solver, shift), transformer=comps["transformer"],
              transformer_2=comps.get("transformer_2"), boundary_ratio=cfg.boundary_ratio,
              expand_timesteps=cfg.expand_timesteps)
    pipe = (WanImageToVideoPipeline if req.image is not None else WanPipeline)(**kw)
    args = dict(prompt="cond", negative_prompt="uncond" if "uncond" in table else None, height=req.height,
                width=req.width, num_frames=req.num_frames, num_inference_steps=req.num_steps,
                guidance_scale=req.guidance_scale, guidance_scale_2=req.guidance_scale_2,
                generator=torch.Generator().manual_seed(req.seed), output_type="latent",
                max_sequence_length=cfg.max_sequence_length)
    if req.image is not None:
        args["image"] = req.image[None]  # a [-1, 1] tensor: preprocess keeps it (no resize, no normalise)
        if req.image_embeds is not None:
            pipe.image_encoder = StoredImageEncoder(req.image_embeds)
            pipe.image_processor = lambda images, return_tensors: SimpleNamespace(
                to=lambda device: {"pixel_values": images})
    with torch.no_grad():
        return pipe(**args).frames


UPSTREAM_CASES = {
    "t2v-unipc-cfg": ("tiny-2.1-t2v", dict(guidance_scale=5.0, num_steps=3)),
    "t2v-euler-no-cfg": ("tiny-2.1-t2v", dict(solver="euler", flow_shift=5.0, guidance_scale=1.0, num_steps=4,
                                              num_frames=9, height=16, negative_text_ids=None)),
    "two-experts": ("tiny-2.2-t2v-a14b", dict(guidance_scale=4.0, guidance_scale_2=2.5, num_steps=4)),
    "i2v": ("tiny-2.1-i2v", dict(guidance_scale=5.0, num_steps=3)),
    "ti2v-image": ("tiny-2.2-ti2v", dict(guidance_scale=5.0, num_steps=3)),
    "ti2v-text": ("tiny-2.2-ti2v", dict(guidance_scale=3.0, num_steps=3, solver="euler", image=None)),
}


@pytest.mark.upstream
@pytest.mark.parametrize("case", sorted(UPSTREAM_CASES))
def test_scheduled_loop_matches_diffusers_pipeline(case):
    pytest.importorskip("diffusers")
    variant, kw = UPSTREAM_CASES[case]
    cfg, weights, inst = model(variant)
    req = make_request(cfg, **kw)
    (ours,) = run_scheduled(WanDenoiseLoop(inst), [req])
    theirs = run_upstream(cfg, weights, req)
    got = ours["latents"]["vision"]
    assert got.shape == theirs.shape and got.dtype == torch.float32
    assert rel_l2(got, theirs) < REL_L2, (case, rel_l2(got, theirs))
    if cfg.two_experts:
        assert ours["experts"] == [1, 1, 2, 2]  # t = 999, 900 | 750, 500 against the boundary 875


@pytest.mark.upstream
@pytest.mark.parametrize("steps, shift", [(1, 1.0), (4, 3.0), (7, 5.0), (30, 5.0)])
def test_euler_state_matches_diffusers(steps, shift):
    pytest.importorskip("diffusers")
    from diffusers import FlowMatchEulerDiscreteScheduler
    ref = FlowMatchEulerDiscreteScheduler(shift=shift)
    ref.set_timesteps(steps)
    ref.set_begin_index(0)
    state, timesteps = euler.new_euler_state(FlowMatchEulerConfig(shift=shift), steps)
    assert torch.equal(timesteps, ref.timesteps) and torch.equal(state.sigmas, ref.sigmas)
    g = torch.Generator().manual_seed(steps)
    x_ref = x = torch.randn(1, 4, 2, 3, 3, generator=g)
    for t in ref.timesteps:
        v = torch.randn(x.shape, generator=g)
        x_ref = ref.step(v, t, x_ref, return_dict=False)[0]
        state, x = euler.euler_step(state, v, x)
        assert torch.equal(x, x_ref)
    v16 = torch.randn(x.shape, generator=g).to(torch.bfloat16)  # (upstream) the result takes the velocity's dtype
    state, _ = euler.new_euler_state(FlowMatchEulerConfig(shift=shift), steps)
    assert euler.euler_step(state, v16, x)[1].dtype == torch.bfloat16


@pytest.mark.upstream
@pytest.mark.parametrize("steps, shift", [(3, 3.0), (6, 5.0), (20, 3.0)])
def test_unipc_state_matches_diffusers(steps, shift):
    pytest.importorskip("diffusers")
    from diffusers import UniPCMultistepScheduler
    ref = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=shift)
    ref.set_timesteps(steps)
    state, timesteps = unipc.new_state(UniPCConfig(flow_shift=shift), steps)
    assert torch.equal(timesteps, ref.timesteps) and torch.equal(state.sigmas, ref.sigmas)
    g = torch.Generator().manual_seed(steps)
    x_ref = x = torch.randn(1, 4, 2, 3, 3, generator=g)
    for t in ref.timesteps:
        v = torch.randn(x.shape, generator=g)
        x_ref = ref.step(v, t, x_ref, return_dict=False)[0]
        state, x = unipc.unipc_step(state, v, x)
        assert rel_l2(x, x_ref) < 1e-6


# ------------------------------------------------------------------------------------------------ always run

def test_concurrent_requests_batched_equal_each_alone():
    """Different seeds, guidance (one without CFG), solvers and start ticks: batched = alone, and they batch."""
    cfg, _, inst = model("tiny-2.2-t2v-a14b")
    loop = WanDenoiseLoop(inst)
    reqs = [make_request(cfg, seed=1, guidance_scale=5.0, num_steps=4),
            make_request(cfg, seed=2, guidance_scale=1.0, guidance_scale_2=3.0, num_steps=4, solver="euler"),
            make_request(cfg, seed=3, guidance_scale=3.5, guidance_scale_2=2.0, num_steps=5, text_ids=ids(5, 9))]
    batch_sizes: list[int] = []
    together = run_scheduled(loop, reqs, start_ticks=[0, 0, 1], record_trajectory=True, batch_sizes=batch_sizes)
    assert max(batch_sizes) == 3  # requests at different step indices, seeds, guidance and solvers shared forwards
    for req, got in zip(reqs, together):
        (alone,) = run_scheduled(loop, [req], record_trajectory=True)
        assert got["timesteps"] == alone["timesteps"] and got["experts"] == alone["experts"]
        assert rel_l2(got["latents"]["vision"], alone["latents"]["vision"]) < 1e-6
        assert len(got["trajectory"]) == req.num_steps and torch.equal(got["initial"], alone["initial"])
    assert rel_l2(together[0]["latents"]["vision"], together[1]["latents"]["vision"]) > 1e-2


def test_batch_key_groups_across_steps_and_guidance_but_not_experts():
    cfg, _, inst = model("tiny-2.2-t2v-a14b")
    loop = WanDenoiseLoop(inst)
    a = loop.init_state(make_request(cfg, seed=1, num_steps=4))
    b = loop.init_state(make_request(cfg, seed=2, num_steps=4, guidance_scale=2.0))
    (a1,) = loop.run_step([a], [loop.plan_step(a)])
    assert loop.plan_step(a1).batch_key == loop.plan_step(b).batch_key  # step 1 vs step 0, both expert 1
    assert loop.plan_step(a1) == loop.plan_step(a1)  # pure
    late = replace(a1, step=2)
    assert loop.plan_step(late).batch_key != loop.plan_step(b).batch_key  # expert 2 vs expert 1


def test_text_cache_encodes_a_shared_prompt_once():
    cfg, weights, _ = model("tiny-2.1-t2v")
    inst = WanModelInstance(cfg, weights, weights_version="fresh-cache")
    loop = WanDenoiseLoop(inst)
    reqs = [make_request(cfg, seed=s, num_steps=2) for s in range(4)]  # one prompt, one negative prompt, K = 4
    results = run_scheduled(loop, reqs)
    assert inst.text_encoder.stats.prompts_encoded == 2
    assert inst.text_encoder.stats.cache_hits == 6
    assert rel_l2(results[0]["latents"]["vision"], results[1]["latents"]["vision"]) > 1e-2  # seeds differ


def test_expert_switched_one_step_late_differs(monkeypatch):
    cfg, _, inst = model("tiny-2.2-t2v-a14b")
    req = make_request(cfg, num_steps=4, guidance_scale=4.0, guidance_scale_2=2.5)
    (good,) = run_scheduled(WanDenoiseLoop(inst), [req])
    original = denoise.expert_schedule
    monkeypatch.setattr(denoise, "expert_schedule",
                        lambda c, ts: (lambda e: (e[0],) + e[:-1])(original(c, ts)))  # 1,1,1,2
    (late,) = run_scheduled(WanDenoiseLoop(inst), [req])
    assert late["experts"] == [1, 1, 1, 2] and good["experts"] == [1, 1, 2, 2]
    assert rel_l2(late["latents"]["vision"], good["latents"]["vision"]) > 1e-3


def test_invalid_requests_refused_with_the_manifest_message():
    cfg, _, inst = model("tiny-2.1-t2v")
    sched = WorkUnitScheduler()
    with pytest.raises(RequestRejected, match="negative_text_ids"):
        sched.submit(WanDenoiseLoop(inst), make_request(cfg, negative_text_ids=None))
    with pytest.raises(RequestRejected, match="guidance_scale_2"):
        sched.submit(WanDenoiseLoop(inst), make_request(cfg, guidance_scale_2=2.0))
    with pytest.raises(RequestRejected, match="identity CFG policy"):
        sched.submit(WanDenoiseLoop(inst, cfg_policy="identity"), make_request(cfg))
    assert sched.idle


def test_cfg_policies_agree():
    cfg, _, inst = model("tiny-2.1-t2v")
    req = make_request(cfg, num_steps=2)
    (batched,) = run_scheduled(WanDenoiseLoop(inst, "batched"), [req])
    (two,) = run_scheduled(WanDenoiseLoop(inst, "two-forward"), [req])
    assert rel_l2(batched["latents"]["vision"], two["latents"]["vision"]) < 1e-6


def test_bf16_run_keeps_fp32_latents_close_to_fp32():
    """bf16 DiT: CFG combined in bf16, Euler rounds each step to bf16 (upstream); latents come back fp32."""
    cfg, weights, inst = model("tiny-2.1-t2v")
    half = WanModelInstance(cfg, weights, dtype=torch.bfloat16, weights_version="bf16")
    for solver in ("euler", "unipc"):
        req = make_request(cfg, num_steps=3, solver=solver)
        (lo,) = run_scheduled(WanDenoiseLoop(half), [req])
        (hi,) = run_scheduled(WanDenoiseLoop(inst), [req])
        x = lo["latents"]["vision"]
        assert x.dtype == torch.float32 and x.isfinite().all()
        assert 1e-5 < rel_l2(x, hi["latents"]["vision"]) < 5e-2
