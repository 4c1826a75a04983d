"""OpenAI-style HTTP server for one engine (optional `serve` extra: FastAPI + uvicorn + python-multipart; MP4 needs
imageio-ffmpeg, also in the extra). The /v1/videos contract (fields, video object, errors) is `videos_api.py`'s.

    fvgen serve wan --variant tiny-2.1-t2v --port 8000 --output-dir videos/     (or python -m optimized.serving.server)

    POST   /v1/videos                 create (JSON, or multipart/form-data with an `input_reference` / `image` file)
    POST   /v1/videos/sync            create and wait: the MP4 itself (header x-video-id), or the error envelope
    GET    /v1/videos                 list (?after=ID&limit=20&order=desc): {object: list, data, has_more, first_id,
                                      last_id}
    GET    /v1/videos/{id}            the video object: status queued | in_progress | completed | failed, progress
    GET    /v1/videos/{id}/content    the MP4 (?variant=video), frame 0 as PNG (thumbnail) or the JSON sidecar
    DELETE /v1/videos/{id}            delete (an unfinished video is cancelled at its next step boundary first):
                                      {id, object: video.deleted, deleted: true}
    GET    /v1/videos/{id}/events     server-sent events: request.accepted, request.stage, progress (one per step and
                                      per decode chunk), request.completed (with content URLs) | request.failed |
                                      request.cancelled
    GET    /health                    liveness + queue depth
    GET    /v1/models, /v1/models/ID  the served model and its DeploymentCard

Request fields (JSON or form): prompt | prompt_ids, negative_prompt | negative_prompt_ids, size "WIDTHxHEIGHT" (or
width + height), seconds (num_frames = seconds * fps + 1) or num_frames (frames), fps, num_inference_steps (steps),
guidance_scale (guidance), guidance_scale_2, flow_shift, boundary_ratio, seed, input_reference | image (base64 /
data URL / {"image_url": data URL}; multipart: a file), lora, model (optional; must name the served model). Errors
are `{"error": {"message", "type", "code", "param"}}`: 400 for a bad field or a malformed body (`param` names the
field), 401 without the API key (when one is set), 404 for an unknown id, 409 for content that is not ready, 429
when `max_queue` requests are in flight, 413 for an oversized body or upload, 503 while shutting down. No response
or event names a server path.

Held under abuse: a request is refused (400) before anything is allocated (the engine's admission; an image's
declared size is read from its header before it is decoded); the control plane never waits on the driver's tick;
SIGTERM cancels in-flight work whatever clients are connected. Durable: artifacts are written atomically (temp file +
rename, permissions from the umask), content is served only after every file of the video is in place, and the video
index is a SQLite file beside them (`index.sqlite3` in --output-dir), recovered at start-up (stale temp files
removed; videos a kill interrupted marked failed). Retention: ended videos beyond --keep-videos / --keep-bytes /
--keep-seconds are evicted, oldest first, files included. API keys: --api-key or FVGEN_API_KEY (`Authorization:
Bearer KEY` or `X-API-Key`).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import os
import re
import socket
import sqlite3
import sys
import time
import uuid
from dataclasses import asdict, dataclass, fields as dc_fields
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from optimized.serving.async_engine import AsyncEngine, EngineClosed, QueueFull
from optimized.serving.comfy import install_comfy_routes
from optimized.serving.loras import install_lora_routes
from optimized.serving.requests import default_fps, frame_step, takes_image
from optimized.serving.sessions import install_sessions
from optimized.serving.observability import add_log_args, configure_logging, install_observability
from optimized.serving.videos_api import (FIELDS, BadField, FrameRule, ImageLimits, api_status, content_urls,  # noqa: F401
                                          error, frames_to_seconds, guess_param, list_page, parse_fields,
                                          public_param, request_schema, scrub)

MAX_UPLOAD_BYTES = 32 << 20
CANCEL_WAIT_S = 2.0               # DELETE of an unfinished video waits at most this long for the cancel to land
API_KEY_ENV = "FVGEN_API_KEY"
TERMINAL_STATUSES = ("completed", "failed", "cancelled")   # "cancelled": rows an older server wrote


# ------------------------------------------------------------------------------------------ the durable video index
@dataclass
class VideoEntry:
    """One video this server made: what GET answers once the engine has let go of the request."""
    id: str
    status: str                       # queued | in_progress | completed | failed ("cancelled": an older server's)
    created_at: int
    completed_at: int | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    seed: int | None = None
    total_steps: int = 0
    error: str | None = None
    timings: dict | None = None
    bytes: int = 0                    # of its files on disk (retention counts them)
    error_code: str | None = None     # cancelled | generation_failed | interrupted | ...
    fps: float | None = None
    prompt: str | None = None
    created_seq: float = 0.0          # time.time() at creation: the list's order within one created_at second


@dataclass(frozen=True)
class Retention:
    """Ended videos are kept while all three hold; beyond them the oldest are evicted, files included."""
    max_videos: int = 1000
    max_bytes: int = 20 << 30
    max_age_s: float = 7 * 24 * 3600.0


ARTIFACT_SUFFIXES = (".mp4", ".json", ".png", ".wav")
VIDEO_ID = re.compile(r"video_[0-9a-f]{20}")


class VideoStore:
    """The video index: a SQLite file beside the artifacts (one row per video, committed at every change, so a
    kill loses no completed video), mirrored in memory. Runs on the event loop thread only."""

    def __init__(self, output_dir: Path, retention: Retention = Retention()):
        self.output_dir, self.retention = output_dir, retention
        self.db = sqlite3.connect(output_dir / "index.sqlite3", check_same_thread=False, isolation_level=None)
        self.db.execute("CREATE TABLE IF NOT EXISTS videos (id TEXT PRIMARY KEY, entry TEXT NOT NULL)")
        known = {f.name for f in dc_fields(VideoEntry)}
        self.entries: dict[str, VideoEntry] = {}
        for vid, text in self.db.execute("SELECT id, entry FROM videos"):
            try:
                self.entries[vid] = VideoEntry(**{k: v for k, v in json.loads(text).items() if k in known})
            except (ValueError, TypeError):
                self.db.execute("DELETE FROM videos WHERE id = ?", (vid,))
        self.evicted = 0

    def paths(self, vid: str) -> dict[str, Path]:
        return {"video": self.output_dir / f"{vid}.mp4", "sidecar": self.output_dir / f"{vid}.json",
                "thumbnail": self.output_dir / f"{vid}.png", "audio": self.output_dir / f"{vid}.wav"}

    def save(self, entry: VideoEntry) -> None:
        self.entries[entry.id] = entry
        self.db.execute("INSERT OR REPLACE INTO videos (id, entry) VALUES (?, ?)", (entry.id, json.dumps(asdict(entry))))

    def remove(self, vid: str) -> None:
        """Forget the video first (GETs from here on are 404), then unlink its files (a reader holding one open
        keeps reading it)."""
        self.entries.pop(vid, None)
        self.db.execute("DELETE FROM videos WHERE id = ?", (vid,))
        for p in self.paths(vid).values():
            p.unlink(missing_ok=True)

    def recover(self) -> dict:
        """At start-up: stale temp files removed (a kill mid-write), videos a kill interrupted marked failed (their
        partial files removed), completed ones whose files are gone dropped, files no row names removed."""
        stale = [p for p in self.output_dir.iterdir() if p.name.startswith(".video_") and p.is_file()]
        for p in stale:
            p.unlink(missing_ok=True)
        interrupted = 0
        for entry in list(self.entries.values()):
            if entry.status not in TERMINAL_STATUSES:
                for p in self.paths(entry.id).values():
                    p.unlink(missing_ok=True)
                entry.status, entry.error = "failed", "interrupted: the server stopped before this video finished"
                entry.error_code = "interrupted"
                entry.completed_at, entry.bytes = int(time.time()), 0
                self.save(entry)
                interrupted += 1
            elif entry.status == "completed" and not all(
                    self.paths(entry.id)[k].is_file() for k in ("video", "sidecar", "thumbnail")):
                self.remove(entry.id)
        orphans = [p for p in self.output_dir.iterdir() if p.suffix in ARTIFACT_SUFFIXES
                   and VIDEO_ID.fullmatch(p.stem) and p.stem not in self.entries]
        for p in orphans:
            p.unlink(missing_ok=True)
        self.evict()
        return {"stale_temp_files": len(stale), "interrupted": interrupted, "orphans": len(orphans)}

    def evict(self, now: float | None = None) -> list[str]:
        """Remove ended videos beyond the retention policy, oldest first."""
        now = time.time() if now is None else now
        ended = sorted((e for e in self.entries.values() if e.status in TERMINAL_STATUSES),
                       key=lambda e: (e.completed_at or e.created_at, e.created_at))
        total = sum(e.bytes for e in ended)
        gone = []
        for i, e in enumerate(ended):
            left = len(ended) - i
            old = now - (e.completed_at or e.created_at) > self.retention.max_age_s
            if left > self.retention.max_videos or total > self.retention.max_bytes or old:
                total -= e.bytes
                self.remove(e.id)
                gone.append(e.id)
        self.evicted += len(gone)
        return gone

    def close(self) -> None:
        self.db.close()


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n"


async def _read_capped(request: Request) -> bytes:
    """The body, refused with 413 past MAX_UPLOAD_BYTES before more of it is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_UPLOAD_BYTES:
        raise BadField(None, f"body larger than {MAX_UPLOAD_BYTES} bytes", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_UPLOAD_BYTES:
            raise BadField(None, f"body larger than {MAX_UPLOAD_BYTES} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> None:
    raise BadField(None, f"body is not valid JSON: {name} is not a JSON number")


def parse_json_body(raw: bytes) -> dict:
    """A JSON object from the raw body; BadField (400) for anything else (not UTF-8, not JSON, numbers past
    Python's digit limit, nesting too deep)."""
    try:
        text = raw.decode("utf-8") if raw else "{}"
    except UnicodeDecodeError as e:
        raise BadField(None, f"body is not UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise BadField(None, f"body is not valid JSON: {e.msg} at {e.pos}") from None
    except RecursionError:
        raise BadField(None, "body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # e.g. an integer longer than Python converts (4300 digits)
        raise BadField(None, f"body is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(body, dict):
        raise BadField(None, "body must be a JSON object")
    return body


def create_app(engine: Any, *, output_dir: str | Path, max_queue: int = 16, model_name: str | None = None,
               retention: Retention = Retention(), api_key: str | None = None,
               session_options: dict | None = None) -> FastAPI:
    """An app serving `engine` (a sync Engine: the app wraps it in an AsyncEngine on startup). The video index in
    `output_dir` is recovered here (before any request is served)."""
    from contextlib import asynccontextmanager

    from optimized.runtime.artifacts import _atomic_write_bytes, png_bytes
    from optimized.serving.families import media_chain

    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store = VideoStore(out_dir, retention)
    store.recover()
    card = engine.deployment_card()
    name = model_name or f"{card['family']}-{card['variant']}"
    caps = card.get("capabilities", {})
    image_limits = ImageLimits(takes_image(engine), caps.get("max_height"), caps.get("max_width"))
    try:
        rule: FrameRule | None = FrameRule(default_fps(engine), frame_step(engine))
    except ValueError:  # no media chain: every video request is refused at submit, naming what is missing
        rule = None
    # the server's directories as a client must never see them (longest first: a prefix never hides a longer one)
    roots = tuple(sorted({str(out_dir), str(out_dir.absolute()), str(out_dir.resolve())}, key=len, reverse=True))
    started_at = int(time.time())
    state: dict = {"closing": False, "tasks": set()}
    live: dict = {}                    # video id -> AsyncHandle while the engine holds it
    settled: dict[str, asyncio.Event] = {}
    deleting: set[str] = set()         # DELETEd while unfinished: gone for clients, removed once the engine lets go

    def begin_shutdown() -> None:
        """Refuse new work and cancel what is in flight, so every stream (SSE included) ends and shutdown goes on."""
        state["closing"] = True
        for h in list(live.values()):
            asyncio.ensure_future(h.cancel())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["engine"] = AsyncEngine(engine, max_queue=max_queue)
        state["engine"].subscribe(on_event)
        app.state.loop = asyncio.get_running_loop()
        try:
            yield
        finally:
            begin_shutdown()
            try:
                await asyncio.wait_for(state["engine"].close(), 60)
                if state["tasks"]:
                    await asyncio.wait_for(asyncio.gather(*state["tasks"], return_exceptions=True), 30)
            finally:
                store.close()

    app = FastAPI(title="FastVideo v2 engine", lifespan=lifespan)
    app.state.begin_shutdown = begin_shutdown
    app.state.store = store
    app.state.model_name = name
    install_sessions(app, engine, api_key=api_key, **(session_options or {}))   # realtime sessions (sessions.py)
    install_observability(app, engine)   # /metrics, spans, JSON event logs: optimized/serving/observability.py

    def video_object(entry: VideoEntry) -> dict:
        """OpenAI's video object (+ the extension fields vllm-omni clients read: width, height, num_frames, fps,
        seed; and stage, url, timings)."""
        h = live.get(entry.id)
        status, implied_code = api_status(entry.status)
        progress = 100 if status == "completed" else 0
        stage = None
        if h is not None:   # ended in the engine but not yet in the index: still in_progress
            status = "queued" if h.status == "waiting" else "in_progress"
            done_steps = sum(1 for e in h.history if e.kind == "progress")
            progress = min(99, int(100 * done_steps / entry.total_steps)) if entry.total_steps else 0
            stage = h.stage
        failure = None
        if status == "failed":
            failure = {"code": entry.error_code or implied_code or "generation_failed",
                       "message": scrub(entry.error or "the video failed", roots)}
        expires = entry.completed_at + int(retention.max_age_s) if entry.completed_at and status == "completed" \
            else None
        obj = {"id": entry.id, "object": "video", "model": name, "status": status, "progress": progress,
               "created_at": entry.created_at, "completed_at": entry.completed_at, "expires_at": expires,
               "size": f"{entry.width}x{entry.height}" if entry.height else None,
               "seconds": frames_to_seconds(entry.num_frames, entry.fps), "prompt": entry.prompt,
               "remixed_from_video_id": None, "error": failure,
               "width": entry.width, "height": entry.height, "num_frames": entry.num_frames, "fps": entry.fps,
               "seed": entry.seed, "stage": stage}
        if status == "completed":
            obj["url"] = f"/v1/videos/{entry.id}/content"
            obj["timings"] = entry.timings
        return obj

    async def finalize(vid: str, kind: str, error_text: str | None) -> None:
        """The engine ended `vid`: thumbnail written, the index row committed (or the video removed, when it was
        deleted meanwhile), the engine's handle released."""
        h, entry = live.get(vid), store.entries.get(vid)
        try:
            if entry is None or h is None:
                return
            status, code = kind.split(".")[1], None
            if status == "completed":
                try:
                    frame = h.program.value.frames[0]
                    await asyncio.to_thread(lambda: _atomic_write_bytes(store.paths(vid)["thumbnail"],
                                                                        png_bytes(frame)))
                    entry.timings = h.program.value.timings
                except Exception as e:  # noqa: BLE001 - a failed write fails this video only
                    status, code, error_text = "failed", "artifact_write_failed", f"writing the thumbnail: {e}"
            elif status == "cancelled":   # not one of the API's statuses: a failure whose code says why
                status, code = "failed", "cancelled"
                error_text = error_text or ("cancelled: the server shut down before it finished" if state["closing"]
                                            else "cancelled before it finished")
            else:
                code = "generation_failed"
            if vid in deleting:
                store.remove(vid)
                return
            if status != "completed":
                for p in store.paths(vid).values():
                    p.unlink(missing_ok=True)
            entry.status, entry.error, entry.error_code = status, error_text, code
            entry.completed_at = int(time.time())
            entry.bytes = sum(p.stat().st_size for p in store.paths(vid).values() if p.is_file())
            store.save(entry)
            store.evict()
        finally:
            live.pop(vid, None)
            deleting.discard(vid)
            state["engine"].release(vid)
            settled.pop(vid, asyncio.Event()).set()

    def on_event(ev: Any) -> None:
        if ev.request_id not in live:
            return
        if ev.kind in ("request.completed", "request.failed", "request.cancelled"):
            task = asyncio.ensure_future(finalize(ev.request_id, ev.kind, ev.data.get("error")))
            state["tasks"].add(task)
            task.add_done_callback(state["tasks"].discard)

    def public_event(vid: str, data: dict) -> dict:
        """An engine event as clients see it: artifact paths become content URLs, no server directory anywhere."""
        data = dict(data)
        paths = data.pop("paths", None)
        if paths:
            data["urls"] = content_urls(vid, paths)
        return scrub(data, roots)

    @app.exception_handler(BadField)
    async def _bad_field(request: Request, exc: BadField):
        return error(exc.status, scrub(str(exc), roots), exc.param, code=exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):   # unknown route, wrong method
        return error(exc.status_code, str(exc.detail), None, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        loc = [str(x) for x in first.get("loc", ()) if x not in ("query", "path", "body")]
        return error(400, f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid')}", loc[-1] if loc else None)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):  # a bug answers with the envelope, never a drop
        return error(500, f"internal error: {type(exc).__name__}", None)

    if api_key is not None:
        @app.middleware("http")
        async def _authenticate(request: Request, call_next):
            if request.url.path.startswith("/v1/"):
                given = request.headers.get("authorization", "")
                token = given[7:] if given[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
                if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), api_key.encode("utf-8")):
                    return error(401, "missing or wrong API key (Authorization: Bearer KEY, or X-API-Key)", None,
                                 headers={"WWW-Authenticate": "Bearer"})
            return await call_next(request)

    @app.get("/health")
    async def health():
        eng = state["engine"]
        return {"status": "closing" if state["closing"] else "ok", "model": name, "queue_depth": eng.queue_depth,
                "max_queue": eng.max_queue, "driver_errors": len(eng.driver_errors), "videos": len(store.entries)}

    def model_object() -> dict:
        return {"id": name, "object": "model", "created": started_at, "owned_by": "fastvideo",
                "deployment_card": scrub(engine.deployment_card(), roots)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        if model_id != name:
            raise BadField("model", f"model {model_id[:80]!r} is not served here (served: {name!r})", 404,
                           code="model_not_found")
        return model_object()

    async def read_request(request: Request) -> tuple[dict, bytes | None]:
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
            return parse_json_body(await _read_capped(request)), None
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_UPLOAD_BYTES + (1 << 20):
            raise BadField(None, f"body larger than {MAX_UPLOAD_BYTES} bytes", 413)
        try:
            form = await request.form()
        except Exception as e:  # noqa: BLE001 - a malformed upload is the client's
            raise BadField(None, f"malformed multipart body: {str(e)[:120]}") from None
        body, image_bytes = {}, None
        for key, value in form.multi_items():
            if hasattr(value, "read"):
                if key not in ("image", "input_reference"):
                    raise BadField(key, f"unexpected file field {key[:80]!r} (use input_reference)")
                image_bytes = await value.read(MAX_UPLOAD_BYTES + 1)
                if len(image_bytes) > MAX_UPLOAD_BYTES:
                    raise BadField(key, f"{key} is larger than {MAX_UPLOAD_BYTES} bytes", 413)
                body.setdefault(key, None)
            elif (nested := re.fullmatch(r"(\w+)\[(\w+)\]", key)) is not None:   # OpenAI's input_reference[image_url]
                body.setdefault(nested[1], {})
                if not isinstance(body[nested[1]], dict):
                    raise BadField(nested[1], f"{nested[1]} given twice")
                body[nested[1]][nested[2]] = value
            else:
                body[key] = value
        return body, image_bytes

    async def start_video(request: Request) -> VideoEntry:
        """Parse, validate and queue one video; its index entry (BadField with the status otherwise)."""
        if state["closing"]:
            raise BadField(None, "the server is shutting down", 503)
        body, image_bytes = await read_request(request)
        if body.get("model") not in (None, name):
            raise BadField("model", f"model {str(body['model'])[:80]!r} is not served here (served: {name!r})", 404,
                           code="model_not_found")
        has_image = image_bytes is not None or body.get("image") is not None or body.get("input_reference") is not None
        kw = await asyncio.to_thread(parse_fields, body, image_bytes, image_limits, rule) if has_image else \
            parse_fields(body, image_bytes, image_limits, rule)
        created = time.time()
        vid = f"video_{uuid.uuid4().hex[:20]}"
        try:
            handle = await state["engine"].submit(out=store.paths(vid)["video"], request_id=vid, **kw)
        except QueueFull as e:
            raise BadField(None, str(e), 429) from None
        except EngineClosed as e:
            raise BadField(None, str(e), 503) from None
        except (ValueError, OverflowError, TypeError) as e:  # ServingError / RequestRejected / ManifestError
            msg = str(e)
            raise BadField(public_param(getattr(e, "field", None), body) or guess_param(msg, body), msg) from None
        req = handle.program.request
        try:
            fps = float(media_chain(engine).fps(req))
        except (ValueError, TypeError, AttributeError):
            fps = None
        entry = VideoEntry(vid, "queued", int(created), seed=getattr(req, "seed", None),
                           num_frames=_pixel_frames(req) or kw.get("num_frames"),
                           height=_pixel_side(req, "height") or kw.get("height"),
                           width=_pixel_side(req, "width") or kw.get("width"), total_steps=_total_steps(handle),
                           fps=fps, prompt=kw.get("prompt"), created_seq=created)
        live[vid] = handle
        settled[vid] = asyncio.Event()
        store.save(entry)
        if handle.final_status is not None:  # ended before it was listed (e.g. refused by the driver)
            on_event(handle.history[-1])
        return entry

    @app.post("/v1/videos", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": request_schema(caps)}}}})
    async def create(request: Request):
        return JSONResponse(video_object(await start_video(request)), status_code=200)

    @app.post("/v1/videos/sync", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": request_schema(caps)}}}})
    async def create_sync(request: Request):
        """Create and wait: the MP4 once it is written (a client that hangs up cancels its video)."""
        entry = await start_video(request)
        done = settled.get(entry.id)
        while done is not None and not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected() and entry.id in live:
                    await live[entry.id].cancel()
        final = store.entries.get(entry.id)
        if final is None:
            raise BadField("id", f"video {entry.id} was deleted before it finished", 404)
        obj = video_object(final)
        if obj["status"] != "completed":
            failure = obj["error"] or {}
            status = 503 if failure.get("code") == "cancelled" and state["closing"] else 500
            return error(status, f"video {entry.id} failed: {failure.get('message')}", None,
                         code=failure.get("code"), headers={"x-video-id": entry.id})
        took = sum(v for k, v in (final.timings or {}).items() if k == "total" and isinstance(v, (int, float)))
        return serve_file(entry.id, "video", {"x-video-id": entry.id, "x-inference-time-s": f"{took:.3f}"})

    def _entry(vid: str) -> VideoEntry:
        entry = store.entries.get(vid)
        if entry is None or vid in deleting:
            raise BadField("id", f"no video with id {vid[:80]!r}", 404)
        return entry

    @app.get("/v1/videos")
    async def list_videos(request: Request):
        q = request.query_params
        items = sorted((e for e in store.entries.values() if e.id not in deleting),
                       key=lambda e: (e.created_seq or e.created_at, e.id))
        page, has_more = list_page(items, q.get("after"), q.get("limit"), q.get("order"))
        data = [video_object(e) for e in page]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}

    @app.get("/v1/videos/{vid}")
    async def retrieve(vid: str):
        return video_object(_entry(vid))

    kinds = {"video": ("video/mp4", 'attachment; filename="{}.mp4"'), "sidecar": ("application/json", None),
             "thumbnail": ("image/png", None)}

    def serve_file(vid: str, variant: str, headers: dict | None = None) -> StreamingResponse:
        try:  # opened now: a DELETE from here on unlinks the name, this reader keeps the file
            f = open(store.paths(vid)[variant], "rb")
        except FileNotFoundError:
            raise BadField("id", f"no video with id {vid!r} (deleted)", 404) from None
        size = os.fstat(f.fileno()).st_size

        async def body():
            try:
                while chunk := await asyncio.to_thread(f.read, 1 << 16):
                    yield chunk
            finally:
                f.close()

        media_type, disposition = kinds[variant]
        head = {"content-length": str(size), **(headers or {}),
                **({"content-disposition": disposition.format(vid)} if disposition else {})}
        return StreamingResponse(body(), media_type=media_type, headers=head)

    @app.get("/v1/videos/{vid}/content")
    async def content(vid: str, variant: str = "video"):
        if variant not in kinds:
            raise BadField("variant", f"variant must be video, thumbnail or sidecar, got {variant[:80]!r}")
        entry = _entry(vid)
        if entry.status != "completed" or vid in live:
            raise BadField("id", f"video {vid} is {video_object(entry)['status']}; content exists once it is "
                           f"completed", 409)
        return serve_file(vid, variant)

    @app.delete("/v1/videos/{vid}")
    async def delete(vid: str):
        """Delete (OpenAI's shape); an unfinished video is cancelled first and is gone for clients at once."""
        _entry(vid)
        h = live.get(vid)
        if h is None:
            store.remove(vid)
        else:  # cancel (queued for the driver), wait a little for it to land: its queue slot frees with it
            deleting.add(vid)
            await h.cancel()
            done = settled.get(vid)
            if done is not None:
                try:
                    await asyncio.wait_for(done.wait(), CANCEL_WAIT_S)
                except asyncio.TimeoutError:
                    pass
        return {"id": vid, "object": "video.deleted", "deleted": True}

    @app.get("/v1/videos/{vid}/events")
    async def events(vid: str):
        entry = _entry(vid)
        h = live.get(vid)

        async def stream():
            if h is None:  # ended and released: its terminal event
                obj = video_object(entry)
                failure = obj["error"] or {}
                kind = "request.completed" if obj["status"] == "completed" else \
                    "request.cancelled" if failure.get("code") == "cancelled" else "request.failed"
                data = {"request_id": vid, "status": obj["status"], **({"error": failure} if failure else {})}
                if obj["status"] == "completed":
                    data["urls"] = content_urls(vid, kinds)
                yield _sse(kind, data)
                return
            async for ev in h.events():
                yield _sse(ev.kind, public_event(vid, ev.to_json()))

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    install_comfy_routes(app, engine, state, out_dir, api_key)   # ComfyUI's /prompt, /history, ... (comfy.py)
    install_lora_routes(app, engine, state, out_dir / ".lora-uploads")   # /v1/loras + the `lora` field (loras.py)
    return app


def _pixel_frames(req: Any) -> int | None:
    frames = getattr(req, "num_frames", None)
    latent = getattr(req, "latent_frames", None)
    return frames or (None if latent is None else (latent - 1) * 4 + 1)


def _pixel_side(req: Any, side: str) -> int | None:
    v = getattr(req, side, None)
    latent = getattr(req, f"latent_{side}", None)
    return v or (None if latent is None else latent * 16)


def _total_steps(handle: Any) -> int:
    """Steps the progress bar counts: denoise steps + decode chunks (+ encode chunks)."""
    req = handle.program.request
    steps = getattr(req, "num_steps", 0) or 0
    frames = getattr(req, "num_frames", None)
    latent = getattr(req, "latent_frames", None) or (None if frames is None else (frames - 1) // 4 + 1)
    return steps + (latent or 0) * (2 if handle.program.image is not None else 1)


# ------------------------------------------------------------------------------------------------------ command line
def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a canonical model directory written by fvconvert")
    p.add_argument("--variant", help="a variant with seeded random weights (e.g. tiny-2.1-t2v, tiny); no checkpoint")
    p.add_argument("--seed-weights", type=int, default=0, help="seed of the random weights with --variant")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="model dtype")
    p.add_argument("--plan", default="none", help="parallel plan (only 'none' for now)")


def _bounded_int(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is out of range ({lo}..{hi if hi is not None else ''})")
        return v
    return parse


class SetupError(Exception):
    """A setting the server cannot start with (exit 2, one message)."""


def check_device(device: str) -> None:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise SetupError(f"--device {device!r}: give cpu, cuda or cuda:N")


def check_output_dir(path: str) -> None:
    """The output directory exists (made here) and is writable, before the engine loads."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise SetupError(f"--output-dir {path}: not a writable directory ({e.strerror or e})") from None


def check_port_free(host: str, port: int) -> None:
    """The address can be bound now (as uvicorn will: SO_REUSEADDR), before the engine loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise SetupError(f"--host {host}: cannot resolve it ({e})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise SetupError(f"--host {host} --port {port}: cannot bind ({e.strerror or e}); is another server "
                             f"on it?") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning printed when the server is reachable beyond loopback without an API key (None otherwise)."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"warning: serving on {host} (beyond loopback) without an API key: anyone who reaches the port can "
            f"create and delete videos; set --api-key or {API_KEY_ENV}")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module doc as written, and every option's default in its help."""


def build_parser(prog: str = "python -m optimized.serving.server") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("family", nargs="?", help="family name (cosmos3, wan); optional with --model")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (beyond loopback: set --api-key)")
    p.add_argument("--port", type=_bounded_int(0, 65535), default=8000, help="port (0: a free one, printed)")
    p.add_argument("--output-dir", default="fv_videos", help="where videos and the index (index.sqlite3) live")
    p.add_argument("--max-queue", type=_bounded_int(1), default=16,
                   help="requests in flight at once (>= 1); more get 429")
    p.add_argument("--keep-videos", type=_bounded_int(0), default=Retention.max_videos,
                   help="ended videos kept (older ones evicted, files included)")
    p.add_argument("--keep-bytes", type=_bounded_int(0), default=Retention.max_bytes,
                   help="bytes of ended videos' files kept")
    p.add_argument("--keep-seconds", type=_bounded_int(0), default=int(Retention.max_age_s),
                   help="seconds an ended video is kept")
    p.add_argument("--api-key", default=None, help=f"require this key on /v1/* (None: ${API_KEY_ENV} if set, "
                                                   f"else no key)")
    p.add_argument("--session-idle-timeout", type=_bounded_int(1), default=300,
                   help="seconds a realtime session with nothing running and no client call stays open")
    p.add_argument("--max-sessions", type=_bounded_int(1), default=64, help="realtime sessions open at once")
    p.add_argument("--serve-accel", action="append", default=[], metavar="NAME[:KNOBS][@CERT.json]",
                   help="list an acceleration on the DeploymentCard with its certificate (fvparity certify --out); "
                        "repeatable")
    p.add_argument("--default-accel", default=None, metavar="NAME[:KNOBS]",
                   help="the acceleration requests get when they name none (a request's accel: none runs exact)")
    add_log_args(p)   # --log-format text | json (optimized/serving/observability.py)
    return p


def apply_accel_args(engine: Any, served: list[str], default: str | None) -> None:
    """--serve-accel SPEC[@CERT] ... and --default-accel SPEC onto the engine (ServingError, a ValueError, if bad)."""
    from optimized.serving.requests import serve_accel
    for item in served:
        spec, _, cert = item.partition("@")
        serve_accel(engine, spec, cert or None)
    if default is not None:
        serve_accel(engine, default, None, default=True) if not any(
            i.partition("@")[0] == default for i in served) else serve_accel(
            engine, default, next(i.partition("@")[2] or None for i in served if i.partition("@")[0] == default),
            default=True)


def startup_line(model: str, host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return (f"serving {model} on http://{shown}:{port} (POST /v1/videos, GET /v1/models, docs at /docs); "
            f"Ctrl-C stops")


def _bound_port(server: Any, default: int) -> int:
    try:
        return int(server.servers[0].sockets[0].getsockname()[1])
    except (AttributeError, IndexError, OSError):
        return default


def main(argv: list[str] | None = None, prog: str = "python -m optimized.serving.server") -> int:
    p = build_parser(prog)
    args = p.parse_args(argv)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        if api_key is not None and not api_key.strip():
            raise SetupError("--api-key: an empty key")
        check_device(args.device)
        check_output_dir(args.output_dir)
        check_port_free(args.host, args.port)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    warning = exposure_warning(args.host, api_key)
    if warning:
        print(warning, file=sys.stderr)
    from optimized.serving.loading import load_engine, UsageError
    try:
        engine = load_engine(args.family, args.model, args.variant, args.device, args.dtype, args.plan,
                             args.seed_weights)
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:   # served accelerations and the default one (optimized/serving/requests.py serve_accel)
        apply_accel_args(engine, args.serve_accel, args.default_accel)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn
    retention = Retention(args.keep_videos, args.keep_bytes, float(args.keep_seconds))
    try:
        app = create_app(engine, output_dir=args.output_dir, max_queue=args.max_queue, retention=retention,
                         api_key=api_key, session_options={"idle_timeout_s": float(args.session_idle_timeout),
                                                           "max_sessions": args.max_sessions})
    except (OSError, sqlite3.Error) as e:
        print(f"error: --output-dir {args.output_dir}: cannot open the video index ({e})", file=sys.stderr)
        return 2

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:   # bound: say where (the real port, also with --port 0)
                print(startup_line(app.state.model_name, args.host, _bound_port(self, args.port)), file=sys.stderr,
                      flush=True)

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)   # uvicorn stops accepting, then waits for open connections:
            loop = getattr(app.state, "loop", None)   # cancelling in-flight work ends every stream (SSE included)
            if loop is not None:
                loop.call_soon_threadsafe(app.state.begin_shutdown)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30,
                            **configure_logging(args.log_format))
    Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
