"""AsyncEngine: the scheduler on its own thread behind an asyncio API. Many clients at once get the same frames as
one at a time, events stream per request, cancel stops at a step boundary, a full queue is refused, and a consumer
or subscriber that raises never reaches another request or the driver. Every wait is bounded."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from manifests.wan import WanGenerateRequest
from optimized import Engine
from optimized.serving.async_engine import AsyncEngine, QueueFull
from optimized.serving.families import ServingError

TIMEOUT = 60


def request(seed: int, steps: int = 3) -> WanGenerateRequest:
    return WanGenerateRequest(text_ids=torch.tensor([4, 8, 15, 16]), negative_text_ids=torch.tensor([23]),
                              num_frames=5, height=32, width=32, num_steps=steps, guidance_scale=5.0, seed=seed)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal frames up to one uint8 level (a batched forward rounds differently from a solo one)."""
    return a.shape == b.shape and int((a.int() - b.int()).abs().max()) <= 1


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


@pytest.fixture(scope="module")
def sync_frames():
    eng = Engine.from_variant("tiny-2.1-t2v", seed=0)
    return {s: eng.generate_video(request(s)).frames for s in (1, 2, 3, 4)}


def test_many_clients_at_once_match_one_at_a_time(sync_frames):
    async def main():
        eng = AsyncEngine(Engine.from_variant("tiny-2.1-t2v", seed=0))
        try:
            results = await asyncio.gather(*(eng.generate(request(s)) for s in (1, 2, 3, 4)))
            assert eng.engine.scheduler.tick_count > 0 and threading.current_thread() is threading.main_thread()
            return results
        finally:
            await eng.close()

    results = run(main())
    assert not same(results[0].frames, results[1].frames)  # the comparison can tell requests apart
    for seed, res in zip((1, 2, 3, 4), results):
        assert same(res.frames, sync_frames[seed]), seed


def test_events_stream_per_request_and_end_with_the_terminal_event():
    async def main():
        eng = AsyncEngine(Engine.from_variant("tiny-2.1-t2v", seed=0))
        try:
            handles = [await eng.submit(request(s)) for s in (1, 2)]
            streams = [[ev async for ev in h.events()] for h in handles]
            late = [ev async for ev in handles[0].events()]   # a late subscriber replays the whole history
            return handles, streams, late
        finally:
            await eng.close()

    handles, streams, late = run(main())
    for h, evs in zip(handles, streams):
        assert all(ev.request_id == h.request_id for ev in evs)
        assert evs[0].kind == "request.accepted" and evs[-1].kind == "request.completed"
        steps = [ev.data["step"] for ev in evs if ev.kind == "progress" and ev.data["stage"] == "denoise"]
        assert steps == [1, 2, 3]
        assert [ev.data["stage"] for ev in evs if ev.kind == "request.stage"] == ["denoise", "decode"]
    assert [e.kind for e in late] == [e.kind for e in streams[0]]


def test_cancel_mid_run_stops_at_a_step_boundary_and_others_finish(sync_frames):
    async def main():
        eng = AsyncEngine(Engine.from_variant("tiny-2.1-t2v", seed=0))
        try:
            long = await eng.submit(request(9, steps=400))
            other = await eng.submit(request(1))
            async for ev in long.events():
                if ev.kind == "progress" and ev.data["step"] >= 2:
                    await long.cancel()
                    break
            assert await long.wait() == "cancelled"
            with pytest.raises(RuntimeError, match="cancelled"):
                await long.result()
            steps = max(e.data["step"] for e in long.history if e.kind == "progress")
            return steps, await other.result(), eng.engine.scheduler.idle
        finally:
            await eng.close()

    steps, other, idle = run(main())
    assert 2 <= steps < 400 and idle
    assert same(other.frames, sync_frames[1])


def test_a_full_queue_is_refused_and_frees_up():
    async def main():
        eng = AsyncEngine(Engine.from_variant("tiny-2.1-t2v", seed=0), max_queue=2)
        try:
            a, b = await eng.submit(request(1)), await eng.submit(request(2))
            with pytest.raises(QueueFull):
                await eng.submit(request(3))
            await a.result(), await b.result()
            c = await eng.submit(request(3))
            return await c.result()
        finally:
            await eng.close()

    assert run(main()).frames.shape == (5, 32, 32, 3)


def test_bad_requests_are_refused_without_disturbing_the_driver():
    async def main():
        eng = AsyncEngine(Engine.from_variant("tiny-2.1-t2v", seed=0))
        try:
            with pytest.raises(ValueError, match="height"):
                await eng.submit(request(1).__class__(**{**request(1).__dict__, "height": 30}))
            with pytest.raises(ServingError, match="prompt_ids"):
                await eng.submit(prompt_ids="1,x")
            res = await eng.generate(prompt_ids=[1, 2, 3], num_steps=2)   # plain fields, built by the family adapter
            return res, eng.queue_depth
        finally:
            await eng.close()

    res, depth = run(main())
    assert res.frames.shape == (5, 32, 32, 3) and depth == 0


def test_raising_subscribers_and_consumers_reach_no_other_request(sync_frames):
    """A subscriber on the AsyncEngine, one on the engine's event bus (trace.cache included) and an `async for` body
    that raise: every other request completes with the frames it makes alone, and the driver keeps running."""
    async def main():
        eng = AsyncEngine(Engine.from_variant("tiny-2.1-t2v", seed=0))
        try:
            def bad(ev):
                raise RuntimeError("subscriber bug")

            eng.subscribe(bad)
            await eng._call(lambda: eng.engine.subscribe(bad, prefix="trace."))  # on the driver's own bus
            victim = await eng.submit(request(1))
            others = [await eng.submit(request(s)) for s in (2, 3, 4)]

            async def consumer_that_raises():
                async for ev in victim.events():
                    if ev.kind == "progress":
                        raise ValueError("consumer bug")

            with pytest.raises(ValueError, match="consumer bug"):
                await consumer_that_raises()
            results = [await h.result() for h in [victim, *others]]
            return results, eng.driver_errors
        finally:
            await eng.close()

    results, driver_errors = run(main())
    assert driver_errors == []
    for seed, res in zip((1, 2, 3, 4), results):
        assert same(res.frames, sync_frames[seed]), seed


def test_artifacts_are_written_before_the_result_resolves(tmp_path):
    async def main():
        eng = AsyncEngine(Engine.from_variant("tiny-2.1-t2v", seed=0))
        try:
            h = await eng.submit(request(1), out=tmp_path / "clip")
            res = await h.result()
            return res, (tmp_path / "clip" / "video.json").exists(), h.history[-1]
        finally:
            await eng.close()

    res, sidecar_there, last = run(main())
    assert sidecar_there and res.paths["frames"].endswith("clip") and last.data["paths"] == res.paths
    assert [p.name for p in tmp_path.iterdir()] == ["clip"]


def test_submit_and_cancel_never_wait_on_the_drivers_tick():
    """F12: a tick that takes a second (a big job's step) does not hold up a POST or a cancel."""
    import time

    async def main():
        eng = AsyncEngine(Engine.from_variant("tiny-2.1-t2v", seed=0))
        real_tick = eng.engine.scheduler.tick
        ticking = threading.Event()

        def slow_tick():
            ticking.set()
            time.sleep(1.0)
            real_tick()

        eng.engine.scheduler.tick = slow_tick
        try:
            big = await eng.submit(request(1, steps=50))
            await asyncio.to_thread(ticking.wait, 10)
            t0 = time.perf_counter()
            small = await eng.submit(request(2, steps=1))
            await small.cancel()
            await big.cancel()
            control_s = time.perf_counter() - t0
            return control_s, await big.wait(), await small.wait()
        finally:
            await eng.close()

    control_s, big, small = run(main())
    assert control_s < 0.5, f"submit + cancel took {control_s:.2f}s behind a 1s tick"
    assert big == "cancelled" and small == "cancelled"


def test_a_second_async_engine_on_one_engine_collides_nothing():
    """F13: request ids are unique per Engine across AsyncEngines; two open at once would both tick it: refused."""
    from optimized.serving.async_engine import EngineBusy
    sync = Engine.from_variant("tiny-2.1-t2v", seed=0)

    async def first():
        eng = AsyncEngine(sync)
        try:
            with pytest.raises(EngineBusy):
                AsyncEngine(sync)
            return (await eng.submit(request(1))).request_id, await eng.generate(request(2))
        finally:
            await eng.close()

    async def second():
        eng = AsyncEngine(sync)
        try:
            h = await eng.submit(request(1))
            return h.request_id, await h.result()
        finally:
            await eng.close()

    rid_a, _ = run(first())
    rid_b, res = run(second())
    assert rid_a != rid_b and res.frames.shape == (5, 32, 32, 3)


def test_a_request_refused_after_accepted_still_ends_for_subscribers():
    """F14: every request.accepted a global subscriber sees is followed by a terminal event, and a request refused
    at submit is never announced at all."""
    from optimized.runtime.scheduler import RequestRejected

    async def main():
        eng = AsyncEngine(Engine.from_variant("tiny-2.1-t2v", seed=0))
        seen: dict = {}
        eng.subscribe(lambda ev: seen.setdefault(ev.request_id, []).append(ev.kind))
        try:
            with pytest.raises(ValueError):
                await eng.submit(request(1).__class__(**{**request(1).__dict__, "num_frames": 6}))

            def refuse(*a, **k):
                raise RequestRejected("refused by the scheduler")

            await eng._call(lambda: setattr(eng.engine.scheduler, "submit", refuse))
            h = await eng.submit(request(1))
            status = await h.wait()
            return seen, status, h, eng.queue_depth
        finally:
            await eng.close()

    seen, status, h, depth = run(main())
    assert list(seen) == [h.request_id], seen          # the invalid one was never announced
    assert seen[h.request_id][0] == "request.accepted" and seen[h.request_id][-1] == "request.failed"
    assert status == "failed" and "refused by the scheduler" in h.history[-1].data["error"] and depth == 0


def test_finished_handles_are_released_once_fetched_or_expired():
    """F4: the AsyncEngine holds a finished request only until its owner fetches it, or result_ttl passes."""
    import gc
    import weakref

    async def main():
        eng = AsyncEngine(Engine.from_variant("tiny-2.1-t2v", seed=0), result_ttl=0.0)
        try:
            results = [weakref.ref(await eng.generate(request(s, steps=1))) for s in range(4)]
            fetched_left = len(eng.handles)
            unfetched = [await eng.submit(request(s, steps=1)) for s in range(3)]
            for h in unfetched:
                await h.wait()
            rids = [h.request_id for h in unfetched]
            del unfetched, h
            gc.collect()
            return fetched_left, results, rids, dict(eng.handles)
        finally:
            await eng.close()

    fetched_left, results, rids, left = run(main())
    gc.collect()
    assert fetched_left == 0 and left == {}, (fetched_left, list(left))
    assert all(r() is None for r in results), "a fetched result is still held by the engine"
