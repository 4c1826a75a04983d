"""Provenance across update_weights (issue 22, F5 / F6): every component derived from the resident instance (the
media chain: VAE and decode kernel; the processor) is rebuilt from the new weights, and every result carries the
weights version it was computed with (a video in flight across `update_weights(policy="finish")` keeps, and is
labelled with, the version it started on)."""

import torch

from manifests.wan.sampling import WanGenerateRequest
from optimized import Engine

VARIANT = "tiny-2.1-t2v"


def request(seed: int = 3) -> WanGenerateRequest:
    return WanGenerateRequest(text_ids=torch.arange(1, 6), num_frames=5, height=32, width=32, num_steps=2,
                              guidance_scale=1.0, seed=seed)


def new_weights(eng: Engine, seed: int = 11) -> dict:
    return eng.family.random_weights(eng.model.cfg, seed)


def fresh(eng: Engine, weights: dict, version: str) -> Engine:
    return Engine.from_weights(eng.model.cfg, weights, weights_version=version)


def test_after_update_weights_a_video_decodes_with_the_new_vae():
    """F5: the cached media chain decoded with the old VAE (frames 255 off a fresh engine's)."""
    eng = Engine.from_variant(VARIANT)
    eng.generate_video(request())              # builds (and caches) the media chain on the old weights
    weights = new_weights(eng)
    eng.update_weights(weights, version="v2")
    got = eng.generate_video(request())
    want = fresh(eng, weights, "v2").generate_video(request())
    assert torch.equal(got.frames, want.frames), \
        f"frames differ by up to {int((got.frames.int() - want.frames.int()).abs().max())} from a fresh engine's"
    assert got.weights_version == "v2"
    assert eng.generate_video(request()).frames.shape == want.frames.shape


def test_a_video_in_flight_across_an_update_is_computed_and_labelled_on_its_old_version():
    """F6: it was computed with the old weights but labelled with the new version."""
    eng = Engine.from_variant(VARIANT)
    old_version = eng.model.weights_version
    want_old = Engine.from_variant(VARIANT).generate_video(request())
    weights = new_weights(eng)
    program = eng.start_video(request())
    eng.step()                                 # the denoise stage is running on the old instance
    assert program.stage == "denoise" and program.status == "running"
    eng.update_weights(weights, version="v2", policy="finish")
    later = eng.start_video(request(), request_id="after")
    done = program.result()
    assert done.weights_version == old_version
    assert torch.equal(done.frames, want_old.frames)
    after = later.result()
    assert after.weights_version == "v2"
    assert torch.equal(after.frames, fresh(eng, weights, "v2").generate_video(request()).frames)


def test_a_request_handle_names_the_version_it_ran_on():
    eng = Engine.from_variant(VARIANT)
    old_version = eng.model.weights_version
    before = eng.submit(request())
    eng.step()
    eng.update_weights(new_weights(eng), version="v2", policy="finish")
    after = eng.submit(request())
    eng.run_until_idle()
    assert before.weights_version == old_version and after.weights_version == "v2"
    assert not torch.equal(before.result()["latents"]["vision"], after.result()["latents"]["vision"])
