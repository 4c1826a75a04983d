"""Every cosmos3 upstream format: tiny checkpoints in each upstream layout (built by the documented inverse
mappings, written out below independently of the manifests' regexes), converted and compared bit for bit;
golden cases re-expressed in each layout; partial (reasoner) checkpoints; the manifest rule ops
(split / fuse / transpose / reshape / sidecar / normalize); bad inputs; inspect.

Inverse mappings used to build sources (upstream text, transcribed):
  diffusers -> framework : cosmos-framework cosmos_framework/inference2/_model_io.py `_DIFFUSERS_KEY_MAPPING_RES`
  framework -> raw       : diffusers scripts/convert_cosmos3_to_diffusers.py @ 2aa39f7 (language_model.state_dict()
                           keys + vae2llm/llm2vae + time_embedder.linear_* + sound2llm/llm2sound)
  diffusers -> transformers (module names) : transformers conversion_mapping.py "cosmos3_omni" / "cosmos3_edge"
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import ConversionError, convert, convert_to_state_dict, inspect_source, load_canonical, load_manifest
from converters.cli import main, render_bar
from converters.engine import plan_conversion
from converters.families import get_family
from converters.manifest import CheckpointManifest
from converters.readers import TensorInfo
from manifests.cosmos3 import Cosmos3Config, canonical_key_shapes, load_variant
from tests.conftest import ROOT
from tests.test_converters import DIFFUSERS_CONFIGS, assert_nothing_left, canonical_state, to_diffusers_key

FAMILY = get_family("cosmos3")
FORMATS = ("diffusers", "diffusers-raw", "framework", "transformers")
GOLDEN = ROOT / "golden" / "cosmos3"

# ------------------------------------------------------------------------------------------------
# inverse mappings (canonical -> diffusers is tests.test_converters.to_diffusers_key)

# cosmos-framework _model_io.py: diffusers key -> OmniMoTModel.net key (applied in order, every pattern)
NET_FROM_DIFFUSERS = [
    (r"^action_proj_in\.", "action2llm."), (r"^action_proj_out\.", "llm2action."), (r"^audio_proj_in\.", "sound2llm."),
    (r"^audio_proj_out\.", "llm2sound."), (r"^audio_modality_embed$", "sound_modality_embed"), (r"^proj_in\.", "vae2llm."),
    (r"^proj_out\.", "llm2vae."), (r"^time_embedder\.linear_1\.", "time_embedder.mlp.0."),
    (r"^time_embedder\.linear_2\.", "time_embedder.mlp.2."),
    (r"\.self_attn\.to_q\.", ".self_attn.q_proj."), (r"\.self_attn\.to_k\.", ".self_attn.k_proj."),
    (r"\.self_attn\.to_v\.", ".self_attn.v_proj."), (r"\.self_attn\.to_out\.", ".self_attn.o_proj."),
    (r"\.self_attn\.norm_q\.", ".self_attn.q_norm."), (r"\.self_attn\.norm_k\.", ".self_attn.k_norm."),
    (r"\.self_attn\.add_q_proj\.", ".self_attn.q_proj_moe_gen."), (r"\.self_attn\.add_k_proj\.", ".self_attn.k_proj_moe_gen."),
    (r"\.self_attn\.add_v_proj\.", ".self_attn.v_proj_moe_gen."), (r"\.self_attn\.to_add_out\.", ".self_attn.o_proj_moe_gen."),
    (r"\.self_attn\.norm_added_q\.", ".self_attn.q_norm_moe_gen."), (r"\.self_attn\.norm_added_k\.", ".self_attn.k_norm_moe_gen."),
    (r"^model\.lm_head\.", "language_model.lm_head."), (r"^lm_head\.", "language_model.lm_head."),
    (r"^(embed_tokens\.|layers\.|norm(?:_moe_gen)?\.)(.*)$", r"language_model.model.\1\2"),
]
# transformers conversion_mapping.py, "cosmos3_omni" (checkpoint -> module names)
TF_FROM_DIFFUSERS = [
    (r"^(layers\.|embed_tokens\.|norm\.)", r"model.language_model.\1"),
    (r"^(blocks\.|merger\.|patch_embed\.|pos_embed\.|deepstack_merger_list\.)", r"model.visual.\1"),
    (r"\.self_attn\.to_q\.", ".self_attn.q_proj."), (r"\.self_attn\.to_k\.", ".self_attn.k_proj."),
    (r"\.self_attn\.to_v\.", ".self_attn.v_proj."), (r"\.self_attn\.to_out\.", ".self_attn.o_proj."),
    (r"\.self_attn\.norm_q\.", ".self_attn.q_norm."), (r"\.self_attn\.norm_k\.", ".self_attn.k_norm."),
]
# ... and "cosmos3_edge" adds the dense MLP names
TF_EDGE_EXTRA = [(r"\.mlp\.up_proj\.", ".mlp.fc1."), (r"\.mlp\.down_proj\.", ".mlp.fc2.")]


def _subs(key: str, table) -> str:
    for a, b in table:
        key = re.sub(a, b, key)
    return key


def framework_key(diffusers_key: str) -> str:
    return _subs(diffusers_key, NET_FROM_DIFFUSERS)


def raw_key(diffusers_key: str) -> str:
    k = framework_key(diffusers_key).removeprefix("language_model.")
    return k.replace("time_embedder.mlp.0.", "time_embedder.linear_1.").replace("time_embedder.mlp.2.", "time_embedder.linear_2.")


def transformers_module_key(diffusers_key: str, edge: bool) -> str:
    return _subs(diffusers_key, TF_FROM_DIFFUSERS + (TF_EDGE_EXTRA if edge else []))


def is_edge(cfg: Cosmos3Config) -> bool:
    return cfg.hidden_act == "relu2" and not cfg.qk_norm_for_text


def reasoner_representable(cfg: Cosmos3Config) -> bool:
    """Qwen3-VL text towers are silu + q/k-norm; the Edge tower is relu2 without q/k-norm."""
    return (cfg.hidden_act == "silu" and cfg.qk_norm_for_text) or is_edge(cfg)


def transformers_config(cfg: Cosmos3Config) -> dict:
    """The inverse of converters.families.cosmos3_from_transformers_config (a transformers config.json)."""
    edge = is_edge(cfg)
    tc = {"model_type": "cosmos3_edge_text" if edge else "qwen3_vl_text", "hidden_size": cfg.hidden_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
          "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": cfg.hidden_act,
          "attention_bias": cfg.attention_bias,
          "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, "mrope_section": list(cfg.rope_axes_dim)}}
    return {"model_type": "cosmos3_edge" if edge else "cosmos3_omni",
            "architectures": ["Cosmos3EdgeForConditionalGeneration" if edge else "Cosmos3OmniForConditionalGeneration"],
            "text_config": tc, "vision_config": {}, "tie_word_embeddings": False}


def und_keys(cfg: Cosmos3Config) -> list[str]:
    return FAMILY.part_keys(cfg)["und"]


def source_keys(fmt: str, cfg: Cosmos3Config, *, prefix: str = "", tf_layout: str = "saved") -> dict[str, str]:
    """{canonical key: key in format `fmt`} for every canonical key the format holds."""
    keys = canonical_key_shapes(cfg)
    if fmt == "diffusers":
        return {k: to_diffusers_key(k) for k in keys}
    if fmt == "diffusers-raw":
        return {k: raw_key(to_diffusers_key(k)) for k in keys}
    if fmt == "framework":
        return {k: prefix + framework_key(to_diffusers_key(k)) for k in keys}
    if fmt == "transformers":
        edge = is_edge(cfg)
        if tf_layout == "saved":  # transformers 5 save_pretrained reverses its mapping: diffusers names
            return {k: to_diffusers_key(k) for k in und_keys(cfg)}
        return {k: transformers_module_key(to_diffusers_key(k), edge) for k in und_keys(cfg)}
    raise ValueError(fmt)


def write_source(root: Path, fmt: str, canon: dict[str, torch.Tensor], cfg: Cosmos3Config, diffusers_config: dict, *,
                 kind: str = "safetensors", prefix: str = "", tf_layout: str = "saved",
                 extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `canon` (canonical tensors) as a checkpoint folder in upstream format `fmt`."""
    root.mkdir(parents=True, exist_ok=True)
    sd = {src: canon[k] for k, src in source_keys(fmt, cfg, prefix=prefix, tf_layout=tf_layout).items()}
    sd.update(extra or {})
    names = {"diffusers": "diffusion_pytorch_model", "diffusers-raw": "diffusion_pytorch_model",
             "framework": "model", "transformers": "model"}
    stem = names[fmt]
    if kind == "safetensors":
        save_file(sd, str(root / f"{stem}.safetensors"))
    elif kind == "sharded":
        keys = list(sd)
        wm = {}
        for j in range(2):
            name = f"{stem}-{j + 1:05d}-of-00002.safetensors"
            save_file({k: sd[k] for k in keys[j::2]}, str(root / name))
            wm.update({k: name for k in keys[j::2]})
        (root / f"{stem}.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    elif kind == "torch":
        torch.save(sd, root / ({"framework": "model.pt", "transformers": "pytorch_model.bin"}.get(fmt, f"{stem}.bin")))
    else:
        raise ValueError(kind)
    if fmt in ("diffusers", "diffusers-raw"):
        (root / "config.json").write_text(json.dumps(diffusers_config))
    elif fmt == "transformers":
        (root / "config.json").write_text(json.dumps(transformers_config(cfg)))
    return root


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def infos_of(keys: dict[str, tuple[int, ...]], dtype: str = "bfloat16") -> dict[str, TensorInfo]:
    return {k: TensorInfo(k, Path("w.safetensors"), dtype, tuple(s)) for k, s in keys.items()}


# ------------------------------------------------------------------------------------------------
# manifests


def test_every_format_has_a_valid_manifest(capsys):
    assert FAMILY.formats() == sorted(FORMATS)
    for fmt in FORMATS:
        m = load_manifest("cosmos3", fmt)
        assert m.schema.endswith("/2") and m.conversion_version >= 1 and m.upstream["source"]
        assert m.parity.level == "C0" and m.parity.required
        assert m.dtype_policy.allowed_source_dtypes
        for r in m.rules:
            assert r.match.startswith("^") and r.match.endswith("$")
            assert r.op not in ("drop", "sidecar") or r.reason
    assert load_manifest("cosmos3", "transformers").fills == ("und",)
    assert load_manifest("cosmos3", "transformers").parity.unfilled_parts == "placeholders"
    assert load_manifest("cosmos3", "framework").config_file is None
    assert load_manifest("cosmos3", "diffusers-raw").upstream["revision"].startswith("2aa39f7")
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    assert all(f in out for f in FORMATS)


def test_parts_partition_the_canonical_layout():
    for v in ("tiny", "tiny-edge", "nano", "super", "edge"):
        cfg = load_variant(v)
        parts = FAMILY.part_keys(cfg)
        flat = [k for ks in parts.values() for k in ks]
        assert sorted(flat) == sorted(canonical_key_shapes(cfg)) and len(flat) == len(set(flat))
        assert "lm_head.weight" in parts["und"] and "time_embed.linear_1.weight" in parts["gen"]
        if cfg.has_und_k_norm_for_gen:
            assert "layers.0.und.k_norm_for_gen.weight" in parts["gen"]
    assert list(FAMILY.part_keys(load_variant("edge"))) == ["und", "gen", "vision_heads", "action_heads"]


@pytest.mark.parametrize("variant", ["tiny", "tiny-edge", "nano", "super", "edge"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_manifest_maps_every_key_of_every_variant(fmt, variant):
    """Headers only: the format's key set (documented inverse mapping) plans onto exactly the canonical set."""
    cfg = load_variant(variant)
    if fmt == "transformers" and not reasoner_representable(cfg):
        pytest.skip("no transformers reasoner has this text tower")
    shapes = canonical_key_shapes(cfg)
    layouts = {"transformers": ["saved", "module"], "framework": ["", "model.net."]}.get(fmt, [""])
    m = load_manifest("cosmos3", fmt)
    for lay in layouts:
        src = source_keys(fmt, cfg, prefix=lay if fmt == "framework" else "",
                          tf_layout=lay if fmt == "transformers" else "saved")
        plan = plan_conversion(FAMILY, m, cfg, infos_of({s: shapes[k] for k, s in src.items()}))
        assert {e.target: e.source_key for e in plan.entries} == src
        assert not plan.dropped and not plan.sidecars
        want_unfilled = [p for p in FAMILY.part_keys(cfg) if p != "und"] if fmt == "transformers" else []
        assert plan.parts["unfilled"] == want_unfilled


# ------------------------------------------------------------------------------------------------
# round trips, all formats, tiny variants: identical canonical bytes whatever the source format


@pytest.mark.parametrize("variant", ["tiny", "tiny-edge"])
def test_all_formats_convert_to_identical_canonical_weights(tmp_path, variant):
    cfg = load_variant(variant)
    canon = canonical_state(variant, seed=7)
    dcfg = DIFFUSERS_CONFIGS[variant]
    outs = {}
    for fmt, kind in (("diffusers", "safetensors"), ("diffusers-raw", "sharded"), ("framework", "torch"),
                      ("transformers", "safetensors")):
        src = write_source(tmp_path / f"src-{fmt}", fmt, canon, cfg, dcfg, kind=kind,
                           prefix="model.net." if fmt == "framework" else "")
        out = tmp_path / f"out-{fmt}"
        rep = convert("cosmos3", fmt, src, out, variant=variant, skip_parity=True)
        assert rep.unexpected == [] and rep.missing == [] and rep.dropped == [], fmt
        parts = load_canonical(out, parts=["und"])[1] if fmt == "transformers" else load_canonical(out)[1]
        for k, v in parts.items():
            assert torch.equal(v, canon[k]), (fmt, k)
        outs[fmt] = out
        assert {c: d["keys"] for c, d in rep.components.items()} == {
            p: len(ks) for p, ks in FAMILY.part_keys(cfg).items() if fmt != "transformers" or p == "und"}
    # the generator formats yield byte-identical canonical checkpoints: one C0 result covers all of them
    ref = outs["diffusers"]
    for fmt in ("diffusers-raw", "framework"):
        assert sha256(outs[fmt] / "model.safetensors") == sha256(ref / "model.safetensors"), fmt
        assert (outs[fmt] / "config.json").read_text() == (ref / "config.json").read_text(), fmt
    # the reasoner's und tensors equal the generator formats' und tensors
    und_r = load_canonical(outs["transformers"], parts=["und"])[1]
    und_d = load_canonical(ref, parts=["und"])[1]
    assert und_r.keys() == und_d.keys() and all(torch.equal(und_r[k], und_d[k]) for k in und_d)


@pytest.mark.parametrize("fmt", ["diffusers-raw", "framework"])
def test_c0_post_check_passes_for_generator_formats(tmp_path, fmt):
    """The real post-check (parity's C0, fp32 CPU) on each generator format's converted weights."""
    from parity.families.cosmos3 import check_converted

    cfg = load_variant("tiny-edge")
    src = write_source(tmp_path / "s", fmt, canonical_state("tiny-edge", seed=4), cfg, DIFFUSERS_CONFIGS["tiny-edge"])
    rep = convert("cosmos3", fmt, src, tmp_path / "o", variant="tiny-edge", post_check=check_converted)
    assert rep.parity["status"] == "pass" and rep.parity["level"] == "C0" and rep.parity["checks"] > 10
    assert rep.parity["required_level"] == "C0" and "scope" not in rep.parity


def test_framework_layout_variants(tmp_path):
    """model.net. prefix or not, wrapper components, .pt or safetensors, vision encoder dropped or kept, config
    from --variant or --config."""
    cfg = load_variant("tiny")
    canon = canonical_state("tiny", seed=1)
    vit = {"language_model.visual.blocks.0.attn.qkv.weight": torch.randn(6, 4),
           "language_model.visual.merger.linear_fc1.weight": torch.randn(4, 4)}
    src = write_source(tmp_path / "a", "framework", canon, cfg, {}, kind="safetensors", extra=vit)
    rep = convert("cosmos3", "framework", src, tmp_path / "oa", variant="tiny", skip_parity=True)
    assert rep.sidecars["vision_encoder"]["kept"] is False and rep.sidecars["vision_encoder"]["keys"] == 2
    assert "vision encoder" in rep.sidecars["vision_encoder"]["reason"]
    assert not (tmp_path / "oa" / "vision_encoder").exists()
    assert rep.config_source == {"kind": "variant", "variant": "tiny", "undetermined_fields": []}
    # kept as a sidecar, with the model.net. prefix and a torch.compile wrapper component, config from a file
    pref = {f"model.net.{k}": v for k, v in vit.items()}
    src = write_source(tmp_path / "b", "framework", canon, cfg, {}, kind="torch", prefix="model.net.", extra=pref)
    sd = torch.load(src / "model.pt", weights_only=True)
    k0 = "model.net.language_model.model.layers.0.mlp.up_proj.weight"
    sd[k0.replace("layers.0.", "layers.0._orig_mod.")] = sd.pop(k0)
    torch.save(sd, src / "model.pt")
    (tmp_path / "tcfg.json").write_text(json.dumps(DIFFUSERS_CONFIGS["tiny"]))
    rep = convert("cosmos3", "framework", src, tmp_path / "ob", config=tmp_path / "tcfg.json", keep_sidecars=True,
                  skip_parity=True)
    assert rep.source["kind"] == "torch" and len(rep.normalized) == len(sd)
    side = load_file(str(tmp_path / "ob" / "vision_encoder" / "model.safetensors"))
    assert set(side) == {"blocks.0.attn.qkv.weight", "merger.linear_fc1.weight"}
    assert torch.equal(side["blocks.0.attn.qkv.weight"], vit["language_model.visual.blocks.0.attn.qkv.weight"])
    _, got = load_canonical(tmp_path / "ob")   # the sidecar folder is not part of the canonical checkpoint
    assert all(torch.equal(got[k], canon[k]) for k in canon)
    assert any(o["path"] == "vision_encoder/model.safetensors" for o in rep.outputs)
    # no config anywhere and no variant: a clear refusal
    with pytest.raises(ConversionError, match="--variant NAME"):
        convert("cosmos3", "framework", src, tmp_path / "oc")
    assert_nothing_left(tmp_path / "oc")


def test_normalisation_collision_is_an_error(tmp_path):
    cfg = load_variant("tiny")
    canon = canonical_state("tiny")
    dup = {"language_model.lm_head.weight": canon["lm_head.weight"].clone()}
    src = write_source(tmp_path / "s", "framework", canon, cfg, {}, prefix="model.net.", extra=dup)
    with pytest.raises(ConversionError) as ei:
        convert("cosmos3", "framework", src, tmp_path / "o", variant="tiny")
    msg = str(ei.value)
    assert "model.safetensors" in msg and "'model.net.language_model.lm_head.weight'" in msg
    assert "'language_model.lm_head.weight'" in msg and "both normalise to" in msg
    assert_nothing_left(tmp_path / "o")


# ------------------------------------------------------------------------------------------------
# the reasoner: a clearly labelled partial checkpoint


def test_reasoner_partial_checkpoint(tmp_path, capsys):
    cfg = load_variant("tiny-edge")
    canon = canonical_state("tiny-edge", seed=3)
    vit = {"model.visual.embeddings.patch_embedding.weight": torch.randn(8, 12),
           "model.projector.linear_fc1.weight": torch.randn(8, 8)}
    src = write_source(tmp_path / "r", "transformers", canon, cfg, {}, tf_layout="module", extra=vit)
    out = tmp_path / "o"
    assert main(["cosmos3", "--from", "transformers", str(src), str(out), "--skip-parity", "--keep-sidecars"]) == 0
    text = capsys.readouterr().out
    # no --variant: the fields a reasoner config does not determine take the family defaults (no action head)
    assert "PARTIAL checkpoint: holds und; not filled by this format: gen, vision_heads" in text
    assert "fields not determined by the source" in text
    rep = json.loads((out / "conversion_report.json").read_text())
    assert rep["parts"]["filled"] == ["und"] and rep["parts"]["unfilled"] == ["gen", "vision_heads"]
    assert rep["parts"]["complete"] is False and "lm_head" in rep["parts"]["descriptions"]["und"]
    assert rep["unexpected"] == [] and rep["missing"] == []
    assert "latent_channels" in rep["config_source"]["undetermined_fields"]
    assert json.loads((out / "manifest.json").read_text())["parts"]["unfilled"] == ["gen", "vision_heads"]
    assert set(load_file(str(out / "vision_encoder" / "model.safetensors"))) == {
        "embeddings.patch_embedding.weight", "projector.linear_fc1.weight"}
    # the generator refuses it; the reasoner part loads
    with pytest.raises(ConversionError, match=r"partial canonical checkpoint.*holds part\(s\) und only.*"
                                              r"lacks gen, vision_heads, which.*parts=\['und'\]"):
        load_canonical(out)
    with pytest.raises(ConversionError, match="does not hold part"):
        load_canonical(out, parts=["und", "gen"])
    got_cfg, und = load_canonical(out, parts=["und"])
    assert sorted(und) == sorted(und_keys(cfg)) and all(torch.equal(und[k], canon[k]) for k in und)
    assert got_cfg.hidden_size == cfg.hidden_size and got_cfg.qk_norm_for_text is False
    # a full checkpoint serves the reasoner part too
    dsrc = write_source(tmp_path / "d", "diffusers", canon, cfg, DIFFUSERS_CONFIGS["tiny-edge"])
    convert("cosmos3", "diffusers", dsrc, tmp_path / "full", skip_parity=True)
    assert load_canonical(tmp_path / "full", parts=["und"])[1].keys() == und.keys()


def test_reasoner_config_completed_from_variant(tmp_path):
    cfg = load_variant("tiny")
    canon = canonical_state("tiny")
    src = write_source(tmp_path / "r", "transformers", canon, cfg, {})
    rep = convert("cosmos3", "transformers", src, tmp_path / "o", variant="tiny", skip_parity=True)
    assert rep.variant["status"] == "match" and rep.config_source["completed_from_variant"] == "tiny"
    assert load_canonical(tmp_path / "o", parts=["und"])[0] == cfg       # the whole config, as the variant has it
    with pytest.raises(ConversionError, match=r"config\.json: the source config is not variant 'tiny-edge'.*hidden_act"):
        convert("cosmos3", "transformers", src, tmp_path / "o2", variant="tiny-edge")
    assert_nothing_left(tmp_path / "o2")


def test_reasoner_reads_the_unified_release_root(tmp_path):
    """The unified release root (transformer/ + vision_encoder/ under one index, transformers config): the
    diffusers format takes everything (vision encoder as a sidecar), the reasoner format the und part with the
    generator tensors dropped, each with its reason."""
    cfg = load_variant("tiny")
    canon = canonical_state("tiny", seed=5)
    root = tmp_path / "Cosmos3-Tiny"
    tdir = write_source(root / "transformer", "diffusers", canon, cfg, DIFFUSERS_CONFIGS["tiny"])
    (root / "vision_encoder").mkdir()
    vit = {"blocks.0.attn.qkv.weight": torch.randn(6, 4), "pos_embed.weight": torch.randn(4, 4)}
    save_file(vit, str(root / "vision_encoder" / "model.safetensors"))
    wm = {k: "transformer/diffusion_pytorch_model.safetensors" for k in load_file(str(tdir / "diffusion_pytorch_model.safetensors"))}
    wm.update({k: "vision_encoder/model.safetensors" for k in vit})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (root / "config.json").write_text(json.dumps(transformers_config(cfg)))
    (root / "model_index.json").write_text("{}")

    rep = convert("cosmos3", "diffusers", root, tmp_path / "full", skip_parity=True, keep_sidecars=True)
    assert rep.source["config"].endswith("transformer/config.json") and rep.parts["complete"]
    assert rep.sidecars["vision_encoder"]["keys"] == 2
    assert all(torch.equal(v, canon[k]) for k, v in load_canonical(tmp_path / "full")[1].items())
    rep = convert("cosmos3", "transformers", root, tmp_path / "und", skip_parity=True)
    n_gen = sum(len(ks) for p, ks in FAMILY.part_keys(cfg).items() if p != "und")
    assert len(rep.dropped) == n_gen and all("--from diffusers" in d["reason"] for d in rep.dropped)
    assert rep.parts["filled"] == ["und"] and rep.sidecars["vision_encoder"]["keys"] == 2
    info = inspect_source(root)
    assert info["best"] == "cosmos3/diffusers" and info["kind"] == "safetensors_index"
    # an index entry that leaves the folder is refused
    wm["lm_head.weight"] = "../elsewhere/x.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(ConversionError, match="not a plain shard file name"):
        convert("cosmos3", "diffusers", root, tmp_path / "bad")
    assert_nothing_left(tmp_path / "bad")


def test_reasoner_post_check_runs_c0_with_placeholders(tmp_path):
    """The real C0 post-check on a partial checkpoint: a temporary copy completed with seeded placeholders
    (both engines load the converted und weights; every gen layer attends to und keys/values)."""
    from parity.families.cosmos3 import check_converted

    cfg = load_variant("tiny-edge")
    canon = canonical_state("tiny-edge", seed=2)
    src = write_source(tmp_path / "r", "transformers", canon, cfg, {})
    seen = []

    def check(d: Path) -> dict:
        seen.append(sorted(p.name for p in d.iterdir()))
        return check_converted(d)

    rep = convert("cosmos3", "transformers", src, tmp_path / "o", variant="tiny-edge", post_check=check)
    assert rep.parity["status"] == "pass" and rep.parity["level"] == "C0" and not rep.parity["failed"]
    assert rep.parity["scope"]["checked_parts"] == ["und"] and rep.parity["scope"]["placeholder_parts"]
    assert seen == [["config.json", "manifest.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json"]]
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["config.json", "conversion_report.json",
                                                                  "manifest.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if ".fvconvert-" in p.name]


# ------------------------------------------------------------------------------------------------
# golden cases expressed in every format


def _golden_state(case: Path):
    from converters import convert_diffusers_dir_to_canonical_state_dict
    return convert_diffusers_dir_to_canonical_state_dict(case / "upstream")


def _golden_results(case: Path, cfg, state) -> list:
    from manifests.cosmos3.io import Cosmos3Prediction
    from parity.families.cosmos3 import c0 as pc
    from parity.golden import load_case

    c = load_case(case)
    inp = pc.golden_inputs(c).validate(cfg)
    want = Cosmos3Prediction(vision=c.outputs["pred_vision"], sound=c.outputs.get("pred_sound"),
                             action=c.outputs.get("pred_action"))
    ref = pc.run_reference(pc.load_reference(cfg, state, "cpu", torch.float32), inp)
    fast = pc.run_optimized(pc.load_optimized(cfg, state, "cpu", torch.float32), [inp])[0]
    return pc.compare_predictions(f"{case.name}/reference", ref, want, c.tolerance) + \
        pc.compare_predictions(f"{case.name}/optimized", fast, want, c.tolerance)


@pytest.mark.parametrize("case", sorted(p.name for p in GOLDEN.iterdir()  # transformer cases (not processor ones)
                                         if json.loads((p / "case.json").read_text())["probe"] == "cosmos3.transformer"))
def test_golden_cases_through_every_format(tmp_path, case):
    """Each golden case's upstream weights, re-expressed in every other layout (documented inverse mappings),
    convert to exactly the canonical tensors the case's own layout gives; transformer-probe cases then pass
    against the upstream outputs on both sides with those weights."""
    case_dir = GOLDEN / case
    meta = json.loads((case_dir / "case.json").read_text())
    if meta["upstream_format"] == "transformers":      # a reasoner case (probe cosmos3.reason)
        rep = convert("cosmos3", "transformers", case_dir / "upstream", tmp_path / "o", skip_parity=True)
        assert rep.unexpected == [] and rep.missing == [] and rep.dropped == [] and rep.parts["filled"] == ["und"]
        cfg, want = load_canonical(tmp_path / "o", parts=["und"])
        saved = load_file(str(case_dir / "upstream" / "model.safetensors"))
        module = {transformers_module_key(k, is_edge(cfg)): v for k, v in saved.items()}   # state_dict() names
        (tmp_path / "m").mkdir()
        save_file(module, str(tmp_path / "m" / "model.safetensors"))
        (tmp_path / "m" / "config.json").write_text((case_dir / "upstream" / "config.json").read_text())
        _, got = convert_to_state_dict("cosmos3", "transformers", tmp_path / "m")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        return
    assert meta["upstream_format"] == "diffusers"
    dcfg = json.loads((case_dir / "upstream" / "config.json").read_text())
    cfg, want = _golden_state(case_dir)
    for fmt in ("diffusers-raw", "framework", "transformers"):
        if fmt == "transformers" and not reasoner_representable(cfg):
            continue
        src = write_source(tmp_path / fmt, fmt, want, cfg, dcfg)
        cfg_file = case_dir / "upstream" / "config.json" if fmt == "framework" else None
        got_cfg, got = convert_to_state_dict("cosmos3", fmt, src, config=cfg_file)
        assert got.keys() == (set(und_keys(cfg)) if fmt == "transformers" else want.keys()), fmt
        assert all(torch.equal(got[k], want[k]) for k in got), fmt
        if fmt == "transformers":
            assert all(getattr(got_cfg, f) == getattr(cfg, f) for f in ("hidden_size", "num_layers", "num_heads",
                       "num_kv_heads", "head_dim", "intermediate_size", "vocab_size", "rope_theta", "rope_axes_dim",
                       "rms_norm_eps", "hidden_act", "qk_norm_for_text", "attention_bias"))
            got = {**want, **got}          # the reasoner's und part + the generator's other parts
        else:
            assert got_cfg == cfg
        if meta["probe"] != "cosmos3.transformer":
            continue   # a pipeline/generate case: identical canonical weights are what this test checks
        results = _golden_results(case_dir, cfg, got)
        assert results and all(r.passed for r in results), (fmt, [(r.name, r.metrics) for r in results if not r.passed])


# ------------------------------------------------------------------------------------------------
# rule ops: split / fuse / transpose / reshape, through a custom manifest (a tensor-parallel style export)


def _fused_manifest(tmp_path: Path) -> Path:
    d = json.loads((ROOT / "manifests/cosmos3/checkpoints/diffusers.json").read_text())
    d["format"] = "fused-test"
    d["description"] = "test layout: fused und qkv, gate|up fused, vocab-sharded embedding, transposed vision_in"
    d["rules"] = [
        {"op": "split", "name": "und.qkv", "match": r"^layers\.(\d+)\.self_attn\.qkv\.weight$", "dim": 0,
         "to": [r"layers.\1.und.q_proj.weight", r"layers.\1.und.k_proj.weight", r"layers.\1.und.v_proj.weight"]},
        {"op": "split", "name": "und.gate_up", "match": r"^layers\.(\d+)\.mlp\.gate_up_proj\.weight$", "dim": 0,
         "to": [r"layers.\1.und.mlp.gate_proj.weight", r"layers.\1.und.mlp.up_proj.weight"]},
        {"op": "fuse", "name": "embed shards", "match": r"^embed_tokens\.shard(\d)\.weight$", "to": "embed_tokens.weight",
         "dim": 0, "part": r"\1", "parts": ["0", "1"]},
        {"op": "transpose", "name": "vision_in^T", "match": r"^proj_in_t\.weight$", "to": "vision_in.weight", "dims": [1, 0]},
        {"op": "reshape", "name": "action_in 3d", "match": r"^action_proj_in\.fc3d\.weight$", "to": "action_in.weight"},
    ] + d["rules"]
    p = tmp_path / "fused-test.json"
    p.write_text(json.dumps(d))
    return p


def _fused_source(tmp_path: Path, canon: dict, cfg) -> Path:
    sd = {to_diffusers_key(k): v for k, v in canon.items()}
    for i in range(cfg.num_layers):
        q, k, v = (sd.pop(f"layers.{i}.self_attn.to_{x}.weight") for x in "qkv")
        sd[f"layers.{i}.self_attn.qkv.weight"] = torch.cat([q, k, v])
        g, u = (sd.pop(f"layers.{i}.mlp.{x}_proj.weight") for x in ("gate", "up"))
        sd[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat([g, u])
    e = sd.pop("embed_tokens.weight")
    sd["embed_tokens.shard0.weight"], sd["embed_tokens.shard1.weight"] = e[:50].clone(), e[50:].clone()
    sd["proj_in_t.weight"] = sd.pop("proj_in.weight").t().contiguous()
    sd["action_proj_in.fc3d.weight"] = sd.pop("action_proj_in.fc.weight").reshape(cfg.num_embodiment_domains,
                                                                                  cfg.action_dim, cfg.hidden_size)
    src = tmp_path / "src"
    src.mkdir()
    torch.save(sd, src / "diffusion_pytorch_model.bin")     # a memory-mapped pickle: sources are released per use
    (src / "config.json").write_text(json.dumps(DIFFUSERS_CONFIGS["tiny"]))
    return src


def test_split_fuse_transpose_reshape(tmp_path, capsys):
    cfg = load_variant("tiny")
    canon = canonical_state("tiny", seed=9)
    man = _fused_manifest(tmp_path)
    src = _fused_source(tmp_path, canon, cfg)
    rep = convert("cosmos3", str(man), src, tmp_path / "o", dtype="bf16", skip_parity=True)
    _, got = load_canonical(tmp_path / "o")
    for k, v in canon.items():
        want = v if k.startswith("time_embed.") else v.to(torch.bfloat16)
        assert torch.equal(got[k], want), k
    ops = rep.components["und"]["ops"]
    assert ops["split"] == 5 * cfg.num_layers and ops["fuse"] == 1
    assert rep.components["vision_heads"]["ops"] == {"transpose": 1, "rename": 3}
    assert rep.components["action_heads"]["ops"]["reshape"] == 1
    fused = next(r for r in rep.renamed if r["to"] == "embed_tokens.weight")
    assert fused["from"] == ["embed_tokens.shard0.weight", "embed_tokens.shard1.weight"] and fused["op"] == "fuse"
    # in memory too, and through the CLI with --from pointing at the manifest file
    _, sd = convert_to_state_dict("cosmos3", str(man), src)
    assert all(torch.equal(sd[k], canon[k]) for k in canon)
    assert main(["cosmos3", "--from", str(man), str(src), str(tmp_path / "o2"), "--skip-parity", "-q"]) == 0


@pytest.mark.parametrize("breakage, needles", [
    (lambda sd: sd.__setitem__("layers.0.self_attn.qkv.weight", torch.zeros(127, 64)),
     ["layers.0.self_attn.qkv.weight", "split targets", "need 128 along dim 0"]),
    (lambda sd: sd.pop("embed_tokens.shard1.weight"),
     ["'embed_tokens.weight' (fuse of ['0', '1']) lacks part(s) ['1']", "embed_tokens.shard0.weight"]),
    (lambda sd: sd.__setitem__("embed_tokens.shard7.weight", torch.zeros(1, 64)),
     ["embed_tokens.shard7.weight", "part '7'", "only parts ['0', '1']"]),
    (lambda sd: sd.__setitem__("proj_in_t.weight", torch.zeros(64, 16)),
     ["proj_in_t.weight", "transposed by [1, 0]", "[64, 16]"]),
    (lambda sd: sd.__setitem__("action_proj_in.fc3d.weight", torch.zeros(4, 6, 63)),
     ["action_proj_in.fc3d.weight", "1512 elements", "[4, 384]"]),
    (lambda sd: sd.__setitem__("embed_tokens.shard1.weight", torch.zeros(78, 64, dtype=torch.float16)),
     ["different dtypes", "embed_tokens.shard0.weight"]),
])
def test_rule_op_errors(tmp_path, breakage, needles):
    cfg = load_variant("tiny")
    man = _fused_manifest(tmp_path)
    src = _fused_source(tmp_path, canonical_state("tiny"), cfg)
    sd = torch.load(src / "diffusion_pytorch_model.bin", weights_only=True)
    breakage(sd)
    torch.save(sd, src / "diffusion_pytorch_model.bin")
    with pytest.raises(ConversionError) as ei:
        convert("cosmos3", str(man), src, tmp_path / "o")
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))
    assert "diffusion_pytorch_model.bin" in str(ei.value)
    assert_nothing_left(tmp_path / "o")


def _base_manifest() -> dict:
    return json.loads((ROOT / "manifests/cosmos3/checkpoints/framework.json").read_text())


@pytest.mark.parametrize("breakage, needle", [
    (lambda d: d["rules"].append({"op": "split", "match": "^a$", "to": "x", "dim": 0}), "list of at least two"),
    (lambda d: d["rules"].append({"op": "split", "match": "^a$", "to": ["x", "y"]}), "needs 'dim'"),
    (lambda d: d["rules"].append({"op": "transpose", "match": "^a$", "to": "x", "dims": [0, 1]}), "other than the identity"),
    (lambda d: d["rules"].append({"op": "transpose", "match": "^a$", "to": "x", "dims": [0, 2]}), "permutation"),
    (lambda d: d["rules"].append({"op": "fuse", "match": "^a(\\d)$", "to": "x", "dim": 0, "part": "\\1", "parts": ["0"]}),
     "at least two distinct"),
    (lambda d: d["rules"].append({"op": "fuse", "match": "^a$", "to": "x", "dim": 0, "part": "\\1", "parts": ["0", "1"]}),
     "refers to group"),
    (lambda d: d["rules"].append({"op": "rename", "match": "^a$", "to": "x", "dim": 0}), "unknown fields ['dim']"),
    (lambda d: d["rules"].append({"op": "sidecar", "match": "^a$", "to": "x", "sidecar": "Bad Name", "reason": "r"}),
     "folder name"),
    (lambda d: d["rules"].append({"op": "sidecar", "match": "^a$", "to": "x", "sidecar": "vit"}), "needs a 'reason'"),
    (lambda d: d["normalize"].append({"op": "strip_prefix", "prefix": "model.net"}), "ending in '.'"),
    (lambda d: d["normalize"].append({"op": "remove_component", "component": "a.b"}), "dot-free"),
    (lambda d: d["normalize"].append({"op": "lowercase"}), "op 'lowercase' unknown"),
    (lambda d: d.__setitem__("parity", {"level": "C9"}), "parity.level"),
    (lambda d: d.__setitem__("parity", {"level": "C0", "unfilled_parts": "zeros"}), "unfilled_parts"),
    (lambda d: d["files"]["weights"].append({"kind": "safetensors", "path": "../x.safetensors"}), "relative path"),
    (lambda d: d["files"]["weights"].append({"kind": "safetensors", "path": "x.safetensors", "sha256": "abc"}), "64 lower-case"),
    (lambda d: d["upstream"].__setitem__("color", "red"), "upstream: unknown fields"),
    (lambda d: d.__setitem__("fills", []), "non-empty list"),
])
def test_bad_manifest_fields_are_refused(breakage, needle):
    d = _base_manifest()
    breakage(d)
    with pytest.raises(ConversionError, match="checkpoint manifest broken.json") as ei:
        CheckpointManifest.from_dict(d, origin="broken.json")
    assert needle in str(ei.value)


def test_manifest_family_checks(tmp_path):
    d = _base_manifest()
    d["fills"] = ["und", "brain"]
    p = tmp_path / "m.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ConversionError, match=r"fills names unknown part\(s\) \['brain'\]"):
        load_manifest("cosmos3", str(p))
    d = _base_manifest()
    d["config_mapping"] = "nope"
    p.write_text(json.dumps(d))
    with pytest.raises(ConversionError, match="config_mapping 'nope' unknown"):
        load_manifest("cosmos3", str(p))


def test_expected_files_with_sha256(tmp_path):
    cfg = load_variant("tiny")
    src = write_source(tmp_path / "s", "framework", canonical_state("tiny"), cfg, {})
    (src / "checkpoint.json").write_text('{"step": 1}')
    d = _base_manifest()
    d["format"] = "pinned"
    d["files"]["expected"] = [{"path": "checkpoint.json", "sha256": hashlib.sha256(b'{"step": 1}').hexdigest()}]
    d["files"]["weights"] = [{"kind": "safetensors", "path": "model.safetensors", "sha256": sha256(src / "model.safetensors")}]
    p = tmp_path / "pinned.json"
    p.write_text(json.dumps(d))
    rep = convert("cosmos3", str(p), src, tmp_path / "ok", variant="tiny", skip_parity=True)
    assert any(i["path"].endswith("checkpoint.json") for i in rep.inputs)
    (src / "checkpoint.json").write_text('{"step": 2}')
    with pytest.raises(ConversionError, match=r"checkpoint\.json: sha256 .* differs from the .* manifest cosmos3/pinned expects"):
        convert("cosmos3", str(p), src, tmp_path / "o1", variant="tiny")
    assert_nothing_left(tmp_path / "o1")
    (src / "checkpoint.json").unlink()
    with pytest.raises(ConversionError, match=r"checkpoint\.json: file expected by manifest cosmos3/pinned is missing"):
        convert("cosmos3", str(p), src, tmp_path / "o2", variant="tiny")
    (src / "checkpoint.json").write_text('{"step": 1}')
    sd = load_file(str(src / "model.safetensors"))
    sd["language_model.lm_head.weight"] *= 2
    save_file(sd, str(src / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"model\.safetensors: sha256 .* differs"):
        convert("cosmos3", str(p), src, tmp_path / "o3", variant="tiny")
    assert_nothing_left(tmp_path / "o3")


# ------------------------------------------------------------------------------------------------
# bad inputs in the new layouts: one line naming the file and key, exit 2, nothing in OUT


def _mut(name: str, fn):
    def apply(src: Path) -> None:
        f = src / name
        sd = load_file(str(f))
        fn(sd)
        save_file(sd, str(f))
    return apply


def _truncate_fw(src: Path) -> None:
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-700])


def _header_fw(src: Path) -> None:
    f = src / "model.safetensors"
    b = bytearray(f.read_bytes())
    b[8:20] = b"\xff" * 12
    f.write_bytes(bytes(b))


def _training_pickle(src: Path) -> None:
    torch.save({"model": load_file(str(src / "model.safetensors")), "optimizer": {}, "iteration": 100}, src / "model.pt")
    (src / "model.safetensors").unlink()


BAD = {
    # name: (format, corruption, extra argv, substrings that the one error line must hold)
    "fw-truncated": ("framework", _truncate_fw, ["--variant", "tiny"], ["model.safetensors", "not a readable safetensors"]),
    "fw-corrupt-header": ("framework", _header_fw, ["--variant", "tiny"], ["model.safetensors", "header"]),
    "fw-training-pickle": ("framework", _training_pickle, ["--variant", "tiny"], ["model.pt", "'model'", "flat"]),
    "fw-wrong-shape": ("framework", _mut("model.safetensors", lambda sd: sd.__setitem__(
        "language_model.model.layers.2.mlp_moe_gen.down_proj.weight", torch.zeros(64, 95))), ["--variant", "tiny"],
        ["model.safetensors", "language_model.model.layers.2.mlp_moe_gen.down_proj.weight", "[64, 95]", "[64, 96]"]),
    "fw-wrong-variant": ("framework", None, ["--variant", "tiny-edge"], ["model.safetensors", "unexpected key"]),
    "raw-nan": ("diffusers-raw", _mut("diffusion_pytorch_model.safetensors", lambda sd: sd["vae2llm.weight"].__setitem__(
        (0, 0), float("inf"))), [], ["diffusion_pytorch_model.safetensors", "'vae2llm.weight'", "Inf"]),
    "raw-as-diffusers": ("diffusers", None, [], ["unexpected key", "--from diffusers-raw"]),
    "tf-missing-key": ("transformers", _mut("model.safetensors", lambda sd: sd.pop("layers.1.self_attn.norm_k.weight")), [],
                       ["model.safetensors", "missing key", "layers.1.und.k_norm.weight"]),
    "tf-diffusers-config": ("transformers", lambda s: (s / "config.json").write_text(json.dumps(DIFFUSERS_CONFIGS["tiny"])),
                            [], ["config.json", "model_type is None", "cosmos3_omni"]),
    "tf-vision-shape": ("transformers", _mut("model.safetensors", lambda sd: sd.__setitem__(
        "layers.0.self_attn.to_out.weight", torch.zeros(64, 63))), [],
        ["model.safetensors", "layers.0.self_attn.to_out.weight", "[64, 63]"]),
    "unknown-format": ("gguf", None, [], ["unknown format 'gguf'", "framework", "transformers"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_inputs_new_formats_cli(tmp_path, capsys, name):
    fmt, corrupt, argv, needles = BAD[name]
    cfg = load_variant("tiny")
    base = {"raw-as-diffusers": "diffusers-raw", "unknown-format": "framework"}.get(name, fmt)
    src = write_source(tmp_path / "src", base, canonical_state("tiny"), cfg, DIFFUSERS_CONFIGS["tiny"])
    if corrupt is not None:
        corrupt(src)
    out = tmp_path / "out"
    rc = main(["cosmos3", "--from", fmt, str(src), str(out), "--skip-parity", *argv])
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.startswith("fvconvert: error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in cap.err + cap.out, cap.err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert_nothing_left(out)


def test_required_parity_without_a_post_check(tmp_path, capsys, monkeypatch):
    import converters.cli as cli

    src = write_source(tmp_path / "s", "framework", canonical_state("tiny"), load_variant("tiny"), {})
    monkeypatch.setattr(cli, "get_post_check", lambda name: None)
    rc = main(["cosmos3", "--from", "framework", str(src), str(tmp_path / "o"), "--variant", "tiny"])
    err = capsys.readouterr().err
    assert rc == 2 and "requires C0 parity after conversion" in err and "--skip-parity" in err
    assert_nothing_left(tmp_path / "o")


# ------------------------------------------------------------------------------------------------
# inspect, progress


def test_inspect_guesses_every_format(tmp_path, capsys):
    cfg = load_variant("tiny-edge")
    canon = canonical_state("tiny-edge")
    for fmt in FORMATS:
        src = write_source(tmp_path / fmt, fmt, canon, cfg, DIFFUSERS_CONFIGS["tiny-edge"],
                           prefix="model.net." if fmt == "framework" else "")
        info = inspect_source(src)
        assert info["best"] == f"cosmos3/{fmt}", (fmt, [(g["format"], g["strict"]) for g in info["guesses"]])
        best = next(g for g in info["guesses"] if g["format"] == info["best"])
        assert best["strict"] == "ok"
        if fmt == "framework":
            assert best["variant"] == "tiny-edge" and best["normalized"] == len(canon)
    assert main(["inspect", str(tmp_path / "framework")]) == 0
    text = capsys.readouterr().out
    assert "cosmos3/framework" in text and "as variant tiny-edge (--variant tiny-edge)" in text
    assert main(["inspect", str(tmp_path / "transformers")]) == 0
    assert "PARTIAL: fills und; lacks gen, vision_heads" in capsys.readouterr().out


def test_progress_bar():
    line = render_bar({"done": 3, "total": 10, "done_bytes": 3 * 2**30, "total_bytes": 10 * 2**30, "elapsed_s": 2.0})
    assert line.startswith("[########") and " 30% 3/10 tensors 3.00/10.00 GiB 1.61 GB/s ETA 5s" in line


def test_progress_updates(tmp_path):
    src = write_source(tmp_path / "s", "framework", canonical_state("tiny"), load_variant("tiny"), {})
    ups, lines = [], []
    convert("cosmos3", "framework", src, tmp_path / "o", variant="tiny", progress=lines.append,
            progress_update=ups.append)
    assert ups[-1]["done"] == ups[-1]["total"] == len(ups) and ups[-1]["done_bytes"] == ups[-1]["total_bytes"]
    assert not any("tensors written" in ln for ln in lines) and any(ln.startswith("done:") for ln in lines)


def test_readers_return_fresh_memory_and_release_mapped_pages(tmp_path):
    """Safetensors data comes from plain reads (fresh buffers, nothing memory-mapped stays resident); a
    memory-mapped torch pickle hands its pages back after use and re-reads them on demand."""
    from converters.readers import SafetensorsReader, TorchReader

    sd = {"a": torch.randn(300, 700), "b": torch.arange(10, dtype=torch.float16), "empty": torch.zeros(0, 3)}
    save_file(sd, str(tmp_path / "w.safetensors"))
    with SafetensorsReader(tmp_path / "w.safetensors") as r:
        x = r.get("a")
        x.mul_(0)                                 # writable, and not the file: a second read is unchanged
        assert torch.equal(r.get("a"), sd["a"]) and torch.equal(r.get("b"), sd["b"]) and r.get("empty").shape == (0, 3)
    torch.save(sd, tmp_path / "w.pt")
    r = TorchReader(tmp_path / "w.pt")
    assert r.mapped
    before = r.get("a").clone()
    r.release("a")
    assert torch.equal(r.get("a"), before)
    r.close()
