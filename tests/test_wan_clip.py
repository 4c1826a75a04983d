"""Wan 2.1 I2V's CLIP image encoder, both sides (reference/wan/image_encoder.py, optimized/models/wan/image_encoder.py):
the upstream goldens (transformers CLIPVisionModel + CLIPImageProcessor), the C0 rows and their negative control,
the canonical keys against transformers, and bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from manifests import ManifestError
from manifests.wan.clip import (CLIP_VARIANTS, PROCESSOR_VARIANTS, CLIPImageProcessorConfig, CLIPVisionConfig,
                                clip_variant_for, clip_vision_key_shapes)
from parity.families.wan import clip as clip_checks
from parity.golden import load_case, run_probe
from parity.weights import random_state_dict

from optimized.models.wan.image_encoder import CLIPPixels, load_fast_clip
from reference.wan.image_encoder import load_clip_vision, preprocess_image

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "wan"
CASES = ("clip_vision", "clip_vision_quick")


@pytest.mark.parametrize("name", CASES)
def test_upstream_goldens_both_sides(name):
    case = load_case(GOLDEN / name)
    results = run_probe(clip_checks.golden_clip_probe, case, ("reference", "optimized"))
    assert len(results) >= 6 and all(r.passed for r in results), [(r.name, r.detail) for r in results if not r.passed]


def test_golden_localises_an_upstream_side_difference(tmp_path):
    """A layer-0 weight changed in the case's upstream weights: the embeds fail and the intermediates row names
    encoder.layers.0 (the first stored intermediate) for both sides."""
    import shutil

    from safetensors.torch import load_file, save_file

    case_dir = tmp_path / "clip_vision"
    shutil.copytree(GOLDEN / "clip_vision", case_dir)
    path = case_dir / "upstream" / "model.safetensors"
    state = load_file(str(path))
    state["encoder.layers.0.mlp.fc2.weight"][0, 0] += 1.0
    save_file(state, str(path))
    results = {r.name: r for r in run_probe(clip_checks.golden_clip_probe, load_case(case_dir),
                                            ("reference", "optimized"))}
    for side in ("reference", "optimized"):
        assert not results[f"clip_vision/{side}:image_embeds"].passed
        assert results[f"clip_vision/{side}:image_embeds@intermediates"].divergence == "encoder.layers.0"
    assert results["clip_vision/optimized:pixel_values"].passed   # the processor is not involved


def test_c0_rows_and_fault():
    cfg, pcfg = CLIP_VARIANTS["tiny"], PROCESSOR_VARIANTS["tiny"]
    state = random_state_dict(clip_vision_key_shapes(cfg), 3)
    from manifests.parity import Tolerance
    tol = Tolerance(rel_l2=1e-5)
    clean = clip_checks.clip_checks("t", cfg, pcfg, state, tol, "cpu", torch.float32, 0, None)
    assert [c.name for c in clean] == ["t/pixels", "t/image_embeds", "t/solo", "t/cache"]
    assert all(c.passed for c in clean)
    broken = clip_checks.clip_checks("t", cfg, pcfg, state, tol, "cpu", torch.float32, 0, clip_checks.FAULT)
    failed = [c for c in broken if not c.passed]
    assert [c.name for c in failed] == ["t/image_embeds"] and failed[0].divergence == "encoder.layers.0"


def test_keys_equal_transformers():
    pytest.importorskip("transformers")
    from transformers import CLIPVisionConfig as TC, CLIPVisionModel
    for name, cfg in CLIP_VARIANTS.items():
        if name != "tiny":   # the released size only as shapes (no 630M-parameter model on CPU)
            continue
        m = CLIPVisionModel(TC(**cfg.to_transformers_config()))
        assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == clip_vision_key_shapes(cfg)
    assert CLIPVisionConfig.from_transformers_config(CLIP_VARIANTS["wan2.1"].to_transformers_config()) == \
        CLIP_VARIANTS["wan2.1"]
    assert CLIP_VARIANTS["wan2.1"].num_tokens == 257 and clip_variant_for(1280) == "wan2.1"


def test_bad_input():
    cfg = CLIP_VARIANTS["tiny"]
    state = random_state_dict(clip_vision_key_shapes(cfg), 3)
    for encode in (load_clip_vision(cfg, state), load_fast_clip(cfg, state).forward):
        with pytest.raises(ValueError, match="pixels must be"):
            encode(torch.zeros(1, 3, 27, 28))
    with pytest.raises(KeyError, match="missing"):
        load_fast_clip(cfg, {k: v for k, v in state.items() if "layers.1." not in k})
    with pytest.raises(ManifestError, match="hidden_act"):
        CLIPVisionConfig(hidden_act="relu").validate()
    with pytest.raises(ManifestError, match="do_center_crop"):
        CLIPImageProcessorConfig.from_preprocessor_config({"do_center_crop": False})
    with pytest.raises(ManifestError, match="no single CLIP"):
        clip_variant_for(7)


def test_processors_agree_on_odd_sizes():
    """Both processors on images smaller than the crop, odd crops and extreme aspect ratios (exact)."""
    pcfg = CLIPImageProcessorConfig(shortest_edge=9, crop_height=11, crop_width=7)
    g = np.random.RandomState(0)
    images = [g.randint(0, 256, (h, w, 3)).astype(np.uint8) for h, w in ((5, 40), (33, 4), (9, 9), (12, 31))]
    want = torch.cat([preprocess_image(im, pcfg) for im in images])
    assert torch.equal(CLIPPixels(pcfg)(images), want)
    try:   # and both equal upstream's where transformers is installed
        from PIL import Image
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    except ImportError:
        return
    proc = CLIPImageProcessorPil(size={"shortest_edge": 9}, crop_size={"height": 11, "width": 7})
    upstream = proc(images=[Image.fromarray(im) for im in images], return_tensors="pt")["pixel_values"]
    assert torch.equal(want, upstream)


def test_unused_layers_are_declared_drops_not_loaded():
    """The layer after the one the pipeline reads and post_layernorm: declared `drop` (their shapes are checked at
    load, nothing of them is held); every other canonical key is loaded."""
    from optimized.models.wan.image_encoder import clip_component
    cfg = CLIP_VARIANTS["tiny"]
    spec = clip_component(cfg)
    drops = {t.sources[0] for t in spec.transforms if t.op == "drop"}
    assert drops == {k for k in clip_vision_key_shapes(cfg) if k.startswith(("post_layernorm.", "encoder.layers.2."))}
    fast = load_fast_clip(cfg, random_state_dict(clip_vision_key_shapes(cfg), 3))
    assert not any(k.startswith(("post_layernorm.", "encoder.layers.2.")) for k in fast.params)
    bad = random_state_dict(clip_vision_key_shapes(cfg), 3)
    bad["post_layernorm.weight"] = torch.zeros(9)
    with pytest.raises(Exception, match="post_layernorm.weight"):
        load_fast_clip(cfg, bad)
