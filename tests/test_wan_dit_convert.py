"""wan DiT + UMT5 conversion and whole-pipeline model directories (fvconvert wan --from diffusers | original),
read back with the one canonical reader (manifests/checkpoint.py).

Sources are written by hand from seeded canonical random tensors: the diffusers / transformers layouts are the
canonical names (plus the tied `encoder.embed_tokens.weight` copy), the original Wan-AI layouts come from the
inverse tables below, written independently of the manifests' regexes. Upstream-built pipelines (diffusers /
transformers save_pretrained) are `upstream`-marked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import ConversionError, convert, load_canonical
from converters.cli import main
from manifests.checkpoint import CheckpointError, load_state, read_checkpoint
from manifests.cosmos3.config import load_variant as cosmos3_variant
from manifests.cosmos3.keys import canonical_key_shapes as cosmos3_shapes
from manifests.wan import WanModelConfig, canonical_key_shapes, dit_key_shapes, load_model_variant, umt5_key_shapes
from parity.weights import random_state_dict
from tests.conftest import ROOT

A14B = "tiny-2.2-t2v-a14b"
I2V = "tiny-2.1-i2v"

# ------------------------------------------------------------------------------------------------
# the documented inverse mappings: canonical key -> original Wan-AI release key (wan/modules/model.py, t5.py)

_DIT_TOP = {"scale_shift_table": "head.modulation", "proj_out.weight": "head.head.weight",
            "proj_out.bias": "head.head.bias",
            "condition_embedder.time_embedder.linear_1": "time_embedding.0",
            "condition_embedder.time_embedder.linear_2": "time_embedding.2",
            "condition_embedder.time_proj": "time_projection.1",
            "condition_embedder.text_embedder.linear_1": "text_embedding.0",
            "condition_embedder.text_embedder.linear_2": "text_embedding.2",
            "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
            "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
            "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
            "condition_embedder.image_embedder.norm2": "img_emb.proj.4"}
_DIT_BLOCK = {"scale_shift_table": "modulation", "norm2": "norm3", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
              "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "norm_q": "norm_q", "norm_k": "norm_k",
              "add_k_proj": "k_img", "add_v_proj": "v_img", "norm_added_k": "norm_k_img"}


def original_dit_key(key: str) -> str:
    if key in _DIT_TOP:
        return _DIT_TOP[key]
    if key.startswith("patch_embedding."):
        return key
    if not key.startswith("blocks."):
        stem, leaf = key.rsplit(".", 1)
        return f"{_DIT_TOP[stem]}.{leaf}"
    _, i, rest = key.split(".", 2)
    if rest == "scale_shift_table":
        return f"blocks.{i}.modulation"
    if rest.startswith(("attn1.", "attn2.")):
        attn, sub = rest.split(".", 1)
        stem, leaf = sub.rsplit(".", 1)
        return f"blocks.{i}.{'self_attn' if attn == 'attn1' else 'cross_attn'}.{_DIT_BLOCK[stem]}.{leaf}"
    stem, leaf = rest.rsplit(".", 1)
    return f"blocks.{i}.{_DIT_BLOCK[stem]}.{leaf}"


def original_umt5_key(key: str) -> str:
    if key == "shared.weight":
        return "token_embedding.weight"
    if key == "encoder.final_layer_norm.weight":
        return "norm.weight"
    p = key.split(".")                        # encoder.block.{i}.layer.{j}.<module>...
    i, j, rest = p[2], p[4], ".".join(p[5:])
    table = {("0", "SelfAttention.q.weight"): "attn.q.weight", ("0", "SelfAttention.k.weight"): "attn.k.weight",
             ("0", "SelfAttention.v.weight"): "attn.v.weight", ("0", "SelfAttention.o.weight"): "attn.o.weight",
             ("0", "SelfAttention.relative_attention_bias.weight"): "pos_embedding.embedding.weight",
             ("0", "layer_norm.weight"): "norm1.weight", ("1", "layer_norm.weight"): "norm2.weight",
             ("1", "DenseReluDense.wi_0.weight"): "ffn.gate.0.weight",
             ("1", "DenseReluDense.wi_1.weight"): "ffn.fc1.weight", ("1", "DenseReluDense.wo.weight"): "ffn.fc2.weight"}
    return f"blocks.{i}.{table[(j, rest)]}"


# ------------------------------------------------------------------------------------------------
# hand-written sources


def _write(d: Path, config: dict, weights: dict, name: str) -> None:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    save_file(weights, str(d / name))


def make_pipeline(root: Path, variant: str, seed: int = 0, mutate=None) -> dict[str, dict[str, torch.Tensor]]:
    """A diffusers pipeline root (no upstream packages): {component: canonical state} it holds."""
    cfg = load_model_variant(variant)
    want = {"transformer": random_state_dict(dit_key_shapes(cfg.dit), seed),
            "text_encoder": random_state_dict(umt5_key_shapes(cfg.text_encoder), seed + 1),
            "vae": random_state_dict(canonical_key_shapes(cfg.vae), seed + 2)}
    if cfg.dit_2 is not None:
        want["transformer_2"] = random_state_dict(dit_key_shapes(cfg.dit_2), seed + 3)
    if cfg.image_encoder is not None:   # 2.1 I2V: the CLIP image encoder (transformers 4.x names: vision_model.)
        from manifests.wan.clip import clip_vision_key_shapes
        want["image_encoder"] = random_state_dict(clip_vision_key_shapes(cfg.image_encoder), seed + 4)
    src = {k: dict(v) for k, v in want.items()}
    src["text_encoder"]["encoder.embed_tokens.weight"] = src["text_encoder"]["shared.weight"].clone()  # tied (upstream)
    if mutate:
        mutate(src)
    for name in ("transformer", "transformer_2"):
        if name in src:
            _write(root / name, getattr(cfg, "dit" if name == "transformer" else "dit_2").to_diffusers_config(),
                   src[name], "diffusion_pytorch_model.safetensors")
    _write(root / "text_encoder", cfg.text_encoder.to_transformers_config(), src["text_encoder"], "model.safetensors")
    if "image_encoder" in src:
        _write(root / "image_encoder", {"model_type": "clip_vision_model", **cfg.image_encoder.to_transformers_config()},
               {f"vision_model.{k}": v for k, v in src["image_encoder"].items()}, "model.safetensors")
        p = cfg.image_processor
        (root / "image_processor").mkdir()
        (root / "image_processor" / "preprocessor_config.json").write_text(json.dumps(
            {"size": {"shortest_edge": p.shortest_edge}, "crop_size": {"height": p.crop_height, "width": p.crop_width},
             "image_mean": list(p.image_mean), "image_std": list(p.image_std), "resample": p.resample}))
    _write(root / "vae", {"_class_name": "AutoencoderKLWan", **cfg.vae.to_diffusers_config()}, src["vae"],
           "diffusion_pytorch_model.safetensors")
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    (root / "tokenizer" / "spiece.model").write_bytes(b"\x00fake sentencepiece\x01")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": cfg.num_train_timesteps,
         "flow_shift": cfg.flow_shift, "use_flow_sigmas": True, "prediction_type": "flow_prediction"}))
    index = {"_class_name": "WanImageToVideoPipeline" if cfg.task == "i2v" else "WanPipeline",
             "_diffusers_version": "0.42.1", "scheduler": ["diffusers", "UniPCMultistepScheduler"],
             "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", "T5TokenizerFast"],
             "transformer": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"],
             "transformer_2": ["diffusers", "WanTransformer3DModel"] if cfg.dit_2 else [None, None],
             "boundary_ratio": cfg.boundary_ratio, "expand_timesteps": cfg.expand_timesteps}
    if cfg.image_encoder is not None:
        index["image_encoder"] = ["transformers", "CLIPVisionModel"]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    (root / "model_index.json").write_text(json.dumps(index))
    return want


def assert_equal_state(got: dict, want: dict) -> None:
    assert list(got) == list(want) or set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def assert_nothing_left(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


# ------------------------------------------------------------------------------------------------
# whole pipeline -> model directory


def test_pipeline_root_converts_into_model_directory(tmp_path, capsys):
    want = make_pipeline(tmp_path / "src", A14B)
    out = tmp_path / "out"
    rc = main(["wan", "--from", "diffusers", str(tmp_path / "src"), str(out), "--variant", A14B, "--skip-parity", "-q"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "transformer_2:" in cap.out and "weights_version: sha256:" in cap.out
    index = json.loads((out / "model_index.json").read_text())
    assert index["family"] == "wan" and index["format_version"] == 1
    assert index["components"] == {"transformer": "transformer", "transformer_2": "transformer_2",
                                   "text_encoder": "text_encoder", "vae": "vae"}
    assert WanModelConfig.from_dict(index["config"]) == load_model_variant(A14B)
    ckpt = read_checkpoint(out)
    assert ckpt.is_model and not ckpt.partial and ckpt.weights_version == index["weights_version"]
    assert ckpt.typed_config() == load_model_variant(A14B)
    for name, sd in want.items():
        assert_equal_state(load_state(ckpt, component=name), sd)
        man = json.loads((out / name / "manifest.json").read_text())
        rep = json.loads((out / name / "conversion_report.json").read_text())
        assert man["weights_version"] == rep["weights_version"] == ckpt.components[name].weights_version
        assert man["weights_version"].startswith("sha256:") and len(man["weights_version"]) == 7 + 64
    te = json.loads((out / "text_encoder" / "conversion_report.json").read_text())
    assert te["dropped"][0]["key"] == "encoder.embed_tokens.weight" and te["dropped"][0]["verified_equal"] is True
    # assets verbatim
    assert (out / "tokenizer" / "spiece.model").read_bytes() == (tmp_path / "src/tokenizer/spiece.model").read_bytes()
    assert set(ckpt.assets) == {"tokenizer", "scheduler"}
    # a model dir needs a component name; load_canonical takes it too
    with pytest.raises(CheckpointError, match="name one"):
        load_state(out)
    cfg, sd = load_canonical(out, component="transformer_2")
    assert cfg == load_model_variant(A14B).dit_2 and torch.equal(sd["proj_out.weight"], want["transformer_2"]["proj_out.weight"])
    # the same weights give the same weights_version; different weights a different one
    make_pipeline(tmp_path / "src2", A14B)
    make_pipeline(tmp_path / "src3", A14B, seed=5)
    for s in ("2", "3"):
        assert main(["wan", "--from", "diffusers", str(tmp_path / f"src{s}"), str(tmp_path / f"o{s}"), "--variant", A14B,
                     "--skip-parity", "-q"]) == 0
    assert read_checkpoint(tmp_path / "o2").weights_version == ckpt.weights_version
    assert read_checkpoint(tmp_path / "o3").weights_version != ckpt.weights_version


def test_i2v_pipeline_with_post_checks(tmp_path, capsys):
    """i2v task from the pipeline class; the CLIP image encoder converted (vision_model. stripped); the VAE post-check
    runs (C0), the DiT / UMT5 ones are recorded as not run until parity wires them."""
    want = make_pipeline(tmp_path / "src", I2V)
    out = tmp_path / "out"
    rc = main(["wan", "--from", "diffusers", str(tmp_path / "src"), str(out), "-q"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    rep = json.loads((out / "conversion_report.json").read_text())
    assert rep["config"]["task"] == "i2v" and not rep["not_converted"] and "image_encoder" in rep["components"]
    assert rep["components"]["vae"]["parity"]["status"] == "pass"
    for name in ("transformer", "text_encoder"):
        p = rep["components"][name]["parity"]
        assert p["status"] in ("not run", "pass"), p
        if p["status"] == "not run":
            assert "no parity post-check is wired" in p["reason"]
    ckpt = read_checkpoint(out)
    assert ckpt.typed_config() == load_model_variant(I2V)
    assert_equal_state(load_state(ckpt, component="transformer"), want["transformer"])
    assert_equal_state(load_state(ckpt, component="image_encoder"), want["image_encoder"])


def test_single_component_folders_detected(tmp_path):
    make_pipeline(tmp_path / "src", I2V)
    for name, kind in (("transformer", "transformer"), ("text_encoder", "text_encoder"), ("vae", "vae")):
        out = tmp_path / f"o_{name}"
        assert main(["wan", "--from", "diffusers", str(tmp_path / "src" / name), str(out), "--skip-parity", "-q"]) == 0
        ckpt = read_checkpoint(out)
        comp = ckpt.component()
        assert not ckpt.is_model and comp.kind == kind and ckpt.weights_version == comp.weights_version
        assert json.loads((out / "manifest.json").read_text())["component"] == kind
    assert main(["wan", "--from", "transformers", str(tmp_path / "src/text_encoder"), str(tmp_path / "t2"),
                 "--skip-parity", "-q"]) == 0
    assert read_checkpoint(tmp_path / "t2").weights_version == read_checkpoint(tmp_path / "o_text_encoder").weights_version


# ------------------------------------------------------------------------------------------------
# original Wan-AI layouts


@pytest.mark.parametrize("variant", [I2V, A14B])
def test_original_dit_round_trip(tmp_path, variant):
    cfg = load_model_variant(variant)
    sd = random_state_dict(dit_key_shapes(cfg.dit), 3)
    orig = {original_dit_key(k): v for k, v in sd.items()}
    assert len(orig) == len(sd)
    (tmp_path / "src").mkdir()
    save_file(orig, str(tmp_path / "src" / "diffusion_pytorch_model.safetensors"))
    assert main(["wan", "--from", "original", str(tmp_path / "src"), str(tmp_path / "out"), "--variant", variant,
                 "--skip-parity", "-q"]) == 0
    assert json.loads((tmp_path / "out/manifest.json").read_text())["format"] == "original-dit"
    assert_equal_state(load_state(tmp_path / "out"), sd)
    # single-file exports carry a model.diffusion_model. prefix (stripped, as upstream does)
    save_file({f"model.diffusion_model.{k}": v for k, v in orig.items()}, str(tmp_path / "single.safetensors"))
    convert("wan", "original-dit", tmp_path / "single.safetensors", tmp_path / "out2", variant=variant)
    assert_equal_state(load_state(tmp_path / "out2"), sd)


def test_original_umt5_round_trip(tmp_path):
    cfg = load_model_variant(A14B).text_encoder
    sd = random_state_dict(umt5_key_shapes(cfg), 4)
    orig = {original_umt5_key(k): v for k, v in sd.items()}
    assert len(orig) == len(sd)
    pth = tmp_path / "models_t5_umt5-xxl-enc-bf16.pth"
    torch.save(orig, pth)
    assert main(["wan", "--from", "original", str(pth), str(tmp_path / "out"), "--variant", A14B,
                 "--skip-parity", "-q"]) == 0
    assert json.loads((tmp_path / "out/manifest.json").read_text())["format"] == "original-umt5"
    cfg2, got = load_canonical(tmp_path / "out")
    assert cfg2 == cfg
    assert_equal_state(got, sd)


def test_original_needs_variant(tmp_path, capsys):
    cfg = load_model_variant(A14B)
    (tmp_path / "src").mkdir()
    save_file({original_dit_key(k): v for k, v in random_state_dict(dit_key_shapes(cfg.dit), 0).items()},
              str(tmp_path / "src" / "diffusion_pytorch_model.safetensors"))
    assert main(["wan", "--from", "original", str(tmp_path / "src"), str(tmp_path / "out"), "--skip-parity"]) == 2
    assert "--variant" in capsys.readouterr().err
    assert_nothing_left(tmp_path / "out")


# ------------------------------------------------------------------------------------------------
# refusals: one line, exit 2, nothing written


def _bad_shape(s):
    s["transformer"]["proj_out.bias"] = torch.zeros(3)


def _missing(s):
    del s["transformer_2"]["blocks.1.ffn.net.2.weight"]


def _unexpected(s):
    s["text_encoder"]["encoder.block.0.layer.0.SelfAttention.q.bias"] = torch.zeros(32)


def _untied(s):
    s["text_encoder"]["encoder.embed_tokens.weight"] = s["text_encoder"]["encoder.embed_tokens.weight"] + 1


@pytest.mark.parametrize("mutate,needle", [
    (_bad_shape, r"proj_out\.bias.*shape \[3\]"),
    (_missing, r"missing key.*blocks\.1\.ffn\.net\.2\.weight"),
    (_unexpected, r"unexpected key 'encoder\.block\.0\.layer\.0\.SelfAttention\.q\.bias'"),
    (_untied, r"encoder\.embed_tokens\.weight.*tied to 'shared\.weight'.*differs"),
])
def test_bad_pipeline_refused(tmp_path, capsys, mutate, needle):
    import re

    make_pipeline(tmp_path / "src", A14B, mutate=mutate)
    out = tmp_path / "out"
    assert main(["wan", "--from", "diffusers", str(tmp_path / "src"), str(out), "--skip-parity"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(needle, err), err
    assert_nothing_left(out)


def test_existing_out_needs_force(tmp_path, capsys):
    make_pipeline(tmp_path / "src", A14B)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["wan", "--from", "diffusers", str(tmp_path / "src"), str(out), "--skip-parity"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert main(["wan", "--from", "diffusers", str(tmp_path / "src"), str(out), "--skip-parity", "--force", "-q"]) == 0
    assert (out / "model_index.json").is_file() and not (out / "keep.txt").exists()


def test_reader_refuses_inconsistent_model_dirs(tmp_path):
    make_pipeline(tmp_path / "src", A14B)
    out = tmp_path / "out"
    assert main(["wan", "--from", "diffusers", str(tmp_path / "src"), str(out), "--skip-parity", "-q"]) == 0
    index = json.loads((out / "model_index.json").read_text())

    def with_index(**kw) -> None:
        (out / "model_index.json").write_text(json.dumps({**index, **kw}))

    with_index(family="nope")
    with pytest.raises(CheckpointError, match="unknown family 'nope'"):
        read_checkpoint(out)
    with_index(components={k: v for k, v in index["components"].items() if k != "transformer_2"})
    with pytest.raises(CheckpointError, match="needs component.*transformer_2"):
        read_checkpoint(out)
    with_index(config={**index["config"], "dit_2": {**index["config"]["dit_2"], "num_layers": 1}})
    with pytest.raises(CheckpointError, match="transformer_2 config differs"):
        read_checkpoint(out)
    with_index()
    sd = load_file(str(out / "vae" / "model.safetensors"))
    save_file({**sd, "extra.weight": torch.ones(1)}, str(out / "vae" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected key 'extra\.weight'"):
        load_state(out, component="vae")
    k = next(iter(sd))
    save_file({**sd, k: torch.ones(7)}, str(out / "vae" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{k}.*has shape \[7\]"):
        load_state(out, component="vae")
    (out / "text_encoder" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        read_checkpoint(out)


def test_partial_checkpoint_needs_parts(tmp_path):
    """A partial canonical dir (the cosmos3 reasoner holds only `und`): load_state refuses the full model, naming
    the unfilled parts; parts=[...] loads what is there."""
    cfg = cosmos3_variant("tiny")
    d = tmp_path / "partial"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    from manifests.checkpoint import get_layout

    und = get_layout("cosmos3").part_keys(cfg)["und"]
    state = random_state_dict({k: s for k, s in cosmos3_shapes(cfg).items() if k in und}, 0)
    save_file(state, str(d / "model.safetensors"))
    unfilled = [p for p in get_layout("cosmos3").part_keys(cfg) if p != "und"]
    (d / "manifest.json").write_text(json.dumps({"family": "cosmos3", "format": "transformers",
                                                 "parts": {"filled": ["und"], "unfilled": unfilled}}))
    ckpt = read_checkpoint(d)
    assert ckpt.partial and ckpt.weights_version is None
    with pytest.raises(CheckpointError, match=r"partial canonical checkpoint.*und only.*lacks gen.*parts=\['und'\]"):
        load_state(d)
    assert_equal_state(load_state(d, parts=["und"]), state)
    with pytest.raises(CheckpointError, match="does not hold part"):
        load_state(d, parts=["gen"])


def test_checkpoint_reader_imports_only_stdlib_torch_manifests(tmp_path):
    make_pipeline(tmp_path / "src", A14B)
    out = tmp_path / "out"
    assert main(["wan", "--from", "diffusers", str(tmp_path / "src"), str(out), "--skip-parity", "-q"]) == 0
    code = f"""
import sys, torch
base = set(sys.modules)
from manifests.checkpoint import load_state, read_checkpoint
ck = read_checkpoint({str(out)!r})
for name in ck.components:
    load_state(ck, component=name)
ck.typed_config()
new = {{m.split('.')[0] for m in set(sys.modules) - base}}
bad = sorted(m for m in new if m not in sys.stdlib_module_names and m not in ('manifests', 'torch', '_distutils_hack'))
print(bad)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


# ------------------------------------------------------------------------------------------------
# upstream-built pipelines


@pytest.mark.upstream
def test_upstream_saved_pipeline_converts(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    cfg = load_model_variant(A14B)
    root = tmp_path / "src"
    torch.manual_seed(0)
    d = cfg.dit.to_diffusers_config()
    d.pop("_class_name")
    models = {"transformer": diffusers.WanTransformer3DModel(**d), "transformer_2": diffusers.WanTransformer3DModel(**d)}
    vd = cfg.vae.to_diffusers_config()
    models["vae"] = diffusers.AutoencoderKLWan(**vd)
    tc = cfg.text_encoder.to_transformers_config()
    tc.pop("architectures")
    tc.pop("model_type")
    models["text_encoder"] = transformers.UMT5EncoderModel(transformers.UMT5Config(**tc))
    for name, m in models.items():
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02)
        m.save_pretrained(str(root / name))
    diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                      flow_shift=cfg.flow_shift).save_pretrained(str(root / "scheduler"))
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer_config.json").write_text("{}")
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"],
        "boundary_ratio": cfg.boundary_ratio, "expand_timesteps": False}))
    out = tmp_path / "out"
    assert main(["wan", "--from", "diffusers", str(root), str(out), "--variant", A14B, "--skip-parity", "-q"]) == 0
    ckpt = read_checkpoint(out)
    for name, m in models.items():
        want = {k: v for k, v in m.state_dict().items() if k != "encoder.embed_tokens.weight"}
        got = load_state(ckpt, component=name)
        assert set(got) == set(want), name
        assert all(torch.equal(got[k], want[k]) for k in want), name


def test_original_folder_with_several_formats_refused(tmp_path, capsys):
    cfg = load_model_variant(A14B)
    src = tmp_path / "Wan2.x"
    src.mkdir()
    save_file({original_dit_key(k): v for k, v in random_state_dict(dit_key_shapes(cfg.dit), 0).items()},
              str(src / "diffusion_pytorch_model.safetensors"))
    torch.save({original_umt5_key(k): v for k, v in random_state_dict(umt5_key_shapes(cfg.text_encoder), 0).items()},
               src / "models_t5_umt5-xxl-enc-bf16.pth")
    assert main(["wan", "--from", "original", str(src), str(tmp_path / "out"), "--variant", A14B, "--skip-parity"]) == 2
    assert "several formats" in capsys.readouterr().err
    assert_nothing_left(tmp_path / "out")
    assert main(["wan", "--from", "original", str(src / "models_t5_umt5-xxl-enc-bf16.pth"), str(tmp_path / "out"),
                 "--variant", A14B, "--skip-parity", "-q"]) == 0
