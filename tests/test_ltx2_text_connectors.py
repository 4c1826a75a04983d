"""ltx2 text connectors: reference vs optimized (C0-style, traced per block, a planted fault named), both against
upstream LTX2TextConnectors when diffusers is installed, keys against upstream's state dict."""

from __future__ import annotations

import pytest
import torch

from manifests.errors import ManifestError
from manifests.ltx2.connectors import (
    VARIANTS,
    Ltx2ConnectorsConfig,
    connector_gains,
    connector_key_shapes,
    load_connectors_variant,
)
from manifests.parity import Tolerance
from optimized.models.ltx2.connectors import load_connectors as fast_connectors
from parity.localise import first_divergence
from parity.port.kit import gain_init
from parity.weights import random_state_dict
from reference.ltx2.connectors import load_connectors as ref_connectors

TOL = Tolerance(rel_l2=1e-5)
TINY = ("tiny", "tiny-2.3")


def _inputs(c: Ltx2ConnectorsConfig, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 8, c.caption_channels * c.text_proj_in_factor, generator=g)
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, :3] = 0
    return h, mask


def _state(c, seed=0):
    return random_state_dict(connector_key_shapes(c), seed, gain_init(connector_gains(c)))


def _run(load, c, state, trace=None):
    with torch.no_grad():
        return load(c, state)(*_inputs(c), trace=trace)


@pytest.mark.parametrize("variant", TINY)
def test_reference_equals_optimized(variant):
    c = load_connectors_variant(variant)
    s = _state(c)
    for w, g in zip(_run(ref_connectors, c, s), _run(fast_connectors, c, s)):
        assert ((g.float() - w.float()).norm() / w.float().norm().clamp(min=1e-12)) < 1e-5


def test_fault_is_named_by_its_block():
    c = load_connectors_variant("tiny")
    s = _state(c)
    bad = dict(s)
    key = "audio_connector.transformer_blocks.0.ff.net.2.weight"
    bad[key] = bad[key] * 1.01
    want, got = {}, {}
    _run(ref_connectors, c, s, want.__setitem__)
    _run(fast_connectors, c, bad, got.__setitem__)
    div = first_divergence(got, want, TOL)
    assert div is not None and div.name == "audio_connector.transformer_blocks.0"


def test_registers_replace_the_left_padding():
    """With registers, a padded prompt's valid tokens move to the front: the output of sample 1 must not depend
    on what its padded positions held."""
    c = load_connectors_variant("tiny")
    s = _state(c)
    h, mask = _inputs(c)
    h2 = h.clone()
    h2[1, :3] = 100.0
    for load in (ref_connectors, fast_connectors):
        with torch.no_grad():
            a, b = load(c, s)(h, mask), load(c, s)(h2, mask)
        assert torch.equal(a[1][1], b[1][1]) or torch.allclose(a[1][1], b[1][1], atol=1e-6)


def test_config_refuses_mismatched_widths():
    with pytest.raises(ManifestError, match="connector"):
        Ltx2ConnectorsConfig(caption_channels=16, video_connector_num_attention_heads=2,
                             video_connector_attention_head_dim=4).validate()


@pytest.mark.upstream
@pytest.mark.parametrize("variant", TINY)
def test_both_sides_equal_upstream(variant):
    connectors = pytest.importorskip("diffusers.pipelines.ltx2.connectors")
    c = VARIANTS[variant]
    up = connectors.LTX2TextConnectors(**c.to_dict()).eval()
    assert {k: tuple(v.shape) for k, v in up.state_dict().items()} == connector_key_shapes(c)
    s = _state(c, seed=4)
    up.load_state_dict(s)
    h, mask = _inputs(c)
    with torch.no_grad():
        want = up(h, mask, padding_side="left")
        for load in (ref_connectors, fast_connectors):
            for w, g in zip(want, load(c, s)(h, mask)):
                assert ((g.float() - w.float()).norm() / w.float().norm()) < 1e-5
