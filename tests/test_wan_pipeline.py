"""The readable Wan reference pipeline (reference/wan/pipeline.py) against the committed upstream pipeline goldens
golden/wan/pipe_* (diffusers 0.42.1 WanPipeline / WanImageToVideoPipeline, probe "wan.generate"), plus negative
controls that must fail the same comparison, and one upstream-only run (ti2v without an image)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from manifests.wan.model import WanModelConfig, load_model_variant
from manifests.wan.sampling import WanGenerateRequest
from reference.wan.pipeline import WanReferencePipeline

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden" / "wan"
CASES = ["pipe_t2v", "pipe_euler", "pipe_a14b", "pipe_i2v", "pipe_ti2v"]
COMPONENTS = ("transformer", "transformer_2", "text_encoder", "vae")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def load_case(name: str):
    d = GOLDEN / name
    meta = json.loads((d / "case.json").read_text())
    cfg = WanModelConfig.from_dict(meta["params"]["model_config"])
    weights = {}
    for comp in COMPONENTS:
        files = sorted((d / "upstream" / comp).glob("*.safetensors"))
        if files:
            state = load_file(files[0])
            state.pop("encoder.embed_tokens.weight", None)  # transformers' tied duplicate of shared.weight
            weights[comp] = state
    return meta, cfg, weights, load_file(d / "inputs.safetensors"), load_file(d / "outputs.safetensors")


def request_of(meta: dict, inp: dict) -> WanGenerateRequest:
    P = meta["params"]
    return WanGenerateRequest(
        text_ids=inp["text_ids"], negative_text_ids=inp["negative_text_ids"], num_frames=P["num_frames"],
        height=P["height"], width=P["width"], num_steps=P["num_inference_steps"], guidance_scale=P["guidance_scale"],
        guidance_scale_2=P["guidance_scale_2"], seed=P["seed"], solver=P["solver"], flow_shift=P["flow_shift"],
        image=inp.get("image"), image_embeds=inp.get("image_embeds"))


def final_error(pipe: WanReferencePipeline, request: WanGenerateRequest, want: dict) -> float:
    return rel_l2(pipe.generate(request).latents, want["latents"])


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", CASES)
def test_reference_pipeline_matches_golden(name):
    meta, cfg, weights, inp, want = load_case(name)
    assert meta["probe"] == "wan.generate"
    tol = meta["tolerance"]["rel_l2"]
    pipe = WanReferencePipeline(cfg, weights)
    request = request_of(meta, inp)
    seen = []  # (expert, timestep) of every DiT call
    for expert, model in ((1, pipe.transformer), (2, pipe.transformer_2)):
        if model is not None:
            model.register_forward_pre_hook(lambda m, args, e=expert: seen.append((e, args[1].clone())))
    got = pipe.generate(request, keep_trajectory=True)

    per_step = 2 if request.uses_cfg else 1
    assert len(seen) == per_step * request.num_steps
    model_timesteps = torch.stack([t[0] for _, t in seen[::per_step]])
    assert model_timesteps.dtype == want["model_timesteps"].dtype  # int64 / float32 / float32 per token
    assert torch.equal(model_timesteps, want["model_timesteps"])
    assert [e for e, _ in seen[::per_step]] == want["experts"].tolist()
    assert torch.equal(got.initial, want["initial_latents"])  # randn(seed) on a CPU generator
    assert got.timesteps == want["timesteps"].tolist()
    assert torch.tensor(got.timesteps).dtype == want["timesteps"].dtype  # int64 (UniPC) / float32 (Euler)
    assert got.experts == want["experts"].tolist()
    assert len(got.trajectory) == len(want["trajectory"])
    for i, (a, b) in enumerate(zip(got.trajectory, want["trajectory"])):
        assert rel_l2(a, b) <= tol, f"{name}: step {i} rel_l2 {rel_l2(a, b):.2e}"
    assert rel_l2(got.latents, want["latents"]) <= tol

    cond, uncond = pipe.encode_text(request)
    n = len(inp["text_ids"])
    assert cond.shape == (1, cfg.max_sequence_length, cfg.text_encoder.d_model) and not cond[0, n:].any()
    assert rel_l2(cond[0, :n], want["text_embeds"]) <= tol
    assert (uncond is None) == ("negative_text_embeds" not in want)
    if uncond is not None:
        assert rel_l2(uncond[0, :len(inp["negative_text_ids"])], want["negative_text_embeds"]) <= tol
    if "model_input_0" in want:  # i2v / ti2v: the condition the DiT sees at step 0
        condition = pipe.encode_condition(request, tuple(got.initial.shape))
        x0, _ = pipe.model_inputs(got.initial, torch.tensor(got.timesteps[0]), condition)
        assert rel_l2(x0, want["model_input_0"]) <= tol
    if "video" in want:
        assert rel_l2(pipe.decode(got.latents), want["video"]) <= tol


def test_expert_switched_one_step_late_fails():
    """Negative control: moving the A14B boundary so that the switch happens one step later must be caught."""
    meta, cfg, weights, inp, want = load_case("pipe_a14b")
    request = request_of(meta, inp)
    late = WanReferencePipeline(dataclasses.replace(cfg, boundary_ratio=0.7), weights)
    got = late.generate(request)
    assert want["experts"].tolist() == [1, 1, 2, 2] and got.experts == [1, 1, 1, 2]
    assert rel_l2(got.latents, want["latents"]) > 100 * meta["tolerance"]["rel_l2"]


def test_guidance_scale_2_ignored_fails():
    meta, cfg, weights, inp, want = load_case("pipe_a14b")
    request = dataclasses.replace(request_of(meta, inp), guidance_scale_2=None)
    assert final_error(WanReferencePipeline(cfg, weights), request, want) > 100 * meta["tolerance"]["rel_l2"]


def test_ti2v_without_frame0_blend_fails():
    """Negative control: ti2v must hand the DiT the image latents on frame 0 (and return them there)."""
    meta, cfg, weights, inp, want = load_case("pipe_ti2v")
    pipe = WanReferencePipeline(cfg, weights)
    request = request_of(meta, inp)
    original = pipe.model_inputs

    def no_blend(latents, t, condition):
        x, timestep = original(latents, t, condition)
        return latents, timestep  # noisy frame 0 instead of the image latents

    pipe.model_inputs = no_blend
    assert final_error(pipe, request, want) > 100 * meta["tolerance"]["rel_l2"]


def test_no_uncond_pass_at_guidance_one():
    """guidance 1.0 runs the DiT once per step (upstream `guidance_scale > 1`); 1.5 runs it twice."""
    meta, cfg, weights, inp, want = load_case("pipe_euler")
    pipe = WanReferencePipeline(cfg, weights)
    calls = []
    forward = pipe.transformer.forward
    pipe.transformer.forward = lambda *a, **k: (calls.append(a[2]), forward(*a, **k))[1]
    request = request_of(meta, inp)
    pipe.generate(request)
    assert len(calls) == request.num_steps
    calls.clear()
    pipe.generate(dataclasses.replace(request, guidance_scale=1.5))
    assert len(calls) == 2 * request.num_steps


def test_explicit_noise_and_seed_agree():
    meta, cfg, weights, inp, want = load_case("pipe_t2v")
    pipe = WanReferencePipeline(cfg, weights)
    request = dataclasses.replace(request_of(meta, inp), seed=None, noise=want["initial_latents"].double())
    assert rel_l2(pipe.generate(request).latents, want["latents"]) <= meta["tolerance"]["rel_l2"]
    other = dataclasses.replace(request_of(meta, inp), seed=meta["params"]["seed"] + 1)
    assert rel_l2(pipe.generate(other).latents, want["latents"]) > 1e-2


@pytest.mark.upstream
def test_ti2v_without_image_matches_diffusers():
    """WanPipeline with expand_timesteps and no image (all-ones mask, uniform per-token timesteps), built on the fly
    with the golden maker's recipe (no committed case)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tools"))
    import make_wan_pipeline_goldens as maker
    torch.use_deterministic_algorithms(True)
    try:
        case = dict(variant="tiny-2.2-ti2v", seed=9201, solver="euler", flow_shift=5.0, num_frames=5, height=32,
                    width=64, steps=3, guidance=2.0, guidance_2=None, text_len=5, negative_len=3)
        cfg = load_model_variant(case["variant"])
        comps = maker.build_components(cfg, case["seed"])
        inp = maker.make_inputs(case, cfg)
        want = maker.outputs_of(case, cfg, comps, inp)
    finally:
        torch.use_deterministic_algorithms(False)
    weights = {k: {n: t.detach().clone() for n, t in m.state_dict().items()} for k, m in comps.items()}
    weights["text_encoder"].pop("encoder.embed_tokens.weight", None)
    meta = {"params": {"num_frames": 5, "height": 32, "width": 64, "num_inference_steps": 3, "guidance_scale": 2.0,
                       "guidance_scale_2": None, "seed": case["seed"], "solver": "euler", "flow_shift": 5.0}}
    got = WanReferencePipeline(cfg, weights).generate(request_of(meta, inp), keep_trajectory=True)
    assert want["model_timesteps"].shape == (3, 2 * 1 * 2) and want["model_timesteps"].dtype == torch.float32
    assert got.timesteps == want["timesteps"].tolist() and got.experts == [1, 1, 1]
    assert rel_l2(got.latents, want["latents"]) <= 1e-5
