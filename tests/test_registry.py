"""Families are entries: every registered family provides every part its entry declares, the engine names no family,
and Engine.from_variant / from_checkpoint find the family by variant name / by what the checkpoint records."""

import ast
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import optimized.registry as registry
from optimized import Engine, RequestRejected
from optimized.runtime.family import FamilyEntry, LoopOptions
from optimized.runtime.loop import LoopKernel
from optimized.runtime.spec import SpecError

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = sorted(registry.families())


def tiny_variant(entry: FamilyEntry) -> str:
    return sorted(v for v in entry.list_variants() if v.startswith("tiny"))[0]


def test_every_family_folder_is_registered():
    folders = sorted(p.name for p in (ROOT / "optimized" / "models").iterdir() if (p / "__init__.py").is_file())
    assert FAMILIES == folders and {"cosmos3", "seedvr2", "wan"} <= set(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_provides_every_declared_part(name):
    entry = registry.family(name)
    assert entry.validate() is entry
    for v in entry.list_variants():
        assert isinstance(entry.load_variant(v), entry.config_class), v
    cfg = entry.load_variant(tiny_variant(entry))
    weights = entry.random_weights(cfg, 0)
    assert sorted(weights) == sorted(c.component_id for c in entry.components(cfg))
    for spec in entry.components(cfg):  # random weights hold exactly each component's canonical keys and shapes
        assert {k: tuple(t.shape) for k, t in weights[spec.component_id].items()} == spec.canonical_shapes
    instance = entry.load(cfg, weights, device="cpu", dtype=torch.float32, weights_version="test")
    for loop_name, factory in entry.loops.items():
        assert isinstance(factory(instance, LoopOptions()), LoopKernel), loop_name
    for rtype, loop_name in entry.request_types.items():
        assert entry.loop_for(rtype.__new__(rtype)) == loop_name
    assert entry.parallelize is None or callable(entry.parallelize)


def test_an_entry_missing_a_loop_is_refused():
    entry = registry.family("cosmos3")
    with pytest.raises(SpecError, match="reasoning"):
        replace(entry, loops={"denoise": entry.loops["denoise"]}).validate()
    with pytest.raises(SpecError, match="but no loop to run them"):
        replace(entry, loops={}, jobs={}).validate()
    # no loop and no request type: a component-only family, which validates (and never generates)
    only = replace(entry, loops={}, request_types={}, jobs={}).validate()
    assert only.component_only and not entry.component_only


def test_engine_and_runtime_name_no_family():
    names = set(FAMILIES)
    top = [ROOT / "optimized" / f for f in ("engine.py", "programs.py", "registry.py")]
    for path in [*top, *sorted((ROOT / "optimized" / "runtime").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for m in mods:
                parts = m.split(".")
                assert not (set(parts) & names), f"{path.name} imports {m}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in names, f"{path.name} names family {node.value!r}"
    code = "import sys, optimized.engine; print(sorted(m for m in sys.modules if m.startswith('optimized.models')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['optimized.models']"   # importing the engine loads no family module


def test_from_variant_cosmos3_tiny_generates():
    eng = Engine.from_variant("cosmos3:tiny", seed=0)
    assert eng.family.name == "cosmos3" and eng.model.weights_version == "random:cosmos3:tiny:0"
    h = eng.submit_built("video", text_ids=torch.arange(4), negative_text_ids=torch.arange(2), num_frames=5, height=32,
                         width=32, num_steps=2, guidance_scale=3.0, seed=1)
    assert h.result()["latents"]["vision"].shape == (1, eng.model.cfg.latent_channels, 2, 2, 2)
    with pytest.raises(RequestRejected, match="serves no"):
        eng.submit(object())


def test_reason_then_generate_leaves_no_subscriber():
    from manifests.cosmos3.reasoning import ReasonRequest
    from manifests.cosmos3.sampling import Cosmos3GenerateRequest
    eng = Engine.from_variant("cosmos3:tiny", seed=0, kv_block_size=4)
    before = len(eng.bus._subs)
    gen = Cosmos3GenerateRequest(text_ids=torch.arange(3), negative_text_ids=torch.arange(2), latent_frames=1,
                                 latent_height=2, latent_width=2, num_steps=1, guidance_scale=1.0)
    for _ in range(2):
        out = eng.run_program("reason_then_generate", ReasonRequest(torch.arange(4), 2), gen).result()
        assert out["generation"]["latents"]["vision"].isfinite().all()
    assert len(eng.bus._subs) == before


def test_from_variant_wan_tiny_serves_its_vae_loops():
    from optimized.models.wan import DecodeRequest
    eng = Engine.from_variant("tiny-2.1-t2v", seed=0)
    assert eng.family.name == "wan" and type(eng.model).__name__ == "WanModelInstance"
    z = torch.randn(1, eng.model.cfg.vae.z_dim, 2, 2, 2)
    video = eng.generate(DecodeRequest("d", z))
    assert video.shape[:3] == (1, 3, 5) and video.isfinite().all()


def test_from_variant_wan_tiny_denoises():
    pytest.importorskip("optimized.models.wan.denoise")
    from manifests.wan.sampling import WanGenerateRequest
    eng = Engine.from_variant("tiny-2.1-t2v", seed=0)
    cfg = eng.model.cfg
    req = WanGenerateRequest(text_ids=torch.arange(5), num_frames=5, height=16, width=16, num_steps=2,
                             guidance_scale=1.0, seed=0)
    out = eng.generate(req)
    assert tuple(out["latents"]["vision"].shape) == (1, *req.latent_shape(cfg)[-4:])
    assert out["latents"]["vision"].isfinite().all()


def test_seedvr2_restoration_is_a_loop_on_the_engine():
    from optimized.models.seedvr2 import RestoreRequest
    eng = Engine.from_variant("tiny-3b", seed=0)
    g = torch.Generator().manual_seed(0)
    req = RestoreRequest(torch.rand(3, 5, 16, 16, generator=g) * 2 - 1, torch.randn(7, 80, generator=g),
                         torch.randn(2, 2, 2, 16, generator=g), torch.randn(1, 16, 2, 2, 2, generator=g))
    a, b = eng.submit(req), eng.submit(req)
    eng.run_until_idle()
    phases = [e.data["phase"] for e in a.events if e.kind == "trace.step"]
    assert phases == ["vae_encode", "dit_step", "vae_decode"]
    assert torch.equal(a.result().x0_latent, b.result().x0_latent) and a.result().output_uint8.shape == (5, 16, 16, 3)
    with pytest.raises(RequestRejected, match="one step"):
        eng.submit(replace(req, steps=2))


def test_unknown_and_ambiguous_variants_are_clear(monkeypatch):
    with pytest.raises(registry.UnknownFamily, match="no family has a variant 'nope'.*cosmos3: .*tiny"):
        Engine.from_variant("nope")
    with pytest.raises(registry.UnknownFamily, match="family 'wan' has no variant 'tiny'"):
        Engine.from_variant("tiny", family="wan")
    fams = dict(registry.families())
    twin = replace(fams["cosmos3"], name="cosmos3twin")
    monkeypatch.setattr(registry, "families", lambda: {**fams, "cosmos3twin": twin})
    with pytest.raises(registry.UnknownFamily, match="'tiny' is ambiguous: families cosmos3, .*cosmos3twin.*family="):
        Engine.from_variant("tiny")
    assert Engine.from_variant("tiny", family="cosmos3twin").family.name == "cosmos3twin"


def test_from_checkpoint_reads_family_and_version(tmp_path):
    from safetensors.torch import save_file
    from manifests.checkpoint import CheckpointError
    from manifests.cosmos3.sampling import Cosmos3GenerateRequest
    entry = registry.family("cosmos3")
    cfg = entry.load_variant("tiny")
    state = entry.random_weights(cfg, 1)["transformer"]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    version = "sha256:" + "ab" * 32
    manifest = {"family": "cosmos3", "component": "transformer", "weights_version": version}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    eng = Engine.from_checkpoint(tmp_path)
    assert eng.family.name == "cosmos3" and eng.model.weights_version == version   # read, never hashed
    req = Cosmos3GenerateRequest(text_ids=torch.arange(4), negative_text_ids=torch.arange(2), latent_frames=1,
                                 latent_height=2, latent_width=2, num_steps=2, guidance_scale=2.0, seed=3)
    want = Engine.from_state_dict(cfg, state).generate(req)["latents"]["vision"]
    assert torch.equal(eng.generate(req)["latents"]["vision"], want)
    manifest["parts"] = {"filled": ["und"], "unfilled": ["gen", "vision_heads", "sound_heads", "action_heads"]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="partial.*gen"):
        Engine.from_checkpoint(tmp_path)
    manifest.pop("parts")
    manifest["family"] = "nope"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="unknown family 'nope'"):
        Engine.from_checkpoint(tmp_path)
