"""Every engine event carries designv2's Observability fields (request, session, program, model, instance, loop,
worker, role, timestamp, trace id, versions): stamped by the bus, whoever emits; a program's stages share its trace;
a caller's `submission` scope (traceparent, session) reaches the events of what it submits; contexts do not pile up."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest
import torch

from manifests.wan import WanGenerateRequest
from optimized import Engine
from optimized.runtime import events
from optimized.runtime.events import Event, EventBus, TraceParent, submission

VARIANT = "tiny-2.1-t2v"
CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def request(seed: int = 0, steps: int = 2) -> WanGenerateRequest:
    return WanGenerateRequest(text_ids=torch.arange(1, 6), num_frames=5, height=32, width=32, num_steps=steps,
                              guidance_scale=1.0, seed=seed)


def recorded(engine: Engine) -> list[Event]:
    seen: list[Event] = []
    engine.subscribe(seen.append)
    return seen


def test_every_event_of_a_video_program_carries_the_seeds_fields():
    eng = Engine.from_variant(VARIANT, seed=0)
    eng.__dict__["variant"] = VARIANT                   # what fvgen's load_engine records
    seen = recorded(eng)
    t0 = time.time()
    eng.generate_video(request(), request_id="clip-a")
    eng.generate_video(request(1), request_id="clip-b")
    assert seen, "no event was emitted"
    here = f"{socket.gethostname()}:{os.getpid()}"
    for ev in seen:
        assert ev.worker_id == here and ev.role == "engine", (ev.kind, ev.worker_id, ev.role)
        assert ev.model_id == f"wan/{VARIANT}", (ev.kind, ev.model_id)
        assert ev.instance_id and ev.versions.get("weights") == str(eng.model.weights_version), (ev.kind, ev.versions)
        assert t0 - 1 <= ev.timestamp <= time.time() + 1, (ev.kind, ev.timestamp)
        assert ev.fields()["worker_id"] == here
    by_request = [ev for ev in seen if ev.request_id is not None]
    kinds = {ev.kind for ev in by_request}
    assert {"request.accepted", "request.admitted", "trace.step", "request.completed"} <= kinds, kinds
    for ev in by_request:
        program, stage = ev.request_id.split("/")
        assert ev.program_id == program, (ev.request_id, ev.program_id)
        assert ev.trace_id is not None and len(ev.trace_id) == 32, ev.trace_id
        assert ev.loop_id == {"denoise": "wan.denoise", "decode": "wan.vae_decode"}[stage], (ev.kind, ev.loop_id)
    traces = {p: {ev.trace_id for ev in by_request if ev.program_id == p} for p in ("clip-a", "clip-b")}
    assert all(len(t) == 1 for t in traces.values()), f"a program's stages are on several traces: {traces}"
    assert traces["clip-a"] != traces["clip-b"], "two programs share a trace id"
    assert all(ev.trace_id is None and ev.model_id for ev in seen if ev.request_id is None)   # engine-wide events


def test_a_weight_update_shows_in_the_instance_and_version_of_later_requests():
    eng = Engine.from_variant(VARIANT, seed=0)
    seen = recorded(eng)
    eng.generate(request())
    before = next(ev for ev in seen if ev.kind == "request.completed")
    eng.update_weights(eng.family.random_weights(eng.model.cfg, 11), version="v2")
    eng.generate(request())
    after = [ev for ev in seen if ev.kind == "request.completed"][-1]
    assert after.versions["weights"] == "v2" != before.versions["weights"]
    assert after.instance_id != before.instance_id, "a new resident instance kept the old instance id"


def test_a_callers_submission_scope_reaches_the_events_of_what_it_submits():
    from optimized.serving.async_engine import AsyncEngine

    eng = Engine.from_variant(VARIANT, seed=0)
    seen = recorded(eng)

    async def main() -> str:
        driver = AsyncEngine(eng)
        try:
            with submission(traceparent=CALLER, session_id="sess-1"):
                handle = await driver.submit(request())
            await handle.result()
            return handle.request_id
        finally:
            await driver.close()

    rid = asyncio.run(asyncio.wait_for(main(), 60))
    mine = [ev for ev in seen if ev.request_id and ev.request_id.startswith(rid + "/")]
    assert mine and all(ev.session_id == "sess-1" for ev in mine), {ev.session_id for ev in mine}
    assert {ev.trace_id for ev in mine} == {"4bf92f3577b34da6a3ce929d0e0e4736"}
    assert all(ev.context.parent_span_id == "00f067aa0ba902b7" for ev in mine)


def test_contexts_stay_bounded_and_end_with_their_request():
    bus = EventBus()
    for i in range(events.MAX_PROGRAMS + 50):
        bus.open_program(f"p{i}")
    assert len(bus._programs) == events.MAX_PROGRAMS and bus.program_context("p0") is None
    bus.emit(Event("request.accepted", "solo", 0))
    assert "solo" in bus._requests
    bus.emit(Event("request.completed", "solo", 1))
    assert "solo" not in bus._requests, "a finished request's context is still held"
    bus.emit(Event("request.rejected", "refused", 0))
    assert "refused" not in bus._requests


@pytest.mark.parametrize("header, ok", [
    (CALLER, True),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", True),       # not sampled: still a context
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),      # all-zero trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),      # all-zero span id
    ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),      # version ff is invalid
    ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01", False),      # W3C: lowercase hex only
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", False),  # version 00 has 4 fields
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", True),   # a later version may add fields
    ("garbage", False), (None, False)])
def test_traceparent_parsing_follows_w3c(header, ok):
    parsed = TraceParent.parse(header)
    assert (parsed is not None) == ok, (header, parsed)
    if ok and header.startswith("00"):
        assert parsed.header() == header


def test_a_sessions_generation_events_carry_its_session_id():
    from optimized.serving.async_engine import AsyncEngine

    eng = Engine.from_variant(VARIANT, seed=0)
    seen = recorded(eng)

    async def main() -> tuple[str, str]:
        driver = AsyncEngine(eng)
        try:
            async with driver.session(num_steps=1, num_frames=5, seed=1) as s:
                await s.push_text("a cat")
                rid = await s.generate()
                async for ev in s.events():
                    if ev.kind in ("generation.completed", "generation.failed"):
                        break
                return s.session_id, rid
        finally:
            await driver.close()

    session_id, rid = asyncio.run(asyncio.wait_for(main(), 60))
    mine = [ev for ev in seen if ev.request_id and ev.request_id.startswith(rid + "/")]
    assert mine and {ev.session_id for ev in mine} == {session_id}


def test_the_engine_core_imports_no_metrics_or_tracing_library():
    import subprocess
    import sys
    code = ("import sys, optimized.engine, optimized.serving.async_engine, optimized.runtime.events; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('prometheus_client', 'opentelemetry')); "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the engine core imported {done.stdout.strip()} {done.stderr[-500:]}"
