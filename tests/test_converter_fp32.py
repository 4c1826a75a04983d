"""Which canonical tensors stay float32 whatever the target dtype: a property of the canonical model, stated once per
family (`fp32_keys(cfg)`), read by fvconvert for every source format and by the optimized loaders. The wan DiT's
rule (manifests/wan/dit.py `dit_fp32_keys`) is checked against diffusers' own bf16 load (`upstream`-marked)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from converters import convert_to_state_dict, families
from manifests.wan import dit as wan_dit
from manifests.wan.model import load_model_variant


def test_wan_dit_rule_is_stated_once():
    import optimized.models.wan.spec as wan_spec

    assert families.get_family("wan", "transformer").fp32_keys is wan_dit.dit_fp32_keys
    assert wan_spec.dit_fp32_keys is wan_dit.dit_fp32_keys and not hasattr(wan_spec, "DIT_KEEP_FP32_MODULES")
    cfg = load_model_variant("tiny-2.1-i2v").dit
    pinned = {t.target for t in wan_spec.dit_component(cfg).transforms if t.dtype == "float32"}
    assert pinned == set(wan_dit.dit_fp32_keys(cfg)) and pinned


@pytest.mark.upstream
@pytest.mark.parametrize("variant", ["tiny-2.1-t2v", "tiny-2.1-i2v"])
def test_wan_dit_bf16_conversion_keeps_what_diffusers_keeps(tmp_path, monkeypatch, variant):
    """fvconvert --dtype bf16 of a diffusers WanTransformer3DModel gives every tensor the dtype diffusers'
    from_pretrained(torch_dtype=bfloat16) gives it (`_keep_in_fp32_modules` kept float32); the family rule
    emptied (the port forgets it) is caught."""
    diffusers = pytest.importorskip("diffusers")
    cfg = load_model_variant(variant).dit
    d = cfg.to_diffusers_config()
    d.pop("_class_name")
    torch.manual_seed(0)
    diffusers.WanTransformer3DModel(**d).save_pretrained(str(tmp_path / "src"))
    loaded = diffusers.WanTransformer3DModel.from_pretrained(str(tmp_path / "src"), torch_dtype=torch.bfloat16)
    want = {k: v.dtype for k, v in loaded.state_dict().items()}
    assert {torch.float32, torch.bfloat16} <= set(want.values())

    def wrong() -> list[str]:
        _, got = convert_to_state_dict("wan", "diffusers-transformer", tmp_path / "src", dtype="bfloat16")
        assert set(got) == set(want)
        return [f"{k}: {got[k].dtype} (diffusers {want[k]})" for k in want if got[k].dtype != want[k]]

    assert wrong() == []
    fam = families.get_family("wan", "transformer")
    monkeypatch.setitem(families._CACHE, ("wan", "transformer"), dataclasses.replace(fam, fp32_keys=lambda cfg: []))
    dropped = wrong()
    assert dropped and any(".time_embedder." in w for w in dropped) and any("scale_shift_table" in w for w in dropped)
