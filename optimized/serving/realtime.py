"""Realtime sessions on an AsyncEngine (the seed's Realtime Session Plane): a long-lived context that takes text,
images and conditioning, runs generations on the engine's shared scheduler, streams what they produce as it is
ready, can be interrupted, left and rejoined, and times out when idle.

    async with engine.session(num_steps=4, seed=1) as s:     # AsyncEngine.session / open_session
        await s.push_text("a red fox")                        # the prompt (replaces what was there)
        await s.append("running through snow")               # one more part ("a red fox running through snow")
        await s.update(num_frames=9)                          # conditioning (None clears a field)
        rid = await s.generate()                              # a video request on the shared scheduler
        async for ev in s.events():                           # SessionEvent, in `seq` order
            if ev.kind == "media.video_chunk": ...            # ev.frames: uint8 [F, H, W, 3], one latent chunk
            if ev.kind == "generation.completed": break
        await s.interrupt()                                   # the active generation stops at its next step boundary
        s.leave()                                             # detached: state and event history kept
        s = engine.sessions.rejoin(s.session_id)             # ... until the idle timeout
        async for ev in s.events(after_seq=last_seen): ...    # what was missed, then live

A generation is an ordinary video program (`AsyncEngine.submit`): its steps batch with every other request's on the
one scheduler, and interrupting it is the same cancel the server's DELETE uses (the scheduler retires it at the next
step boundary). Partial media: the decode stage is the chunked causal VAE decode loop (wan's, which cosmos3 also
decodes with), one latent frame per step, so each chunk of pixels is streamed as soon as that step ran, before the
clip is finished; denoising itself produces no pixels until its last step.

Reasoning (a family with a reasoning loop: cosmos3): `await s.reason(max_new_tokens=32, then_generate=True)` runs the
AR decode loop over the prompt on the same scheduler and streams each sampled token as `reasoning.token` the step
it is sampled; with then_generate the reasoned text is the next generation's prompt.

Events (kind, data): session.created {state}, session.rejoined {state, attached, missed}, session.updated {field,
state}, session.left {attached}, generation.started {request_id, prompt, stages}, generation.progress {request_id,
stage, step, total}, media.video_chunk {request_id, stage, chunk, video_frames} + frames, generation.completed
{request_id, num_frames, height, width, fps, chunks, timings}, generation.interrupted {request_id, steps_run,
total_steps}, session.interrupted {request_id}, generation.failed {request_id, error}, reasoning.started {request_id,
prompt, max_new_tokens}, reasoning.token {request_id, index, token_id, text (None without a tokenizer)},
reasoning.completed {request_id, tokens, stopped_by}, session.closed {reason: client | idle_timeout | shutdown}.

Idle: a session with no generation running and no call from its client (pushes, generate, interrupt, ping, rejoin)
for `idle_timeout_s` is closed (reason idle_timeout), attached or not. Bounded: at most `max_sessions` open; per
session the event history keeps the last `max_history_events` events and `max_history_bytes` of frames (a rejoin
older than that is told how many events it missed), the generation records the last `max_generations`; a consumer
that falls `max_pending` events behind is dropped (SessionLagged: it rejoins from its last seq).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from typing import TYPE_CHECKING, Any, AsyncIterator

from optimized.runtime.events import submission
from optimized.serving.session_state import (CLOSE_REASONS, CONDITIONING_TYPES, SESSION_STATUSES,  # noqa: F401
                                           FieldError, GenerationRecord, SessionClosed, SessionEvent,
                                           SessionLagged, SessionLimit, SessionState, UnknownSession)

if TYPE_CHECKING:
    import torch

    from optimized.programs import VideoEvent, VideoResult
    from optimized.serving.async_engine import AsyncEngine, AsyncHandle

log = logging.getLogger("optimized.serving.realtime")


class _Consumer:
    def __init__(self, max_pending: int):
        self.queue: asyncio.Queue = asyncio.Queue(max_pending)
        self.lagged = False
        self.last_seq = 0


class Session:
    """One realtime session (made by `SessionManager.open`; every method runs on the engine's event loop)."""

    def __init__(self, manager: "SessionManager", state: SessionState):
        self.manager, self.state = manager, state
        self.last_result: "VideoResult | None" = None   # the latest completed generation's result
        self._events: deque[SessionEvent] = deque()
        self._history_bytes = 0
        self._dropped = 0                                # events dropped from the history so far
        self._seq = 0
        self._consumers: list[_Consumer] = []
        self._handle: "AsyncHandle | None" = None
        self._watchers: set[asyncio.Task] = set()
        self._count = 0                                  # generations started
        self._idle_since = time.monotonic()
        self._attached = 1                               # clients attached (the opener; rejoins add, leaves drop)

    @property
    def session_id(self) -> str:
        return self.state.session_id

    @property
    def engine(self) -> "AsyncEngine":
        return self.manager.engine

    # ---------------------------------------------------------------- events
    def _emit(self, kind: str, media: Any = None, **data: Any) -> SessionEvent | None:
        if self.state.status == "closed" and kind != "session.closed":
            return None
        self._seq += 1
        ev = SessionEvent(self._seq, kind, self.session_id, data, media)
        self._events.append(ev)
        self._history_bytes += _nbytes(ev)
        m = self.manager
        while len(self._events) > 1 and (len(self._events) > m.max_history_events
                                         or self._history_bytes > m.max_history_bytes):
            self._history_bytes -= _nbytes(self._events.popleft())
            self._dropped += 1
        for c in list(self._consumers):
            if c.queue.full():  # too slow: dropped (it rejoins from its last seq) rather than grow without bound
                c.lagged = True
                self._consumers.remove(c)
            else:
                c.queue.put_nowait(ev)
        return ev

    def missed(self, after_seq: int) -> int:
        """Events after `after_seq` no longer in the history (a rejoin that came back too late)."""
        first = self._events[0].seq if self._events else self._seq + 1
        return max(0, first - 1 - after_seq)

    async def events(self, after_seq: int = 0) -> AsyncIterator[SessionEvent]:
        """The history after `after_seq` (replayed), then live events; ends after session.closed. Raises
        SessionLagged when this consumer falls `max_pending` events behind."""
        replay = [ev for ev in self._events if ev.seq > after_seq]
        closed = self.state.status == "closed"
        c = _Consumer(self.manager.max_pending)
        c.last_seq = after_seq
        if not closed:
            self._consumers.append(c)   # before the first await: nothing emitted from here on is missed
        try:
            for ev in replay:
                c.last_seq = ev.seq
                yield ev
            while not closed:
                if c.lagged and c.queue.empty():
                    raise SessionLagged(c.last_seq)
                ev = await c.queue.get()
                c.last_seq = ev.seq
                yield ev
                if ev.kind == "session.closed":
                    return
        finally:
            if c in self._consumers:
                self._consumers.remove(c)

    # ---------------------------------------------------------------- input
    def _active(self) -> None:
        if self.state.status == "closed":
            raise SessionClosed(f"session {self.session_id} is closed ({self.state.closed_reason})")
        self.state.last_active = time.time()
        self._idle_since = time.monotonic()

    def _updated(self, what: str) -> SessionState:
        self._emit("session.updated", field=what, state=self.state.to_json())
        return self.state

    async def push_text(self, text: str) -> SessionState:
        """A new prompt (replaces the parts so far; a running generation goes on with the prompt it started
        with: `generate()` again to use this one)."""
        self._active()
        self.state.prompt_parts = [_text("text", text)]
        return self._updated("prompt")

    async def append(self, text: str) -> SessionState:
        """One more part of the prompt (prompt memory: the parts so far are kept)."""
        self._active()
        self.state.prompt_parts.append(_text("text", text))
        return self._updated("prompt")

    async def push_image(self, image: "torch.Tensor") -> SessionState:
        """A conditioning image [3, H, W] in [-1, 1]; the latest one pushed conditions the next generation."""
        import torch

        from optimized.serving.requests import takes_image
        self._active()
        if not isinstance(image, torch.Tensor) or image.ndim != 3 or image.shape[0] != 3:
            raise FieldError("image", f"must be a [3, H, W] tensor, got "
                               f"{list(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__}")
        if not takes_image(self.engine.engine):
            raise FieldError("image", f"the {self.engine.engine.family.name} model served here does not "
                                      f"condition on an image")
        self.state.images = [image.detach().float().clamp(-1, 1)]   # only the latest is used: only it is held
        return self._updated("image")

    async def update(self, **conditioning: Any) -> SessionState:
        """Set conditioning fields (CONDITIONING_TYPES; None clears one) for the next generation (a running one
        keeps what it started with: its denoise state was built from them). Checked against the engine's request
        builder and admission at once: a refused value changes nothing."""
        self._active()
        self.state.conditioning = self._checked(conditioning)
        return self._updated("conditioning")

    def _checked(self, conditioning: dict) -> dict:
        new = dict(self.state.conditioning)
        for name, value in conditioning.items():
            if name not in CONDITIONING_TYPES:
                raise FieldError(name, f"not a conditioning field (one of {', '.join(CONDITIONING_TYPES)})")
            if value is None:
                new.pop(name, None)
                continue
            if isinstance(value, bool) or not isinstance(value, CONDITIONING_TYPES[name]):
                raise FieldError(name, f"expected {CONDITIONING_TYPES[name][0].__name__}, got "
                                       f"{type(value).__name__}")
            new[name] = value
        self.manager.check_fields(new, self.state.images[-1] if self.state.images else None)
        return new

    async def ping(self) -> None:
        self._active()

    # ---------------------------------------------------------------- generations
    @property
    def generating(self) -> bool:
        return self._handle is not None and self._handle.final_status is None

    async def generate(self) -> str:
        """Start a generation from the prompt, the latest image and the conditioning; returns its request id. A
        generation still running is interrupted first (at its next step boundary: the new one replaces it).
        Raises ServingError / RequestRejected (bad fields) or QueueFull, leaving the session as it was."""
        self._active()
        if not self.state.prompt:
            raise FieldError("prompt", "push text before generating")
        return await self._generate()

    async def _generate(self, prompt_ids: list[int] | None = None) -> str:
        if self.generating:
            await self.interrupt()
        self._count += 1
        rid = f"{self.session_id}-g{self._count}"
        image = self.state.images[-1] if self.state.images else None
        text = {"prompt": self.state.prompt} if prompt_ids is None else {"prompt_ids": prompt_ids}
        try:
            with submission(session_id=self.session_id):   # its events carry the session id (runtime/events.py)
                handle = await self.engine.submit(image=image, request_id=rid, on_output=self._on_output, **text,
                                                  **self.state.conditioning)
        except Exception:
            self._count -= 1
            raise
        rec = GenerationRecord(rid, self.state.prompt, "queued", started_at=time.time(),
                               total_steps=getattr(handle.program.request, "num_steps", None))
        self.state.history.append(rec)
        del self.state.history[:-self.manager.max_generations]
        self._handle, self.state.active_generation, self.state.status = handle, rid, "generating"
        self._emit("generation.started", request_id=rid, prompt=rec.prompt, stages=handle.program.stage_names())
        task = asyncio.ensure_future(self._watch(handle, rec))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        return rid

    async def reason(self, *, max_new_tokens: int = 32, temperature: float = 0.0,
                     then_generate: bool = False) -> str:
        """Reason over the prompt with the model's reasoning loop (cosmos3's AR decode, on the shared scheduler),
        streaming `reasoning.token` events as each step samples one; with `then_generate`, the prompt + reasoned
        text then becomes the next generation's prompt (as cosmos3's `reason_then_generate`: the reasoning hands its
        und-stream K/V to the generator's cache). Returns the reasoning's request id; replaces a running one."""
        from optimized.serving.requests import tokens_for
        self._active()
        entry = self.engine.engine.family
        rtype = next((t for t, loop in entry.request_types.items() if loop == "reasoning"), None)
        if rtype is None:
            raise FieldError("reason", f"the {entry.name} model served here has no reasoning loop")
        if not self.state.prompt:
            raise FieldError("prompt", "push text before reasoning")
        for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise FieldError(name, f"expected a number, got {type(value).__name__}")
        ids = tokens_for(self.engine.engine, self.state.prompt, None)
        request = rtype(prompt_ids=ids, max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                        seed=int(self.state.conditioning.get("seed", 0)))
        if self.generating:
            await self.interrupt()
        self._count += 1
        rid = f"{self.session_id}-r{self._count}"
        try:
            with submission(session_id=self.session_id):
                handle = await self.engine.submit_loop(request, request_id=rid, on_output=self._on_token,
                                                       **({"export_und_kv": True} if then_generate else {}))
        except Exception:
            self._count -= 1
            raise
        rec = GenerationRecord(rid, self.state.prompt, "running", "reasoning", time.time(),
                               total_steps=int(max_new_tokens))
        self.state.history.append(rec)
        del self.state.history[:-self.manager.max_generations]
        self._handle, self.state.active_generation, self.state.status = handle, rid, "generating"
        self._emit("reasoning.started", request_id=rid, prompt=rec.prompt, max_new_tokens=int(max_new_tokens))
        task = asyncio.ensure_future(self._watch_reasoning(handle, rec, then_generate))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        return rid

    def _on_token(self, ev: "VideoEvent") -> None:
        rec = self._record(ev.request_id)
        if rec is not None:
            rec.steps_run = ev.data["index"] + 1
        self._emit("reasoning.token", request_id=ev.request_id, index=ev.data["index"],
                   token_id=ev.data["token_id"], text=self.manager.token_text(ev.data["token_id"]))

    async def _watch_reasoning(self, handle: Any, rec: GenerationRecord, then_generate: bool) -> None:
        rid = handle.request_id
        follow: list[int] | None = None
        try:
            await handle.wait()
            rec.ended_at = time.time()
            if handle.final_status == "completed":
                result = await handle.result()
                rec.status = "completed"
                self._emit("reasoning.completed", request_id=rid, tokens=[int(t) for t in result["tokens"]],
                           stopped_by=result["stopped_by"])
                follow = [int(t) for t in result["text_ids"]] if then_generate else None
            elif handle.final_status == "cancelled":
                rec.status = "interrupted"
                self._emit("generation.interrupted", request_id=rid, steps_run=rec.steps_run,
                           total_steps=rec.total_steps)
                self._emit("session.interrupted", request_id=rid)
            else:
                rec.status, rec.error = "failed", handle.error or "failed"
                self._emit("generation.failed", request_id=rid, error=rec.error)
        finally:
            if self._handle is handle:
                self._handle, self.state.active_generation = None, None
                if self.state.status == "generating":
                    self.state.status = "open"
                self._idle_since = time.monotonic()
        if follow is not None and self.state.status != "closed" and not self.generating:
            try:
                await self._generate(prompt_ids=follow)
            except Exception as e:  # noqa: BLE001 - the session goes on; its client is told why
                self._emit("generation.failed", request_id=None, error=f"{type(e).__name__}: {e}")

    async def interrupt(self) -> str | None:
        """Stop the running generation at its next step boundary (the scheduler's cancel; returns at once, the
        generation.interrupted event follows); the request id, or None when nothing is running."""
        self._active()
        if not self.generating:
            return None
        await self._handle.cancel()
        return self._handle.request_id

    def _on_output(self, ev: "VideoEvent") -> None:
        rec = self._record(ev.request_id)
        if rec is not None:
            rec.chunks += 1
        data = {k: v for k, v in ev.data.items() if k != "frames"}
        self._emit("media.video_chunk", ev.data["frames"], request_id=ev.request_id, **data)

    def _record(self, rid: str) -> GenerationRecord | None:
        return next((g for g in reversed(self.state.history) if g.request_id == rid), None)

    async def _watch(self, handle: "AsyncHandle", rec: GenerationRecord) -> None:
        rid = handle.request_id
        try:
            totals: dict[str, int | None] = {}    # steps per stage (decode: latent chunks)
            async for ev in handle.events():
                if ev.kind == "request.stage":
                    rec.status = "running"
                    totals[ev.data.get("stage")] = ev.data.get("total")
                elif ev.kind == "progress":
                    stage = ev.data.get("stage")
                    if stage == "denoise":
                        rec.steps_run = ev.data.get("step", rec.steps_run)
                    self._emit("generation.progress", request_id=rid, stage=stage, step=ev.data.get("step"),
                               total=totals.get(stage))
            status = handle.final_status
            rec.ended_at = time.time()
            if status == "completed":
                result = await handle.result()   # hands the result over: the engine forgets the handle
                self.last_result = result if self.manager.keep_results else None
                rec.status = "completed"
                F, H, W, _ = result.frames.shape
                self._emit("generation.completed", request_id=rid, num_frames=F, height=H, width=W, fps=result.fps,
                           chunks=rec.chunks, timings=result.timings)
            elif status == "cancelled":
                rec.status = "interrupted"
                self._emit("generation.interrupted", request_id=rid, steps_run=rec.steps_run,
                           total_steps=rec.total_steps)
                self._emit("session.interrupted", request_id=rid)
            else:
                rec.status, rec.error = "failed", handle.program.error or "failed"
                self._emit("generation.failed", request_id=rid, error=rec.error)
        finally:
            self.engine.release(rid)
            if self._handle is handle:
                self._handle, self.state.active_generation = None, None
                if self.state.status == "generating":
                    self.state.status = "open"
                self._idle_since = time.monotonic()   # the idle countdown starts when the generation ends

    # ---------------------------------------------------------------- presence
    def leave(self) -> None:
        """The client went away: the session stays (state, history) until it is rejoined or times out."""
        if self.state.status != "closed" and self._attached > 0:
            self._attached -= 1
            self.state.connected = self._attached > 0
            self._emit("session.left", attached=self._attached)

    def _rejoined(self, after_seq: int) -> None:
        self._active()
        self._attached += 1
        self.state.connected = True
        self._emit("session.rejoined", attached=self._attached, state=self.state.to_json(),
                   missed=self.missed(after_seq))

    async def close(self, reason: str = "client") -> None:
        """Interrupt what runs, tell every consumer (session.closed), forget the session."""
        if self.state.status == "closed":
            return
        if self.generating:
            await self._handle.cancel()   # the engine retires it at the next step boundary
        self.state.status, self.state.closed_reason = "closed", reason
        self.state.connected = False
        self._emit("session.closed", reason=reason)
        self.state.images.clear()
        self.manager._forget(self)


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise FieldError(name, f"expected a string, got {type(value).__name__}")
    return value.strip()


def _nbytes(ev: SessionEvent) -> int:
    return 256 + (ev.frames.numel() * ev.frames.element_size() if ev.frames is not None else 0)


class SessionManager:
    """The open sessions of one AsyncEngine, and the one task that times idle ones out (running only while a
    session is open)."""

    def __init__(self, engine: "AsyncEngine", *, idle_timeout_s: float = 300.0, max_sessions: int = 64,
                 max_history_events: int = 1024, max_history_bytes: int = 32 << 20, max_generations: int = 32,
                 max_pending: int = 4096, keep_results: bool = True):
        if idle_timeout_s <= 0 or max_sessions < 1 or max_pending < 1:
            raise ValueError("idle_timeout_s must be > 0, max_sessions and max_pending >= 1")
        self.engine = engine
        self.idle_timeout_s, self.max_sessions = float(idle_timeout_s), max_sessions
        self.max_history_events, self.max_history_bytes = max_history_events, max_history_bytes
        self.max_generations, self.max_pending = max_generations, max_pending
        self.keep_results = keep_results   # Session.last_result (False: a server, whose clients got the chunks)
        self.sessions: dict[str, Session] = {}
        self.closed_count = {reason: 0 for reason in CLOSE_REASONS}
        self._reaper: asyncio.Task | None = None

    def token_text(self, token_id: int) -> str | None:
        """A token's text from the served tokenizer (a processor's `tok.backend`, a `tokenizers.Tokenizer`); None
        without one (random-weight variants: ids only)."""
        from optimized.serving.requests import processor_for
        backend = getattr(getattr(processor_for(self.engine.engine), "tok", None), "backend", None)
        return backend.decode([token_id]) if backend is not None else None

    def check_fields(self, conditioning: dict, image: Any = None) -> None:
        """Refuse conditioning the engine would refuse (built with a one-token prompt and the session's image, or a
        blank one of the requested size for a model that needs one and has none yet, then admitted)."""
        import torch

        from optimized.serving.requests import build_request, takes_image
        eng = self.engine.engine
        if image is None and takes_image(eng):
            size = {**eng.family.request_defaults, **conditioning}
            image = torch.zeros(3, int(size.get("height", 1)), int(size.get("width", 1)))
        req, _ = build_request(eng, prompt_ids=[0], image=image, **conditioning)
        self.engine._preflight(req)

    async def open(self, *, session_id: str | None = None, idle_timeout_s: float | None = None,
                   **conditioning: Any) -> Session:
        """A new session; `idle_timeout_s` may shorten (never lengthen) the manager's; `conditioning` as in
        `Session.update`."""
        if len(self.sessions) >= self.max_sessions:
            raise SessionLimit(f"{len(self.sessions)} sessions open (max {self.max_sessions}); close one first")
        sid = session_id or f"sess_{secrets.token_hex(12)}"   # a capability: unguessable
        if sid in self.sessions:
            raise ValueError(f"session id {sid!r} is already open")
        if "/" in sid:
            raise ValueError(f"session id {sid!r}: '/' is reserved for stage ids")
        timeout = self.idle_timeout_s
        if idle_timeout_s is not None:
            if isinstance(idle_timeout_s, bool) or not isinstance(idle_timeout_s, (int, float)) \
                    or not idle_timeout_s > 0:
                raise FieldError("idle_timeout_s", f"must be a positive number, got {idle_timeout_s!r}")
            timeout = min(float(idle_timeout_s), timeout)
        session = Session(self, SessionState(sid, idle_timeout_s=timeout))
        session.state.conditioning = session._checked(conditioning)   # refused before the session exists
        self.sessions[sid] = session
        session._emit("session.created", state=session.state.to_json())
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            raise UnknownSession(f"no open session {str(session_id)[:80]!r} (never opened, closed or timed out)")
        return session

    def rejoin(self, session_id: str, after_seq: int = 0) -> Session:
        """The same session, attached again (its idle countdown restarts); `events(after_seq=)` replays."""
        session = self.get(session_id)
        session._rejoined(after_seq)
        return session

    def _forget(self, session: Session) -> None:
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
            self.closed_count[session.state.closed_reason] = self.closed_count.get(session.state.closed_reason,
                                                                                    0) + 1

    async def _reap(self) -> None:
        """Close sessions idle past their timeout; ends when none is open (restarted by the next open)."""
        while self.sessions:
            shortest = min(s.state.idle_timeout_s for s in self.sessions.values())
            await asyncio.sleep(min(1.0, max(0.02, shortest / 4)))
            now = time.monotonic()
            for s in list(self.sessions.values()):
                if not s.generating and now - s._idle_since >= s.state.idle_timeout_s:
                    await s.close("idle_timeout")

    async def close(self, reason: str = "shutdown") -> None:
        for s in list(self.sessions.values()):
            await s.close(reason)
        if self._reaper is not None and not self._reaper.done():
            self._reaper.cancel()
            try:
                await self._reaper
            except asyncio.CancelledError:
                pass


class SessionScope:
    """`async with engine.session(**options) as s`: opened on enter, closed on exit."""

    def __init__(self, engine: "AsyncEngine", options: dict):
        self.engine, self.options = engine, options
        self.session: Session | None = None

    async def __aenter__(self) -> Session:
        self.session = await self.engine.open_session(**self.options)
        return self.session

    async def __aexit__(self, *exc: Any) -> None:
        if self.session is not None:
            await self.session.close("client")


__all__ = ["CONDITIONING_TYPES", "FieldError", "GenerationRecord", "Session", "SessionClosed", "SessionEvent",
           "SessionLagged", "SessionLimit", "SessionManager", "SessionScope", "SessionState", "UnknownSession"]
