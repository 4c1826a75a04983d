"""The engine and its WorkUnit scheduler: refusal at submission, admission by reservation, batching across
requests, cancellation at step boundaries (reservation and cache freed), preemption, events."""

import math

import pytest
import torch

from manifests.cosmos3 import canonical_key_shapes, load_variant
from manifests.cosmos3.sampling import ActionSpec, Cosmos3GenerateRequest, UniPCConfig
from optimized import Engine, RequestRejected
from parity.weights import random_state_dict
from reference.cosmos3 import generate, load_transformer

CFG = load_variant("tiny")
STATE = random_state_dict(canonical_key_shapes(CFG), 3)


def request(seed=1, guidance=4.0, steps=3, **kw):
    base = dict(text_ids=torch.arange(6) + seed, negative_text_ids=torch.arange(3), latent_frames=2,
                latent_height=4, latent_width=4, num_steps=steps, guidance_scale=guidance, seed=seed)
    base.update(kw)
    return Cosmos3GenerateRequest(**base)


def engine(**kw):
    return Engine.from_state_dict(CFG, STATE, **kw)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("bad, message", [
    (dict(num_steps=-2), "num_steps"),
    (dict(guidance_scale=math.nan), "guidance_scale"),
    (dict(action=ActionSpec("teleport", 2, 0)), "unknown action mode"),
    (dict(action=ActionSpec("policy", 2, 99), vision_condition_frames=(0,),
          condition_latents=torch.zeros(1, 4, 2, 4, 4)), "domain_id 99"),
    (dict(text_ids=torch.tensor([5, 999])), "outside"),
    (dict(sound_frames=3, noise_sound=torch.zeros(2, 2)), "noise_sound"),
])
def test_invalid_request_refused_engine_keeps_serving(bad, message):
    eng = engine()
    good = eng.submit(request(seed=2))
    with pytest.raises(RequestRejected, match=message):
        eng.submit(request(**bad))
    assert good.result()["latents"]["vision"].shape == (1, 4, 2, 4, 4)
    assert [e.kind for e in good.events][0] == "request.accepted"


@pytest.mark.parametrize("sizes, message", [
    (dict(num_frames=8, height=64, width=64), "4k \\+ 1"),
    (dict(num_frames=9, height=60, width=64), "height must be a positive multiple of 16"),
    (dict(num_frames=9, height=64, width=0), "width"),
])
def test_pixel_sizes_validated(sizes, message):
    eng = engine()
    with pytest.raises(RequestRejected, match=message):
        eng.submit_built("video", text_ids=torch.arange(4), negative_text_ids=torch.arange(2), **sizes)
    h = eng.submit_built("video", text_ids=torch.arange(4), negative_text_ids=torch.arange(2), num_frames=5, height=32,
                         width=48, num_steps=2)
    assert h.result()["latents"]["vision"].shape == (1, 4, 2, 2, 3)


def test_request_that_can_never_fit_is_rejected_one_that_cannot_fit_now_waits():
    eng = engine()
    state = eng.loop("denoise").init_state(request())
    held = eng.loop("denoise").admission(state).device_bytes
    need = held + eng.loop("denoise").plan_step(state).resources.device_bytes   # held for life + its step's bytes
    small = engine(memory_budget_bytes=need - 1)
    with pytest.raises(RequestRejected, match="can never fit"):
        small.submit(request())
    tight = engine(memory_budget_bytes=need + held // 2)
    a, b = tight.submit(request(seed=1)), tight.submit(request(seed=2))
    tight.step()
    assert a.status == "running" and b.status == "waiting"
    tight.run_until_idle()
    kinds = [(e.request_id, e.kind) for e in a.events + b.events if e.kind in ("request.admitted", "request.completed")]
    assert kinds.index(("req-0", "request.completed")) < kinds.index(("req-1", "request.admitted"))
    assert tight.scheduler.reserved_bytes == 0


def test_cancel_mid_loop_frees_reservation_and_cache_others_unchanged():
    solo = engine().generate(request(seed=1, steps=4))["latents"]["vision"]
    eng = engine()
    keep = eng.submit(request(seed=1, steps=4))
    victim = eng.submit(request(seed=7, steps=4, text_ids=torch.arange(9) + 40))
    eng.step()
    eng.step()
    victim_keys = [k for k in eng.model.und_cache.keys() if k.input_hashes in
                   {eng.model.und_cache_key(victim.record.state.request.text_ids).input_hashes}]
    assert victim_keys, "the victim's prompt should be cached while it runs"
    reserved_before = eng.scheduler.reserved_bytes
    victim.cancel()
    eng.step()
    assert victim.status == "cancelled"
    assert eng.scheduler.reserved_bytes == reserved_before - victim.record.reservation.device_bytes
    assert all(k not in eng.model.und_cache for k in victim_keys)
    assert "request.cancelled" in [e.kind for e in victim.events]
    got = keep.result()["latents"]["vision"]
    assert rel(got, solo) <= 1e-6
    with pytest.raises(RuntimeError, match="cancelled"):
        victim.result()


def test_preempted_request_resumes_with_same_result():
    straight = engine().generate(request(seed=5, steps=4))["latents"]["vision"]
    eng = engine()
    h = eng.submit(request(seed=5, steps=4))
    eng.step()
    eng.scheduler.preempt(h.request_id)
    eng.step()
    assert h.status == "waiting" and "request.preempted" in [e.kind for e in h.events]
    assert rel(h.result()["latents"]["vision"], straight) <= 1e-6


def test_batches_requests_at_different_steps_and_matches_reference():
    ref_model = load_transformer(CFG, STATE)
    reqs = [request(seed=1, guidance=3.0), request(seed=2, guidance=1.0, latent_frames=3),
            request(seed=3, guidance=6.0, sound_frames=4)]
    eng = engine()
    seen = []
    eng.subscribe(lambda ev: seen.append(ev), prefix="trace.")
    handles = [eng.submit(reqs[0])]
    eng.step()
    handles += [eng.submit(r) for r in reqs[1:]]
    eng.run_until_idle()
    batch_sizes = [len(e.data["batch"]) for e in seen if e.kind == "trace.step"]
    assert max(batch_sizes) == 3
    for r, h in zip(reqs, handles):
        want = generate(ref_model, r)
        got = h.result()["latents"]
        assert rel(got["vision"], want.vision) <= 1e-5
        if r.sound_frames:
            assert rel(got["sound"], want.sound) <= 1e-5
    ops = {e.data["op"] for e in seen if e.kind == "trace.cache"}
    assert {"miss", "put", "hit"} <= ops
    assert eng.scheduler.cost.measured, "the cost model is calibrated by measuring"


def test_identity_cfg_policy_refuses_guidance():
    eng = engine(cfg_policy="identity")
    with pytest.raises(RequestRejected, match="identity CFG policy"):
        eng.submit(request(guidance=4.0))
    assert eng.generate(request(guidance=1.0))["latents"]["vision"].isfinite().all()


def test_failed_step_isolated_to_its_request(monkeypatch):
    from optimized.models.cosmos3 import loops
    eng = engine()
    good, bad = eng.submit(request(seed=1)), eng.submit(request(seed=2, latent_frames=3))
    original = loops.advance

    def flaky(solver, v, x):
        if x.ndim == 5 and x.shape[2] == 3:
            raise RuntimeError("planted failure")
        return original(solver, v, x)
    monkeypatch.setattr(loops, "advance", flaky)
    eng.run_until_idle()
    assert bad.status == "failed" and "planted failure" in bad.record.error
    assert good.status == "completed"


def test_family_parts_are_reached_by_explicit_methods_not_attribute_forwarding():
    """No `__getattr__` magic on the engine: a typo is an AttributeError, and builders / programs / loops are reached
    through `submit_built`, `run_program`, `loop` (names a reader can grep)."""
    eng = engine()
    assert "__getattr__" not in vars(type(eng))
    with pytest.raises(AttributeError):
        eng.denoise   # noqa: B018 - the loop is engine.loop("denoise")
    with pytest.raises(AttributeError):
        eng.submit_video   # noqa: B018
    assert eng.loop("denoise") is not None
