"""seedvr2 converter (fvconvert seedvr2 --from official_pth): released key sets covered by the manifest, the one
suffix normalisation, strict refusals that name the key and write nothing, converted goldens pass both sides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from converters import ConversionError, load_canonical
from converters.engine import convert, plan_conversion
from converters.families import get_family
from converters.manifest import load_manifest
from converters.readers import TensorInfo
from manifests.seedvr2 import load_variant
from optimized.models.seedvr2 import load_fast_nadit
from reference.seedvr2 import load_nadit
from tests.test_seedvr2_goldens import golden_file, load_case, rel_l2

FAMILY, FORMAT = "seedvr2", "official_pth"


def released_infos(name: str) -> dict[str, TensorInfo]:
    infos = {}
    for line in golden_file(name).read_text().splitlines():
        key, shape = line.split("\t")
        infos[key] = TensorInfo(key, Path(name), "float32", tuple(int(x) for x in shape.strip("()").split(",") if x))
    return infos


@pytest.mark.parametrize("keys_file, variant, n", [("nadit3b_full_keys.txt", "3b", 635),
                                                    ("nadit7b_full_keys.txt", "7b", 1128)])
def test_released_key_sets_match_manifest(keys_file, variant, n):
    infos = released_infos(keys_file)
    assert len(infos) == n
    plan = plan_conversion(get_family(FAMILY), load_manifest(FAMILY, FORMAT), load_variant(variant), infos)
    assert len(plan.entries) == n and not plan.dropped
    renamed = [e for e in plan.entries if e.target.endswith(".attn.rope.freqs")]
    assert len(renamed) == load_variant(variant).num_layers


def _write(tmp_path: Path, sd: dict) -> Path:
    p = tmp_path / "upstream_weights.pth"
    torch.save(sd, p)
    return p


def _golden_state():
    d, _, _, _ = load_case("nadit3b_tiny_b")
    return torch.load(d, weights_only=True)


@pytest.mark.parametrize("damage, key", [
    ("extra", "blocks.0.attn.extra.weight"),
    ("missing", "vid_out.proj.bias"),
    ("duplicate", "blocks.1.attn.rope.freqs"),
    ("shape", "blocks.2.attn.proj_qkv.all.weight"),
])
def test_refusals_name_the_key_and_write_nothing(tmp_path, damage, key):
    sd = _golden_state()
    if damage == "extra":
        sd[key] = torch.zeros(3)
    elif damage == "missing":
        del sd[key]
    elif damage == "duplicate":  # already-normalised key beside the upstream one: two sources, one target
        sd[key] = sd["blocks.1.attn.rope.rope.freqs"].clone()
    elif damage == "shape":
        sd[key] = sd[key][:-1]
    src, out = _write(tmp_path, sd), tmp_path / "out"
    with pytest.raises(ConversionError) as e:
        convert(FAMILY, FORMAT, src, out, variant="tiny-3b")
    assert key in str(e.value)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))]


def test_truncation_needs_the_flag(tmp_path):
    sd = {k: v for k, v in _golden_state().items() if not k.startswith("blocks.3.")}
    src = _write(tmp_path, sd)
    with pytest.raises(ConversionError, match="truncate"):
        convert(FAMILY, FORMAT, src, tmp_path / "out", variant="tiny-3b")
    convert(FAMILY, FORMAT, src, tmp_path / "out", variant="tiny-3b", allow_truncate=True)
    cfg, state = load_canonical(tmp_path / "out")
    assert cfg.num_layers == 3 and "blocks.2.attn.rope.freqs" in state


@pytest.mark.parametrize("case, variant", [("nadit3b_tiny_a", "tiny-3b"), ("nadit7b_tiny", "tiny-7b")])
def test_converted_golden_passes_both_sides(tmp_path, case, variant):
    d, _, i, o = load_case(case)
    convert(FAMILY, FORMAT, d, tmp_path / "out", variant=variant)
    cfg, state = load_canonical(tmp_path / "out")
    assert cfg == load_variant(variant)
    for model in (load_nadit(cfg, state), load_fast_nadit(cfg, state)):
        with torch.no_grad():
            out = model(i["vid"], i["vid_shape"], i["txt"], i["txt_shape"], i["timestep"])
        assert rel_l2(out, o["vid_sample"]) <= 1e-5


def test_released_vae_key_set_matches_manifest():
    from manifests.seedvr2 import load_vae_variant, vae_key_shapes
    infos = released_infos("vae_full_keys.txt")
    assert {k: i.shape for k, i in infos.items()} == vae_key_shapes(load_vae_variant("released"))
