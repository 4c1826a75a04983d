"""A batched step that raises is never silent: the scheduler reruns its members one by one from their pre-step
states (a failing request fails alone; serving keeps that), but first emits one `trace.batch_failed` event (error,
member ids, loop, steps), and every C1 case with more than one request turns such an event into a failed
`<case>/no_batch_failed` check (single-process wan / cosmos3 C1, and per rank in the plan runs). Without it a batch
that cannot run (CFG-parallel returning too few predictions once an unguided row joins) shows only where a check
asks whether a batch formed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from optimized.runtime.events import EventBus
from optimized.runtime.scheduler import WorkUnitScheduler
from tests.test_scheduler import FakeClock, Job, TimedKernel


@dataclass
class NoBatchKernel(TimedKernel):
    """Steps one request fine; raises for a batch of more than one."""
    loop_id = "toy.nobatch"

    def run_step(self, states, plans):
        if len(states) > 1:
            raise RuntimeError(f"cannot batch {len(states)} rows")
        return super().run_step(states, plans)


def test_a_batched_step_that_raises_is_said_once_and_its_members_still_complete_alone():
    bus = EventBus()
    seen = []
    bus.subscribe(lambda ev: seen.append(ev) if ev.kind in ("trace.batch_failed", "trace.step") else None)
    kernel = NoBatchKernel(FakeClock(), seconds=lambda b: 1.0)
    sched = WorkUnitScheduler(bus=bus, clock=kernel.clock, batching="greedy")
    a, b = sched.submit(kernel, Job("a", 3), "a"), sched.submit(kernel, Job("b", 3), "b")
    sched.run_until_idle()
    assert a.status == b.status == "completed" and a.result == b.result == 3     # isolation kept
    assert all(batch in (["a"], ["b"]) for batch in kernel.batches)               # every step ran solo
    # one event per batched step (3 steps), each before its members' solo reruns
    assert [(e.kind, e.request_id) for e in seen] == [("trace.batch_failed", None), ("trace.step", "a"),
                                                      ("trace.step", "b")] * 3
    failures = [e.data for e in seen if e.kind == "trace.batch_failed"]
    assert [f["steps"] for f in failures] == [[0, 0], [1, 1], [2, 2]]
    assert all(f["batch"] == ["a", "b"] and f["loop"] == "toy.nobatch" for f in failures)
    assert failures[0]["error"] == "RuntimeError: cannot batch 2 rows"


def test_a_solo_step_that_raises_is_a_failed_request_not_a_batch_failure():
    bus = EventBus()
    seen = []
    bus.subscribe(seen.append, prefix="trace.")

    @dataclass
    class Failing(TimedKernel):
        def run_step(self, states, plans):
            raise RuntimeError("boom")

    kernel = Failing(FakeClock(), seconds=lambda b: 1.0)
    sched = WorkUnitScheduler(bus=bus, clock=kernel.clock)
    rec = sched.submit(kernel, Job("a", 2))
    sched.run_until_idle()
    assert rec.status == "failed" and not [e for e in seen if e.kind == "trace.batch_failed"]


def _refusing_batches(monkeypatch, loop_cls) -> None:
    """Plant a batched-step exception: `loop_cls.run_step` raises for more than one state."""
    original = loop_cls.run_step

    def refuses_batches(self, states, plans):
        if len(states) > 1:
            raise RuntimeError("planted: batched step refused")
        return original(self, states, plans)

    monkeypatch.setattr(loop_cls, "run_step", refuses_batches)


def _wan_c1_concurrent(monkeypatch):
    """Single-process wan C1 on the tiny t2v variant, only its three-request concurrent case."""
    from parity.families.wan import cases as case_lib
    from parity.families.wan.c1 import run_c1

    anchors = case_lib.anchor_cases
    monkeypatch.setattr(case_lib, "c1_cases", lambda cfg, matrix="ci", seed=0:
                        [c for c in anchors(cfg) if c.name == "concurrent3"])
    return run_c1(["tiny-2.1-t2v"], None, "cpu", ["fp32"], 0, None, lambda msg: None)


def test_wan_c1_fails_no_batch_failed_when_a_batched_denoise_step_raises(monkeypatch):
    from optimized.models.wan.denoise import WanDenoiseLoop

    clean = _wan_c1_concurrent(monkeypatch)
    check = [c for c in clean.checks if c.name.endswith("/no_batch_failed")]
    assert [c.name for c in check] == ["tiny-2.1-t2v/fp32/concurrent3/no_batch_failed"] and check[0].passed
    assert clean.passed, [(c.name, c.detail) for c in clean.checks if not c.passed][:5]

    _refusing_batches(monkeypatch, WanDenoiseLoop)
    bad = [c for c in _wan_c1_concurrent(monkeypatch).checks if not c.passed]
    names = {c.name.split("/", 2)[2] for c in bad}
    assert "concurrent3/no_batch_failed" in names, sorted(names)
    failed = next(c for c in bad if c.name.endswith("/no_batch_failed"))
    assert "RuntimeError: planted: batched step refused" in failed.detail and "wan.denoise" in failed.detail
    # the solo reruns are right: apart from the batch checks, nothing else sees it
    assert names <= {"concurrent3/no_batch_failed", "concurrent3/req0/batched_with_others",
                     "concurrent3/req1/batched_with_others", "concurrent3/req2/batched_with_others"}, sorted(names)


def test_cosmos3_c1_fails_no_batch_failed_when_a_batched_denoise_step_raises(monkeypatch):
    from optimized.models.cosmos3.loops import FlowDenoiseLoop
    from parity.families.cosmos3.c1 import run_c1

    def concurrent3():
        return run_c1(["tiny"], None, "cpu", ["fp32"], 0, None, lambda msg: None, only=("concurrent3",))

    clean = concurrent3()
    assert [c.name for c in clean.checks if c.name.endswith("/no_batch_failed")] == \
        ["tiny/fp32/concurrent3/no_batch_failed"]
    assert clean.passed, [(c.name, c.detail) for c in clean.checks if not c.passed][:5]
    _refusing_batches(monkeypatch, FlowDenoiseLoop)
    bad = {c.name.split("/", 2)[2]: c for c in concurrent3().checks if not c.passed}
    assert "concurrent3/no_batch_failed" in bad, sorted(bad)
    assert "planted: batched step refused" in bad["concurrent3/no_batch_failed"].detail
    assert all(n == "concurrent3/no_batch_failed" or n.endswith("/batched_with_others") for n in bad), sorted(bad)


@pytest.mark.dist
@pytest.mark.slow
def test_cfg_rows_halved_fails_no_batch_failed_on_every_rank_of_the_mixed_rows_batch():
    """The wan cfgp2 plan run, the mixed-rows case: the fault's batched step raises (too few predictions), the solo
    reruns are right, and both `batched_with_others` and the new `no_batch_failed` fail on both ranks."""
    from tests.test_wan_sp import c1

    only = ("cfgp_mixed_rows.",)
    clean = c1("cfgp2", only=only)
    assert clean.passed and any(c.name.endswith("/no_batch_failed") for c in clean.checks)
    bad = [c for c in c1("cfgp2", fault="cfg-rows-halved", only=only).checks if not c.passed]
    kinds = {c.name.rsplit("/", 1)[1] for c in bad}
    assert kinds == {"batched_with_others", "no_batch_failed"}, sorted(c.name for c in bad)
    ranks = {c.name.split("/")[4] for c in bad if c.name.endswith("/no_batch_failed")}
    assert ranks == {"rank0", "rank1"}, [c.name for c in bad]
    assert all("Error: " in c.detail for c in bad if c.name.endswith("/no_batch_failed"))   # the error named


@pytest.mark.dist
@pytest.mark.slow
def test_cosmos3_cfg_rows_halved_fails_no_batch_failed_on_every_rank():
    from tests.test_cosmos3_sp import c1

    bad = [c for c in c1("cfgp2", "cfg-rows-halved", only=("cfgp_mixed_rows",)).checks if not c.passed]
    failed = [c for c in bad if c.name.endswith("/no_batch_failed")]
    assert {c.name.split("/")[4] for c in failed} == {"rank0", "rank1"}, [c.name for c in bad]
    assert all("cosmos3.denoise" in c.detail and "Error: " in c.detail for c in failed), failed[0].detail
