"""AsyncEngine: one Engine driven by its own thread, used from asyncio.

    engine = AsyncEngine(Engine.from_variant("tiny-2.1-t2v"), max_queue=32)
    result = await engine.generate(request, out="clip.mp4")           # VideoResult
    handle = await engine.submit(request)                              # or prompt=... / prompt_ids=... fields
    async for event in handle.events(): ...                            # VideoEvent: request.*, progress per step
    await handle.cancel()                                              # stops at the next step boundary
    await engine.close()

Threading: only the driver thread touches the scheduler. Every call from asyncio (submit, cancel) is a closure put
on the driver's command queue and answered through a future; between commands the driver ticks the scheduler while
it has work and sleeps on the queue otherwise. Events reach asyncio through `loop.call_soon_threadsafe`, so a slow
or failing consumer never runs on (or stops) the driver: an exception in an `AsyncEngine.subscribe` callback or in
the body of one `async for` is that consumer's own, every other request and subscriber goes on. Artifacts (MP4,
PNG) are written off the driver thread (`asyncio.to_thread`) before a result resolves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from typing import Any, AsyncIterator, Callable

from optimized.programs import TERMINAL, VideoEvent, VideoProgram, VideoResult, check_out_path, write_video_artifacts

log = logging.getLogger("optimized.serving")


class QueueFull(RuntimeError):
    """More requests in flight than the engine's `max_queue` (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine was closed; no new requests."""


class AsyncHandle:
    """One video request on an AsyncEngine."""

    def __init__(self, engine: "AsyncEngine", request_id: str, out: Any):
        self.engine, self.out = engine, out
        self.program: VideoProgram | None = None       # set by the driver when the program starts
        self.request_id = request_id
        self.history: list[VideoEvent] = []            # every event so far (late subscribers replay it)
        self._queues: list[asyncio.Queue] = []
        self._done = asyncio.Event()
        self._result: asyncio.Future = engine.loop.create_future()
        self.paths: dict = {}

    @property
    def status(self) -> str:
        return self.final_status or (self.program.status if self.program is not None else "waiting")

    @property
    def stage(self) -> str | None:
        return self.program.stage

    # called on the event loop (through call_soon_threadsafe)
    def _deliver(self, ev: VideoEvent) -> None:
        if ev.kind == "request.completed" and self.out is not None and not self._result.done():
            # write the artifacts off the driver thread, then announce completion
            asyncio.ensure_future(self._write_then_complete(ev))
            return
        self._publish(ev)

    async def _write_then_complete(self, ev: VideoEvent) -> None:
        try:
            self.paths = await asyncio.to_thread(write_video_artifacts, self.program.value, self.out)
            self.program.value.paths = self.paths
            self._publish(VideoEvent(ev.kind, ev.request_id, {**ev.data, "paths": self.paths}))
        except Exception as e:  # noqa: BLE001 - a failed write fails this request only; nothing half-written
            self._publish(VideoEvent("request.failed", ev.request_id, {"error": f"writing artifacts: {e}"}))

    def _publish(self, ev: VideoEvent) -> None:
        self.history.append(ev)
        for q in list(self._queues):
            q.put_nowait(ev)
        self.engine._fan_out(ev)
        if ev.kind in ("request.completed", "request.failed", "request.cancelled"):
            if not self._result.done():
                if ev.kind == "request.completed":
                    self._result.set_result(self.program.value)
                else:
                    self._result.set_exception(RuntimeError(
                        f"video request {self.request_id} {ev.kind.split('.')[1]}"
                        + (f": {ev.data['error']}" if ev.data.get("error") else "")))
                    self._result.exception()  # retrieved here: nobody has to await a failed request
            self._done.set()
            self.engine._finished(self)

    @property
    def final_status(self) -> str | None:
        """completed | failed | cancelled once the request has ended (artifacts written), else None."""
        for ev in reversed(self.history):
            if ev.kind in ("request.completed", "request.failed", "request.cancelled"):
                return ev.kind.split(".")[1]
        return None

    async def events(self) -> AsyncIterator[VideoEvent]:
        """Every event of this request from the start (replayed), then live, ending with its terminal event."""
        q: asyncio.Queue = asyncio.Queue()
        for ev in self.history:
            q.put_nowait(ev)
        self._queues.append(q)
        try:
            while True:
                ev = await q.get()
                yield ev
                if ev.kind in ("request.completed", "request.failed", "request.cancelled"):
                    return
        finally:
            if q in self._queues:
                self._queues.remove(q)

    async def result(self) -> VideoResult:
        return await asyncio.shield(self._result)

    async def wait(self) -> str:
        await self._done.wait()
        return self.final_status

    async def cancel(self) -> None:
        """Ask the driver to stop this request at its next step boundary (returns once the request is marked)."""
        if self.final_status is None:
            await self.engine._call(self.program.cancel)


class AsyncEngine:
    def __init__(self, engine: Any, *, max_queue: int = 64, idle_sleep: float = 0.05,
                 loop: asyncio.AbstractEventLoop | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.idle_sleep = idle_sleep
        self.loop = loop or asyncio.get_running_loop()   # made inside the application's event loop
        self.handles: dict[str, AsyncHandle] = {}      # every request, ended ones included (for GET by id)
        self.active: set[str] = set()
        self._subs: list[tuple[str, Callable[[VideoEvent], Any]]] = []
        self._commands: queue.Queue = queue.Queue()
        self._closed = False
        self._ids = itertools.count()
        self.driver_errors: list[str] = []
        self._thread = threading.Thread(target=self._drive, name="fv-engine-driver", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the driver thread
    def _drive(self) -> None:
        sched = self.engine.scheduler
        while True:
            try:
                block = sched.idle
                cmd = self._commands.get(timeout=self.idle_sleep) if block else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            if cmd is _STOP:
                return
            if cmd is not None:
                fn, fut = cmd
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - the caller gets the exception
                        fut.set_exception(e)
                continue  # drain commands before the next tick
            if not sched.idle:
                try:
                    sched.tick()
                except Exception as e:  # noqa: BLE001 - a runtime bug must not kill the driver
                    msg = f"{type(e).__name__}: {e}"
                    self.driver_errors.append(msg)
                    log.exception("scheduler tick failed")
                    self._fail_all(msg)

    def _fail_all(self, msg: str) -> None:
        for rid in list(self.active):
            h = self.handles.get(rid)
            if h is not None and h.program.status not in TERMINAL:
                h.program.fail(f"engine error: {msg}")

    async def _call(self, fn: Callable[[], Any]) -> Any:
        if self._closed:
            raise EngineClosed("the engine is closed")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        return await asyncio.wrap_future(fut)

    # ---------------------------------------------------------------- API
    async def submit(self, request: Any = None, *, out: Any = None, image: Any = None,
                     request_id: str | None = None, **fields: Any) -> AsyncHandle:
        """Queue a video request: a family request, or plain fields (prompt / prompt_ids, num_frames, height, width,
        num_steps, guidance_scale, seed, negative_prompt(_ids), image) built by `serving.requests.build_request`.
        Raises QueueFull when `max_queue` requests are in flight, ServingError / RequestRejected when invalid."""
        if self._closed:
            raise EngineClosed("the engine is closed")
        if len(self.active) >= self.max_queue:
            raise QueueFull(f"{len(self.active)} requests in flight (max_queue {self.max_queue}); retry later")
        if out is not None:
            check_out_path(out)
        rid = request_id or f"video-{next(self._ids)}"
        if rid in self.handles:
            raise ValueError(f"request_id {rid!r} already used")
        self.active.add(rid)  # counted before the driver runs it, so a burst cannot overshoot max_queue
        handle = AsyncHandle(self, rid, out)  # made on the event loop; the driver only attaches the program

        def start() -> VideoProgram:
            req, img = request, image
            if req is None:
                from optimized.serving.requests import build_request
                req, img = build_request(self.engine, image=image, **fields)
            prog = VideoProgram(self.engine, req, program_id=rid, out=None, image=img)
            handle.program = prog  # the listener is attached before the program starts: no event is missed
            prog.subscribe(lambda ev: self.loop.call_soon_threadsafe(handle._deliver, ev))
            return prog.start()

        try:
            await self._call(start)
        except BaseException:
            self.active.discard(rid)
            raise
        self.handles[rid] = handle
        return handle

    async def generate(self, request: Any = None, **kw: Any) -> VideoResult:
        handle = await self.submit(request, **kw)
        return await handle.result()

    async def cancel(self, request_id: str) -> None:
        await self.handles[request_id].cancel()

    def subscribe(self, fn: Callable[[VideoEvent], Any], prefix: str = "") -> Callable[[], None]:
        """fn(event) on the event loop for every request's events; an exception in fn is logged and contained."""
        entry = (prefix, fn)
        self._subs.append(entry)
        return lambda: self._subs.remove(entry) if entry in self._subs else None

    def _fan_out(self, ev: VideoEvent) -> None:
        for prefix, fn in list(self._subs):
            if ev.kind.startswith(prefix):
                try:
                    fn(ev)
                except Exception:  # noqa: BLE001 - a subscriber's bug is its own
                    log.warning("AsyncEngine subscriber %r raised on %s", fn, ev.kind, exc_info=True)

    def _finished(self, handle: AsyncHandle) -> None:
        self.active.discard(handle.request_id)

    def deployment_card(self) -> dict:
        return self.engine.deployment_card()

    @property
    def queue_depth(self) -> int:
        return len(self.active)

    async def close(self, cancel: bool = True) -> None:
        """Cancel what is in flight (or let it finish), stop the driver thread."""
        if self._closed:
            return
        if cancel:
            for rid in list(self.active):
                await self.handles[rid].cancel()
        for rid in list(self.active):
            await self.handles[rid].wait()
        self._closed = True
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, 10.0)

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


_STOP = object()
