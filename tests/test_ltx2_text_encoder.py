"""ltx2 Gemma 3 text path: reference vs optimized on the tiny spec (left padding, sliding + full layers, GQA,
linear RoPE scaling on the full layers), a planted fault, and both sides against transformers' Gemma 3 text model
(the pipeline's oracle) when transformers is installed. Padded positions are compared only where defined (the
connectors drop them; upstream leaves them unspecified)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from manifests.errors import ManifestError
from manifests.ltx2.gemma3 import TINY, Gemma3TextSpec, gemma3_key_shapes
from optimized.models.ltx2.gemma3 import FastGemma3Text
from reference.ltx2.gemma3 import hidden_states

SPEC = dataclasses.replace(TINY, rope_global_linear_factor=8.0, num_hidden_layers=3,
                           layer_types=("sliding_attention", "sliding_attention", "full_attention"))


def _weights(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: 0.3 * torch.randn(shape, generator=g) for k, shape in gemma3_key_shapes(spec).items()}


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SPEC.vocab_size, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, :3] = 0                                                   # Gemma pads on the left
    return ids, mask


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_reference_equals_optimized():
    w = _weights(SPEC)
    ids, mask = _inputs()
    want, got = hidden_states(w, SPEC, ids, mask), FastGemma3Text(SPEC, w)(ids, mask)
    assert want.shape == (2, 8, SPEC.hidden_size, SPEC.num_hidden_layers + 1)
    assert _rel(got, want) < 1e-5


def test_fault_in_one_layer_shows_from_that_layer_on():
    w = _weights(SPEC)
    ids, mask = _inputs()
    bad = dict(w)
    key = "layers.1.mlp.down_proj.weight"        # one output channel: a uniform scale would vanish in the post-norm
    bad[key] = w[key].clone()
    bad[key][0] *= 1.5
    want, got = hidden_states(w, SPEC, ids, mask), FastGemma3Text(SPEC, bad)(ids, mask)
    per_state = [_rel(got[..., k], want[..., k]) for k in range(want.shape[-1])]
    assert per_state[0] < 1e-6 and per_state[1] < 1e-6 and per_state[2] > 1e-4     # state 2 = layer 1's output


def test_refusals():
    with pytest.raises(ManifestError, match="multiple"):
        Gemma3TextSpec(num_attention_heads=3, num_key_value_heads=2).validate()
    with pytest.raises(ManifestError, match="bidirectional"):
        Gemma3TextSpec.from_transformers_config({"use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="keys"):
        FastGemma3Text(SPEC, {})


@pytest.mark.upstream
def test_both_sides_equal_transformers():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma3TextConfig(
        vocab_size=SPEC.vocab_size, hidden_size=SPEC.hidden_size, intermediate_size=SPEC.intermediate_size,
        num_hidden_layers=SPEC.num_hidden_layers, num_attention_heads=SPEC.num_attention_heads,
        num_key_value_heads=SPEC.num_key_value_heads, head_dim=SPEC.head_dim,
        query_pre_attn_scalar=SPEC.query_pre_attn_scalar, sliding_window=SPEC.sliding_window,
        layer_types=list(SPEC.layer_types),
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    assert Gemma3TextSpec.from_transformers_config(cfg.to_dict()) == SPEC
    model = transformers.Gemma3TextModel(cfg).eval()
    w = _weights(SPEC, seed=2)
    model.load_state_dict(w)
    ids, mask = _inputs()
    with torch.no_grad():
        want = torch.stack(model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states, -1)
    valid = mask.bool()
    for got in (hidden_states(w, SPEC, ids, mask), FastGemma3Text(SPEC, w)(ids, mask)):
        assert _rel(got[valid], want[valid]) < 1e-5
