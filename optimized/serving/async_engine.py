"""AsyncEngine: one Engine driven by its own thread, used from asyncio.

    engine = AsyncEngine(Engine.from_variant("tiny-2.1-t2v"), max_queue=32)
    result = await engine.generate(request, out="clip.mp4")           # VideoResult
    handle = await engine.submit(request)                              # or prompt=... / prompt_ids=... fields
    async for event in handle.events(): ...                            # VideoEvent: request.*, progress per step
    await handle.cancel()                                              # stops at the next step boundary
    handle = await engine.submit(request, on_output=fn)                # fn(VideoEvent "media.video_chunk") per
                                                                       # decoded latent chunk, as it is ready
    loop = await engine.submit_loop(reason_request, on_output=fn)      # a plain loop request (no media stages);
    result = await loop.result()                                       # fn(VideoEvent "reasoning.token") per token
    async with engine.session(num_steps=4) as session: ...            # realtime sessions (serving/realtime.py)
    await engine.close()

Threading: only the driver thread touches the scheduler. The control plane never waits on a tick: `submit` builds
and validates the request on the event loop (reading the engine, never the scheduler: a refusal is raised there,
before anything is queued or allocated), then puts its start on the driver's command queue and returns; `cancel`
queues the cancel and returns. The driver drains that queue between ticks (every request advances at most one step
per tick) and sleeps on it when idle. A start the driver still refuses ends its handle with `request.failed`, so
every `request.accepted` a subscriber sees is followed by a terminal event. Events reach asyncio through
`loop.call_soon_threadsafe`, so a slow or failing consumer never runs on (or stops) the driver: an exception in an
`AsyncEngine.subscribe` callback or in the body of one `async for` is that consumer's own, every other request and
subscriber goes on. Artifacts (MP4, PNG) are written off the driver thread (`asyncio.to_thread`) before a result
resolves.

Retention: `handles` holds every unfinished request; a finished one is held (with its result) until its owner fetches
it (`await handle.result()`, `release(id)`) or `result_ttl` seconds pass, and at most `max_finished` of them (oldest
dropped first). An Engine is driven by one AsyncEngine at a time, and request ids are unique per Engine.

Streamed outputs: one bus subscription (made here, removed at close) sees every `request.output` of the scheduler on
the driver thread; a decode chunk of a program submitted with `on_output` is turned into uint8 frames there and
handed to `on_output` on the event loop, before that program's terminal event. Nothing of it is kept in the handle's
history (a chunk's frames live as long as the callback holds them). A loop request (`submit_loop`, e.g. cosmos3
reasoning) streams the tokens each step added to its state (`generated`: the AR loop's), read on the driver right
after the step's `trace.step`, one `reasoning.token` event per token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable

from optimized.programs import TERMINAL, VideoEvent, VideoProgram, VideoResult, check_out_path, write_video_artifacts
from optimized.runtime.scheduler import RequestRejected

log = logging.getLogger("optimized.serving")
TERMINAL_KINDS = ("request.completed", "request.failed", "request.cancelled")


class QueueFull(RuntimeError):
    """More requests in flight than the engine's `max_queue` (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine was closed; no new requests."""


class EngineBusy(RuntimeError):
    """The Engine is already driven by another open AsyncEngine (two drivers would tick one scheduler at once)."""


class AsyncHandle:
    """One video request on an AsyncEngine."""

    def __init__(self, engine: "AsyncEngine", request_id: str, out: Any, program: VideoProgram):
        self.engine, self.out = engine, out
        self.program = program                          # started by the driver (status "waiting" until then)
        self.request_id = request_id
        self.history: list[VideoEvent] = []            # every event so far (late subscribers replay it)
        self.finished_at: float | None = None          # loop.time() of the terminal event
        self.cancel_requested = False
        self._queues: list[asyncio.Queue] = []
        self._done = asyncio.Event()
        self._result: asyncio.Future = engine.loop.create_future()
        self.paths: dict = {}

    @property
    def status(self) -> str:
        return self.final_status or self.program.status

    @property
    def stage(self) -> str | None:
        return self.program.stage

    # called on the event loop (through call_soon_threadsafe)
    def _deliver(self, ev: VideoEvent) -> None:
        if self.final_status is not None:
            return  # ended (e.g. refused at start): nothing after the terminal event
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
        if ev.kind in TERMINAL_KINDS:
            if not self._result.done():
                if ev.kind == "request.completed":
                    self._result.set_result(self.program.value)
                else:
                    self._result.set_exception(RuntimeError(
                        f"video request {self.request_id} {ev.kind.split('.')[1]}"
                        + (f": {ev.data['error']}" if ev.data.get("error") else "")))
                    self._result.exception()  # retrieved here: nobody has to await a failed request
            self.finished_at = self.engine.loop.time()
            self._done.set()
            self.engine._finished(self)

    @property
    def final_status(self) -> str | None:
        """completed | failed | cancelled once the request has ended (artifacts written), else None."""
        for ev in reversed(self.history):
            if ev.kind in TERMINAL_KINDS:
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
                if ev.kind in TERMINAL_KINDS:
                    return
        finally:
            if q in self._queues:
                self._queues.remove(q)

    async def result(self) -> VideoResult:
        """The result (fetching it releases the handle from the engine: the caller holds it from then on)."""
        try:
            return await asyncio.shield(self._result)
        finally:
            if self._result.done():
                self.engine.release(self.request_id)

    async def wait(self) -> str:
        await self._done.wait()
        return self.final_status

    async def cancel(self) -> None:
        """Ask the driver to stop this request at its next step boundary; returns at once (never waits on a tick:
        `wait()` for the terminal event)."""
        if self.final_status is None and not self.cancel_requested:
            self.cancel_requested = True
            self.engine._post(self.program.cancel)


class LoopHandle:
    """One plain loop request on an AsyncEngine (a family request without media stages, e.g. cosmos3 reasoning)."""

    def __init__(self, engine: "AsyncEngine", request_id: str, on_output: Callable[[VideoEvent], Any] | None):
        self.engine, self.request_id, self.on_output = engine, request_id, on_output
        self.final_status: str | None = None           # completed | failed | cancelled
        self.error: str | None = None
        self.tokens_seen = 0                           # driver side: tokens already streamed
        self.cancel_requested = False
        self._result: asyncio.Future = engine.loop.create_future()

    async def result(self) -> Any:
        """The loop's result (its `finalize`); RuntimeError saying why when it failed or was cancelled."""
        return await asyncio.shield(self._result)

    async def wait(self) -> str:
        await asyncio.wait([self._result])
        return self.final_status

    async def cancel(self) -> None:
        """Stop at the next step boundary (returns at once)."""
        if self.final_status is None and not self.cancel_requested:
            self.cancel_requested = True
            sched = self.engine.engine.scheduler
            self.engine._post(lambda: sched.cancel(self.request_id) if self.request_id in sched.records else None)

    def _end(self, status: str, value: Any, error: str | None) -> None:   # event loop
        if self.final_status is not None:
            return
        self.final_status, self.error = status, error
        if status == "completed":
            self._result.set_result(value)
        else:
            self._result.set_exception(RuntimeError(f"request {self.request_id} {status}"
                                                    + (f": {error}" if error else "")))
            self._result.exception()   # retrieved: nobody has to await a failed request
        self.engine._loops.pop(self.request_id, None)
        self.engine.active.discard(self.request_id)


class AsyncEngine:
    def __init__(self, engine: Any, *, max_queue: int = 64, idle_sleep: float = 0.05,
                 loop: asyncio.AbstractEventLoop | None = None, result_ttl: float = 600.0, max_finished: int = 256):
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        driver = engine.__dict__.get("_async_driver")
        if driver is not None and not driver._closed:
            raise EngineBusy("this Engine is already driven by an open AsyncEngine; share that one (or close it "
                             "first): two drivers would tick one scheduler at once")
        self.engine = engine
        self.max_queue = max_queue
        self.idle_sleep = idle_sleep
        self.result_ttl, self.max_finished = result_ttl, max_finished
        self.loop = loop or asyncio.get_running_loop()   # made inside the application's event loop
        self.handles: dict[str, AsyncHandle] = {}      # unfinished requests + finished ones not yet fetched / expired
        self._finished_order: OrderedDict[str, None] = OrderedDict()
        self.active: set[str] = set()
        self._subs: list[tuple[str, Callable[[VideoEvent], Any]]] = []
        self._commands: queue.Queue = queue.Queue()
        self._closed = False
        self._output_fns: dict[str, Callable[[VideoEvent], Any]] = {}   # program id -> on_output (unfinished only)
        self._loops: dict[str, LoopHandle] = {}                         # unfinished loop requests
        self._sessions: Any = None                                      # SessionManager, made on first use
        self.driver_errors: list[str] = []
        from optimized.serving.families import media_chain
        for name in engine.family.loops:   # built here, before the driver runs: submit's checks read them
            engine.loop(name)
        try:
            media_chain(engine)
        except ValueError:
            pass  # no media chain: every video request is refused at submit, naming what is missing
        engine.__dict__["_async_driver"] = self
        self._unsubscribe_outputs = engine.subscribe(self._on_bus)
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
                if fut is None:  # posted: nobody waits for it
                    try:
                        fn()
                    except Exception as e:  # noqa: BLE001 - a control command must not kill the driver
                        self.driver_errors.append(f"{type(e).__name__}: {e}")
                        log.exception("driver command failed")
                elif fut.set_running_or_notify_cancel():
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
            elif rid in self._loops:
                self.loop.call_soon_threadsafe(self._loops[rid]._end, "failed", None, f"engine error: {msg}")

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the driver and wait for its answer (tests and tools; the control plane uses `_post`)."""
        if self._closed:
            raise EngineClosed("the engine is closed")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        return await asyncio.wrap_future(fut)

    def _post(self, fn: Callable[[], Any]) -> None:
        """Queue fn for the driver (run between ticks) without waiting for it."""
        self._commands.put((fn, None))

    # ---------------------------------------------------------------- API
    def _preflight(self, request: Any) -> None:
        """Refuse on the event loop what the scheduler would refuse at submission, reading only the request and
        the engine (never the scheduler's state): the engine's admission (`Engine.admit`: the contract's bounds,
        the family's limits, peak bytes against the budget), so a refusal queues and allocates nothing."""
        entry = self.engine.family
        try:
            entry.make_job(entry.loop_for(request), request)
        except (TypeError, KeyError) as e:
            raise RequestRejected(str(e)) from None
        self.engine.admit(request)

    def _request_id(self, given: str | None) -> str:
        if given is None:
            return f"video-{uuid.uuid4().hex[:16]}"    # unique per Engine, whichever AsyncEngine or caller made it
        if "/" in given:
            raise ValueError(f"request id {given!r}: '/' is reserved for stage ids")
        records = self.engine.scheduler.records
        if given in self.handles or given in self._loops or given in records \
                or any(f"{given}/{stage}" in records for stage in ("encode", "denoise", "decode")):
            raise ValueError(f"request_id {given!r} already used")
        return given

    async def submit(self, request: Any = None, *, out: Any = None, image: Any = None,
                     request_id: str | None = None, on_output: Callable[[VideoEvent], Any] | None = None,
                     **fields: Any) -> AsyncHandle:
        """Queue a video request: a family request, or plain fields (prompt / prompt_ids, num_frames, height, width,
        num_steps, guidance_scale, seed, negative_prompt(_ids), image) built by `serving.requests.build_request`.
        Returns once it is queued (never waits on the driver). Raises QueueFull when `max_queue` requests are in
        flight, ServingError / RequestRejected (ValueErrors) when invalid. `on_output(event)` (on the event loop)
        gets each decoded chunk as the decode loop produces it: `VideoEvent("media.video_chunk", id, {"chunk",
        "video_frames": [start, end), "frames": uint8 [end - start, H, W, 3]})`, all of them before the terminal
        event."""
        if self._closed:
            raise EngineClosed("the engine is closed")
        self._expire()
        if len(self.active) >= self.max_queue:
            raise QueueFull(f"{len(self.active)} requests in flight (max_queue {self.max_queue}); retry later")
        if out is not None:
            check_out_path(out)
        rid = self._request_id(request_id)
        req, img = request, image
        if req is None:
            from optimized.serving.requests import build_request
            req, img = build_request(self.engine, image=image, **fields)
        self._preflight(req)
        prog = VideoProgram(self.engine, req, program_id=rid, out=None, image=img)
        handle = AsyncHandle(self, rid, out, prog)
        # the listener is attached before the program starts: no event is missed
        prog.subscribe(lambda ev: self.loop.call_soon_threadsafe(handle._deliver, ev))
        self.engine.bus.open_program(rid)   # its trace / session context (the caller's `submission` scope): events.py
        self.active.add(rid)  # counted before the driver runs it, so a burst cannot overshoot max_queue
        self.handles[rid] = handle
        if on_output is not None:
            self._output_fns[rid] = on_output

        def start() -> None:
            if handle.cancel_requested:   # cancelled before the driver reached it: nothing was submitted
                self.loop.call_soon_threadsafe(handle._publish, VideoEvent("request.cancelled", rid, {}))
                return
            try:
                prog.start()
            except Exception as e:  # noqa: BLE001 - refused by the scheduler: this request ends, nothing else
                error = f"rejected: {e}" if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                self.loop.call_soon_threadsafe(handle._publish, VideoEvent("request.failed", rid, {"error": error}))

        self._post(start)
        return handle

    async def generate(self, request: Any = None, **kw: Any) -> VideoResult:
        handle = await self.submit(request, **kw)
        return await handle.result()

    async def cancel(self, request_id: str) -> None:
        await (self.handles.get(request_id) or self._loops[request_id]).cancel()

    def release(self, request_id: str) -> None:
        """Forget a finished request (its owner holds the handle and result from here on)."""
        h = self.handles.get(request_id)
        if h is not None and h.final_status is not None:
            del self.handles[request_id]
            self._finished_order.pop(request_id, None)

    def _expire(self) -> None:
        """Drop finished handles past `result_ttl` or beyond `max_finished` (oldest first)."""
        now = self.loop.time()
        for rid in list(self._finished_order):
            h = self.handles.get(rid)
            if h is None:
                self._finished_order.pop(rid, None)
            elif len(self._finished_order) > self.max_finished or now - h.finished_at >= self.result_ttl:
                self.release(rid)
            else:
                break  # in finishing order: the rest are younger

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

    async def submit_loop(self, request: Any, *, request_id: str | None = None,
                          on_output: Callable[[VideoEvent], Any] | None = None, **options: Any) -> LoopHandle:
        """Queue a plain family request (its type picks the loop, `options` go to its job, as `Engine.submit`) on
        the shared scheduler. Refused here (RequestRejected) before anything is queued; QueueFull as `submit`.
        `on_output(event)` (event loop) gets `VideoEvent("reasoning.token", id, {"index", "token_id"})` for
        every token the loop's steps add, before the result resolves."""
        from optimized.runtime.scheduler import RequestRejected as Rejected
        if self._closed:
            raise EngineClosed("the engine is closed")
        if len(self.active) >= self.max_queue:
            raise QueueFull(f"{len(self.active)} requests in flight (max_queue {self.max_queue}); retry later")
        try:
            loop_name = self.engine.family.loop_for(request)
            self.engine.family.make_job(loop_name, request, **options)
        except TypeError as e:
            raise Rejected(str(e)) from None
        self.engine.admit(request, (loop_name,))
        rid = self._request_id(request_id)
        handle = LoopHandle(self, rid, on_output)
        self._loops[rid] = handle     # before the driver can see any of its events
        self.active.add(rid)

        def start() -> None:
            if handle.cancel_requested:
                self.loop.call_soon_threadsafe(handle._end, "cancelled", None, None)
                return
            try:
                self.engine.submit(request, request_id=rid, **options)
            except Exception as e:  # noqa: BLE001 - refused by the scheduler: this request ends, nothing else
                self.loop.call_soon_threadsafe(handle._end, "failed", None, f"{type(e).__name__}: {e}")

        self._post(start)
        return handle

    # driver thread: every event of the scheduler
    def _on_bus(self, ev: Any) -> None:
        if ev.request_id in self._loops:
            return self._on_loop_event(self._loops[ev.request_id], ev)
        if ev.kind != "request.output":
            return
        rid = ev.request_id or ""
        pid, _, stage = rid.rpartition("/")
        if stage != "decode" or pid not in self._output_fns:
            return
        chunk = ev.data.get("output")
        frames = getattr(chunk, "frames", None)
        if frames is None:
            return
        from optimized.runtime.artifacts import to_uint8_frames
        data = {"stage": stage, "chunk": int(chunk.step_index), "video_frames": list(chunk.video_frames),
                "frames": to_uint8_frames(frames)}   # converted here: the event loop never runs tensor work
        self.loop.call_soon_threadsafe(self._deliver_output, VideoEvent("media.video_chunk", pid, data))

    def _on_loop_event(self, handle: LoopHandle, ev: Any) -> None:
        sched = self.engine.scheduler
        if ev.kind == "trace.step" and handle.on_output is not None:
            rec = sched.records.get(handle.request_id)
            generated = getattr(rec.state, "generated", None) if rec is not None else None
            for i in range(handle.tokens_seen, len(generated or ())):   # this step's tokens (the AR loop: one)
                self.loop.call_soon_threadsafe(self._deliver_loop_output, handle, VideoEvent(
                    "reasoning.token", handle.request_id, {"index": i, "token_id": int(generated[i])}))
            handle.tokens_seen = len(generated or ())
        elif ev.kind == "request.completed":
            value = sched.take_result(handle.request_id)
            self.loop.call_soon_threadsafe(handle._end, "completed", value, None)
        elif ev.kind in ("request.failed", "request.cancelled"):
            sched.forget(handle.request_id)
            self.loop.call_soon_threadsafe(handle._end, ev.kind.split(".")[1], None, ev.data.get("error"))

    def _deliver_loop_output(self, handle: LoopHandle, ev: VideoEvent) -> None:
        try:
            handle.on_output(ev)
        except Exception:  # noqa: BLE001 - a consumer's bug is its own
            log.warning("on_output callback %r raised on %s", handle.on_output, ev.kind, exc_info=True)

    def _deliver_output(self, ev: VideoEvent) -> None:
        fn = self._output_fns.get(ev.request_id)
        if fn is None:
            return
        try:
            fn(ev)
        except Exception:  # noqa: BLE001 - a consumer's bug is its own
            log.warning("on_output callback %r raised on %s", fn, ev.kind, exc_info=True)

    # ---------------------------------------------------------------- realtime sessions
    @property
    def sessions(self) -> Any:
        """This engine's SessionManager (`optimized.serving.realtime`), made with defaults on first use."""
        if self._sessions is None:
            self.configure_sessions()
        return self._sessions

    def configure_sessions(self, **options: Any) -> Any:
        """Make the SessionManager with `options` (idle_timeout_s, max_sessions, history bounds); before any
        session is opened."""
        from optimized.serving.realtime import SessionManager
        if self._sessions is not None and self._sessions.sessions:
            raise RuntimeError("sessions are already open on this engine; configure them before the first one")
        self._sessions = SessionManager(self, **options)
        return self._sessions

    async def open_session(self, **options: Any) -> Any:
        """A new realtime Session (see `SessionManager.open`: session_id, idle_timeout_s, conditioning fields)."""
        if self._closed:
            raise EngineClosed("the engine is closed")
        return await self.sessions.open(**options)

    def session(self, **options: Any) -> Any:
        """`async with engine.session(**options) as s:` opens a Session and closes it on exit."""
        from optimized.serving.realtime import SessionScope
        return SessionScope(self, options)

    def _finished(self, handle: AsyncHandle) -> None:
        self._output_fns.pop(handle.request_id, None)
        self.active.discard(handle.request_id)
        if handle.request_id in self.handles:
            self._finished_order[handle.request_id] = None
        self._expire()

    def deployment_card(self) -> dict:
        return self.engine.deployment_card()

    @property
    def queue_depth(self) -> int:
        return len(self.active)

    async def close(self, cancel: bool = True) -> None:
        """Close every realtime session (reason shutdown), cancel what is in flight (or let it finish), stop the
        driver thread."""
        if self._closed:
            return
        if self._sessions is not None:
            await self._sessions.close("shutdown")   # their generations are cancelled with the rest below
        if cancel:
            for rid in list(self.active):
                await (self.handles.get(rid) or self._loops[rid]).cancel()
        for rid in list(self.active):
            h = self.handles.get(rid) or self._loops.get(rid)
            if h is not None:
                await h.wait()
        self._closed = True
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, 10.0)
        self._unsubscribe_outputs()
        if self.engine.__dict__.get("_async_driver") is self:
            del self.engine.__dict__["_async_driver"]

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


_STOP = object()
