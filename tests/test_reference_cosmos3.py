"""The reference on its own, against values worked out by hand from the upstream formulas."""

import pytest
import torch

from manifests.cosmos3 import canonical_key_shapes, load_variant
from manifests.cosmos3.io import Cosmos3ForwardInputs
from parity.weights import random_state_dict
from reference.cosmos3 import load_transformer, pack_sample
from reference.cosmos3.model import patchify, unpatchify

TINY = load_variant("tiny")


def inputs(**kw):
    base = dict(text_ids=torch.arange(5), vision_latents=torch.randn(1, 4, 3, 4, 6), timestep=937)
    base.update(kw)
    return Cosmos3ForwardInputs(**base)


def test_position_ids_by_hand_fps30():
    p = pack_sample(TINY, inputs(fps_vision=30.0))
    off = 5 + 15000
    # vision: t = i / (30/4) * (24/4) + off = 0.8 i + off; grid 3 x 2 x 3 patches
    assert p.position_ids.dtype == torch.float32 and p.position_ids.shape == (3, 5 + 18)
    assert torch.equal(p.position_ids[:, :5], torch.arange(5.0).expand(3, 5))
    t = p.position_ids[0, 5:].view(3, 6)[:, 0]
    assert torch.allclose(t, torch.tensor([off, off + 0.8, off + 1.6]), atol=2e-3)  # fp32 near 15000
    assert p.position_ids[1, 5:11].tolist() == [0, 0, 0, 1, 1, 1]
    assert p.position_ids[2, 5:11].tolist() == [0, 1, 2, 0, 1, 2]


def test_sound_and_action_positions_by_hand():
    p = pack_sample(TINY, inputs(sound_latents=torch.randn(8, 3), fps_sound=25.0,
                                 action_latents=torch.randn(2, 6), action_domain_id=0, action_condition_rows=(0,)))
    off = 5 + 15000
    sound = p.position_ids[0, p.sound_sequence_indexes]
    assert torch.allclose(sound, torch.tensor([0.0, 0.96, 1.92]) + off, atol=2e-3)  # 24/25 per sound frame
    action = p.position_ids[0, p.action_sequence_indexes]
    assert torch.allclose(action, torch.tensor([0.25, 0.5]) + off, atol=2e-3)  # (i+1) * 6/fps at fps 24
    assert p.action_mse_loss_indexes.tolist() == [p.action_sequence_indexes[1].item()]


def test_image_positions_are_integer_offsets():
    p = pack_sample(TINY, inputs(vision_latents=torch.randn(1, 4, 1, 2, 2)))
    assert p.position_ids[0, 5:].tolist() == [5 + 15000.0]  # T = 1 is never fps-modulated


def test_patchify_feature_order_and_padding():
    x = torch.randn(1, 4, 2, 3, 5)  # odd H and W -> padded to 4 x 6
    tokens = patchify(x, 2)
    assert tokens.shape == (2 * 2 * 3, 16)
    # token (t=1, h=0, w=2), feature (py=1, px=0, c=3) = latent[c=3, t=1, y=1, x=4]
    assert tokens[1 * 6 + 0 * 3 + 2, (1 * 2 + 0) * 4 + 3] == x[0, 3, 1, 1, 4]
    assert tokens[0 * 6 + 1 * 3 + 2, (1 * 2 + 1) * 4 + 0] == 0  # y = 3 is padding
    assert torch.equal(unpatchify(tokens, 2, 2, 3, 2, 4, 3, 5), x[0])


def test_conditioned_frames_exactly_zero_and_timestep_only_on_noisy():
    model = load_transformer(TINY, random_state_dict(canonical_key_shapes(TINY), 0))
    inp = inputs(vision_condition_frames=(0,))
    with torch.no_grad():
        pred = model(inp)
        assert torch.count_nonzero(pred.vision[0, :, 0]) == 0 and torch.count_nonzero(pred.vision[0, :, 1:]) > 0
        # the clean frame's embedding must not depend on the timestep; noisy frames must
        e1, e2 = {}, {}
        model(inp, trace=lambda n, t: e1.__setitem__(n, t))
        model(inputs(vision_condition_frames=(0,), timestep=10, vision_latents=inp.vision_latents,
                     text_ids=inp.text_ids), trace=lambda n, t: e2.__setitem__(n, t))
    clean = slice(5, 5 + 6)
    assert torch.equal(e1["embed"][clean], e2["embed"][clean])
    assert not torch.equal(e1["embed"][5 + 6:], e2["embed"][5 + 6:])


def test_load_refuses_mismatched_state():
    state = random_state_dict(canonical_key_shapes(TINY), 0)
    state.pop("vision_in.bias")
    with pytest.raises(ValueError, match="vision_in.bias"):
        load_transformer(TINY, state)
