"""Released cosmos3 sizes (nano, super, edge): the upstream classes instantiated on the meta device (no weights
allocated) give the real release key/shape sets; every manifest must map them key for key onto the canonical
layout (or, for the reasoner, its `und` part) with nothing unexpected, dropped or missing.

  diffusers     Cosmos3OmniTransformer(**released config)                               (diffusers 0.42.1)
  framework     the diffusers set through cosmos-framework's own key mapping (_model_io.py), with and
                without the model.net. prefix of DCP exports
  diffusers-raw the diffusers set through the 2aa39f7 converter's raw naming
  transformers  Cosmos3OmniForConditionalGeneration (nano, super) / Cosmos3EdgeForConditionalGeneration (edge):
                state_dict() names and the names save_pretrained writes (revert_weight_conversion)

Plus tiny real-weight round trips through the upstream loaders themselves.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from converters import convert, convert_to_state_dict, load_canonical, load_manifest
from converters.engine import plan_conversion
from converters.families import cosmos3_from_transformers_config, get_family
from converters.readers import TensorInfo
from manifests.cosmos3 import Cosmos3Config, canonical_key_shapes, load_variant
from tests.conftest import ROOT
from tests.test_converter_formats import framework_key, raw_key, transformers_config, und_keys

pytestmark = pytest.mark.upstream

FAMILY = get_family("cosmos3")
RELEASED = ("nano", "super", "edge")
RELEASE_KEY_COUNTS = {"nano": 814, "super": 1430, "edge": 549}   # diffusers state dicts (models/cosmos3.md 3.1)


def diffusers_config(cfg: Cosmos3Config) -> dict:
    """The inverse of Cosmos3Config.from_diffusers_config: the released transformer/config.json values."""
    d = {
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size, "attention_bias": cfg.attention_bias, "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act, "qk_norm_for_text": cfg.qk_norm_for_text,
        "use_und_k_norm_for_gen": cfg.use_und_k_norm_for_gen, "rope_theta": cfg.rope_theta,
        "rope_axes_dim": list(cfg.rope_axes_dim), "latent_channel": cfg.latent_channels,
        "latent_patch_size": cfg.patch_size, "patch_latent_dim": cfg.patch_latent_dim,
        "timestep_scale": cfg.timestep_scale, "base_fps": int(cfg.base_fps),
        "enable_fps_modulation": cfg.enable_fps_modulation,
        "unified_3d_mrope_reset_spatial_ids": cfg.reset_spatial_ids,
        "unified_3d_mrope_temporal_modality_margin": cfg.temporal_modality_margin,
        "sound_gen": cfg.has_sound, "sound_dim": cfg.sound_dim, "sound_latent_fps": cfg.sound_latent_fps,
        "action_gen": cfg.has_action, "action_dim": cfg.action_dim, "num_embodiment_domains": cfg.num_embodiment_domains,
    }
    assert Cosmos3Config.from_diffusers_config(d) == cfg   # the inverse really is one
    return d


@pytest.fixture(scope="module")
def diffusers_release_sets() -> dict[str, dict[str, tuple[int, ...]]]:
    pytest.importorskip("diffusers")
    try:
        from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer
    except ImportError:
        pytest.skip("this diffusers has no Cosmos3OmniTransformer")
    out = {}
    for v in RELEASED:
        with torch.device("meta"):
            model = Cosmos3OmniTransformer(**diffusers_config(load_variant(v)))
        out[v] = {k: tuple(t.shape) for k, t in model.state_dict().items()}
        del model
    return out


def _plan(fmt: str, variant: str, keys: dict[str, tuple[int, ...]]):
    return plan_conversion(FAMILY, load_manifest("cosmos3", fmt), load_variant(variant),
                           {k: TensorInfo(k, Path("release.safetensors"), "bfloat16", s) for k, s in keys.items()})


@pytest.mark.parametrize("variant", RELEASED)
def test_diffusers_release_keyset(diffusers_release_sets, variant):
    keys = diffusers_release_sets[variant]
    assert len(keys) == RELEASE_KEY_COUNTS[variant]
    plan = _plan("diffusers", variant, keys)
    want = canonical_key_shapes(load_variant(variant))
    assert {e.target: e.shape for e in plan.entries} == want          # every canonical key, its shape
    assert sorted(e.source_key for e in plan.entries) == sorted(keys)  # from every release key
    assert not plan.dropped and not plan.sidecars and plan.parts["complete"]
    assert sum(math_prod(s) for s in keys.values()) == sum(math_prod(s) for s in want.values())


def math_prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("variant", RELEASED)
def test_framework_and_raw_release_keysets(diffusers_release_sets, variant):
    """The same release through cosmos-framework's own key mapping (and the 2aa39f7 raw naming)."""
    keys = diffusers_release_sets[variant]
    want = canonical_key_shapes(load_variant(variant))
    vit = {"language_model.visual.blocks.0.attn.qkv.weight": (3456, 1152),
           "language_model.visual.merger.linear_fc2.weight": (4096, 4608)}
    for fmt, mapped in (("framework", {framework_key(k): s for k, s in keys.items()}),
                        ("framework", {"model.net." + framework_key(k): s for k, s in keys.items()}
                         | {"model.net." + k: s for k, s in vit.items()}),
                        ("diffusers-raw", {raw_key(k): s for k, s in keys.items()})):
        assert len(mapped) >= len(keys)
        plan = _plan(fmt, variant, mapped)
        assert {e.target: e.shape for e in plan.entries} == want, fmt
        assert not plan.dropped
        assert len(plan.sidecars) == (len(vit) if any(k.startswith("model.net.") for k in mapped) else 0)


@pytest.fixture(scope="module")
def transformers_release_sets() -> dict[str, tuple[dict, dict, dict]]:
    pytest.importorskip("transformers")
    try:
        from transformers import (Cosmos3EdgeConfig, Cosmos3EdgeForConditionalGeneration, Cosmos3OmniConfig,
                                  Cosmos3OmniForConditionalGeneration)
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        pytest.skip("this transformers has no Cosmos3Omni/Cosmos3Edge reasoner")
    out = {}
    for v in RELEASED:
        d = transformers_config(load_variant(v))
        tc = {k: x for k, x in d["text_config"].items() if k != "model_type"}
        if d["model_type"] == "cosmos3_edge":
            conf, cls = Cosmos3EdgeConfig(text_config=tc), Cosmos3EdgeForConditionalGeneration
        else:
            conf, cls = Cosmos3OmniConfig(text_config=tc), Cosmos3OmniForConditionalGeneration
        with torch.device("meta"):
            model = cls(conf)
        sd = model.state_dict()
        module = {k: tuple(t.shape) for k, t in sd.items()}
        saved = {k: tuple(t.shape) for k, t in revert_weight_conversion(model, dict(sd)).items()}
        out[v] = (module, saved, conf.to_dict())
        del model
    return out


@pytest.mark.parametrize("variant", RELEASED)
def test_transformers_reasoner_release_keyset(transformers_release_sets, variant):
    module, saved, conf = transformers_release_sets[variant]
    cfg = load_variant(variant)
    # the config mapping recovers every field a reasoner config determines
    fields = cosmos3_from_transformers_config(conf)
    assert {k: (list(x) if isinstance(x, tuple) else x) for k, x in fields.items()} == \
        {k: x for k, x in cfg.to_dict().items() if k in fields}
    und = set(und_keys(cfg))
    want = {k: s for k, s in canonical_key_shapes(cfg).items() if k in und}
    for layout, keys in (("module", module), ("saved", saved)):
        plan = _plan("transformers", variant, keys)
        assert {e.target: e.shape for e in plan.entries} == want, layout
        assert plan.parts["filled"] == ["und"] and plan.parts["unfilled"] == [p for p in FAMILY.part_keys(cfg) if p != "und"]
        assert not plan.dropped, layout
        vision = [k for k in keys if "visual" in k or "projector" in k or k.startswith(
            ("blocks.", "merger.", "patch_embed.", "pos_embed.", "deepstack_merger_list."))]
        assert len(plan.sidecars) == len(vision) > 0, layout
        assert len(plan.entries) + len(plan.sidecars) == len(keys)


# ------------------------------------------------------------------------------------------------
# real (tiny) weights through the upstream loaders


GOLDEN = ROOT / "golden" / "cosmos3"


@pytest.mark.parametrize("case", ["silu_sound_action_i2v", "relu2_edge_action"])
def test_transformers_loads_and_saves_what_we_convert(tmp_path, case):
    """transformers' own loader reads the golden case's diffusers weights (its cosmos3 key mapping, generator
    tensors ignored), save_pretrained writes its reasoner checkpoint; fvconvert --from transformers must give
    exactly the und tensors fvconvert --from diffusers gives."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as tlog

    upstream = GOLDEN / case / "upstream"
    cfg, want = convert_to_state_dict("cosmos3", "diffusers", upstream)
    tconf = transformers_config(cfg)
    tconf["vision_config"] = ({"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "num_patches": 16, "patch_size": 4}
                              if tconf["model_type"] == "cosmos3_edge" else
                              {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                               "out_hidden_size": cfg.hidden_size, "deepstack_visual_indexes": [0],
                               "num_position_embeddings": 16, "patch_size": 4})
    if tconf["model_type"] == "cosmos3_edge":
        tconf["projector_hidden_size"] = 24
    tconf["text_config"].pop("model_type")
    unified = tmp_path / "unified"
    unified.mkdir()
    shutil.copy(upstream / "diffusion_pytorch_model.safetensors", unified / "model.safetensors")
    (unified / "config.json").write_text(json.dumps(tconf))
    tlog.set_verbosity_error()
    model = AutoModelForImageTextToText.from_pretrained(unified, dtype=torch.float32)
    assert type(model).__name__ in ("Cosmos3OmniForConditionalGeneration", "Cosmos3EdgeForConditionalGeneration")
    model.save_pretrained(tmp_path / "reasoner")
    rep = convert("cosmos3", "transformers", tmp_path / "reasoner", tmp_path / "out", skip_parity=True,
                  keep_sidecars=True)
    assert rep.unexpected == [] and rep.missing == [] and rep.parts["filled"] == ["und"]
    assert rep.sidecars["vision_encoder"]["keys"] > 0
    got_cfg, got = load_canonical(tmp_path / "out", parts=["und"])
    assert sorted(got) == sorted(und_keys(cfg))
    for k, v in got.items():
        assert torch.equal(v, want[k]), k
    # and the unified folder itself converts as the reasoner too (generator tensors dropped with a reason)
    rep2 = convert("cosmos3", "transformers", unified, tmp_path / "out2", skip_parity=True)
    assert len(rep2.dropped) == len(want) - len(got)
