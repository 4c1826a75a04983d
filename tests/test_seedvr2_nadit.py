"""seedvr2 NaDiT: reference and optimized against the upstream goldens (fp32, rel L2 <= 1e-5), window listings."""

from __future__ import annotations

import pytest
import torch

from manifests.seedvr2 import load_variant, nadit_from_upstream_config
from manifests.seedvr2.keys import CANONICAL_ROPE_SUFFIX, UPSTREAM_ROPE_SUFFIX
from optimized.models.seedvr2 import load_fast_nadit
from reference.seedvr2 import load_nadit, windows
from tests.test_seedvr2_goldens import load_case, rel_l2, upstream_weights

CASES = [("nadit3b_tiny_a", "tiny-3b"), ("nadit3b_tiny_b", "tiny-3b"), ("nadit7b_tiny", "tiny-7b")]
TOL = 1e-5


def canonical(sd):  # the converter's one suffix normalisation, inlined so this test does not need converters/
    return {k[: -len(UPSTREAM_ROPE_SUFFIX)] + CANONICAL_ROPE_SUFFIX if k.endswith(UPSTREAM_ROPE_SUFFIX) else k: v
            for k, v in sd.items()}


def call(model, i, **kw):
    with torch.no_grad():
        return model(i["vid"], i["vid_shape"], i["txt"], i["txt_shape"], i["timestep"], **kw)


@pytest.mark.parametrize("case, variant", CASES)
def test_window_listings_match_upstream(case, variant):
    _, meta, _, _ = load_case(case)
    for sample in meta["windows"]["samples"].values():
        grid = tuple(sample["token_grid_thw"])
        for method in ("regular", "shifted"):
            assert [[list(a) for a in box] for box in windows(grid, (4, 3, 3), method)] == sample[method]


@pytest.mark.parametrize("case, variant", CASES)
def test_config_from_case_matches_variant(case, variant):
    _, meta, _, _ = load_case(case)
    assert nadit_from_upstream_config(meta["config"]) == load_variant(variant)


@pytest.mark.parametrize("side", ["reference", "optimized"])
@pytest.mark.parametrize("case, variant", CASES)
def test_nadit_matches_golden(case, variant, side):
    d, _, inputs, outputs = load_case(case)
    cfg, state = load_variant(variant), canonical(upstream_weights(d))
    model = load_nadit(cfg, state) if side == "reference" else load_fast_nadit(cfg, state)
    trace = {}
    out = call(model, inputs, trace=lambda n, t: trace.__setitem__(n, t.clone()))
    assert rel_l2(out, outputs["vid_sample"]) <= TOL
    if inputs["vid_shape"].shape[0] == 1:
        for name in ("emb", "txt_in", "vid_in"):  # the intermediates the repacked goldens keep
            if name in outputs:
                assert rel_l2(trace[name].reshape(outputs[name].shape), outputs[name]) <= TOL, name


@pytest.mark.parametrize("side", ["reference", "optimized"])
def test_3b_batch_is_per_sample(side):
    """The 7B case's batched inputs through the 3B weights equal the two single-sample 3B goldens (upstream's
    multi-sample text q/k mix-up is a bug we do not reproduce)."""
    d, _, inputs, _ = load_case("nadit7b_tiny")
    da, _, _, out_a = load_case("nadit3b_tiny_a")
    _, _, _, out_b = load_case("nadit3b_tiny_b")
    cfg, state = load_variant("tiny-3b"), canonical(upstream_weights(da))
    model = load_nadit(cfg, state) if side == "reference" else load_fast_nadit(cfg, state)
    out = call(model, inputs)
    n = out_a["vid_sample"].shape[0]
    assert rel_l2(out[:n], out_a["vid_sample"]) <= TOL
    assert rel_l2(out[n:], out_b["vid_sample"]) <= TOL


def test_reference_refuses_bad_state():
    cfg = load_variant("tiny-3b")
    from manifests.seedvr2 import nadit_key_shapes
    state = {k: torch.zeros(s) for k, s in nadit_key_shapes(cfg).items()}
    state.pop("vid_out.proj.bias")
    with pytest.raises(KeyError, match="vid_out.proj.bias"):
        load_nadit(cfg, state)
