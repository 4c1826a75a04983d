"""The fleet router with in-process fake replicas: cost and affinity placement, health, failover when a replica dies
mid-stage (resumed from the last completed stage, nothing lost or written twice), clear failure when it cannot."""

import threading

import pytest

from optimized.fleet.deployment import RoutingSpec
from optimized.fleet.router import (FleetRequestFailed, HealthReport, ReplicaDied, RequestCancelled, RequestLedger,
                                    Router, StageCall, StageCostModel, StageError, StageOutput, StagePlan, StageRecord)


class FakeReplica:
    """A replica in this process: the encoder hashes the prompt (cached by key), the denoiser runs `steps` steps of
    arithmetic, the decoder formats. `die_at_step`: the process dies at that step of its next denoise (and stays
    dead); `gate`: a threading.Event the stage waits on (to hold it busy)."""

    def __init__(self, role, idx, die_at_step=None, gate=None, raise_error=None):
        self.role, self.replica_id = role, f"{role}-{idx}"
        self.die_at_step, self.gate, self.raise_error = die_at_step, gate, raise_error
        self.dead = False
        self.calls: list[StageCall] = []
        self.cache: dict[str, int] = {}
        self.steps_run = 0
        self.health_error = None

    def run_stage(self, call):
        if self.dead:
            raise ReplicaDied(self.replica_id, "process exited")
        self.calls.append(call)
        if self.gate is not None:
            self.gate.wait(5)
        if self.raise_error is not None:
            raise self.raise_error
        hit = False
        if self.role == "encoder":
            prompt = call.payload["prompt"]
            hit = call.cache_key in self.cache
            emb = self.cache[call.cache_key] if hit else sum(map(ord, prompt)) * 7
            self.cache[call.cache_key] = emb
            out = {"emb": emb, "steps": call.payload["steps"]}
        elif self.role == "denoiser":
            x = call.payload["emb"]
            for step in range(call.payload["steps"]):
                if self.die_at_step is not None and step == self.die_at_step:
                    self.dead = True
                    raise ReplicaDied(self.replica_id, f"killed at step {step}")
                x = (x * 31 + step) % 1_000_003
                self.steps_run += 1
            out = {"latent": x}
        else:
            out = f"video:{call.payload['latent']}"
        return StageOutput(out, seconds=0.01, cache_hit=hit,
                           resident=tuple(self.cache) if self.role == "encoder" else None, bytes_moved=8)

    def health(self, timeout_s):
        if self.dead:
            raise ReplicaDied(self.replica_id, "process exited")
        if self.health_error is not None:
            raise self.health_error
        return HealthReport(self.replica_id, self.role, True, resident=tuple(self.cache))


def fleet(n_enc=1, n_den=2, n_dec=1, routing=RoutingSpec(), den_kw=None):
    den_kw = den_kw or {}
    pools = {"encoder": [FakeReplica("encoder", i) for i in range(n_enc)],
             "denoiser": [FakeReplica("denoiser", i, **den_kw.get(i, {})) for i in range(n_den)],
             "decoder": [FakeReplica("decoder", i) for i in range(n_dec)]}
    events = []
    router = Router(pools, routing, StageCostModel(), on_event=lambda k, r, d: events.append((k, r, d)))
    return router, pools, events


def plans(prompt, steps=4):
    return [StagePlan("encoder", 1, f"text:{prompt}"), StagePlan("denoiser", steps), StagePlan("decoder", 1)]


def run(router, rid, prompt="a cat", steps=4, **kw):
    writes = []

    def finish(video):
        writes.append(video)
        return video
    art, ledger = router.run(rid, {"prompt": prompt, "steps": steps}, plans(prompt, steps), finish=finish, **kw)
    return art, ledger, writes


def expected(prompt="a cat", steps=4):
    x = sum(map(ord, prompt)) * 7
    for s in range(steps):
        x = (x * 31 + s) % 1_000_003
    return f"video:{x}"


def test_plain_run_crosses_every_role_once():
    router, pools, events = fleet()
    art, ledger, writes = run(router, "r1")
    assert art == expected() and writes == [art]
    assert list(ledger.completed) == ["encoder", "denoiser", "decoder"]
    assert ledger.bytes_moved == 24 and ledger.artifact_commits == 1 and not ledger.failures
    assert [k for k, _, _ in events].count("stage.completed") == 3


def test_denoiser_killed_mid_run_resumes_on_the_other_from_the_encoder_output():
    router, pools, events = fleet(den_kw={0: {"die_at_step": 2}})
    art, ledger, writes = run(router, "r1")
    enc, (d0, d1), dec = pools["encoder"][0], pools["denoiser"], pools["decoder"][0]
    assert art == expected()                       # the same video an undisturbed run makes
    assert writes == [art] and ledger.artifact_commits == 1           # written once
    assert len(enc.calls) == 1 and len(dec.calls) == 1               # the encoder is not re-run
    assert [c.attempt for c in d0.calls + d1.calls] == [1, 2]
    assert d1.calls[0].payload == ledger.outputs["encoder"]            # resumed from the last completed stage
    assert ledger.completed["denoiser"].replica_id == "denoiser-1"
    assert ledger.failures == ["denoiser on denoiser-0 (try 1): denoiser-0 died: killed at step 2"]
    assert ("stage.failover", "r1") in [(k, r) for k, r, _ in events]
    assert router.health()["roles"]["denoiser"][0]["status"] == "dead"
    # the next request never goes to the dead replica
    art2, ledger2, _ = run(router, "r2", prompt="a dog")
    assert art2 == expected("a dog") and ledger2.completed["denoiser"].replica_id == "denoiser-1"
    assert len(d0.calls) == 1


def test_every_denoiser_dead_fails_with_one_clear_error():
    router, pools, _ = fleet(den_kw={0: {"die_at_step": 1}, 1: {"die_at_step": 3}})
    writes = []
    with pytest.raises(FleetRequestFailed) as e:
        router.run("r1", {"prompt": "p", "steps": 4}, plans("p"), finish=writes.append)
    msg = str(e.value)
    assert msg.startswith("request r1: stage denoiser could not complete (no healthy replica left")
    assert "denoiser-0 died: killed at step 1" in msg and "denoiser-1 died: killed at step 3" in msg
    assert msg.endswith("completed stages: encoder")
    assert writes == [] and pools["decoder"][0].calls == []          # no artifact, nothing half-made
    assert router.health()["status"] == "degraded"


def test_max_attempts_bounds_the_retries():
    router, pools, _ = fleet(n_den=3, routing=RoutingSpec(max_attempts=2),
                             den_kw={0: {"die_at_step": 0}, 1: {"die_at_step": 0}})
    with pytest.raises(FleetRequestFailed, match="gave up after 2 tries"):
        run(router, "r1")
    assert pools["denoiser"][2].calls == []


def test_a_stage_error_on_a_live_replica_is_not_failed_over():
    router, pools, _ = fleet(den_kw={0: {"raise_error": ValueError("num_frames must be 4k + 1")}})
    with pytest.raises(StageError, match="denoiser on denoiser-0 raised ValueError: num_frames must be 4k"):
        run(router, "r1")
    assert pools["denoiser"][1].calls == []
    assert router.health()["roles"]["denoiser"][0]["status"] == "healthy"


def test_cost_places_on_the_replica_that_finishes_first():
    gate = threading.Event()
    router, pools, _ = fleet(den_kw={0: {"gate": gate}})
    long = threading.Thread(target=run, args=(router, "long"), kwargs={"steps": 50})
    long.start()
    try:
        for _ in range(500):   # wait until the long request holds denoiser-0
            if pools["denoiser"][0].calls:
                break
            threading.Event().wait(0.01)
        assert pools["denoiser"][0].calls
        busy = router.states["denoiser"]["denoiser-0"]
        assert busy.backlog_s == pytest.approx(router.cost.predict("denoiser", 50))
        _, ledger, _ = run(router, "short", steps=4)
        assert ledger.completed["denoiser"].replica_id == "denoiser-1"
    finally:
        gate.set()
        long.join(5)
    assert router.states["denoiser"]["denoiser-0"].backlog_s == 0.0


def test_cost_model_calibrates_from_measured_calls():
    cost = StageCostModel({"encoder": 1.0, "denoiser": 2.0, "decoder": 1.0})
    assert cost.predict("denoiser", 10) == 20.0
    cost.observe("denoiser", 10, 1.0)       # measured 0.1 s / unit replaces the prior
    assert cost.predict("denoiser", 10) == pytest.approx(1.0)
    cost.observe("denoiser", 10, 3.0)       # EMA 0.5: (0.1 + 0.3) / 2
    assert cost.predict("denoiser", 10) == pytest.approx(2.0)
    assert cost.to_dict()["observations"] == {"denoiser.miss": 2}


def _warm(router, pools, prompt, on):
    """Encode `prompt` on encoder `on` (the other one held busy meanwhile)."""
    other = 1 - on
    gate = threading.Event()
    pools["encoder"][other].gate = gate
    t = threading.Thread(target=run, args=(router, f"hold-{prompt}"), kwargs={"prompt": "holder"})
    if on == 1:
        t.start()
        for _ in range(500):
            if pools["encoder"][0].calls and pools["encoder"][0].calls[-1].payload["prompt"] == "holder":
                break
            threading.Event().wait(0.01)
    _, ledger, _ = run(router, f"warm-{prompt}", prompt=prompt)
    gate.set()
    if on == 1:
        t.join(5)
    pools["encoder"][other].gate = None
    assert ledger.completed["encoder"].replica_id == f"encoder-{on}"


@pytest.mark.parametrize("affinity", [True, False])
def test_affinity_sends_a_prompt_to_the_encoder_holding_its_embedding(affinity):
    router, pools, _ = fleet(n_enc=2, routing=RoutingSpec(affinity=affinity))
    _warm(router, pools, "a red fox", on=1)
    _, ledger, _ = run(router, "again", prompt="a red fox")
    # with both idle, ties go to encoder-0; only affinity moves it to encoder-1, where the embedding is
    assert ledger.completed["encoder"].replica_id == ("encoder-1" if affinity else "encoder-0")
    assert ledger.completed["encoder"].cache_hit is affinity


def test_affinity_yields_to_cost_when_the_holder_is_loaded():
    router, pools, _ = fleet(n_enc=2)
    _warm(router, pools, "a red fox", on=1)
    router.states["encoder"]["encoder-1"].backlog_s = 100.0           # the holder is far behind
    _, ledger, _ = run(router, "again", prompt="a red fox")
    assert ledger.completed["encoder"].replica_id == "encoder-0"


def test_a_dead_replicas_cache_is_never_routed_to():
    router, pools, _ = fleet(n_enc=2)
    _warm(router, pools, "a red fox", on=1)
    pools["encoder"][1].dead = True
    _, ledger, _ = run(router, "again", prompt="a red fox")
    assert ledger.completed["encoder"].replica_id == "encoder-0" and not ledger.completed["encoder"].cache_hit
    assert "encoder on encoder-1 (try 1)" in ledger.failures[0]
    assert router.states["encoder"]["encoder-1"].resident == frozenset()


def test_health_probes_mark_unhealthy_and_recover():
    router, pools, _ = fleet()
    d0 = pools["denoiser"][0]
    d0.health_error = TimeoutError("no answer in 10 s")
    assert router.check_health(now=100.0) == {"encoder-0": True, "denoiser-0": False, "denoiser-1": True,
                                              "decoder-0": True}
    _, ledger, _ = run(router, "r1")
    assert ledger.completed["denoiser"].replica_id == "denoiser-1" and d0.calls == []
    d0.health_error = None
    assert router.check_health(now=100.5)["denoiser-0"] is False       # within the interval: not probed again
    assert router.check_health(now=103.0)["denoiser-0"] is True
    d0.dead = True
    assert router.check_health(now=106.0)["denoiser-0"] is False
    d0.dead = False                                                     # a dead replica stays dead
    assert router.check_health(now=109.0)["denoiser-0"] is False
    assert router.health()["roles"]["denoiser"][0]["status"] == "dead"


def test_cancel_between_stages():
    router, pools, _ = fleet()
    flag = {"stop": False}
    orig = pools["encoder"][0].run_stage

    def enc_then_cancel(call):
        out = orig(call)
        flag["stop"] = True
        return out
    pools["encoder"][0].run_stage = enc_then_cancel
    with pytest.raises(RequestCancelled, match="cancelled before denoiser"):
        run(router, "r1", cancelled=lambda: flag["stop"])
    assert all(not d.calls for d in pools["denoiser"])


def test_ledger_commits_a_stage_and_the_artifact_once():
    ledger = RequestLedger("r")
    ledger.commit_stage(StageRecord("denoiser", "denoiser-1", 2, 0.1, False, 8), "latent")
    with pytest.raises(RuntimeError, match="already committed by denoiser-1"):
        ledger.commit_stage(StageRecord("denoiser", "denoiser-0", 1, 0.1, False, 8), "late latent")
    assert ledger.outputs["denoiser"] == "latent"
    ledger.commit_artifact("video")
    with pytest.raises(RuntimeError, match="artifact already committed"):
        ledger.commit_artifact("video again")


def test_router_refuses_an_empty_pool():
    with pytest.raises(ValueError, match="no replica for role 'decoder'"):
        Router({"encoder": [FakeReplica("encoder", 0)], "denoiser": [FakeReplica("denoiser", 0)], "decoder": []})


def test_a_replica_at_max_inflight_is_passed_over_while_another_is_free():
    router, pools, _ = fleet()
    router.max_inflight = {"denoiser": 1}
    d0, d1 = router.states["denoiser"]["denoiser-0"], router.states["denoiser"]["denoiser-1"]
    d0.inflight, d0.backlog_s, d1.backlog_s = 1, 0.0, 50.0      # d0 predicts earlier but is full
    assert router.place(StagePlan("denoiser", 4))[0].replica.replica_id == "denoiser-1"
    d1.inflight = 1                                             # both full: the earliest predicted finish
    assert router.place(StagePlan("denoiser", 4))[0].replica.replica_id == "denoiser-0"


def test_placement_and_its_reservation_are_one_step():
    router, _, _ = fleet()
    first, seconds = router.place(StagePlan("denoiser", 10), reserve=True)
    second, _ = router.place(StagePlan("denoiser", 10), reserve=True)
    assert {first.replica.replica_id, second.replica.replica_id} == {"denoiser-0", "denoiser-1"}
    assert first.backlog_s == seconds == router.cost.predict("denoiser", 10) and first.inflight == 1
