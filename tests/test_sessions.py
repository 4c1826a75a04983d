"""Realtime sessions through the Python API (optimized/serving/realtime.py on AsyncEngine): the prompt a generation
runs on is the session's text and appended parts, decoded chunks stream one per decode step (each the clip's own
frames, before the next decode step), interrupt stops at a step boundary, a session's steps batch with an ordinary
request's on the one scheduler, leave / rejoin replays what was missed, idle sessions time out, bad input changes
nothing, a slow consumer is dropped instead of growing memory. Every wait is bounded."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from optimized import Engine
from optimized.serving.async_engine import AsyncEngine
from optimized.serving.realtime import FieldError, SessionLagged, UnknownSession
from optimized.serving.requests import byte_ids

TIMEOUT = 60


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


@pytest.fixture(scope="module")
def engine():
    return Engine.from_variant("tiny-2.1-t2v", seed=0)


async def until(session, kind: str, after_seq: int = 0) -> list:
    """Events of `session` after `after_seq` up to and including the first of `kind`."""
    out = []
    async for ev in session.events(after_seq):
        out.append(ev)
        if ev.kind == kind:
            return out
    raise AssertionError(f"the session ended before {kind}: {[e.kind for e in out]}")


def test_prompt_parts_reach_the_request_and_chunks_stream_per_decode_step(engine):
    async def main():
        eng = AsyncEngine(engine)
        try:
            async with eng.session(num_steps=2, num_frames=9, seed=5) as s:
                await s.push_text("an old text")
                await s.push_text("a cat")           # replaces
                await s.append("on a mat")            # appended: prompt memory
                rid = await s.generate()
                events = await until(s, "generation.completed")
                return rid, events, s.last_result, s.state
        finally:
            await eng.close()

    rid, events, result, state = run(main())
    assert state.prompt == "a cat on a mat"
    assert torch.equal(result.request.text_ids, byte_ids(engine, "a cat on a mat"))   # what the model was given
    assert result.request.seed == 5 and result.request.num_steps == 2
    ours = [e for e in events if e.data.get("request_id") == rid]
    chunks = [e for e in ours if e.kind == "media.video_chunk"]
    assert [c.data["chunk"] for c in chunks] == [0, 1, 2]   # 9 frames = 3 latent frames, one per decode step
    # each chunk is exactly the clip's frames [start, end): the same pixels the finished result holds
    assert chunks[-1].data["video_frames"][1] == result.frames.shape[0]
    for c in chunks:
        a, b = c.data["video_frames"]
        assert c.frames.dtype == torch.uint8 and torch.equal(c.frames, result.frames[a:b])
    # streamed as it is ready: chunk k (made by decode step k+1) arrives after decode step k ended and before decode
    # step k+2 ends; its order against its own step's progress event is not fixed (two delivery paths, one step)
    order = [(e.kind, e.data.get("stage"), e.data.get("step"), e.data.get("chunk")) for e in ours]
    decode = [o for o in order if o[1] == "decode"]
    progress_at = {o[2]: i for i, o in enumerate(decode) if o[0] == "generation.progress"}
    chunk_at = {o[3]: i for i, o in enumerate(decode) if o[0] == "media.video_chunk"}
    assert sorted(progress_at) == [1, 2, 3] and sorted(chunk_at) == [0, 1, 2], decode
    for k, i in chunk_at.items():
        assert k == 0 or i > progress_at[k], decode          # not before the step before it ended
        assert k + 2 not in progress_at or i < progress_at[k + 2], decode   # not held back to the end
    assert order[-1][0] == "generation.completed" and events[-1].data["chunks"] == 3
    assert [g.status for g in state.history] == ["completed"] and state.active_generation is None


def test_interrupt_stops_at_the_next_step_boundary_and_the_session_goes_on(engine):
    async def main():
        eng = AsyncEngine(engine)
        try:
            s = await eng.open_session(num_steps=200, num_frames=5)
            await s.push_text("a long one")
            rid = await s.generate()
            seen = await until(s, "generation.progress")
            assert await s.interrupt() == rid
            rest = await until(s, "session.interrupted", seen[-1].seq)
            record = engine.scheduler.records.get(f"{rid}/denoise")
            again = await s.generate()                 # the session takes the next one
            done = await until(s, "generation.completed", rest[-1].seq)
            await s.close()
            return rid, rest, record, again, done, s
        finally:
            await eng.close()

    rid, rest, record, again, done, s = run(main())
    stopped = next(e for e in rest if e.kind == "generation.interrupted")
    steps = [e.data["step"] for e in rest if e.kind == "generation.progress" and e.data["request_id"] == rid]
    assert stopped.data["request_id"] == rid and stopped.data["steps_run"] < 200
    assert stopped.data["steps_run"] == (steps[-1] if steps else 1)   # no step ran after the last one reported
    assert not any(e.kind == "media.video_chunk" for e in rest)        # never reached the decode stage
    assert record is None or record.status == "cancelled"
    assert again != rid and done[-1].data["request_id"] == again
    assert [g.status for g in s.state.history] == ["interrupted", "completed"]


def test_generate_while_generating_replaces_the_running_one(engine):
    async def main():
        eng = AsyncEngine(engine)
        try:
            async with eng.session(num_steps=200, num_frames=5) as s:
                await s.push_text("first")
                first = await s.generate()
                await until(s, "generation.progress")
                await s.update(num_steps=2)
                second = await s.generate()             # barge-in: the first is interrupted
                events = await until(s, "generation.completed")
                return first, second, events
        finally:
            await eng.close()

    first, second, events = run(main())
    ended = {e.data["request_id"]: e.kind for e in events if e.kind.startswith("generation.")
             and e.kind not in ("generation.started", "generation.progress")}
    assert ended == {first: "generation.interrupted", second: "generation.completed"}


def test_a_sessions_steps_batch_with_an_ordinary_requests(engine):
    async def main():
        eng = AsyncEngine(engine)
        steps: list = []
        unsubscribe = engine.subscribe(steps.append, prefix="trace.step")
        greedy, engine.scheduler.batching = engine.scheduler.batching, "greedy"   # batch sizes not from the clock
        gate = threading.Event()
        try:
            s = await eng.open_session(num_steps=3, num_frames=5)
            await s.push_text("a session")
            eng._post(gate.wait)                       # hold the driver so both start before its next tick
            ordinary = await eng.submit(prompt="a plain request", num_steps=3, num_frames=5)
            rid = await s.generate()
            gate.set()
            await until(s, "generation.completed")
            assert await ordinary.wait() == "completed"
            return rid, ordinary.request_id, list(steps)
        finally:
            gate.set()
            engine.scheduler.batching = greedy
            unsubscribe()
            await eng.close()

    rid, other, steps = run(main())
    both = [ev for ev in steps if {f"{rid}/denoise", f"{other}/denoise"} <= set(ev.data["batch"])]
    assert both and all(ev.data["batch_size"] == 2 for ev in both)


def test_leave_then_rejoin_replays_what_was_missed_with_the_state_kept(engine):
    async def main():
        eng = AsyncEngine(engine)
        try:
            s = await eng.open_session(num_steps=2, num_frames=9, seed=3)
            await s.push_text("kept")
            started = (await until(s, "session.updated"))[-1].seq
            rid = await s.generate()
            s.leave()
            assert not s.state.connected
            for _ in range(600):                       # the generation runs on while nobody is attached
                if not s.generating:
                    break
                await asyncio.sleep(0.05)
            back = eng.sessions.rejoin(s.session_id, after_seq=started)
            replay = await until(back, "session.rejoined", started)
            return s, back, rid, replay, back.state.connected
        finally:
            await eng.close()

    s, back, rid, replay, connected = run(main())
    assert back is s and connected and back.state.prompt == "kept"
    assert back.state.conditioning == {"num_steps": 2, "num_frames": 9, "seed": 3}
    kinds = [e.kind for e in replay]
    assert kinds[0] == "generation.started" and kinds[-1] == "session.rejoined"
    assert kinds.count("media.video_chunk") == 3 and "generation.completed" in kinds and "session.left" in kinds
    assert replay[-1].data["missed"] == 0 and replay[-1].data["state"]["history"][0]["request_id"] == rid


def test_rejoin_after_the_history_was_trimmed_says_how_much_was_missed(engine):
    async def main():
        eng = AsyncEngine(engine)
        eng.configure_sessions(max_history_events=4)
        try:
            s = await eng.open_session()
            for i in range(10):
                await s.append(f"part {i}")
            s.leave()
            eng.sessions.rejoin(s.session_id, after_seq=1)
            return list(s._events)
        finally:
            await eng.close()

    events = run(main())
    rejoined = events[-1]
    # seq 1 created, 2..11 the appends, 12 left: the last 4 (9..12) were kept when it rejoined, so 2..8 are gone
    assert rejoined.kind == "session.rejoined" and rejoined.data["missed"] == 7
    assert [e.seq for e in events] == [10, 11, 12, 13]


def test_idle_sessions_time_out_but_not_while_generating(engine):
    async def main():
        eng = AsyncEngine(engine)
        try:
            idle = await eng.open_session(idle_timeout_s=0.2)
            busy = await eng.open_session(idle_timeout_s=0.2, num_steps=60, num_frames=5)   # runs ~1 s
            await busy.push_text("slow")
            await busy.generate()
            closed = await until(idle, "session.closed")
            await until(busy, "generation.completed")   # ran past the timeout: not closed under it
            end = await until(busy, "session.closed")
            with pytest.raises(UnknownSession):
                eng.sessions.rejoin(idle.session_id)
            return closed, end, eng.sessions
        finally:
            await eng.close()

    closed, end, manager = run(main())
    assert closed[-1].data["reason"] == "idle_timeout" and end[-1].data["reason"] == "idle_timeout"
    kinds = [e.kind for e in end]
    assert kinds.index("generation.completed") < kinds.index("session.closed")
    assert manager.sessions == {} and manager._reaper.done()   # the reaper stops once nothing is open


def test_bad_input_is_refused_naming_the_field_and_changes_nothing(engine):
    async def main():
        eng = AsyncEngine(engine)
        try:
            s = await eng.open_session(num_steps=2)
            with pytest.raises(FieldError) as no_prompt:
                await s.generate()
            await s.push_text("ok")
            before = s.state.to_json()
            refused = {}
            for bad in ({"num_frames": 6}, {"height": 33}, {"num_steps": "3"}, {"bogus": 1}, {"seed": True}):
                with pytest.raises(ValueError) as e:
                    await s.update(**bad)
                refused[next(iter(bad))] = e.value
            with pytest.raises(FieldError) as image:
                await s.push_image(torch.zeros(3, 32, 32))   # a text-to-video model
            with pytest.raises(FieldError):
                await eng.open_session(num_frames="9")
            after = s.state.to_json()
            return no_prompt.value, refused, image.value, before, after, len(eng.sessions.sessions)
        finally:
            await eng.close()

    no_prompt, refused, image, before, after, open_count = run(main())
    assert no_prompt.field == "prompt" and image.field == "image"
    assert "4k+1" in str(refused["num_frames"]) and "multiples" in str(refused["height"])
    assert refused["num_steps"].field == "num_steps" and refused["bogus"].field == "bogus"
    assert refused["seed"].field == "seed"
    before.pop("last_active"), after.pop("last_active")
    assert before == after and open_count == 1


def test_a_consumer_that_falls_behind_is_dropped_not_buffered(engine):
    async def main():
        eng = AsyncEngine(engine)
        eng.configure_sessions(max_pending=3)
        try:
            s = await eng.open_session()
            stream = s.events()
            first = await stream.__anext__()          # attached, then stops reading
            for i in range(10):
                await s.append(str(i))
            got = []
            with pytest.raises(SessionLagged) as lag:
                async for ev in stream:
                    got.append(ev.seq)
            return first, got, lag.value, s
        finally:
            await eng.close()

    first, got, lag, s = run(main())
    assert first.seq == 1 and got == [2, 3, 4] and lag.last_seq == 4   # what it held, then told where to resume
    assert s._consumers == []


def test_close_cancels_the_running_generation_and_forgets_everything(engine):
    async def main():
        eng = AsyncEngine(engine)
        try:
            s = await eng.open_session(num_steps=200, num_frames=5)
            await s.push_text("closing")
            rid = await s.generate()
            await until(s, "generation.progress")
            await s.close()
            handle = eng.handles.get(rid)
            status = await handle.wait() if handle is not None else "released"
            for _ in range(100):
                if not s._watchers:
                    break
                await asyncio.sleep(0.02)
            return s, status, dict(eng._output_fns), dict(eng.handles), dict(eng.sessions.sessions)
        finally:
            await eng.close()

    s, status, outputs, handles, sessions = run(main())
    assert status in ("cancelled", "released") and s.state.status == "closed"
    assert outputs == {} and handles == {} and sessions == {} and not s._watchers


@pytest.fixture(scope="module")
def cosmos3():
    return Engine.from_variant("cosmos3:tiny", seed=0)


def test_cosmos3_reasoning_streams_each_token_at_its_step_then_generates_from_it(cosmos3):
    async def main():
        eng = AsyncEngine(cosmos3)
        streamed_at_step: list[int] = []

        def on_step(ev):   # driver thread, right after AsyncEngine's own subscriber saw the same step
            loop = eng._loops.get(ev.request_id)
            if loop is not None:
                streamed_at_step.append(loop.tokens_seen)

        unsubscribe = cosmos3.subscribe(on_step, prefix="trace.step")
        try:
            async with eng.session(num_steps=2, seed=4) as s:
                await s.push_text("why is the sky blue")
                rid = await s.reason(max_new_tokens=5, then_generate=True)
                events = await until(s, "generation.completed")
                return rid, events, s.last_result, list(streamed_at_step)
        finally:
            unsubscribe()
            await eng.close()

    rid, events, result, streamed_at_step = run(main())
    tokens = [e for e in events if e.kind == "reasoning.token"]
    done = next(e for e in events if e.kind == "reasoning.completed")
    assert [t.data["index"] for t in tokens] == [0, 1, 2, 3, 4]
    assert [t.data["token_id"] for t in tokens] == done.data["tokens"] and len(done.data["tokens"]) == 5
    assert all(t.data["text"] is None for t in tokens)          # a random-weight variant has no tokenizer
    # one token streamed per step as it is sampled (prefill samples the first), not all at the end; the last
    # step only caches the final token's K/V for the hand-off (export_und_kv)
    assert streamed_at_step == [1, 2, 3, 4, 5, 5]
    kinds = [e.kind for e in events]
    assert kinds.index("reasoning.completed") < kinds.index("generation.started")
    generated = [e for e in events if e.kind == "media.video_chunk"]
    assert generated and all(e.data["request_id"] != rid for e in generated)
    # the generation's prompt is the reasoning's prompt + generated text
    prompt = list("why is the sky blue".encode())
    assert result.request.text_ids.tolist() == prompt + done.data["tokens"]


def test_reasoning_is_interrupted_at_a_step_boundary(cosmos3):
    async def main():
        eng = AsyncEngine(cosmos3)
        try:
            async with eng.session() as s:
                await s.push_text("think long")
                rid = await s.reason(max_new_tokens=200)
                await until(s, "reasoning.token")
                assert await s.interrupt() == rid
                events = await until(s, "session.interrupted")
                return rid, events, dict(eng._loops), set(eng.active), rid in cosmos3.scheduler.records
        finally:
            await eng.close()

    rid, events, loops, active, recorded = run(main())
    stopped = next(e for e in events if e.kind == "generation.interrupted")
    tokens = [e for e in events if e.kind == "reasoning.token"]
    assert stopped.data["steps_run"] < 200 and stopped.data["steps_run"] == len(tokens)
    assert "reasoning.completed" not in [e.kind for e in events]
    assert loops == {} and active == set() and not recorded    # nothing of it is left on the engine


def test_reasoning_on_a_model_without_a_reasoning_loop_is_refused(engine):
    async def main():
        eng = AsyncEngine(engine)
        try:
            async with eng.session() as s:
                await s.push_text("x")
                with pytest.raises(FieldError) as e:
                    await s.reason()
                return e.value
        finally:
            await eng.close()

    assert run(main()).field == "reason"


def test_the_latest_pushed_image_conditions_the_generation(cosmos3):
    first = torch.linspace(-1, 1, 3 * 32 * 32).reshape(3, 32, 32)
    latest = -first

    async def main():
        eng = AsyncEngine(cosmos3)
        try:
            async with eng.session(num_steps=2, seed=2) as s:
                await s.push_text("from this image")
                await s.push_image(first)
                await s.push_image(latest)
                await s.generate()
                events = await until(s, "generation.completed")
                direct = await eng.generate(prompt="from this image", image=latest, num_steps=2, seed=2)
                other = await eng.generate(prompt="from this image", image=first, num_steps=2, seed=2)
                return events, s.last_result, direct, other, [list(im.shape) for im in s.state.images]
        finally:
            await eng.close()

    events, result, direct, other, held = run(main())
    started = next(e for e in events if e.kind == "generation.started")
    assert started.data["stages"] == ["encode", "denoise", "decode"] and held == [[3, 32, 32]]
    assert torch.equal(result.frames, direct.frames) and not torch.equal(result.frames, other.frames)
