"""Step / residual caches and the guidance interval, engine vs reference (no upstream package needed).

C1 under each acceleration: both sides decide independently and must agree on every decision and on the latents
after every step; each check uses knobs under which some steps DO reuse / predict / skip (asserted, so the check
is not vacuous). Negative controls: a residual store that never refreshes and a residual read from the other CFG
branch must fail and be localised. Also: batching (a request without accel stays bitwise what it is alone; requests
with different decisions share one batched step), trace.step shows the decisions, residuals die with the request,
bad specs are refused with one clear message.
"""

from __future__ import annotations

import pytest
import torch

from manifests.accel import AccelSpecError, parse_accel
from manifests.errors import RequestFieldError
from manifests.wan import load_model_variant
from optimized.models.wan.denoise import WanDenoiseJob, WanDenoiseLoop
from optimized.models.wan.instance import WanModelInstance
from optimized.runtime.scheduler import WorkUnitScheduler
from parity.accel_checks import default_request, run_accel_c1
from parity.accel_rows import first_failure

VARIANT = "tiny-2.1-t2v"
# knobs chosen on the tiny random model so that some steps hit (its residual diffs are ~0.4-0.8 step to step)
SPECS = {
    "fbcache": "fbcache:threshold=0.5",
    "dbcache": "dbcache:fn=1,bn=1,warmup=1,threshold=0.5",
    "taylorseer": "taylorseer:before=1,interval=2,order=1",
    "magcache": "magcache:ratios=1.0/0.99/0.98/0.97,retention=0.0,threshold=0.5,max_skip=2",
    "guidance_interval": "guidance_interval:start=2,end=6",
    "cfg_delta": "cfg_delta:warmup=2,interval=3,cooldown=1",   # of 8 steps: uncond runs 0, 1, 2, 5, 7
}
_MODEL: dict = {}


def tiny():
    if not _MODEL:
        cfg = load_model_variant(VARIANT)
        weights = WanModelInstance.random_weights(cfg, 0)
        _MODEL.update(cfg=cfg, weights=weights)
    return _MODEL["cfg"], _MODEL["weights"]


def run(requests, events: list | None = None):
    cfg, weights = tiny()
    loop = WanDenoiseLoop(WanModelInstance(cfg, weights, weights_version="accel-test"))
    sched = WorkUnitScheduler()
    if events is not None:
        sched.bus.subscribe(events.append, "trace.step")
    handles = [sched.submit(loop, WanDenoiseJob(r)) for r in requests]
    while not sched.idle:
        sched.tick()
    assert all(h.status == "completed" for h in handles), [h.error for h in handles]
    return loop, [h.result for h in handles]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_c1_under_acceleration_decisions_and_latents_agree(name):
    cfg, weights = tiny()
    rows = run_accel_c1("wan", SPECS[name], weights=weights)
    assert first_failure(rows) is None, first_failure(rows)
    actions = {r.detail for r in rows if r.check == "decision"}
    assert actions == {"same"}
    # not vacuous: the engine really skipped work under these knobs
    _, (res,) = run([default_request(cfg, parse_accel(SPECS[name]), 8)])
    kinds = {d.action for d in res["accel"]["decisions"]}
    assert "compute" in kinds and kinds & {"reuse", "predict", "skip"}, kinds


@pytest.mark.parametrize("name", ["fbcache", "dbcache", "cfg_delta"])
@pytest.mark.parametrize("fault", ["never_refresh", "wrong_branch"])
def test_negative_controls_fail_and_are_localised(name, fault):
    _, weights = tiny()
    clean = run_accel_c1("wan", SPECS[name], weights=weights)
    assert first_failure(clean) is None
    bad = first_failure(run_accel_c1("wan", SPECS[name], weights=weights, fault=fault))
    assert bad is not None, f"{fault} was not caught"
    assert bad.check == "latents" or bad.branch in ("cond", "uncond"), bad
    if fault == "never_refresh":   # the first refresh happens at step 1 at the earliest
        assert bad.step >= 1, bad


def test_cfg_delta_runs_uncond_on_warmup_interval_and_cooldown_steps_only():
    cfg, _ = tiny()
    _, (res,) = run([default_request(cfg, parse_accel(SPECS["cfg_delta"]), 8)])
    by_branch = {b: [d.action for d in res["accel"]["decisions"] if d.branch == b] for b in ("cond", "uncond")}
    assert by_branch["cond"] == ["compute"] * 8
    # warmup=2: 0, 1; then every 3rd step from 2: 2, 5; cooldown=1: 7
    assert [i for i, a in enumerate(by_branch["uncond"]) if a == "compute"] == [0, 1, 2, 5, 7]
    assert [i for i, a in enumerate(by_branch["uncond"]) if a == "predict"] == [3, 4, 6]
    bad = first_failure(run_accel_c1("wan", SPECS["cfg_delta"], weights=tiny()[1], fault="wrong_branch"))
    assert bad.step == 3 and bad.branch == "uncond" and bad.check == "decision", bad   # no delta there: computes


def test_magcache_stale_stack_residual_is_caught():
    _, weights = tiny()
    bad = first_failure(run_accel_c1("wan", SPECS["magcache"], weights=weights, fault="never_refresh"))
    assert bad is not None and bad.step >= 1


def test_exact_request_in_an_accelerated_batch_is_bitwise_itself_and_decisions_share_steps():
    cfg, _ = tiny()
    exact = default_request(cfg, None, 6, seed=5)
    fast_a = default_request(cfg, parse_accel(SPECS["fbcache"]), 6, seed=1)
    fast_b = default_request(cfg, parse_accel("fbcache:threshold=0.0"), 6, seed=2)   # threshold 0: never reuses
    events: list = []
    loop, (r_exact, r_a, r_b) = run([exact, fast_a, fast_b], events)
    _, (alone,) = run([exact])
    assert torch.equal(r_exact["latents"]["vision"], alone["latents"]["vision"])
    assert "accel" not in r_exact
    _, (a_alone,) = run([fast_a])
    rel = (r_a["latents"]["vision"] - a_alone["latents"]["vision"]).norm() / a_alone["latents"]["vision"].norm()
    assert rel < 1e-5     # batched with others vs alone: the same decisions, latents within batching noise
    assert [d.action for d in r_a["accel"]["decisions"]] == [d.action for d in a_alone["accel"]["decisions"]]
    # different decisions at one step, in one batched step of all three requests
    acts_a = [d.action for d in r_a["accel"]["decisions"]]
    acts_b = [d.action for d in r_b["accel"]["decisions"]]
    assert "reuse" in acts_a and set(acts_b) == {"compute"}
    assert max(e.data["batch_size"] for e in events) == 3
    # trace.step carries each accelerated request's decisions of that step; residuals die with their requests
    shown = [e.data["accel"] for e in events if "accel" in e.data]
    assert len(shown) == 2 * 6 and all(len(rows) == 2 for rows in shown)
    assert any(row["action"] == "reuse" for rows in shown for row in rows)
    assert len(loop.residuals.store) == 0


def test_lossy_cache_differs_from_exact():
    """The certificate's premise: with hits, the accelerated latents are not the exact ones (and C1 still passes)."""
    cfg, _ = tiny()
    _, (fast, exact) = run([default_request(cfg, parse_accel(SPECS["fbcache"]), 6, seed=1),
                            default_request(cfg, None, 6, seed=1)])
    assert not torch.allclose(fast["latents"]["vision"], exact["latents"]["vision"], atol=1e-4)


def test_residual_keys_name_request_branch_blocks_and_accel():
    from optimized.accel.residual import ResidualCache, ResidualOwner
    spec = parse_accel(SPECS["dbcache"])
    owner = ResidualOwner("r1", "wan", "dit", "v1", "float32", "16x2x4x4", spec)
    cache = ResidualCache()
    k = cache.key(owner, "cond", (0, 1), "fn_residual")
    assert dict(k.input_hashes) == {"request": "r1", "branch": "cond", "blocks": "0-1", "slot": "fn_residual",
                                    "accel": spec.label()}
    assert k != cache.key(owner, "uncond", (0, 1), "fn_residual")
    other = ResidualOwner("r1", "wan", "dit", "v1", "float32", "16x2x4x4", parse_accel("dbcache:fn=1"))
    assert k != cache.key(other, "cond", (0, 1), "fn_residual")
    with pytest.raises(ValueError, match="slot"):
        cache.key(owner, "cond", (0, 1), "nonsense")


@pytest.mark.parametrize("text, message", [
    ("magcache", "ratios is required"),
    ("magcache:ratios=1.0/x", "numbers"),
    ("dbcache:fn=3,bn=1", "exceeds"),
])
def test_bad_specs_are_refused_with_one_message(text, message):
    cfg, weights = tiny()
    loop = WanDenoiseLoop(WanModelInstance(cfg, weights, weights_version="accel-test"))
    with pytest.raises(ValueError, match=message):
        loop.init_state(default_request(cfg, parse_accel(text), 4))


def test_request_field_is_validated():
    cfg, _ = tiny()
    with pytest.raises(RequestFieldError, match="AccelSpec"):
        default_request(cfg, "fbcache", 4).validate(cfg)
    with pytest.raises(AccelSpecError, match="knob"):
        parse_accel("fbcache:fn=1")
    assert default_request(cfg, parse_accel("fbcache"), 4).validate(cfg).accel.get("threshold") == 0.05


STA = "sta:tile_t=1,tile_h=1,tile_w=1,window_t=0,window_h=0,window_w=1,start_step=2"


def test_sparse_attention_is_routed_through_both_sides_with_keys_counted():
    """A sparse kind routes wan self-attention through optimized/accel/sparse.py and reference/wan/sparse_attention.py
    (the sparse-attention work's functions); C1 compares their keys_skipped too, per step and branch."""
    pytest.importorskip("optimized.accel.sparse")
    cfg, weights = tiny()
    rows = run_accel_c1("wan", STA, weights=weights, num_steps=4)
    assert first_failure(rows) is None, first_failure(rows)
    # one batch holding requests at different steps: each row's own step decides its mask and its count
    early = default_request(cfg, parse_accel(STA), 4, seed=1)
    late = default_request(cfg, parse_accel(STA), 4, seed=2)
    cfg_, weights_ = tiny()
    loop = WanDenoiseLoop(WanModelInstance(cfg_, weights_, weights_version="accel-test"))
    sched = WorkUnitScheduler()
    h1 = sched.submit(loop, WanDenoiseJob(early))
    sched.tick()
    sched.tick()
    h2 = sched.submit(loop, WanDenoiseJob(late))
    while not sched.idle:
        sched.tick()
    _, (alone,) = run([late])
    counts = [(d.step, d.keys_skipped) for d in h2.result["accel"]["decisions"]]
    assert counts == [(d.step, d.keys_skipped) for d in alone["accel"]["decisions"]]
    assert {c for s, c in counts if s < 2} == {0} and all(c > 0 for s, c in counts if s >= 2)
    assert h1.status == "completed"


def test_other_wan_variants_two_experts_and_per_token_timesteps():
    """guidance_interval across an expert switch and fbcache under per-token (ti2v) timesteps agree with the
    reference; a step cache across an expert switch is refused with one message (upstream caches per transformer)."""
    assert first_failure(run_accel_c1("wan", "guidance_interval:start=1,end=3", variant="tiny-2.2-t2v-a14b",
                                      num_steps=4)) is None
    assert first_failure(run_accel_c1("wan", SPECS["fbcache"], variant="tiny-2.2-ti2v", num_steps=4)) is None
    with pytest.raises(ValueError, match="two-expert"):
        run_accel_c1("wan", "fbcache", variant="tiny-2.2-t2v-a14b", num_steps=4)


def test_accel_report_is_the_cli_entry():
    from parity.accel_checks import accel_report
    from parity.errors import SetupError
    clean = accel_report("wan", SPECS["fbcache"])
    assert all(c.passed for c in clean.checks) and clean.settings["accel"] == parse_accel(SPECS["fbcache"]).label()
    bad = accel_report("wan", SPECS["fbcache"], fault="wrong_branch")
    first = next(c for c in bad.checks if not c.passed)
    assert first.divergence.startswith("step ") and "branch" in first.divergence
    for accel, fault, message in [("nope", None, "unknown acceleration"), ("fbcache", "bogus", "unknown accel fault"),
                                  ("dbcache:fn=9", None, "exceeds")]:
        with pytest.raises(SetupError, match=message):
            accel_report("wan", accel, fault=fault)


def test_an_evicted_residual_makes_the_rule_compute():
    """A residual store too small to hold anything: every decision computes (as an empty upstream buffer does),
    nothing breaks, and the result is the exact one."""
    from optimized.accel.residual import ResidualCache
    from optimized.runtime.cache import CacheStore
    cfg, weights = tiny()
    loop = WanDenoiseLoop(WanModelInstance(cfg, weights, weights_version="accel-test"))
    loop.residuals = ResidualCache(CacheStore(max_bytes=16, name="residual"))
    sched = WorkUnitScheduler()
    h = sched.submit(loop, WanDenoiseJob(default_request(cfg, parse_accel(SPECS["fbcache"]), 4, seed=1)))
    while not sched.idle:
        sched.tick()
    assert {d.action for d in h.result["accel"]["decisions"]} == {"compute"}
    _, (exact,) = run([default_request(cfg, None, 4, seed=1)])
    rel = (h.result["latents"]["vision"] - exact["latents"]["vision"]).norm() / exact["latents"]["vision"].norm()
    assert rel < 1e-5


def test_what_the_cached_step_cannot_run_is_refused():
    from optimized.training.records import CaptureSpec
    cfg, weights = tiny()
    loop = WanDenoiseLoop(WanModelInstance(cfg, weights, weights_version="accel-test"))
    req = default_request(cfg, parse_accel("fbcache"), 4)
    with pytest.raises(ValueError, match="batch-invariant"):
        loop.init_state(WanDenoiseJob(req, capture=CaptureSpec(batch_invariant=True)))
    assert loop.init_state(WanDenoiseJob(req, capture=CaptureSpec())).accel is not None
    with pytest.raises(ValueError, match="batched CFG policy"):
        WanDenoiseLoop(WanModelInstance(cfg, weights, weights_version="accel-test"), "two-forward").init_state(req)
