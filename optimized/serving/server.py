"""OpenAI-style HTTP server for one engine (optional `serve` extra: FastAPI + uvicorn + python-multipart; MP4 needs
imageio-ffmpeg, also in the extra).

    fvgen serve wan --variant tiny-2.1-t2v --port 8000 --output-dir videos/     (or python -m optimized.serving.server)

    POST   /v1/videos                 create (JSON, or multipart/form-data with an `image` / `input_reference` file)
    GET    /v1/videos/{id}            status, progress, result URL
    GET    /v1/videos/{id}/content    the MP4 (?variant=video), frame 0 as PNG (thumbnail) or the JSON sidecar
    DELETE /v1/videos/{id}            cancel an unfinished video (at the next step boundary) / delete a finished one
    GET    /v1/videos/{id}/events     server-sent events: request.accepted, request.stage, progress (one per step and
                                      per decode chunk), request.completed | request.failed | request.cancelled
    GET    /health                    liveness + queue depth
    GET    /v1/models                 the served model and its DeploymentCard

Request fields (JSON or form): prompt | prompt_ids, negative_prompt | negative_prompt_ids, size "HEIGHTxWIDTH" (or
height + width), frames (num_frames), steps (num_steps), guidance (guidance_scale), seed, image (base64 PNG/JPEG or a
data: URL; multipart: a file), model (optional; must name the served model). Errors are JSON
`{"error": {"message", "type", "param"}}`: 400 for a bad field (`param` names it), 404 for an unknown id, 409 for
content that is not ready, 429 when `max_queue` requests are in flight, 413 for an oversized upload. Artifacts are
written atomically (temp file + rename), and content is served only after every file of the video is in place.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from optimized.serving.async_engine import AsyncEngine, EngineClosed, QueueFull
from optimized.serving.families import ServingError
from optimized.serving.requests import decode_base64_image, decode_image, parse_size

FIELDS = {"model", "prompt", "prompt_ids", "negative_prompt", "negative_prompt_ids", "size", "height", "width",
          "frames", "num_frames", "seconds", "steps", "num_steps", "guidance", "guidance_scale", "seed", "image",
          "input_reference"}
ALIASES = {"frames": "num_frames", "steps": "num_steps", "guidance": "guidance_scale"}
INT_FIELDS = ("num_frames", "num_steps", "seed", "height", "width")
MAX_UPLOAD_BYTES = 32 << 20


class BadField(ValueError):
    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param}}, status_code=status)


def guess_param(message: str, body: dict) -> str | None:
    """The request field an engine-side validation message is about (messages name the field they refuse)."""
    names = ("negative_prompt_ids", "negative_text_ids", "prompt_ids", "text_ids", "num_frames", "height", "width",
             "num_steps", "guidance_scale", "seed", "image", "size", "prompt", "latent_height", "latent_width",
             "latent_frames")
    public = {"text_ids": "prompt_ids", "negative_text_ids": "negative_prompt_ids", "latent_height": "size",
              "latent_width": "size", "latent_frames": "frames", "num_frames": "frames", "num_steps": "steps",
              "guidance_scale": "guidance"}
    for name in names:
        if re.search(rf"\b{name}\b", message):
            found = public.get(name, name)
            return "size" if found in ("height", "width", "size") and "size" in body else found
    if re.search(r"\bframe count\b|\bframes\b", message):
        return "frames"
    return None


def _as_int(name: str, v: Any) -> int:
    if isinstance(v, bool):
        raise BadField(name, f"{name} must be an integer, got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, str) and re.fullmatch(r"-?\d+", v.strip()):
        return int(v)
    raise BadField(name, f"{name} must be an integer, got {v!r}")


def _as_float(name: str, v: Any) -> float:
    try:
        if isinstance(v, bool):
            raise ValueError
        return float(v)
    except (TypeError, ValueError):
        raise BadField(name, f"{name} must be a number, got {v!r}") from None


def parse_fields(body: dict, image_bytes: bytes | None) -> dict:
    """Validated keyword fields for `AsyncEngine.submit` (BadField naming the field otherwise)."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadField(unknown[0], f"unknown field {unknown[0]!r}; fields: {sorted(FIELDS)}")
    kw: dict = {}
    for key, value in body.items():
        if value is None or key in ("model", "image", "input_reference", "size", "seconds"):
            continue
        name = ALIASES.get(key, key)
        if name in kw:
            raise BadField(key, f"{key} given twice (as {name})")
        if name in INT_FIELDS:
            kw[name] = _as_int(key, value)
        elif name == "guidance_scale":
            kw[name] = _as_float(key, value)
        elif name in ("prompt", "negative_prompt"):
            if not isinstance(value, str):
                raise BadField(key, f"{key} must be a string")
            kw[name] = value
        else:  # prompt_ids / negative_prompt_ids: a list of ints or "1,2,3"
            kw[name] = value
    if body.get("size") is not None:
        if "height" in kw or "width" in kw:
            raise BadField("size", "give size or height + width, not both")
        try:
            kw["height"], kw["width"] = parse_size(body["size"])
        except ServingError as e:
            raise BadField("size", str(e)) from None
    if body.get("seconds") is not None:
        raise BadField("seconds", "seconds is not supported: give frames (the pixel frame count, 4k + 1)")
    if "prompt" not in kw and "prompt_ids" not in kw:
        raise BadField("prompt", "prompt (or prompt_ids) is required")
    try:
        if image_bytes is not None:
            kw["image"] = decode_image(image_bytes, "image")
        elif isinstance(body.get("image"), str):
            kw["image"] = decode_base64_image(body["image"], "image")
        elif body.get("image") is not None:
            raise BadField("image", "image must be a base64 string (or a multipart file)")
    except ServingError as e:
        raise BadField("image", str(e)) from None
    return kw


class VideoStore:
    """Metadata of every video this server made (by id), beside the AsyncEngine's handles."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.meta: dict[str, dict] = {}

    def paths(self, vid: str) -> dict:
        return {"video": self.output_dir / f"{vid}.mp4", "sidecar": self.output_dir / f"{vid}.json"}


def create_app(engine: Any, *, output_dir: str | Path, max_queue: int = 16, model_name: str | None = None) -> FastAPI:
    """An app serving `engine` (a sync Engine: the app wraps it in an AsyncEngine on startup)."""
    from contextlib import asynccontextmanager

    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store = VideoStore(out_dir)
    card = engine.deployment_card()
    name = model_name or f"{card['family']}-{card['variant']}"
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["engine"] = AsyncEngine(engine, max_queue=max_queue)
        state["engine"].subscribe(on_event)
        try:
            yield
        finally:
            await asyncio.wait_for(state["engine"].close(), 60)

    app = FastAPI(title="FastVideo v2 engine", lifespan=lifespan)

    def video_object(vid: str) -> dict:
        h = state["engine"].handles[vid]
        meta = store.meta[vid]
        status = {"waiting": "queued", "running": "in_progress"}.get(h.status, h.status)
        if h.status == "completed" and h.final_status is None:
            status = "in_progress"  # denoised and decoded; artifacts still being written
        done_steps = sum(1 for e in h.history if e.kind == "progress")
        total = meta.get("total_steps") or 0
        obj = {"id": vid, "object": "video", "model": name, "status": status, "stage": h.stage,
               "progress": min(100, int(100 * done_steps / total)) if total else 0,
               "created_at": meta["created_at"], "completed_at": meta.get("completed_at"),
               "size": f"{meta['height']}x{meta['width']}" if meta.get("height") else None,
               "frames": meta.get("num_frames"), "seed": meta.get("seed"), "error": None}
        if status == "completed":
            obj["url"] = f"/v1/videos/{vid}/content"
            obj["timings"] = h.program.value.timings if h.program.value is not None else None
        for ev in h.history:
            if ev.kind == "request.failed":
                obj["error"] = {"message": ev.data.get("error", "failed"), "type": "generation_error"}
        return obj

    def on_event(ev: Any) -> None:
        meta = store.meta.get(ev.request_id)
        if meta is None:
            return
        if ev.kind == "request.stage" and ev.data.get("total"):
            meta.setdefault("stage_totals", {})[ev.data["stage"]] = ev.data["total"]
        if ev.kind in ("request.completed", "request.failed", "request.cancelled"):
            meta["completed_at"] = int(time.time())

    @app.exception_handler(BadField)
    async def _bad_field(request: Request, exc: BadField):
        return error(exc.status, str(exc), exc.param)

    @app.get("/health")
    async def health():
        eng = state["engine"]
        return {"status": "ok", "model": name, "queue_depth": eng.queue_depth, "max_queue": eng.max_queue,
                "driver_errors": len(eng.driver_errors)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "fastvideo",
                                            "deployment_card": engine.deployment_card()}]}

    @app.post("/v1/videos")
    async def create(request: Request):
        eng = state["engine"]
        ctype = request.headers.get("content-type", "")
        image_bytes = None
        if ctype.startswith("multipart/form-data"):
            try:
                form = await request.form()
            except Exception as e:  # noqa: BLE001 - a malformed upload is the client's
                raise BadField(None, f"malformed multipart body: {e}") from None
            body = {}
            for key, value in form.multi_items():
                if hasattr(value, "read"):
                    if key not in ("image", "input_reference"):
                        raise BadField(key, f"unexpected file field {key!r} (use image)")
                    image_bytes = await value.read()
                    if len(image_bytes) > MAX_UPLOAD_BYTES:
                        raise BadField(key, f"{key} is larger than {MAX_UPLOAD_BYTES} bytes", 413)
                else:
                    body[key] = value
            if isinstance(body.get("prompt_ids"), str):
                pass  # "1,2,3": parsed by the request builder
        else:
            raw = await request.body()
            if len(raw) > MAX_UPLOAD_BYTES:
                raise BadField(None, f"body larger than {MAX_UPLOAD_BYTES} bytes", 413)
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError as e:
                raise BadField(None, f"body is not valid JSON: {e.msg} at {e.pos}") from None
            if not isinstance(body, dict):
                raise BadField(None, "body must be a JSON object")
        if body.get("model") not in (None, name):
            raise BadField("model", f"model {body['model']!r} is not served here (served: {name!r})", 404)
        kw = parse_fields(body, image_bytes)
        created = int(time.time())
        vid = f"video_{uuid.uuid4().hex[:20]}"
        try:
            handle = await eng.submit(out=store.paths(vid)["video"], request_id=vid, **kw)
        except QueueFull as e:
            return error(429, str(e), None, "rate_limit_error")
        except EngineClosed as e:
            return error(503, str(e), None, "server_error")
        except ValueError as e:  # ServingError / RequestRejected / ManifestError: a bad field
            msg = str(e)
            return error(400, msg, guess_param(msg, body))
        req = handle.program.request
        store.meta[vid] = {"created_at": created, "seed": getattr(req, "seed", None),
                           "num_frames": getattr(req, "num_frames", None) or kw.get("num_frames"),
                           "height": getattr(req, "height", None) or kw.get("height"),
                           "width": getattr(req, "width", None) or kw.get("width"),
                           "total_steps": _total_steps(handle)}
        return JSONResponse(video_object(vid), status_code=200)

    def _handle(vid: str):
        eng = state["engine"]
        if vid not in eng.handles or vid not in store.meta:
            raise BadField("id", f"no video with id {vid!r}", 404)
        return eng.handles[vid]

    @app.get("/v1/videos/{vid}")
    async def retrieve(vid: str):
        _handle(vid)
        return video_object(vid)

    @app.get("/v1/videos/{vid}/content")
    async def content(vid: str, variant: str = "video"):
        h = _handle(vid)
        if h.final_status != "completed":
            return error(409, f"video {vid} is {video_object(vid)['status']}; content exists once it is completed",
                         "id")
        paths = store.paths(vid)
        if variant == "video":
            return FileResponse(paths["video"], media_type="video/mp4", filename=f"{vid}.mp4")
        if variant == "sidecar":
            return FileResponse(paths["sidecar"], media_type="application/json")
        if variant == "thumbnail":
            from optimized.runtime.artifacts import png_bytes
            return Response(png_bytes(h.program.value.frames[0]), media_type="image/png")
        raise BadField("variant", f"variant must be video, thumbnail or sidecar, got {variant!r}")

    @app.delete("/v1/videos/{vid}")
    async def delete(vid: str):
        h = _handle(vid)
        if h.final_status is None:
            await h.cancel()
            try:
                await asyncio.wait_for(h.wait(), 60)
            except asyncio.TimeoutError:
                pass
            return video_object(vid)
        for p in store.paths(vid).values():
            p.unlink(missing_ok=True)
        store.meta.pop(vid, None)
        return {"id": vid, "object": "video.deleted", "deleted": True}

    @app.get("/v1/videos/{vid}/events")
    async def events(vid: str):
        h = _handle(vid)

        async def stream():
            async for ev in h.events():
                yield f"event: {ev.kind}\ndata: {json.dumps(ev.to_json(), default=str)}\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


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
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--plan", default="none", help="parallel plan (only 'none' for now)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m optimized.serving.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("family", nargs="?", help="family name (cosmos3, wan); optional with --variant / --model")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--output-dir", default="fv_videos")
    p.add_argument("--max-queue", type=int, default=16)
    args = p.parse_args(argv)
    from optimized.serving.fvgen import load_engine, UsageError
    try:
        engine = load_engine(args.family, args.model, args.variant, args.device, args.dtype, args.plan,
                             args.seed_weights)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn
    uvicorn.run(create_app(engine, output_dir=args.output_dir, max_queue=args.max_queue), host=args.host,
                port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
