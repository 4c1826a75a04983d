"""golden/wan/lora_*: diffusers 0.42.1 WanPipeline with a diffusers-format LoRA (load_lora_weights, set_adapters /
fuse_lora; tools/make_lora_goldens.py) against the engine (the LoRA file loaded as is, per request or merged) and
the reference (merge-then-run), plus the alpha / r fault failing the same comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from manifests.lora import LoraRef
from manifests.lora_files import load_adapter
from manifests.wan.model import WanModelConfig
from manifests.wan.sampling import WanGenerateRequest
from optimized.engine import Engine
from parity.lora_checks import planted
from reference.wan.lora import merge_lora
from reference.wan.pipeline import WanReferencePipeline

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "wan"
CASES = ["lora_t2v", "lora_t2v_fused"]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def load_case(name: str):
    d = GOLDEN / name
    meta = json.loads((d / "case.json").read_text())
    base = GOLDEN / meta["base_case"]
    P = json.loads((base / "case.json").read_text())["params"]
    cfg = WanModelConfig.from_dict(P["model_config"])
    weights = {}
    for comp in ("transformer", "text_encoder", "vae"):
        state = load_file(sorted((base / "upstream" / comp).glob("*.safetensors"))[0])
        state.pop("encoder.embed_tokens.weight", None)   # transformers' tied duplicate of shared.weight
        weights[comp] = state
    inp = load_file(base / "inputs.safetensors")
    request = WanGenerateRequest(
        text_ids=inp["text_ids"], negative_text_ids=inp["negative_text_ids"], num_frames=P["num_frames"],
        height=P["height"], width=P["width"], num_steps=P["num_inference_steps"], guidance_scale=P["guidance_scale"],
        seed=P["seed"], solver=P["solver"], flow_shift=P["flow_shift"])
    base_latents = load_file(base / "outputs.safetensors")["latents"]
    return meta, cfg, weights, request, load_file(d / "outputs.safetensors")["latents"], base_latents, d


def engine_latents(meta, cfg, weights, request, d) -> torch.Tensor:
    P = meta["params"]
    engine = Engine.from_weights(cfg, weights)
    engine.loras.load(P["adapter_name"], d / P["lora_file"])
    if P["fused"]:
        engine.loras.merge(P["adapter_name"], P["scale"])
        return engine.generate(request)["latents"]["vision"]
    from dataclasses import replace
    return engine.generate(replace(request, lora=(LoraRef(P["adapter_name"], P["scale"]),)))["latents"]["vision"]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", CASES)
def test_lora_golden_both_sides(name):
    meta, cfg, weights, request, want, base_latents, d = load_case(name)
    tol = meta["tolerance"]["rel_l2"]
    assert rel_l2(base_latents, want) > 100 * tol   # the LoRA changes the result: the case pins something
    got = engine_latents(meta, cfg, weights, request, d)
    assert rel_l2(got, want) <= tol, rel_l2(got, want)
    P = meta["params"]
    adapter = load_adapter(d / P["lora_file"], "wan", cfg)
    assert adapter.source_format == "diffusers" and {p.alpha for p in adapter.targets["transformer"].values()} == {8.0}
    ref = WanReferencePipeline(cfg, merge_lora(weights, [(adapter, P["scale"])])).generate(request).latents
    assert rel_l2(ref, want) <= tol, rel_l2(ref, want)


def test_lora_golden_fails_with_alpha_scaling_off():
    meta, cfg, weights, request, want, _, d = load_case("lora_t2v")
    with planted("lora-scale-off"):
        got = engine_latents(meta, cfg, weights, request, d)
    assert rel_l2(got, want) > 100 * meta["tolerance"]["rel_l2"]
