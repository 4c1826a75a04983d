"""Step / residual caches and the guidance interval on the cosmos3 generation loop (issue 21, item 3): the engine
(optimized/accel + optimized/models/cosmos3) against the readable rules (reference/cosmos3/accel.py), decisions and
latents step by step on cosmos3:tiny with random weights; exact rows batched with accelerated ones stay bitwise
themselves; the planted faults fail at the step and branch they first bite; kinds the loop cannot honour refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from manifests.accel import parse_accel
from manifests.cosmos3 import canonical_key_shapes, load_variant
from manifests.cosmos3.sampling import ActionSpec
from manifests.errors import RequestFieldError
from optimized.models.cosmos3.loops import DenoiseJob, FlowDenoiseLoop
from optimized.models.cosmos3.model import load_fast
from optimized.runtime.scheduler import WorkUnitScheduler
from parity.accel_checks_cosmos3 import (
    default_request,
    first_failure,
    flat_trajectory,
    run_accel_c1_cosmos3,
)
from parity.weights import random_state_dict

STEPS = 5
# knobs chosen so that every kind both computes and skips work within 5 steps on random tiny weights
SPECS = {
    "fbcache": "fbcache:threshold=0.3",
    "dbcache": "dbcache:fn=2,bn=0,threshold=0.3,warmup=1,max_continuous=1",
    "magcache": "magcache:ratios=1.0/0.99/0.98/0.97/0.96,threshold=0.1,retention=0.2,max_skip=2",
    "guidance_interval": "guidance_interval:start=1,end=3",
}
SKIPPING = {"reuse", "predict", "skip"}


@pytest.fixture(scope="module")
def tiny():
    cfg = load_variant("tiny")
    return cfg, random_state_dict(canonical_key_shapes(cfg), 0)


def _engine(cfg, weights, requests, policy="batched"):
    loop = FlowDenoiseLoop(load_fast(cfg, weights), policy)
    sched = WorkUnitScheduler(batching="greedy")
    handles = [sched.submit(loop, DenoiseJob(r, record_trajectory=True)) for r in requests]
    while not sched.idle:
        sched.tick()
    assert all(h.status == "completed" for h in handles), [h.error for h in handles]
    return loop, [h.result for h in handles]


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_engine_matches_reference_decisions_and_latents(tiny, kind):
    cfg, weights = tiny
    rows, results = run_accel_c1_cosmos3(SPECS[kind], weights=weights, num_steps=STEPS)
    bad = first_failure(rows)
    assert bad is None, bad
    decisions = results[0]["accel"]["decisions"]
    assert len(decisions) == 2 * STEPS and {d.branch for d in decisions} == {"cond", "uncond"}
    assert any(d.action in SKIPPING for d in decisions), f"{kind} never skipped work: the test would prove nothing"
    assert any(d.action == "compute" and d.step > 0 for d in decisions) or kind == "guidance_interval"
    # lossy: the accelerated trajectory is not the exact one (a cache that is silently off would be)
    _, (plain,) = _engine(cfg, weights, [default_request(cfg, None, STEPS, 0)])
    final_accel, final_exact = flat_trajectory(results[0]["trajectory"])[-1], flat_trajectory(plain["trajectory"])[-1]
    assert not torch.equal(final_accel, final_exact)


def test_multimodal_request_with_mates_of_other_shapes(tiny):
    """Sound + action latents flatten into one cached output and back; mates of another shape run as another group
    of the same step (their own pad), another accelerated same-shape mate decides for itself."""
    cfg, weights = tiny
    spec = parse_accel(SPECS["fbcache"])
    cond = torch.randn(1, cfg.latent_channels, 3, 4, 6, generator=torch.Generator().manual_seed(7))
    kw = {"sound_frames": 4, "vision_condition_frames": (0,), "condition_latents": cond,
          "action": ActionSpec("policy", 4, 1)}
    request = default_request(cfg, spec, STEPS, 3, **kw)
    mates = [default_request(cfg, spec, STEPS, 4, **kw), default_request(cfg, spec, STEPS, 5, latent_width=4)]
    rows, results = run_accel_c1_cosmos3(spec, weights=weights, request=request, mates=mates)
    assert first_failure(rows) is None, first_failure(rows)
    assert set(results[0]["trajectory"][-1]) == {"vision", "sound", "action"}


def test_exact_request_batched_with_accelerated_stays_bitwise(tiny):
    cfg, weights = tiny
    exact = default_request(cfg, None, STEPS, 11)
    _, (alone,) = _engine(cfg, weights, [exact])
    batch_sizes = []
    original = FlowDenoiseLoop.run_step

    def recording(self, states, plans):
        batch_sizes.append(len(states))
        return original(self, states, plans)

    FlowDenoiseLoop.run_step = recording
    try:
        loop, (mixed, accelerated) = _engine(cfg, weights, [exact, default_request(cfg, parse_accel(SPECS["fbcache"]),
                                                                                   STEPS, 12)])
    finally:
        FlowDenoiseLoop.run_step = original
    assert batch_sizes == [2] * STEPS        # the two requests shared every step
    assert any(d.action == "reuse" for d in accelerated["accel"]["decisions"])
    for a, b in zip(alone["trajectory"], mixed["trajectory"]):
        assert all(torch.equal(a[m], b[m]) for m in a)
    assert "accel" not in mixed
    assert not loop.residuals.store.keys()   # finished requests' residuals are released


@pytest.mark.parametrize("fault", ["never_refresh", "wrong_branch"])
def test_planted_faults_fail_at_their_step_and_branch(tiny, fault):
    _, weights = tiny
    clean, clean_results = run_accel_c1_cosmos3(SPECS["fbcache"], weights=weights, num_steps=STEPS)
    assert first_failure(clean) is None
    rows, _ = run_accel_c1_cosmos3(SPECS["fbcache"], weights=weights, num_steps=STEPS, fault=fault)
    bad = first_failure(rows)
    assert bad is not None and bad.check == "decision"
    if fault == "wrong_branch":
        # step 0: cond stores its block-0 residual first; uncond then reads it as its own "previous" one
        assert (bad.step, bad.branch) == (0, "uncond")
    else:
        # the first step whose "previous residual" is not step 0's on the clean side (equal to the reference's, the
        # clean run passed): the one after the cond branch's second compute; the faulty engine still compares with
        # step 0's there
        computes = [d.step for d in clean_results[0]["accel"]["decisions"] if d.branch == "cond"
                    and d.action == "compute"]
        assert len(computes) >= 2 and computes[1] + 1 < STEPS, "no refresh to miss: the control would prove nothing"
        assert bad.step == computes[1] + 1 and bad.branch == "cond", bad


def test_unsupported_kinds_and_setups_refused(tiny):
    cfg, weights = tiny
    sta = default_request(cfg, parse_accel("sta"), STEPS, 0)
    with pytest.raises(RequestFieldError, match="does not apply to the cosmos3 denoising loop"):
        sta.validate(cfg)
    loop = FlowDenoiseLoop(load_fast(cfg, weights))
    with pytest.raises(ValueError, match="does not apply to the cosmos3"):
        loop.init_state(sta)
    from reference.cosmos3 import generate, load_transformer
    reference = load_transformer(cfg, weights)
    too_deep = default_request(cfg, parse_accel("dbcache:fn=4,bn=0"), STEPS, 0)
    for run in (loop.init_state, lambda r: generate(reference, r)):
        with pytest.raises(ValueError, match="exceeds the DiT's 3 blocks"):
            run(too_deep)
        # upstream TaylorSeer (lite) on cosmos3 predicts the vision head alone and skips no layer
        # either message: the kind's loops may stop listing cosmos3.denoise (requested of manifests/accel)
        with pytest.raises(ValueError, match="taylorseer (is refused on cosmos3: .*proj_out|does not apply to the "
                                             "cosmos3)"):
            run(default_request(cfg, parse_accel("taylorseer"), STEPS, 0))
        # cache-dit would feed the Bn layers a cached text stream
        with pytest.raises(ValueError, match="dbcache on cosmos3 needs bn=0"):
            run(default_request(cfg, parse_accel("dbcache:fn=1,bn=1"), STEPS, 0))
    two_forward = FlowDenoiseLoop(load_fast(cfg, weights), "two-forward")
    with pytest.raises(ValueError, match="batched CFG policy"):
        two_forward.init_state(default_request(cfg, parse_accel("fbcache"), STEPS, 0))
    bad_type = dataclasses.replace(default_request(cfg, None, STEPS, 0), accel="fbcache")
    with pytest.raises(RequestFieldError, match="accel must be an AccelSpec"):
        bad_type.validate(cfg)


def test_trace_step_info_shows_the_decisions(tiny):
    cfg, weights = tiny
    loop = FlowDenoiseLoop(load_fast(cfg, weights))
    state = loop.init_state(default_request(cfg, parse_accel(SPECS["guidance_interval"]), STEPS, 0))
    plan = loop.plan_step(state)
    (state,) = loop.run_step([state], [plan])
    assert [(d["branch"], d["action"]) for d in plan.info["accel"]] == [("cond", "compute"), ("uncond", "skip")]
    assert plan.info["graph_cache"] == "accel"
    loop.release(state)
    assert not loop.residuals.store.keys()


# ------------------------------------------------------------------------------------------------ upstream goldens
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "accel_cosmos3"
GOLDEN_REL_L2 = 1e-5   # as the exact gen_t2v anchor; measured <= 1e-6 on both sides (fp32 CPU)


def _golden(kind: str):
    from converters import convert_diffusers_dir_to_canonical_state_dict
    from parity.families.cosmos3.c1 import golden_request
    from parity.golden import load_case
    meta = json.loads((GOLDEN / kind / "accel.json").read_text())
    base = load_case(GOLDEN.parents[0] / "cosmos3" / "gen_t2v")
    cfg, state = convert_diffusers_dir_to_canonical_state_dict(base.path / "upstream")
    request = dataclasses.replace(golden_request(base), num_steps=meta["steps"], accel=parse_accel(meta["accel"]))
    trajectory = load_file(str(GOLDEN / kind / "outputs.safetensors"))["trajectory_vision"]
    return meta, cfg, state, request, trajectory


def _view(d) -> dict:
    as_list = lambda r: None if r is None else list(r)
    return {"step": d.step, "branch": d.branch, "action": d.action, "blocks_computed": as_list(d.blocks_computed),
            "blocks_reused": as_list(d.blocks_reused)}


@pytest.mark.parametrize("kind", ["fbcache", "magcache", "dbcache"])
@pytest.mark.parametrize("side", ["reference", "engine"])
def test_upstream_goldens_decisions_and_trajectory(kind, side):
    """diffusers' own FBCache / MagCache hooks and cache-dit's DBCache on Cosmos3OmniPipeline
    (tools/make_accel_cosmos3_goldens.py): each side makes upstream's decisions and follows its vision trajectory
    step by step."""
    meta, cfg, state, request, want = _golden(kind)
    if side == "reference":
        from reference.cosmos3 import generate, load_transformer
        res = generate(load_transformer(cfg, state), request, keep_trajectory=True)
        decisions, trajectory = res.accel, [t["vision"] for t in res.trajectory]
    else:
        _, (res,) = _engine(cfg, state, [request])
        decisions, trajectory = res["accel"]["decisions"], [t["vision"] for t in res["trajectory"]]
    assert [_view(d) for d in decisions] == meta["decisions"]
    assert len(trajectory) == want.shape[0]
    for step, (got, ref) in enumerate(zip(trajectory, want)):
        err = float((got.double() - ref.double()).norm() / ref.double().norm())
        assert err <= GOLDEN_REL_L2, f"step {step}: rel L2 {err:.3g}"


def test_upstream_golden_catches_never_refresh():
    """Negative control: the engine with a residual store that never refreshes leaves upstream's decisions."""
    from parity.accel_rows import planted
    meta, cfg, state, request, _ = _golden("fbcache")
    with planted("never_refresh"):
        _, (res,) = _engine(cfg, state, [request])
    assert [_view(d) for d in res["accel"]["decisions"]] != meta["decisions"]
