"""LoRA: the converter's formats and refusals, per-row adapters in one batched step against their solo runs and
the reference's merge-then-run, merged == unmerged with the weights version the engine reports, hot load / unload,
and the planted faults (alpha / r off, wrong projection, stale prepared cache) caught and localised."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from converters.cli import main as fvconvert
from manifests.lora import LoraAdapter, LoraPair, LoraRef, parse_lora_field, parse_lora_spec
from manifests.lora_files import load_adapter
from manifests.errors import RequestFieldError
from manifests.wan.model import load_model_variant
from manifests.wan.sampling import WanGenerateRequest
from optimized.adapters import AdapterError
from optimized.engine import Engine, RequestRejected
from optimized.models.wan.instance import WanModelInstance
from parity.lora_checks import lora_parity

VARIANT = "tiny-2.1-t2v"
CFG = load_model_variant(VARIANT)
ORIGINAL = {"attn1.to_q": "self_attn.q", "attn1.to_v": "self_attn.v", "attn2.to_k": "cross_attn.k",
            "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def weights():
    return WanModelInstance.random_weights(CFG, 0)


def make_adapter(weights, seed: int, modules: list[str], alpha: float = 8.0, rank: int = 4) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    targets = {}
    for m in modules:
        out, inn = weights["transformer"][m + ".weight"].shape
        targets[m] = LoraPair(torch.randn(rank, inn, generator=g) * 0.3, torch.randn(out, rank, generator=g) * 0.3,
                              alpha)
    return LoraAdapter("wan", {"transformer": targets})


def request(seed: int = 3, lora=()) -> WanGenerateRequest:
    g = torch.Generator().manual_seed(5)
    return WanGenerateRequest(text_ids=torch.randint(1, 100, (7,), generator=g),
                              negative_text_ids=torch.randint(1, 100, (4,), generator=g), num_frames=5, height=32,
                              width=32, num_steps=3, seed=seed, lora=tuple(lora))


@pytest.fixture(scope="module")
def adapters(weights):
    return {"a": make_adapter(weights, 1, ["blocks.0.attn1.to_q", "blocks.0.attn1.to_v", "blocks.1.attn2.to_k",
                                           "blocks.1.ffn.net.0.proj", "proj_out"]),
            "b": make_adapter(weights, 2, ["blocks.0.attn2.to_out.0", "blocks.1.attn1.to_k", "blocks.0.ffn.net.2",
                                           "blocks.1.attn1.to_q"], alpha=2.0)}


MIXED = [request(lora=[LoraRef("a", 0.7)]), request(lora=[LoraRef("b", 1.3), LoraRef("a", -0.5)]), request()]


# ------------------------------------------------------------------ formats
def _deltas(adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    return {m: p.factor * (p.up @ p.down) for m, p in adapter.targets["transformer"].items()}


def test_formats_read_to_the_same_deltas(tmp_path, weights):
    """diffusers (alpha in save_lora_weights metadata), PEFT (adapter_config.json), original (lora_down / up and
    .alpha), kohya: one adapter, the same alpha / r * B @ A per layer."""
    ref = make_adapter(weights, 7, [f"blocks.{i}.{m}" for i in range(2) for m in ORIGINAL], alpha=2.0)
    diffusers, peft, original, kohya = {}, {}, {}, {}
    for mod, p in ref.targets["transformer"].items():
        i, rest = mod.split(".", 2)[1], mod.split(".", 2)[2]
        for half, t in (("lora_A", p.down), ("lora_B", p.up)):
            diffusers[f"transformer.{mod}.{half}.weight"] = t
            peft[f"base_model.model.{mod}.{half}.weight"] = t
        o = f"blocks.{i}.{ORIGINAL[rest]}"
        original[f"diffusion_model.{o}.lora_down.weight"], original[f"diffusion_model.{o}.lora_up.weight"] = p.down, p.up
        original[f"diffusion_model.{o}.alpha"] = torch.tensor(2.0)
        k = "lora_unet_" + o.replace(".", "_")
        kohya[f"{k}.lora_down.weight"], kohya[f"{k}.lora_up.weight"], kohya[f"{k}.alpha"] = p.down, p.up, \
            torch.tensor(2.0)
    save_file(diffusers, tmp_path / "d.safetensors",
              metadata={"lora_adapter_metadata": json.dumps({"transformer.r": 4, "transformer.lora_alpha": 2.0})})
    (tmp_path / "peft").mkdir()
    save_file(peft, tmp_path / "peft" / "adapter_model.safetensors")
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 2.0}))
    save_file(original, tmp_path / "o.safetensors")
    save_file(kohya, tmp_path / "k.safetensors")
    want = _deltas(ref)
    for path, fmt in (("d.safetensors", "diffusers"), ("peft", "peft"), ("o.safetensors", "original"),
                      ("k.safetensors", "kohya")):
        got = load_adapter(tmp_path / path, "wan", CFG)
        assert got.source_format == fmt
        d = _deltas(got)
        assert sorted(d) == sorted(want), fmt
        assert all(torch.allclose(d[m], want[m], atol=1e-6) for m in want), fmt
    # without the metadata diffusers takes alpha = r: a different adapter
    save_file(diffusers, tmp_path / "d0.safetensors")
    assert load_adapter(tmp_path / "d0.safetensors", "wan", CFG).targets["transformer"]["blocks.0.attn1.to_q"].alpha == 4


def test_fvconvert_lora_round_trip_and_refusals(tmp_path, weights, capsys):
    A = torch.randn(4, 24)
    good = {"transformer.blocks.0.attn1.to_q.lora_A.weight": A,
            "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.randn(24, 4)}
    save_file(good, tmp_path / "good.safetensors")
    out = tmp_path / "c.safetensors"
    assert fvconvert(["lora", "wan", str(tmp_path / "good.safetensors"), str(out), "--variant", VARIANT]) == 0
    again = load_adapter(out, "wan", CFG)
    assert again.source_format == "diffusers" and torch.equal(again.targets["transformer"]["blocks.0.attn1.to_q"].down, A)
    bad = {
        "unknown": {**good, "transformer.blocks.0.attn1.to_q.lora_C.weight": A.clone()},
        "missing_half": {"transformer.blocks.0.attn1.to_q.lora_A.weight": A},
        "shape": {**good, "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.randn(25, 4)},
        "not_linear": {"transformer.blocks.0.attn1.norm_q.lora_A.weight": A.clone(),
                       "transformer.blocks.0.attn1.norm_q.lora_B.weight": torch.randn(24, 4)},
        "bias": {**good, "transformer.blocks.0.attn1.to_q.lora_B.bias": torch.randn(24)},
        "block_out_of_range": {k.replace("blocks.0", "blocks.9"): v for k, v in good.items()},
    }
    capsys.readouterr()
    for name, sd in bad.items():
        save_file(sd, tmp_path / f"{name}.safetensors")
        rc = fvconvert(["lora", "wan", str(tmp_path / f"{name}.safetensors"), str(tmp_path / f"{name}_out.safetensors"),
                        "--variant", VARIANT])
        err = capsys.readouterr().err
        assert rc == 2, name
        assert err.count("\n") == 1 and err.startswith("fvconvert: error:") and "Traceback" not in err, (name, err)
        assert not (tmp_path / f"{name}_out.safetensors").exists(), name
    assert fvconvert(["lora", "wan", str(tmp_path / "good.safetensors"), str(out), "--variant", VARIANT]) == 2  # exists


def test_request_field_and_spec_parsing():
    assert parse_lora_field("a") == (LoraRef("a"),)
    assert parse_lora_field([{"name": "a", "scale": 0.5}, "b"]) == (LoraRef("a", 0.5), LoraRef("b"))
    for bad in ([{"nam": "a"}], ["a", "a"], [{"name": "a", "scale": float("nan")}], [3], ["../x"]):
        with pytest.raises(RequestFieldError):
            parse_lora_field(bad)
    assert parse_lora_spec("dir/x.safetensors:0.5") == ("dir/x.safetensors", 0.5)
    assert parse_lora_spec("C:/x.safetensors") == ("C:/x.safetensors", 1.0)


# ------------------------------------------------------------------ engine
def test_mixed_adapters_one_batched_step_each_equals_solo_and_reference(weights, adapters):
    checks = lora_parity(CFG, weights, adapters, MIXED)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    assert [c.name for c in checks] == ["batched/one_step", "request0/unmerged_vs_reference",
                                        "request1/unmerged_vs_reference", "request2/unmerged_vs_reference",
                                        "request0/merged_vs_unmerged"]
    engine = Engine.from_weights(CFG, weights, batching="greedy")
    for n, a in adapters.items():
        engine.loras.load(n, a)
    handles = [engine.submit(r) for r in MIXED]
    batched = [h.result()["latents"]["vision"] for h in handles]
    for r, b in zip(MIXED, batched):
        solo = engine.generate(r)["latents"]["vision"]
        assert (solo - b).abs().max().item() < 1e-4
    # the adapters matter: each LoRA row is far from the base row
    assert min((batched[i] - batched[2]).abs().max().item() for i in (0, 1)) > 0.1


@pytest.mark.parametrize("fault,where", [("lora-scale-off", "blocks.0"), ("lora-wrong-projection", "blocks.0"),
                                         ("lora-stale-cache", "blocks.0")])
def test_planted_faults_fail_and_name_the_layer(weights, adapters, fault, where):
    checks = lora_parity(CFG, weights, adapters, MIXED[:2] if fault != "lora-stale-cache" else MIXED[1:2], fault=fault)
    failed = [c for c in checks if not c.passed and c.name.endswith("unmerged_vs_reference")]
    assert failed and checks[0].passed, checks   # batching is not what breaks
    assert failed[0].where == where


def test_merge_is_a_new_weights_version_and_unmerge_restores_it(weights, adapters):
    engine = Engine.from_weights(CFG, weights, weights_version="base-v1")
    engine.loras.load("a", adapters["a"])
    unmerged = engine.generate(request(lora=[LoraRef("a", 0.7)]))["latents"]["vision"]
    version = engine.loras.merge("a", 0.7)
    assert version.startswith("base-v1+a:lora:") and engine.model.weights_version == version
    h = engine.submit(request())
    assert h.weights_version == version
    assert (h.result()["latents"]["vision"] - unmerged).abs().max().item() < 1e-4
    assert [x["merged"] for x in engine.loras.list()] == [True]
    with pytest.raises(RequestRejected, match="merged into the weights"):   # would apply it twice
        engine.submit(request(lora=[LoraRef("a")]))
    with pytest.raises(AdapterError, match="unmerge it first"):
        engine.loras.unload("a")
    assert engine.loras.unmerge() == "base-v1" and engine.model.weights_version == "base-v1"
    base = engine.generate(request())["latents"]["vision"]
    assert (base - unmerged).abs().max().item() > 0.1


def test_hot_load_unload_and_unknown_adapter(weights, adapters):
    engine = Engine.from_weights(CFG, weights)
    with pytest.raises(RequestRejected, match="not loaded") as e:
        engine.submit(request(lora=[LoraRef("a")]))
    assert e.value.field == "lora"
    engine.loras.load("a", adapters["a"])
    h = engine.submit(request(lora=[LoraRef("a")]))
    with pytest.raises(AdapterError, match="in flight"):
        engine.loras.unload("a")
    h.result()
    engine.loras.unload("a")
    assert engine.loras.list() == [] and len(engine.loras.prepared) == 0
    with pytest.raises(AdapterError, match="no linear layer|not applied"):
        engine.loras.load("bad", LoraAdapter("wan", {"transformer": {"condition_embedder.time_proj": LoraPair(
            torch.zeros(2, 24), torch.zeros(144, 2), 2.0)}}))
    assert engine.loras.list() == []


def test_fvgen_lora_flag(tmp_path, capsys):
    from optimized.serving.fvgen import main as fvgen
    lora = "golden/wan/lora_t2v/upstream/pytorch_lora_weights.safetensors"
    base = ["wan", "--variant", VARIANT, "--prompt-ids", "3,4,5", "--steps", "2", "--quiet"]
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    assert fvgen(base + ["--out", str(tmp_path / "plain")]) == 0
    assert fvgen(base + ["--out", str(tmp_path / "styled"), "--lora", f"{root / lora}:0.7"]) == 0
    plain, styled = sorted((tmp_path / "plain").glob("*.png")), sorted((tmp_path / "styled").glob("*.png"))
    assert plain and len(plain) == len(styled)
    assert any(a.read_bytes() != b.read_bytes() for a, b in zip(plain, styled))
    capsys.readouterr()
    assert fvgen(base + ["--out", str(tmp_path / "bad"), "--lora", str(tmp_path / "missing.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "no such LoRA file" in err and "Traceback" not in err and not (tmp_path / "bad").exists()
