"""Regression tests for the engine / scheduler defects found under load and bad input (issue 11, items 1-4 and the
engine parts of 7). Each test failed on the code before its fix:
  1. a failing request in a batched step made its batch mates' steps apply twice (state advanced in place);
  2. `submit()` built (allocated) the whole request before checking the budget;
  3. no upper bound on request size; the reasoning loop's step bytes were never counted;
  4. a raising subscriber failed requests and the driver;
  7. seed=1.5, temperature=1e-300, cancel("unknown") raised raw errors; NaN weights were loaded without a word."""

import json
import time
from dataclasses import dataclass, field

import pytest
import torch

import optimized.models.cosmos3.reasoner as reasoner
from manifests.cosmos3 import canonical_key_shapes, load_variant
from manifests.cosmos3.reasoning import ReasonRequest
from manifests.cosmos3.sampling import Cosmos3GenerateRequest
from manifests.wan.sampling import WanGenerateRequest
from optimized import Engine, RequestRejected
from optimized.runtime.loop import LoopKernel, RequestEstimate, ResourceRequest, WorkPlan
from optimized.runtime.scheduler import WorkUnitScheduler, run_requests
from parity.weights import random_state_dict

CFG = load_variant("tiny")
STATE = random_state_dict(canonical_key_shapes(CFG), 5)


def engine(**kw) -> Engine:
    return Engine.from_state_dict(CFG, STATE, kv_block_size=4, **kw)


def generation(n: int, steps: int = 1, **kw) -> Cosmos3GenerateRequest:
    base = dict(text_ids=torch.arange(5) + n, negative_text_ids=torch.arange(3), latent_frames=1,
                latent_height=2, latent_width=2, num_steps=steps, guidance_scale=3.0, seed=n)
    return Cosmos3GenerateRequest(**{**base, **kw})


# ---------------------------------------------------------------------------------------------- a toy kernel
@dataclass
class Counter:
    """Deliberately mutable state (a list advanced in place) with a planted failure at one step."""
    name: str
    total: int
    fail_at: int = -1
    values: list = field(default_factory=list)


class InPlaceKernel(LoopKernel[Counter]):
    """run_step appends to each state's list in place, then fails for a planted request after its mates advanced:
    the worst case for a scheduler that re-runs a failed batch."""
    loop_id = "toy.inplace"

    def __init__(self, step_bytes: int = 0, held_bytes: int = 0, estimate_bytes: int | None = None):
        self.step_bytes, self.held_bytes, self.estimate_bytes = step_bytes, held_bytes, estimate_bytes
        self.built: list[str] = []

    def estimate(self, request):
        return None if self.estimate_bytes is None else RequestEstimate(self.estimate_bytes, 0)

    def init_state(self, request: Counter) -> Counter:
        self.built.append(request.name)   # stands for the allocation a real kernel does here
        return Counter(request.name, request.total, request.fail_at)

    def plan_step(self, s: Counter) -> WorkPlan:
        return WorkPlan("", self.loop_id, "count", len(s.values), batch_key="one",
                        resources=ResourceRequest(device_bytes=self.step_bytes))

    def run_step(self, states, plans):
        for s in states:
            s.values.append(len(s.values))
        for s in states:
            if len(s.values) - 1 == s.fail_at:
                raise RuntimeError(f"planted failure in {s.name}")
        return list(states)

    def admission(self, s: Counter) -> ResourceRequest:
        return ResourceRequest(device_bytes=self.held_bytes)

    def is_done(self, s: Counter) -> bool:
        return len(s.values) >= s.total

    def finalize(self, s: Counter) -> list:
        return list(s.values)


# ---------------------------------------------------------------------------------------------- 1. no double apply
def test_failed_batch_reruns_mates_from_pre_step_states():
    sched = WorkUnitScheduler()
    kernel = InPlaceKernel()
    recs = [sched.submit(kernel, Counter("a", 4)), sched.submit(kernel, Counter("bad", 4, fail_at=2)),
            sched.submit(kernel, Counter("b", 4))]
    sched.run_until_idle()
    assert recs[1].status == "failed" and "planted failure in bad" in recs[1].error
    for rec in (recs[0], recs[2]):
        assert rec.status == "completed" and rec.result == [0, 1, 2, 3], rec.result


@pytest.mark.parametrize("culprit_position", [0, 1, 2])
def test_failing_reasoning_request_leaves_batch_mates_tokens_unchanged(monkeypatch, culprit_position):
    """Two greedy requests batched with one that fails exactly at their last token (the issue's repro: they came
    back with 9 tokens instead of 8, or different ones)."""
    mates = [ReasonRequest(torch.arange(5), 8), ReasonRequest(torch.arange(6) + 3, 8)]
    solo = [engine().reason(r)["tokens"] for r in mates]
    culprit = ReasonRequest(torch.arange(5) + 1, 8, temperature=0.7, seed=99)
    calls = {"n": 0}
    original = reasoner.choose_token

    def choose(logits, req, generator):
        if req.seed == 99:
            calls["n"] += 1
            if calls["n"] >= 8:  # from the step where the mates sample their 8th (last) token
                raise RuntimeError("planted sampling failure")
        return original(logits, req, generator)
    monkeypatch.setattr(reasoner, "choose_token", choose)
    order = list(mates)
    order.insert(culprit_position, culprit)
    eng = engine()
    handles = [eng.submit(r) for r in order]
    eng.run_until_idle()
    bad = handles.pop(culprit_position)
    assert bad.status == "failed" and "planted sampling failure" in bad.record.error
    got = [h.result()["tokens"] for h in handles]
    assert got == solo, f"batch mates changed: {got} vs solo {solo}"


@pytest.mark.parametrize("temperature", [1.505e-39, 1e-300, 5e-7])
def test_degenerate_temperature_rejected_up_front(temperature):
    eng = engine()
    with pytest.raises(RequestRejected, match="temperature .* is below 1e-06.*temperature=0"):
        eng.submit(ReasonRequest(torch.arange(5), 8, temperature=temperature, top_k=1))
    assert eng.scheduler.idle and not eng.scheduler.records


# ---------------------------------------------------------------------------------------------- 2. estimate first
def test_submit_refuses_from_the_estimate_before_building_state():
    kernel = InPlaceKernel(estimate_bytes=10 << 30)
    sched = WorkUnitScheduler(memory_budget_bytes=1 << 30)
    with pytest.raises(RequestRejected, match="can never fit"):
        sched.submit(kernel, Counter("huge", 3))
    assert kernel.built == [], "init_state ran (allocated) before the budget check"
    kernel.estimate_bytes = 1 << 20
    assert run_requests(kernel, [Counter("ok", 2)]) == [[0, 1]]


def test_reasoning_estimate_refuses_before_init_state(monkeypatch):
    eng = engine(memory_budget_bytes=1 << 20)
    monkeypatch.setattr(reasoner.ARDecodeLoop, "init_state",
                        lambda self, job: pytest.fail("init_state ran before the budget check"))
    with pytest.raises(RequestRejected, match="can never fit"):
        eng.submit(ReasonRequest(torch.arange(5), 100_000))   # within the token limit, KV beyond the budget


def test_huge_video_request_rejected_before_any_allocation(monkeypatch):
    from optimized.models.cosmos3.loops import FlowDenoiseLoop
    from optimized.models.wan.denoise import WanDenoiseLoop
    for loop in (FlowDenoiseLoop, WanDenoiseLoop):
        monkeypatch.setattr(loop, "init_state", lambda self, job: pytest.fail("allocated before the size check"))
    eng = engine()
    t0 = time.perf_counter()
    with pytest.raises(RequestRejected, match="frames exceeds the family limit of 1025"):
        eng.submit_built("video", text_ids=torch.arange(4), negative_text_ids=torch.arange(2), num_frames=6 * 10 ** 8 + 1,
                         height=32, width=32)
    wan = Engine.from_variant("tiny-2.1-t2v")
    with pytest.raises(RequestRejected, match="frames exceeds the family limit of 4093"):
        wan.submit(WanGenerateRequest(text_ids=torch.arange(1, 5), num_frames=6 * 10 ** 8 + 1, height=16, width=16,
                                      guidance_scale=1.0))
    assert time.perf_counter() - t0 < 10


# ---------------------------------------------------------------------------------------------- 3. size limits
@pytest.mark.parametrize("kind, kw, message", [
    ("wan", dict(num_frames=10 ** 6 + 1), "1000001 frames exceeds the family limit of 4093"),
    ("wan", dict(height=16 * 2048), "32768 height exceeds the family limit of 16384"),
    ("cosmos3", dict(latent_frames=250_001), "1000001 frames exceeds the family limit of 1025"),
    ("cosmos3", dict(latent_width=1024), "16384 width exceeds the family limit of 4096"),
    ("reason", dict(max_new_tokens=10 ** 6), "tokens exceeds the family limit of 131072"),
])
def test_request_size_limits_enforced_at_submit(kind, kw, message):
    if kind == "wan":
        eng = Engine.from_variant("tiny-2.1-t2v")
        req = WanGenerateRequest(**{**dict(text_ids=torch.arange(1, 5), num_frames=5, height=16, width=16,
                                           guidance_scale=1.0, num_steps=1), **kw})
    elif kind == "cosmos3":
        eng, req = engine(), generation(1, **kw)
    else:
        eng, req = engine(kv_blocks=10 ** 6), ReasonRequest(torch.arange(5), **kw)
    with pytest.raises(RequestRejected, match=message):
        eng.submit(req)
    assert not eng.scheduler.records


def test_reasoning_step_bytes_count_against_the_budget():
    eng = engine()
    loop = eng.loop("reasoning")
    req = ReasonRequest(torch.arange(40), 4)
    state = loop.init_state(req)
    held = loop.admission(state).device_bytes
    step = loop.plan_step(state).resources.device_bytes
    assert step > 0, "the prefill's activations must be declared"
    with pytest.raises(RequestRejected, match="can never fit"):
        engine(memory_budget_bytes=held + step - 1).submit(req)
    assert len(engine(memory_budget_bytes=held + step).reason(req)["tokens"]) == 4


def test_step_bytes_split_batches_and_a_step_that_can_never_fit_fails_alone():
    budget = 1000
    kernel = InPlaceKernel(step_bytes=300, held_bytes=50)
    sched = WorkUnitScheduler(memory_budget_bytes=budget)
    seen = []
    sched.bus.subscribe(lambda ev: seen.append(len(ev.data["batch"])), "trace.step")
    recs = [sched.submit(kernel, Counter(str(i), 3)) for i in range(5)]
    sched.run_until_idle()
    assert all(r.status == "completed" for r in recs)
    assert sched.peak_bytes <= budget and max(seen) < 5, (sched.peak_bytes, seen)

    class Growing(InPlaceKernel):  # the third step needs more than the whole budget
        def plan_step(self, s):
            p = super().plan_step(s)
            return WorkPlan("", p.loop_id, p.phase, p.step_index, p.batch_key,
                            ResourceRequest(device_bytes=5000 if len(s.values) == 2 else 10))
    sched = WorkUnitScheduler(memory_budget_bytes=budget)
    big, small = sched.submit(Growing(), Counter("big", 4)), sched.submit(Growing(), Counter("small", 2))
    sched.run_until_idle()
    assert big.status == "failed" and "needs 5000 bytes" in big.error and small.status == "completed"
    assert sched.reserved_bytes == 0


# ---------------------------------------------------------------------------------------------- 4. subscribers
def test_raising_subscriber_isolated_all_requests_complete():
    eng = engine()
    calls, errors, done = [], [], []

    def broken(ev):
        calls.append(ev)
        raise RuntimeError("subscriber bug")
    eng.subscribe(broken, prefix="trace.cache")
    eng.subscribe(lambda ev: errors.append(ev), prefix="trace.subscriber_error")
    eng.subscribe(lambda ev: done.append(ev.request_id), prefix="request.completed")
    eng.subscribe(lambda ev: 1 / 0, prefix="request.")   # a second broken one, on the scheduler's own events
    handles = [eng.submit(generation(i)) for i in range(20)]
    eng.run_until_idle()
    assert [h.status for h in handles] == ["completed"] * 20
    assert sorted(done) == sorted(h.request_id for h in handles)
    assert len(calls) > 1, "the broken subscriber is kept and still called"
    assert sorted(e.data["event_kind"].split(".")[0] for e in errors) == ["request", "trace"], errors
    assert errors[0].data["error"] == "RuntimeError: subscriber bug" or errors[1].data["error"] == \
        "RuntimeError: subscriber bug"
    assert eng.bus.failures  # later failures counted, not reported again


def test_raising_cache_subscriber_does_not_fail_the_cache_user():
    eng = engine()
    eng.model.und_cache.subscribe(lambda ev: 1 / 0)
    assert eng.generate(generation(3))["latents"]["vision"].isfinite().all()
    assert sum(eng.model.und_cache.subscriber_failures.values()) >= 2


# ---------------------------------------------------------------------------------------------- 7. clear errors
def wan_request(**kw):
    return WanGenerateRequest(**{**dict(text_ids=torch.arange(1, 5), num_frames=5, height=16, width=16,
                                        guidance_scale=1.0, num_steps=1), **kw})


@pytest.mark.parametrize("family, make, message", [
    ("cosmos3", lambda: ReasonRequest(torch.arange(5), 4, seed=1.5), "seed must be an int"),
    ("cosmos3", lambda: ReasonRequest(torch.arange(5), 4, seed=2 ** 64), "seed must be an int"),
    ("cosmos3", lambda: ReasonRequest(torch.arange(5), 4, temperature="hot"), "temperature must be >= 0"),
    ("cosmos3", lambda: ReasonRequest(torch.arange(5), True), "max_new_tokens"),
    ("cosmos3", lambda: generation(1, seed=1.5), "seed must be an int"),
    ("cosmos3", lambda: generation(1, guidance_scale=None), "guidance_scale must be finite"),
    ("cosmos3", lambda: generation(1, sound_frames=1.5), "sound_frames"),
    ("wan", lambda: wan_request(seed=1.5), "seed must be an int"),
    ("wan", lambda: wan_request(seed=2 ** 64), "seed must be an int"),
])
def test_bad_values_are_clear_rejections(family, make, message):
    eng = Engine.from_variant("tiny-2.1-t2v") if family == "wan" else engine()
    with pytest.raises(RequestRejected, match=message):
        eng.submit(make())
    assert eng.scheduler.idle


def test_cancel_unknown_request_is_a_clear_value_error():
    from optimized import engine as engine_module
    eng = engine()
    for call in (eng.cancel, eng.scheduler.cancel, eng.scheduler.preempt):
        with pytest.raises(ValueError, match="no request with id 'unknown'") as info:
            call("unknown")
        assert isinstance(info.value, engine_module.UnknownRequest)
    h = eng.submit(ReasonRequest(torch.arange(4), 2))
    eng.cancel(h.request_id)
    eng.run_until_idle()
    assert h.status == "cancelled"


def test_non_finite_weights_refused_naming_the_key(tmp_path):
    from safetensors.torch import save_file
    from manifests.checkpoint import CheckpointError
    key = sorted(STATE)[3]
    bad = {k: v.clone() for k, v in STATE.items()}
    bad[key].view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=f"'transformer' key '{key}' holds NaN/Inf"):
        Engine.from_state_dict(CFG, bad)
    save_file(bad, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_dict()))
    (tmp_path / "manifest.json").write_text(json.dumps({"family": "cosmos3", "component": "transformer",
                                                        "weights_version": "sha256:" + "cd" * 32}))
    with pytest.raises(CheckpointError, match=f"key '{key}' holds NaN/Inf"):
        Engine.from_checkpoint(tmp_path)
    bad[key].view(-1)[0] = 0.0
    save_file(bad, str(tmp_path / "model.safetensors"))
    assert Engine.from_checkpoint(tmp_path).family.name == "cosmos3"
