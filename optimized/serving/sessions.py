"""The realtime session WebSocket: `install_sessions(app, engine)` serves `optimized.serving.realtime` sessions on
`/v1/realtime/sessions` (JSON text messages, each with a `type`), and `GET /v1/realtime/stats`.

Client -> server:
    {"type": "session.start", "conditioning": {...}?, "idle_timeout_s": 30?}   open a new session
    {"type": "session.rejoin", "session_id": "sess_...", "after_seq": 12?}     attach to an open one; events after
                                                                               after_seq are replayed, then live
    {"type": "input.text", "text": "a red fox"}                                the prompt (replaces it)
    {"type": "input.append", "text": "in the snow"}                            one more prompt part
    {"type": "input.image", "image": "<base64 PNG/JPEG or data: URL>"}         conditioning image
    {"type": "conditioning.update", "conditioning": {"seed": 3, "num_steps": null}}   fields (null clears one)
    {"type": "generate"}                                                       start (interrupts a running one)
    {"type": "reason", "max_new_tokens": 32?, "temperature": 0?, "then_generate": false?}   a family with a reasoning
                                                                               loop (cosmos3): reasoning.token per
                                                                               sampled token; then_generate: the
                                                                               reasoned text is the next prompt
    {"type": "interrupt"}                                                      stop at the next step boundary
    {"type": "session.state"}                                                  -> {"type": "session.state", state}
    {"type": "ping"}                                                           -> {"type": "pong"} (counts as
                                                                               activity for the idle timeout)
    {"type": "session.close"}                                                  close it (a disconnect only leaves)

Server -> client: every session event (`realtime.SessionEvent.to_json`: type, seq, session_id, time, data), with
`media.video_chunk` carrying `frames`: one base64 PNG per video frame, and `video_frames: [start, end)` in the clip;
plus replies that are not session events (no seq): `pong`, `session.state`, and errors
`{"type": "error", "code", "message", "param", "of": the message type}` with code one of invalid_json,
invalid_message, no_session, unknown_session, session_limit, invalid_request (param names the field), queue_full,
closing, lagged, no_active_generation, server_error. A bad message is answered and the connection goes on. The server
closes the socket after `session.closed` (close code 1000) or when the client falls too far behind (4008, `lagged`:
rejoin from the last seq it got). A disconnect leaves the session open (`session.left`) for a rejoin until its idle
timeout; a session id is a capability (unguessable: 96 random bits): any client holding it (and the API key) may
rejoin. With an API key the handshake needs `Authorization: Bearer KEY` or `X-API-Key` (else HTTP 403). At shutdown
the server closes every socket (1012) and then every session (reason shutdown).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect

from optimized.serving.async_engine import AsyncEngine, EngineClosed, QueueFull
from optimized.serving.realtime import (Session, SessionClosed, SessionEvent, SessionLagged, SessionLimit,
                                        UnknownSession)

log = logging.getLogger("optimized.serving.sessions")
PATH = "/v1/realtime/sessions"
MAX_MESSAGE_CHARS = 16 << 20          # uvicorn's default ws_max_size (larger frames are refused by the protocol: 1009)
CLOSE_LAGGED = 4008


class BadMessage(ValueError):
    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def _frames_png(frames: Any) -> list[str]:
    from optimized.runtime.artifacts import png_bytes
    return [base64.b64encode(png_bytes(f)).decode("ascii") for f in frames]


async def event_json(ev: SessionEvent) -> dict:
    """A session event as the client gets it (frames PNG-encoded off the event loop)."""
    out = ev.to_json()
    if ev.frames is not None:
        out["frames"] = await asyncio.to_thread(_frames_png, ev.frames)
        out["height"], out["width"] = int(ev.frames.shape[1]), int(ev.frames.shape[2])
    return out


def _authorized(ws: WebSocket, api_key: str | None) -> bool:
    if api_key is None:
        return True
    given = ws.headers.get("authorization", "")
    token = given[7:] if given[:7].lower() == "bearer " else ws.headers.get("x-api-key", "")
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), api_key.encode("utf-8"))


class Connection:
    """One client socket; attached to at most one session at a time."""

    def __init__(self, ws: WebSocket, engine: AsyncEngine, image_limits: dict):
        self.ws, self.engine, self.image_limits = ws, engine, image_limits
        self.session: Session | None = None
        self._sender: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    async def send(self, message: dict) -> None:
        async with self._lock:   # one writer at a time: replies and the event forwarder share the socket
            await self.ws.send_text(json.dumps(message))

    async def run(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("text") is not None:
                    await self.handle(message["text"])
                else:
                    await self.error("invalid_message", "send JSON text frames (a binary frame was sent)", None, None)
        except (WebSocketDisconnect, RuntimeError, OSError):   # gone, or closed by the server (session.closed)
            pass
        finally:
            await self._detach(leave=True)

    async def handle(self, text: str) -> None:
        kind = None
        try:
            if len(text) > MAX_MESSAGE_CHARS:
                raise BadMessage("invalid_message", f"message larger than {MAX_MESSAGE_CHARS} characters")
            try:
                msg = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                raise BadMessage("invalid_json", "a message must be one JSON object") from None
            if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
                raise BadMessage("invalid_message", "a message must be a JSON object with a string `type`", "type")
            kind = msg["type"]
            await self.dispatch(kind, msg)
        except BadMessage as e:
            await self.error(e.code, str(e), e.param, kind)
        except (SessionClosed, UnknownSession) as e:
            await self.error("unknown_session", str(e), "session_id", kind)
        except SessionLimit as e:
            await self.error("session_limit", str(e), None, kind)
        except QueueFull as e:
            await self.error("queue_full", str(e), None, kind)
        except EngineClosed as e:
            await self.error("closing", str(e), None, kind)
        except (ValueError, TypeError, OverflowError) as e:   # ServingError / RequestRejected / ManifestError
            from optimized.serving.videos_api import guess_param   # the HTTP API's field names
            msg = str(e)
            await self.error("invalid_request", msg, getattr(e, "field", None) or guess_param(msg, {}), kind)
        except (WebSocketDisconnect, OSError):
            raise   # the socket is gone: run() ends the connection
        except Exception as e:  # noqa: BLE001 - a bug answers this message; the connection and the session go on
            log.exception("realtime session message %r failed", kind)
            await self.error("server_error", f"internal error: {type(e).__name__}", None, kind)

    async def error(self, code: str, message: str, param: str | None, of: str | None) -> None:
        await self.send({"type": "error", "code": code, "message": message, "param": param, "of": of})

    def _need(self) -> Session:
        if self.session is None:
            raise BadMessage("no_session", "start or rejoin a session first (session.start / session.rejoin)")
        return self.session

    async def dispatch(self, kind: str, msg: dict) -> None:
        if kind == "ping":
            if self.session is not None:
                await self.session.ping()
            return await self.send({"type": "pong"})
        if kind == "session.start":
            cond = _field(msg, "conditioning", dict, {})
            timeout = msg.get("idle_timeout_s")
            await self._detach(leave=True)
            session = await self.engine.open_session(idle_timeout_s=timeout, **cond)
            return self._attach(session, 0)
        if kind == "session.rejoin":
            sid = _field(msg, "session_id", str)
            after = _field(msg, "after_seq", int, 0)
            if self.session is not None and self.session.session_id == sid:
                await self._detach(leave=False)
            else:
                await self._detach(leave=True)
            session = self.engine.sessions.rejoin(sid, after)
            return self._attach(session, after)
        s = self._need()
        if kind == "input.text":
            await s.push_text(_field(msg, "text", str))
        elif kind == "input.append":
            await s.append(_field(msg, "text", str))
        elif kind == "input.image":
            from optimized.serving.requests import base64_image_bytes, decode_image
            data = base64_image_bytes(_field(msg, "image", str))
            await s.push_image(await asyncio.to_thread(decode_image, data, "image", **self.image_limits))
        elif kind == "conditioning.update":
            await s.update(**_field(msg, "conditioning", dict))
        elif kind == "generate":
            await s.generate()
        elif kind == "reason":
            await s.reason(max_new_tokens=_field(msg, "max_new_tokens", int, 32),
                           temperature=_field(msg, "temperature", (int, float), 0.0),
                           then_generate=bool(_field(msg, "then_generate", bool, False)))
        elif kind == "interrupt":
            if await s.interrupt() is None:
                raise BadMessage("no_active_generation", "no generation is running")
        elif kind == "session.state":
            await s.ping()
            await self.send({"type": "session.state", "state": s.state.to_json()})
        elif kind == "session.close":
            await s.close("client")
        else:
            raise BadMessage("invalid_message", f"unknown message type {kind[:80]!r}", "type")

    def _attach(self, session: Session, after_seq: int) -> None:
        self.session = session
        self._sender = asyncio.ensure_future(self._forward(session, after_seq))

    async def _detach(self, leave: bool) -> None:
        session, sender = self.session, self._sender
        self.session, self._sender = None, None
        if sender is not None and sender is not asyncio.current_task():
            sender.cancel()
            try:
                await sender
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the forwarder's end is not the client's
                pass
        if leave and session is not None:
            session.leave()

    async def _forward(self, session: Session, after_seq: int) -> None:
        """The session's events to the socket; closes the socket after session.closed (or when lagging)."""
        try:
            async for ev in session.events(after_seq):
                await self.send(await event_json(ev))
                if ev.kind == "session.closed":
                    self.session = None
                    await self.ws.close(1000, f"session closed: {ev.data.get('reason')}")
                    return
        except SessionLagged as e:
            try:
                await self.error("lagged", str(e), "after_seq", None)
                await self.ws.close(CLOSE_LAGGED, "lagged")
            except Exception:  # noqa: BLE001 - the client may be gone already
                pass
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass   # the client went away: run() sees it and leaves the session


def _field(msg: dict, name: str, kind: type | tuple, default: Any = ...) -> Any:
    value = msg.get(name, None if default is ... else default)
    if value is None and default is ...:
        raise BadMessage("invalid_message", f"{msg['type']}: `{name}` is required", name)
    if value is None:
        value = default
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise BadMessage("invalid_message", f"{msg['type']}: `{name}` must be "
                         f"{getattr(kind, '__name__', 'a number')}", name)
    return value


def install_sessions(app: FastAPI, engine: Any, *, api_key: str | None = None, path: str = PATH,
                     **options: Any) -> None:
    """Serve realtime sessions of `engine` on `app`: an AsyncEngine, a callable returning one, or a sync Engine
    (its open AsyncEngine driver is looked up per connection, so this can be called before the app starts).
    `options` configure its SessionManager (idle_timeout_s, max_sessions, history bounds) when the first
    connection makes it; results are not kept per session (the clients got every chunk)."""
    options = {"keep_results": False, **options}

    def driver() -> AsyncEngine | None:
        if isinstance(engine, AsyncEngine):
            eng = engine
        elif callable(engine) and not hasattr(engine, "scheduler"):
            eng = engine()
        else:
            eng = engine.__dict__.get("_async_driver")
        if eng is None or eng._closed:
            return None
        if eng._sessions is None:
            eng.configure_sessions(**options)
        return eng

    def image_limits(eng: AsyncEngine) -> dict:
        caps = eng.engine.deployment_card().get("capabilities", {})
        return {"max_height": caps.get("max_height"), "max_width": caps.get("max_width")}

    @app.websocket(path)
    async def realtime_sessions(ws: WebSocket):
        if not _authorized(ws, api_key):
            await ws.close(1008)   # before accept: the handshake is refused (HTTP 403)
            return
        eng = driver()
        if eng is None:
            await ws.close(1013)   # try again later: the engine is not serving (starting or shutting down)
            return
        await ws.accept()
        await Connection(ws, eng, image_limits(eng)).run()

    @app.get(path.rsplit("/", 1)[0] + "/stats")
    async def realtime_stats():
        """Open sessions and the server process's asyncio tasks (operators; the leak tests read it)."""
        eng = driver()
        manager = eng.sessions if eng is not None else None
        sessions = list(manager.sessions.values()) if manager is not None else []
        return {"sessions": len(sessions), "connected": sum(s.state.connected for s in sessions),
                "generating": sum(s.generating for s in sessions),
                "closed": dict(manager.closed_count) if manager is not None else {},
                "asyncio_tasks": len(asyncio.all_tasks()), "engine_handles": len(eng.handles) if eng else 0,
                "output_callbacks": len(eng._output_fns) if eng else 0}


__all__ = ["PATH", "install_sessions", "event_json"]
