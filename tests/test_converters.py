"""Checkpoint conversion: manifests, engine, fvconvert CLI.

Tiny diffusers-layout checkpoints are built by the documented inverse mapping (written out by hand
below, independent of the manifest's regexes), with random tensors of the canonical shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import (ConversionError, convert, convert_diffusers_dir_to_canonical_state_dict, convert_to_state_dict,
                        load_canonical, load_manifest)
from converters.cli import main
from converters.engine import plan_conversion
from converters.families import get_family
from converters.manifest import CheckpointManifest
from converters.readers import SafetensorsReader
from manifests.cosmos3 import canonical_key_shapes, load_variant

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------
# hand-written diffusers configs (diffusers' field names) and the inverse key mapping

DIFFUSERS_CONFIGS = {
    "tiny": {
        "_class_name": "Cosmos3OmniTransformer", "_diffusers_version": "0.42.1",
        "attention_bias": False, "attention_dropout": 0.0, "base_fps": 24, "enable_fps_modulation": True,
        "head_dim": 16, "hidden_size": 64, "intermediate_size": 96, "latent_channel": 4, "latent_patch_size": 2,
        "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2, "patch_latent_dim": 16,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 5000000.0, "rope_axes_dim": [4, 2, 2],
        "unified_3d_mrope_reset_spatial_ids": True, "unified_3d_mrope_temporal_modality_margin": 15000,
        "action_dim": 6, "action_gen": True, "num_embodiment_domains": 4,
        "sound_dim": 8, "sound_gen": True, "sound_latent_fps": 25.0, "timestep_scale": 0.001,
        "vocab_size": 128, "hidden_act": "silu", "qk_norm_for_text": True, "use_und_k_norm_for_gen": False,
    },
    "tiny-edge": {
        "_class_name": "Cosmos3OmniTransformer", "_diffusers_version": "0.42.1",
        "attention_bias": False, "attention_dropout": 0.0, "base_fps": 24, "enable_fps_modulation": True,
        "head_dim": 16, "hidden_size": 64, "intermediate_size": 96, "latent_channel": 4, "latent_patch_size": 2,
        "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2, "patch_latent_dim": 16,
        "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 100000000.0, "rope_axes_dim": [4, 2, 2],
        "unified_3d_mrope_reset_spatial_ids": True, "unified_3d_mrope_temporal_modality_margin": 15000,
        "action_dim": 6, "action_gen": True, "num_embodiment_domains": 4,
        "sound_dim": None, "sound_gen": False, "sound_latent_fps": 25.0, "timestep_scale": 0.001,
        "vocab_size": 128, "hidden_act": "relu2", "qk_norm_for_text": False, "use_und_k_norm_for_gen": True,
    },
}

_TOP = {
    "embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "lm_head.weight",
    "und_norm.weight": "norm.weight", "gen_norm.weight": "norm_moe_gen.weight",
    "sound_modality_embed": "audio_modality_embed", "action_modality_embed": "action_modality_embed",
    "action_in.weight": "action_proj_in.fc.weight", "action_in.bias": "action_proj_in.bias.weight",
    "action_out.weight": "action_proj_out.fc.weight", "action_out.bias": "action_proj_out.bias.weight",
}
_PREFIX = {"vision_in.": "proj_in.", "vision_out.": "proj_out.", "time_embed.": "time_embedder.",
           "sound_in.": "audio_proj_in.", "sound_out.": "audio_proj_out."}
_LAYER = {
    ("und", "q_proj"): "self_attn.to_q", ("und", "k_proj"): "self_attn.to_k", ("und", "v_proj"): "self_attn.to_v",
    ("und", "o_proj"): "self_attn.to_out", ("gen", "q_proj"): "self_attn.add_q_proj",
    ("gen", "k_proj"): "self_attn.add_k_proj", ("gen", "v_proj"): "self_attn.add_v_proj",
    ("gen", "o_proj"): "self_attn.to_add_out", ("und", "q_norm"): "self_attn.norm_q",
    ("und", "k_norm"): "self_attn.norm_k", ("gen", "q_norm"): "self_attn.norm_added_q",
    ("gen", "k_norm"): "self_attn.norm_added_k", ("und", "k_norm_for_gen"): "self_attn.k_norm_und_for_gen",
    ("und", "attn_norm"): "input_layernorm", ("gen", "attn_norm"): "input_layernorm_moe_gen",
    ("und", "mlp_norm"): "post_attention_layernorm", ("gen", "mlp_norm"): "post_attention_layernorm_moe_gen",
    ("und", "mlp"): "mlp", ("gen", "mlp"): "mlp_moe_gen",
}


def to_diffusers_key(key: str) -> str:
    if key in _TOP:
        return _TOP[key]
    for a, b in _PREFIX.items():
        if key.startswith(a):
            return b + key[len(a):]
    parts = key.split(".")
    assert parts[0] == "layers", key
    i, path, module, rest = parts[1], parts[2], parts[3], parts[4:]
    return ".".join(["layers", i, _LAYER[(path, module)], *rest])


def canonical_state(variant: str, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cfg = load_variant(variant)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in canonical_key_shapes(cfg).items()}


def make_diffusers_ckpt(root: Path, variant: str = "tiny", layout: str = "single", *, seed: int = 0,
                        dtype=torch.float32, mutate=None) -> tuple[Path, dict[str, torch.Tensor]]:
    """A diffusers transformer folder at root. Returns (folder, canonical state dict it encodes)."""
    canon = canonical_state(variant, seed, dtype)
    diff = {to_diffusers_key(k): v for k, v in canon.items()}
    assert len(diff) == len(canon)
    cfg = dict(DIFFUSERS_CONFIGS[variant])
    if mutate is not None:
        mutate(diff, cfg)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    if layout == "single":
        save_file(diff, str(root / "diffusion_pytorch_model.safetensors"))
    elif layout == "sharded":
        keys = list(diff)
        parts = [keys[i::3] for i in range(3)]
        wm = {}
        for j, ks in enumerate(parts):
            name = f"diffusion_pytorch_model-{j + 1:05d}-of-00003.safetensors"
            save_file({k: diff[k] for k in ks}, str(root / name))
            wm.update({k: name for k in ks})
        (root / "diffusion_pytorch_model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    elif layout == "bin":
        torch.save(diff, root / "diffusion_pytorch_model.bin")
    elif layout == "pth":
        torch.save(diff, root / "weights.pth")
    else:
        raise ValueError(layout)
    return root, canon


def assert_nothing_left(out: Path) -> None:
    assert not os.path.lexists(out), f"{out} exists after a failed run"
    if out.parent.exists():
        leftovers = [p.name for p in out.parent.iterdir() if ".fvconvert-" in p.name]
        assert not leftovers, leftovers


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------
# manifest


def test_diffusers_manifest_loads_and_maps_every_canonical_key():
    m = load_manifest("cosmos3", "diffusers")
    assert m.id == "cosmos3/diffusers" and m.conversion_version >= 1
    assert m.upstream["source"].startswith("diffusers 0.42.1")
    assert [w.path for w in m.weight_files][:2] == ["diffusion_pytorch_model.safetensors",
                                                    "diffusion_pytorch_model.safetensors.index.json"]
    for variant in ("tiny", "tiny-edge", "nano", "edge", "super"):
        for k in canonical_key_shapes(load_variant(variant)):
            rule, target = m.match(to_diffusers_key(k))
            assert rule is not None and rule.op == "rename" and target == k, (k, rule, target)
    # suffix-exact: near-misses match nothing
    for bad in ("layers.0.self_attn.to_q.weight_scale", "xlayers.0.mlp.up_proj.weight", "norm.weight.extra",
                "layers.0.input_layernorm_moe_gen_x.weight", "model.layers.0.mlp.up_proj.weight"):
        assert m.match(bad) == (None, None), bad
    rule, target = m.match("rotary_emb.inv_freq")
    assert rule.op == "drop" and target is None and "persistent" in rule.reason


def _manifest_dict() -> dict:
    return json.loads((REPO / "manifests/cosmos3/checkpoints/diffusers.json").read_text())


@pytest.mark.parametrize("breakage, needle", [
    (lambda d: d["rules"].__setitem__(1, {**d["rules"][1], "match": "embed_tokens\\.weight"}), "anchored"),
    (lambda d: d["rules"].__setitem__(1, {**d["rules"][1], "match": "^embed_tokens\\.weight"}), "anchored"),
    (lambda d: d["rules"].__setitem__(1, {**d["rules"][1], "op": "merge"}), "op 'merge' unknown"),
    (lambda d: d["rules"].__setitem__(1, {**d["rules"][1], "op": "fuse"}), "a fuse rule needs 'dim'"),
    (lambda d: d["rules"].__setitem__(1, {**d["rules"][1], "match": "^(unclosed$"}), "does not compile"),
    (lambda d: d["rules"].__setitem__(5, {**d["rules"][5], "to": "vision_in.\\3"}), "refers to group"),
    (lambda d: d["rules"].__setitem__(0, {"op": "drop", "match": "^x$"}), "needs a 'reason'"),
    (lambda d: d["rules"].__setitem__(1, {**d["rules"][1], "colour": "red"}), "unknown fields"),
    (lambda d: d.__setitem__("extra", 1), "unknown fields"),
    (lambda d: d["files"]["weights"].append({"kind": "gguf", "path": "x.gguf"}), "kind 'gguf' unknown"),
    (lambda d: d["dtype_policy"].__setitem__("default", "int8"), "dtype_policy.default"),
    (lambda d: d["dtype_policy"].__setitem__("keep_fp32", ["^time_embed\\."]), "manifests/cosmos3/keys.py fp32_keys"),
    (lambda d: d.__setitem__("conversion_version", 0), "conversion_version"),
])
def test_bad_manifests_are_refused(breakage, needle):
    d = _manifest_dict()
    breakage(d)
    with pytest.raises(ConversionError, match="checkpoint manifest") as ei:
        CheckpointManifest.from_dict(d, origin="broken.json")
    assert needle in str(ei.value)
    assert "broken.json" in str(ei.value)


def test_unknown_format_and_family():
    with pytest.raises(ConversionError, match="unknown format 'gguf' for cosmos3; known formats: diffusers"):
        load_manifest("cosmos3", "gguf")
    with pytest.raises(ConversionError, match="unknown model family"):
        load_manifest("nope", "diffusers")


def test_two_sources_onto_one_target_is_an_error():
    d = _manifest_dict()
    # a (deliberately wrong) manifest that sends both the und and the gen q projection to one place
    d["rules"].insert(1, {"op": "rename", "match": "^layers\\.(\\d+)\\.self_attn\\.add_q_proj\\.weight$",
                          "to": "layers.\\1.und.q_proj.weight"})
    m = CheckpointManifest.from_dict(d, origin="conflict.json")
    fam = get_family("cosmos3")
    cfg = load_variant("tiny")
    from converters.readers import TensorInfo
    infos = {to_diffusers_key(k): TensorInfo(to_diffusers_key(k), Path("w.safetensors"), "float32", s)
             for k, s in canonical_key_shapes(cfg).items()}
    with pytest.raises(ConversionError, match="both map to canonical key 'layers.0.und.q_proj.weight'") as ei:
        plan_conversion(fam, m, cfg, infos)
    assert "layers.0.self_attn.to_q.weight" in str(ei.value) and "w.safetensors" in str(ei.value)


# ------------------------------------------------------------------------------------------------
# conversion round trips


@pytest.mark.parametrize("variant", ["tiny", "tiny-edge"])
def test_roundtrip_exact(tmp_path, variant):
    src, canon = make_diffusers_ckpt(tmp_path / "src", variant)
    out = tmp_path / "out" / "ckpt"                      # parent does not exist yet
    seen: list[str] = []
    report = convert("cosmos3", "diffusers", src, out, variant=variant, progress=seen.append)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "conversion_report.json", "manifest.json",
                                                     "model.safetensors"]
    cfg, sd = load_canonical(out)
    assert cfg == load_variant(variant)
    assert list(sd) == list(canonical_key_shapes(cfg))
    for k, v in canon.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    # report
    rep = json.loads((out / "conversion_report.json").read_text())
    assert rep == json.loads(json.dumps(report.to_dict()))
    assert rep["unexpected"] == [] and rep["missing"] == [] and rep["dropped"] == []
    assert rep["num_output_keys"] == len(canon) == len(rep["renamed"])
    assert {r["to"]: r["from"] for r in rep["renamed"]} == {k: to_diffusers_key(k) for k in canon}
    assert rep["parity"]["status"] == "skipped" and rep["variant"] == {"name": variant, "status": "match"}
    assert rep["dtypes"]["output"] == {"float32": len(canon)}
    ins = {Path(i["path"]).name: i["sha256"] for i in rep["inputs"]}
    assert ins == {"config.json": sha256(src / "config.json"),
                   "diffusion_pytorch_model.safetensors": sha256(src / "diffusion_pytorch_model.safetensors")}
    outs = {o["path"]: o["sha256"] for o in rep["outputs"]}
    assert outs == {n: sha256(out / n) for n in ("model.safetensors", "config.json", "manifest.json")}
    man = json.loads((out / "manifest.json").read_text())
    assert man["family"] == "cosmos3" and man["format"] == "diffusers" and man["manifest"]["rules"]
    assert json.loads((out / "config.json").read_text()) == cfg.to_dict()
    assert load_file(str(out / "model.safetensors")).keys() == sd.keys()  # standard safetensors
    assert any("[" in s and "tensors written" in s for s in seen)
    assert_nothing_left(tmp_path / "out" / "nothing")


@pytest.mark.parametrize("variant", ["tiny", "tiny-edge"])
def test_in_memory_conversion_matches(tmp_path, variant):
    src, canon = make_diffusers_ckpt(tmp_path / "src", variant, seed=3)
    cfg, sd = convert_diffusers_dir_to_canonical_state_dict(src)
    assert cfg == load_variant(variant)
    assert list(sd) == list(canon) and all(torch.equal(sd[k], canon[k]) for k in canon)


def test_sharded_input(tmp_path):
    src, canon = make_diffusers_ckpt(tmp_path / "src", "tiny", "sharded")
    report = convert("cosmos3", "diffusers", src, tmp_path / "out")
    _, sd = load_canonical(tmp_path / "out")
    assert all(torch.equal(sd[k], canon[k]) for k in canon)
    assert report.source["kind"] == "safetensors_index" and len(report.inputs) == 1 + 1 + 3
    # the index file itself as SRC works too
    cfg, sd2 = convert_diffusers_dir_to_canonical_state_dict(src / "diffusion_pytorch_model.safetensors.index.json")
    assert all(torch.equal(sd2[k], canon[k]) for k in canon)


@pytest.mark.parametrize("layout", ["bin", "pth"])
def test_torch_pickle_input(tmp_path, layout):
    src, canon = make_diffusers_ckpt(tmp_path / "src", "tiny-edge", layout)
    arg = src if layout == "bin" else src / "weights.pth"
    convert("cosmos3", "diffusers", arg, tmp_path / "out")
    _, sd = load_canonical(tmp_path / "out")
    assert all(torch.equal(sd[k], canon[k]) for k in canon)


def test_pth_with_explicit_config(tmp_path):
    src, canon = make_diffusers_ckpt(tmp_path / "src", "tiny", "pth")
    elsewhere = tmp_path / "cfg" / "transformer_config.json"
    elsewhere.parent.mkdir()
    (src / "config.json").rename(elsewhere)
    with pytest.raises(ConversionError, match="config file not found"):
        convert("cosmos3", "diffusers", src / "weights.pth", tmp_path / "out")
    convert("cosmos3", "diffusers", src / "weights.pth", tmp_path / "out", config=elsewhere)
    assert load_canonical(tmp_path / "out")[0] == load_variant("tiny")


def test_sharded_output(tmp_path):
    src, canon = make_diffusers_ckpt(tmp_path / "src", "tiny")
    report = convert("cosmos3", "diffusers", src, tmp_path / "out", max_shard_bytes=64 * 1024)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in names and "model.safetensors" not in names
    for s in shards:
        assert os.path.getsize(tmp_path / "out" / s) <= 64 * 1024 + 16 * 1024  # header + one tensor may exceed
    _, sd = load_canonical(tmp_path / "out")
    assert all(torch.equal(sd[k], canon[k]) for k in canon)
    assert {o["path"] for o in report.outputs} >= set(shards) | {"model.safetensors.index.json"}


def test_dtype_policy(tmp_path):
    src, canon = make_diffusers_ckpt(tmp_path / "src", "tiny")
    report = convert("cosmos3", "diffusers", src, tmp_path / "out", dtype="bf16")
    _, sd = load_canonical(tmp_path / "out")
    for k, v in canon.items():
        if k.startswith("time_embed."):
            assert sd[k].dtype == torch.float32 and torch.equal(sd[k], v), k
        else:
            assert sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], v.to(torch.bfloat16)), k
    assert report.dtypes["output"]["float32"] == 4 and sorted(report.dtypes["kept_fp32"]) == sorted(
        k for k in canon if k.startswith("time_embed."))
    # a bf16 source: time_embed is upcast to float32, the rest stays bf16 (default: keep the source dtype)
    src2, canon2 = make_diffusers_ckpt(tmp_path / "src2", "tiny", dtype=torch.bfloat16)
    cfg, sd2 = convert_diffusers_dir_to_canonical_state_dict(src2)
    assert sd2["time_embed.linear_1.weight"].dtype == torch.float32
    assert torch.equal(sd2["time_embed.linear_1.weight"], canon2["time_embed.linear_1.weight"].float())
    assert sd2["layers.0.und.q_proj.weight"].dtype == torch.bfloat16
    # load_canonical can cast on read, keeping the fp32 keys
    _, sd3 = load_canonical(tmp_path / "out", dtype="float16")
    assert sd3["layers.0.und.q_proj.weight"].dtype == torch.float16 and sd3["time_embed.linear_2.bias"].dtype == torch.float32
    with pytest.raises(ConversionError, match="unsupported output dtype"):
        convert("cosmos3", "diffusers", src, tmp_path / "out8", dtype="int8")
    assert_nothing_left(tmp_path / "out8")


def test_fp32_keys_are_the_familys_only(tmp_path, capsys, monkeypatch):
    """Which tensors stay float32 is stated once, by the family (the canonical model), for every format: an
    empty family rule sends the time embedder to bf16, and a manifest may no longer state (or contradict) it."""
    from converters import families

    src, canon = make_diffusers_ckpt(tmp_path / "src", "tiny")
    fam = get_family("cosmos3")
    monkeypatch.setitem(families._CACHE, ("cosmos3", "transformer"),
                        dataclasses.replace(fam, fp32_keys=lambda cfg: []))
    _, sd = convert_to_state_dict("cosmos3", "diffusers", src, dtype="bf16")
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    monkeypatch.undo()
    _, sd = convert_to_state_dict("cosmos3", "diffusers", src, dtype="bf16")
    assert sorted(k for k, v in sd.items() if v.dtype == torch.float32) == sorted(fam.fp32_keys(load_variant("tiny")))
    d = _manifest_dict()
    d["dtype_policy"]["keep_fp32"] = []
    (tmp_path / "old.json").write_text(json.dumps(d))
    rc = main(["cosmos3", "--from", str(tmp_path / "old.json"), str(src), str(tmp_path / "out"), "--skip-parity"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fvconvert: error:")]
    assert rc == 2 and len(lines) == 1 and "keep_fp32 is no longer read" in lines[0], lines
    assert "fp32_keys(cfg)" in lines[0] and "manifests/cosmos3/keys.py" in lines[0]
    assert not (tmp_path / "out").exists()


def test_float16_overflow_is_refused(tmp_path):
    def big(diff, cfg):
        diff["lm_head.weight"][0, 0] = 1e6
    src, _ = make_diffusers_ckpt(tmp_path / "src", "tiny", mutate=big)
    with pytest.raises(ConversionError, match=r"lm_head\.weight.*overflow float16"):
        convert("cosmos3", "diffusers", src, tmp_path / "out", dtype="float16")
    assert_nothing_left(tmp_path / "out")


def test_drop_rule_and_report(tmp_path):
    def add_inv_freq(diff, cfg):
        diff["rotary_emb.inv_freq"] = torch.ones(8)
    src, canon = make_diffusers_ckpt(tmp_path / "src", "tiny", mutate=add_inv_freq)
    report = convert("cosmos3", "diffusers", src, tmp_path / "out")
    assert [d["key"] for d in report.dropped] == ["rotary_emb.inv_freq"] and report.dropped[0]["reason"]
    assert report.num_source_keys == len(canon) + 1 and report.num_output_keys == len(canon)


def test_truncated_layers_need_allow_truncate(tmp_path):
    def drop_last_layer(diff, cfg):
        for k in [k for k in diff if k.startswith("layers.2.")]:
            del diff[k]
    src, canon = make_diffusers_ckpt(tmp_path / "src", "tiny", mutate=drop_last_layer)
    with pytest.raises(ConversionError, match=r"missing key.*layers\.2\..*allow-truncate") as ei:
        convert("cosmos3", "diffusers", src, tmp_path / "out")
    assert "diffusion_pytorch_model.safetensors" in str(ei.value)
    assert_nothing_left(tmp_path / "out")
    report = convert("cosmos3", "diffusers", src, tmp_path / "out", allow_truncate=True)
    assert report.truncated == {"config_num_layers": 3, "converted_num_layers": 2, "absent_keys": len(
        [k for k in canon if k.startswith("layers.2.")])}
    cfg, sd = load_canonical(tmp_path / "out")
    assert cfg.num_layers == 2 and all(torch.equal(sd[k], canon[k]) for k in sd)
    # a hole in the middle is never a truncation
    def drop_middle(diff, cfg):
        del diff["layers.1.mlp.up_proj.weight"]
    src2, _ = make_diffusers_ckpt(tmp_path / "src2", "tiny", mutate=drop_middle)
    with pytest.raises(ConversionError, match=r"missing key.*'layers\.1\.und\.mlp\.up_proj\.weight'"):
        convert("cosmos3", "diffusers", src2, tmp_path / "out2", allow_truncate=True)
    assert_nothing_left(tmp_path / "out2")


def test_variant_check(tmp_path):
    src, _ = make_diffusers_ckpt(tmp_path / "src", "tiny")
    with pytest.raises(ConversionError, match="not variant 'tiny-edge'.*hidden_act='silu'") as ei:
        convert("cosmos3", "diffusers", src, tmp_path / "out", variant="tiny-edge")
    assert "config.json" in str(ei.value)
    with pytest.raises(ConversionError, match="unknown variant"):
        convert("cosmos3", "diffusers", src, tmp_path / "out", variant="giant")
    assert_nothing_left(tmp_path / "out")


def test_post_check_hook(tmp_path):
    src, _ = make_diffusers_ckpt(tmp_path / "src", "tiny")
    calls = []

    def ok(d: Path) -> dict:
        calls.append(sorted(p.name for p in d.iterdir()))
        cfg, sd = load_canonical(d)  # the hook sees a complete canonical checkpoint
        return {"status": "pass", "level": "C0", "checks": len(sd)}

    report = convert("cosmos3", "diffusers", src, tmp_path / "out", post_check=ok)
    assert calls == [["config.json", "manifest.json", "model.safetensors"]]
    assert report.parity["status"] == "pass"
    assert json.loads((tmp_path / "out" / "conversion_report.json").read_text())["parity"]["level"] == "C0"

    r = convert("cosmos3", "diffusers", src, tmp_path / "skip", post_check=ok, skip_parity=True)
    assert r.parity["status"] == "skipped" and len(calls) == 1

    for i, bad in enumerate([lambda d: {"status": "fail", "summary": "layers.0.gen rel_l2 3e-1"},
                             lambda d: 1 / 0, lambda d: "pass"]):
        out = tmp_path / f"bad{i}"
        with pytest.raises(ConversionError, match="post-check") as ei:
            convert("cosmos3", "diffusers", src, out, post_check=bad)
        assert str(out) in str(ei.value)
        assert_nothing_left(out)


def test_existing_out_needs_force(tmp_path):
    src, canon = make_diffusers_ckpt(tmp_path / "src", "tiny")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists.*--force") as ei:
        convert("cosmos3", "diffusers", src, out)
    assert str(out) in str(ei.value) and (out / "keep.txt").read_text() == "mine"
    convert("cosmos3", "diffusers", src, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    # a failed forced run keeps the old OUT intact
    def nan(diff, cfg):
        diff["lm_head.weight"][0, 0] = float("nan")
    bad, _ = make_diffusers_ckpt(tmp_path / "bad", "tiny", mutate=nan)
    before = sha256(out / "model.safetensors")
    with pytest.raises(ConversionError, match="NaN"):
        convert("cosmos3", "diffusers", bad, out, force=True)
    assert sha256(out / "model.safetensors") == before
    assert not [p for p in tmp_path.iterdir() if ".fvconvert-" in p.name]
    with pytest.raises(ConversionError, match="output and source are the same|is \\(or contains\\) the source"):
        convert("cosmos3", "diffusers", src, src, force=True)
    assert (src / "diffusion_pytorch_model.safetensors").is_file()


def test_allow_nonfinite(tmp_path):
    def nan(diff, cfg):
        diff["layers.1.self_attn.to_q.weight"][0, 0] = float("nan")
        diff["proj_out.bias"][1] = float("inf")
    src, _ = make_diffusers_ckpt(tmp_path / "src", "tiny", mutate=nan)
    report = convert("cosmos3", "diffusers", src, tmp_path / "out", allow_nonfinite=True)
    assert sorted(n["key"] for n in report.nonfinite) == ["layers.1.und.q_proj.weight", "vision_out.bias"]
    _, sd = load_canonical(tmp_path / "out")
    assert torch.isnan(sd["layers.1.und.q_proj.weight"][0, 0])
    with pytest.raises(ConversionError, match="NaN/Inf"):
        load_canonical(tmp_path / "out", check_finite=True)


# ------------------------------------------------------------------------------------------------
# bad inputs: each -> ConversionError naming the file and key, nothing in OUT; same through the CLI


def _truncate(src: Path) -> None:
    f = src / "diffusion_pytorch_model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])


def _corrupt_header(src: Path) -> None:
    f = src / "diffusion_pytorch_model.safetensors"
    b = bytearray(f.read_bytes())
    b[8:24] = b"\x00garbage\xffgarbage"
    f.write_bytes(bytes(b))


def _drop_shard(src: Path) -> None:
    (src / "diffusion_pytorch_model-00002-of-00003.safetensors").unlink()


def _dupe_across_shards(src: Path) -> None:
    a = src / "diffusion_pytorch_model-00001-of-00003.safetensors"
    b = src / "diffusion_pytorch_model-00002-of-00003.safetensors"
    sa, sb = load_file(str(a)), load_file(str(b))
    k = next(iter(sa))
    sb[k] = sa[k].clone()   # the same key now lives in two shards (the index names only one)
    save_file(sb, str(b))


def _mutating(fn):
    def apply(src: Path) -> None:
        f = src / "diffusion_pytorch_model.safetensors"
        sd = load_file(str(f))
        fn(sd)
        save_file(sd, str(f))
    return apply


def _nested_pickle(src: Path) -> None:
    sd = load_file(str(src / "diffusion_pytorch_model.safetensors"))
    torch.save({"state_dict": sd, "step": 10}, src / "ckpt.pth")


class _Evil:
    def __reduce__(self):
        return (os.getcwd, ())


def _evil_pickle(src: Path) -> None:
    with open(src / "ckpt.pth", "wb") as f:
        pickle.dump({"x": _Evil()}, f)


def _wrong_class(src: Path) -> None:
    c = json.loads((src / "config.json").read_text())
    c["_class_name"] = "WanTransformer3DModel"
    (src / "config.json").write_text(json.dumps(c))


BAD_INPUTS = {
    # name: (layout, corruption, src relative path, (--from), expected substrings in the message)
    "truncated-file": ("single", _truncate, ".", "diffusers", ["diffusion_pytorch_model.safetensors", "not a readable safetensors"]),
    "corrupted-header": ("single", _corrupt_header, ".", "diffusers", ["diffusion_pytorch_model.safetensors", "header"]),
    "missing-shard": ("sharded", _drop_shard, ".", "diffusers", ["index.json", "diffusion_pytorch_model-00002-of-00003.safetensors", "missing"]),
    "duplicate-across-shards": ("sharded", _dupe_across_shards, ".", "diffusers", ["duplicate key", "-00001-of-00003", "-00002-of-00003"]),
    "wrong-shape": ("single", _mutating(lambda sd: sd.__setitem__("layers.1.mlp.up_proj.weight", torch.zeros(95, 64))), ".", "diffusers",
                    ["diffusion_pytorch_model.safetensors", "layers.1.mlp.up_proj.weight", "[95, 64]", "[96, 64]"]),
    "nan-tensor": ("single", _mutating(lambda sd: sd["layers.0.self_attn.to_v.weight"].__setitem__((0, 0), float("nan"))), ".", "diffusers",
                   ["diffusion_pytorch_model.safetensors", "layers.0.self_attn.to_v.weight", "NaN"]),
    "unknown-format": ("single", None, ".", "gguf", ["unknown format 'gguf'", "diffusers"]),
    "nested-pickle": ("single", _nested_pickle, "ckpt.pth", "diffusers", ["ckpt.pth", "'state_dict'", "flat"]),
    "unsafe-pickle": ("single", _evil_pickle, "ckpt.pth", "diffusers", ["ckpt.pth", "weights_only"]),
    "extra-key": ("single", _mutating(lambda sd: sd.__setitem__("layers.0.self_attn.to_q.weight_scale", torch.ones(1))), ".", "diffusers",
                  ["diffusion_pytorch_model.safetensors", "unexpected key 'layers.0.self_attn.to_q.weight_scale'"]),
    "extra-layer": ("single", _mutating(lambda sd: sd.__setitem__("layers.3.mlp.up_proj.weight", torch.ones(96, 64))), ".", "diffusers",
                    ["diffusion_pytorch_model.safetensors", "layers.3.mlp.up_proj.weight", "only 3 layers"]),
    "disabled-head": ("single", _mutating(lambda sd: sd.__setitem__("layers.0.self_attn.k_norm_und_for_gen.weight", torch.ones(16))), ".",
                      "diffusers", ["layers.0.self_attn.k_norm_und_for_gen.weight", "does not have this tensor"]),
    "missing-key": ("single", _mutating(lambda sd: sd.pop("time_embedder.linear_2.bias")), ".", "diffusers",
                    ["diffusion_pytorch_model.safetensors", "missing key", "time_embed.linear_2.bias"]),
    "wrong-class": ("single", _wrong_class, ".", "diffusers", ["config.json", "WanTransformer3DModel"]),
    "no-weights": ("single", lambda s: (s / "diffusion_pytorch_model.safetensors").unlink(), ".", "diffusers",
                   ["no cosmos3/diffusers weights found", "diffusion_pytorch_model.safetensors"]),
    "unknown-file-type": ("single", lambda s: (s / "w.gguf").write_bytes(b"GGUF"), "w.gguf", "diffusers", ["w.gguf", "unknown checkpoint file type"]),
    "missing-src": ("single", None, "nope", "diffusers", ["nope", "not found"]),
}


def _bad_source(tmp_path: Path, name: str) -> tuple[Path, str, list[str]]:
    layout, corrupt, rel, fmt, needles = BAD_INPUTS[name]
    src, _ = make_diffusers_ckpt(tmp_path / "src", "tiny", layout)
    if corrupt is not None:
        corrupt(src)
    return (src / rel if rel != "." else src), fmt, needles


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_api(tmp_path, name):
    src, fmt, needles = _bad_source(tmp_path, name)
    out = tmp_path / "out"
    with pytest.raises(ConversionError) as ei:
        convert("cosmos3", fmt, src, out)
    msg = str(ei.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)
    assert_nothing_left(out)


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_cli(tmp_path, capsys, name):
    src, fmt, needles = _bad_source(tmp_path, name)
    out = tmp_path / "out"
    rc = main(["cosmos3", "--from", fmt, str(src), str(out), "--skip-parity"])
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.startswith("fvconvert: error:")]
    assert rc == 2, cap
    assert len(lines) == 1 and "Traceback" not in cap.err + cap.out, cap.err
    assert needles[0] in lines[0]
    assert_nothing_left(out)


def test_existing_out_cli(tmp_path, capsys):
    src, _ = make_diffusers_ckpt(tmp_path / "src", "tiny")
    out = tmp_path / "out"
    out.mkdir()
    rc = main(["cosmos3", "--from", "diffusers", str(src), str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().count("\n") == 0 and "already exists" in err and "--force" in err
    assert list(out.iterdir()) == []
    assert main(["cosmos3", "--from", "diffusers", str(src), str(out), "--force", "-q"]) == 0
    assert (out / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------------
# CLI


def test_cli_convert_and_inspect(tmp_path, capsys):
    src, canon = make_diffusers_ckpt(tmp_path / "src", "tiny-edge")
    out = tmp_path / "out"
    rc = main(["cosmos3", "--from", "diffusers", str(src), str(out), "--variant", "tiny-edge", "--dtype", "bf16",
               "--skip-parity", "--max-shard-size", "100KiB"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "tensors written" in cap.err                       # progress on stderr
    assert "variant: tiny-edge (match)" in cap.out and "parity:  skipped" in cap.out
    _, sd = load_canonical(out)
    assert sd["layers.0.gen.q_proj.weight"].dtype == torch.bfloat16
    assert (out / "model.safetensors.index.json").is_file()

    assert main(["inspect", str(src)]) == 0
    text = capsys.readouterr().out
    assert "cosmos3/diffusers" in text and f"keys:    {len(canon)}" in text and "strict conversion would pass" in text
    assert "layers.*.self_attn" in text
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["best"] == "cosmos3/canonical" and info["num_keys"] == len(canon) and info["num_layers_seen"] == 3
    assert set(info["dtypes"]) == {"bfloat16", "float32"}
    assert main(["inspect", str(src / "diffusion_pytorch_model.safetensors"), "--keys"]) == 0
    assert "layers.2.mlp_moe_gen.down_proj.weight" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["cosmos3", "SRC", "OUT"], "--from"),
    (["cosmos3", "--from", "diffusers", "SRC"], "OUT"),
    (["hunyuan", "--from", "diffusers", "a", "b"], "No such command"),
    (["cosmos3", "--from", "diffusers", "SRC", "OUT", "--dtype", "int4"], "int4"),
    (["cosmos3", "--from", "diffusers", "SRC", "OUT", "--max-shard-size", "lots"], "lots"),
    (["cosmos3", "--from", "diffusers", "SRC", "OUT", "--variant", "giant"], "unknown variant 'giant'"),
    (["inspect", "does-not-exist"], "not found"),
])
def test_cli_usage_errors(tmp_path, capsys, argv, needle):
    argv = [str(tmp_path / a) if a in ("SRC", "OUT") else a for a in argv]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("fvconvert: error:") and err.strip().count("\n") == 0, err
    assert needle in err


def test_cli_help_answers_questions(capsys):
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    for s in ("cosmos3", "inspect", "formats", "conversion_report.json", "Exit codes"):
        assert s in top
    assert main(["cosmos3", "--help"]) == 0
    h = capsys.readouterr().out
    for s in ("--from", "diffusers", "diffusion_pytorch_model.safetensors.index.json", "--allow-truncate",
              "--allow-nonfinite", "--skip-parity", "--variant", "tiny-edge", "time_embed", "--force"):
        assert s in h, s
    assert main(["formats"]) == 0
    assert "diffusers 0.42.1" in capsys.readouterr().out


def test_cli_subprocess_no_traceback(tmp_path):
    src, _ = make_diffusers_ckpt(tmp_path / "src", "tiny")
    _truncate(src)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("FVCONVERT_DEBUG", None)
    p = subprocess.run([sys.executable, "-m", "converters", "cosmos3", "--from", "diffusers", str(src),
                        str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("fvconvert: error:")
    assert_nothing_left(tmp_path / "out")


# ------------------------------------------------------------------------------------------------
# load_canonical is strict too


def test_load_canonical_strict(tmp_path):
    src, canon = make_diffusers_ckpt(tmp_path / "src", "tiny")
    out = tmp_path / "out"
    convert("cosmos3", "diffusers", src, out)
    f = out / "model.safetensors"
    sd = load_file(str(f))
    save_file({**sd, "extra.weight": torch.ones(2)}, str(f))
    with pytest.raises(ConversionError, match=r"model\.safetensors.*unexpected key 'extra\.weight'"):
        load_canonical(out)
    sd.pop("gen_norm.weight")
    save_file(sd, str(f))
    with pytest.raises(ConversionError, match=r"missing canonical key 'gen_norm\.weight'"):
        load_canonical(out)
    sd["gen_norm.weight"] = torch.ones(63)
    save_file(sd, str(f))
    with pytest.raises(ConversionError, match=r"'gen_norm\.weight' has shape \[63\]"):
        load_canonical(out)
    (out / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ConversionError, match=r"config\.json.*missing keys"):
        load_canonical(out)
    with pytest.raises(ConversionError, match="not a canonical checkpoint directory"):
        load_canonical(tmp_path / "nowhere")


def test_reader_rejects_index_inconsistencies(tmp_path):
    src, _ = make_diffusers_ckpt(tmp_path / "src", "tiny", "sharded")
    idx = src / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(idx.read_text())
    k = next(iter(data["weight_map"]))
    good = data["weight_map"][k]
    data["weight_map"][k] = next(f for f in set(data["weight_map"].values()) if f != good)
    idx.write_text(json.dumps(data))
    with pytest.raises(ConversionError, match=f"key '{k}' is indexed in .* but stored in {good}"):
        SafetensorsReader(idx)
    data["weight_map"][k] = "../escape.safetensors"
    idx.write_text(json.dumps(data))
    with pytest.raises(ConversionError, match="not a plain shard file name"):
        SafetensorsReader(idx)
    # duplicate key inside the index json itself
    text = json.dumps({"weight_map": {k: good}})[:-2] + f', "{k}": "{good}"' + "}}"
    idx.write_text(text)
    with pytest.raises(ConversionError, match="listed twice in the index"):
        SafetensorsReader(idx)


# ------------------------------------------------------------------------------------------------
# upstream: a real diffusers Cosmos3OmniTransformer, save_pretrained, convert


@pytest.mark.upstream
@pytest.mark.parametrize("variant, shard", [("tiny", None), ("tiny-edge", "40KB")])
def test_upstream_diffusers_save_pretrained_converts(tmp_path, variant, shard):
    pytest.importorskip("diffusers")
    try:
        from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer
    except ImportError:
        pytest.skip("this diffusers has no Cosmos3OmniTransformer")
    init = {k: v for k, v in DIFFUSERS_CONFIGS[variant].items() if not k.startswith("_")}
    torch.manual_seed(0)
    model = Cosmos3OmniTransformer(**init).eval()
    with torch.no_grad():  # action/sound embeds and norms start as constants: make every tensor distinct
        for p in model.parameters():
            p.normal_()
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path / "transformer", **kw)
    if shard:
        assert (tmp_path / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    report = convert("cosmos3", "diffusers", tmp_path / "transformer", tmp_path / "out", variant=variant)
    assert report.unexpected == [] and report.missing == [] and report.dropped == []
    cfg, sd = load_canonical(tmp_path / "out")
    assert cfg == load_variant(variant)
    upstream = model.state_dict()
    assert len(upstream) == len(sd)
    for k, v in sd.items():
        assert torch.equal(upstream[to_diffusers_key(k)], v), k
