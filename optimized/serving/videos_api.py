"""The /v1/videos contract the HTTP server speaks: request fields, the video object, the list page, the error
envelope. Pure functions over plain data (the routes live in `server.py`).

The contract is OpenAI's video API (its Sora endpoints were shut down on 2026-09-24; the shape lives on as what
vllm-omni and SGLang serve) plus their extension fields:

    OpenAI:          prompt, model, size "WIDTHxHEIGHT", seconds, input_reference (a file, or {"image_url": URL})
    vllm-omni/SGLang: width, height, num_frames, fps, num_inference_steps, guidance_scale, guidance_scale_2,
                     negative_prompt, seed, lora, flow_shift, boundary_ratio
    this server:     prompt_ids, negative_prompt_ids (token ids), image (= input_reference)
    old names kept:  frames (num_frames), steps (num_inference_steps), guidance (guidance_scale), num_steps

`size` is WIDTHxHEIGHT (OpenAI's reading; this server read HEIGHTxWIDTH before: a string cannot say which it
means, so there is no alias for the old order, give width + height to be explicit). `seconds` becomes num_frames
through the model's fps: num_frames = seconds * fps + 1, which must be a frame count the family makes (4k + 1).

Statuses are the API's four: queued -> in_progress -> completed | failed; a cancelled video (a DELETE of an
unfinished one, a server shutdown) is `failed` with error code `cancelled`. Errors are
`{"error": {"message", "type", "code", "param"}}`. No response carries a server filesystem path (artifacts are
URLs under /v1/videos/{id}/content).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from fastapi.responses import JSONResponse

from optimized.serving.families import ServingError
from optimized.serving.requests import base64_image_bytes, decode_image, parse_size

FIELDS = frozenset({
    "model", "prompt", "prompt_ids", "negative_prompt", "negative_prompt_ids", "size", "height", "width", "seconds",
    "num_frames", "frames", "fps", "num_inference_steps", "num_steps", "steps", "guidance_scale", "guidance",
    "guidance_scale_2", "seed", "image", "input_reference", "lora", "flow_shift", "boundary_ratio",
    "accel"})     # accel: NAME[:knob=value,...] (manifests.accel), "none" for the exact path
# accepted name -> the engine's keyword (AsyncEngine.submit / requests.build_request)
ALIASES = {"frames": "num_frames", "steps": "num_steps", "num_inference_steps": "num_steps",
           "guidance": "guidance_scale"}
INT_FIELDS = ("num_frames", "num_steps", "seed", "height", "width")
FLOAT_FIELDS = ("guidance_scale", "guidance_scale_2", "fps", "flow_shift", "boundary_ratio")
INT_LIMIT = 1 << 63               # every integer field fits int64 (torch's), or it is a 400 naming the field
API_STATUSES = ("queued", "in_progress", "completed", "failed")
# engine-side names -> the public field names of this API
PUBLIC = {"text_ids": "prompt_ids", "negative_text_ids": "negative_prompt_ids", "latent_height": "height",
          "latent_width": "width", "latent_frames": "num_frames"}
# the engine's keyword -> the names a body may give it by, the API's first
ACCEPTED = {"num_steps": ("num_inference_steps", "num_steps", "steps"), "num_frames": ("num_frames", "frames"),
            "guidance_scale": ("guidance_scale", "guidance")}
DEFAULT_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                 409: "video_not_ready", 413: "payload_too_large", 429: "rate_limit_exceeded", 500: "internal_error",
                 503: "server_shutting_down"}

# The `lora` field's hook: None until a LoRA registry is installed (`set_lora_resolver`); then it turns the field's
# value into extra submit keywords (and raises BadField for an unknown adapter).
_lora_resolver: Callable[[Any], dict] | None = None


def set_lora_resolver(resolver: Callable[[Any], dict] | None) -> None:
    """Install (or remove, None) what the `lora` request field means: `resolver(value) -> submit keywords`."""
    global _lora_resolver
    _lora_resolver = resolver


def error_type(status: int) -> str:
    """The envelope's `type` for an HTTP status (OpenAI's names)."""
    return {401: "authentication_error", 429: "rate_limit_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")


class BadField(ValueError):
    """A request the API refuses: the HTTP status, the field (`param`) and a machine-readable `code`."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status = param, status
        self.code = code or DEFAULT_CODES.get(status, "invalid_request")


def error(status: int, message: str, param: str | None = None, kind: str | None = None,
          headers: dict | None = None, code: str | None = None) -> JSONResponse:
    """The error envelope (OpenAI's): {"error": {"message", "type", "code", "param"}}."""
    return JSONResponse({"error": {"message": message, "type": kind or error_type(status), "code": code or
                                   DEFAULT_CODES.get(status, "invalid_request"), "param": param}},
                        status_code=status, headers=headers)


def public_param(name: str | None, body: dict) -> str | None:
    """The API's name for an engine-side field, as the body named it (height / width are `size` when the body gave
    a size, num_frames is `seconds` when it gave seconds; an alias the body used is named as the body named it)."""
    if name is None:
        return None
    name = ALIASES.get(PUBLIC.get(name, name), PUBLIC.get(name, name))   # -> the engine's keyword
    if name in ("height", "width") and "size" in body:
        return "size"
    if name == "num_frames" and "seconds" in body:
        return "seconds"
    names = ACCEPTED.get(name, (name,))
    return next((n for n in names if n in body), names[0])


def guess_param(message: str, body: dict) -> str | None:
    """The request field an engine-side validation message is about (messages name the field they refuse)."""
    names = ("negative_prompt_ids", "negative_text_ids", "prompt_ids", "text_ids", "guidance_scale_2",
             "num_frames", "height", "width", "num_steps", "guidance_scale", "flow_shift", "boundary_ratio", "fps",
             "seed", "image", "size", "prompt", "latent_height", "latent_width", "latent_frames")
    for name in names:
        if re.search(rf"\b{name}\b", message):
            return public_param(name, body)
    if re.search(r"\bframe count\b|\bframes\b", message):
        return public_param("num_frames", body)
    return None


def _as_int(name: str, v: Any) -> int:
    if isinstance(v, str) and re.fullmatch(r"-?\d{1,20}", v.strip()):
        v = int(v)
    if isinstance(v, int) and not isinstance(v, bool):
        if not -INT_LIMIT < v < INT_LIMIT:
            raise BadField(name, f"{name} is out of range (|{name}| < 2**63)")
        return v
    raise BadField(name, f"{name} must be an integer, got {str(v)[:80]!r}")


def _as_float(name: str, v: Any) -> float:
    try:
        if isinstance(v, bool):
            raise ValueError
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        raise BadField(name, f"{name} must be a number, got {str(v)[:80]!r}") from None
    if not math.isfinite(x):
        raise BadField(name, f"{name} must be a finite number, got {v!r}")
    return x


@dataclass(frozen=True)
class ImageLimits:
    """What the served model accepts as an image: whether it takes one at all, and the family's side limits."""
    accepted: bool
    max_height: int | None = None
    max_width: int | None = None


@dataclass(frozen=True)
class FrameRule:
    """How the served model counts time: its clips' default fps and the frame counts it makes (step * k + 1)."""
    fps: float
    frame_step: int = 4


def seconds_to_frames(seconds: Any, fps: float, rule: FrameRule) -> int:
    """`seconds` (OpenAI's string "4", or a number) -> pixel frames: seconds * fps + 1 (the first frame is t = 0),
    which must be step * k + 1; BadField naming `seconds` otherwise, with the nearest durations that map."""
    s = _as_float("seconds", seconds)
    if s <= 0:
        raise BadField("seconds", f"seconds must be positive, got {seconds!r}")
    exact = s * fps
    k = round(exact / rule.frame_step)
    if k < 1 or abs(k * rule.frame_step - exact) > 1e-6 * max(1.0, exact):
        unit = rule.frame_step / fps
        lo, hi = max(1, math.floor(exact / rule.frame_step)), math.ceil(exact / rule.frame_step)
        near = sorted({lo, max(hi, 1)})
        raise BadField("seconds", f"seconds {seconds!r} at {fps:g} fps is {exact:g} frame intervals; this model makes "
                       f"{rule.frame_step}k + 1 frames, so seconds must be a multiple of {unit:g} (nearest: "
                       + ", ".join(f"{n * unit:g} -> {n * rule.frame_step + 1} frames" for n in near) + ")")
    return k * rule.frame_step + 1


def frames_to_seconds(num_frames: int | None, fps: float | None) -> str | None:
    """The video object's `seconds` (a string, as OpenAI's): the clip's duration (num_frames - 1) / fps."""
    if not num_frames or not fps:
        return None
    return f"{(num_frames - 1) / fps:g}"


def _image_reference(value: Any) -> Any:
    """input_reference as JSON: a base64 string / data URL, or OpenAI's {"image_url": URL} (data URLs only: this
    server fetches nothing); {"file_id"} is refused (no files API here)."""
    if isinstance(value, dict):
        if "image_url" in value and isinstance(value["image_url"], str):
            if not value["image_url"].startswith("data:"):
                raise BadField("input_reference", "input_reference.image_url must be a data: URL (base64); this "
                               "server does not fetch remote URLs")
            return value["image_url"]
        if "file_id" in value:
            raise BadField("input_reference", "input_reference.file_id is not supported (no files API here): "
                           "upload the image as a multipart file or a data: URL")
        raise BadField("input_reference", "input_reference must be a file, a base64 string or {\"image_url\": ...}")
    return value


def _accel_field(value: Any) -> str:
    from manifests.accel import AccelSpecError, parse_accel
    from optimized.serving.requests import EXACT_WORDS
    if not isinstance(value, str):
        raise BadField("accel", "accel must be a string NAME[:knob=value,...] (or \"none\")")
    if value.strip().lower() not in EXACT_WORDS:
        try:
            parse_accel(value)
        except AccelSpecError as e:
            raise BadField("accel", f"accel: {e}") from None
    return value


def parse_fields(body: dict, image_bytes: bytes | None, image: ImageLimits, rule: FrameRule | None = None) -> dict:
    """Validated keyword fields for `AsyncEngine.submit` (BadField naming the field otherwise). An image is refused
    before it is decoded when the model takes none or its header declares an over-large size."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadField(unknown[0], f"unknown field {unknown[0][:80]!r}; fields: {sorted(FIELDS)}",
                       code="unknown_parameter")
    kw: dict = {}
    for key, value in body.items():
        if value is None or key in ("model", "image", "input_reference", "size", "seconds", "lora"):
            continue
        name = ALIASES.get(key, key)
        if name in kw:
            raise BadField(key, f"{key} given twice (as {name})")
        if name in INT_FIELDS:
            kw[name] = _as_int(key, value)
        elif name in FLOAT_FIELDS:
            kw[name] = _as_float(key, value)
        elif name in ("prompt", "negative_prompt"):
            if not isinstance(value, str):
                raise BadField(key, f"{key} must be a string")
            kw[name] = value
        elif name == "accel":   # checked here (a 400 naming the field), applied by requests.with_extensions
            kw[name] = _accel_field(value)
        else:  # prompt_ids / negative_prompt_ids: a list of ints or "1,2,3"
            kw[name] = value
    if body.get("size") is not None:
        if "height" in kw or "width" in kw:
            raise BadField("size", "give size (WIDTHxHEIGHT) or width + height, not both")
        try:
            kw["height"], kw["width"] = parse_size(body["size"])
        except ServingError as e:
            raise BadField("size", str(e)) from None
    if body.get("seconds") is not None:
        if "num_frames" in kw:
            raise BadField("seconds", "give seconds or num_frames, not both")
        if rule is None:
            raise BadField("seconds", "seconds: this model has no frame rate to map seconds to frames; give num_frames")
        kw["num_frames"] = seconds_to_frames(body["seconds"], kw.get("fps", rule.fps), rule)
    if body.get("lora") is not None:
        if _lora_resolver is None:
            raise BadField("lora", "LoRA not available: this server has no LoRA adapters", code="lora_not_available")
        kw.update(_lora_resolver(body["lora"]))
    if "prompt" not in kw and "prompt_ids" not in kw:
        raise BadField("prompt", "prompt (or prompt_ids) is required", code="missing_required_parameter")
    param = "input_reference" if "input_reference" in body else "image"   # the name the client used
    if body.get("image") is not None and body.get("input_reference") is not None:
        raise BadField("input_reference", "give image or input_reference, not both")
    given = _image_reference(body.get("image", body.get("input_reference")))
    if image_bytes is None and given is not None and not isinstance(given, str):
        raise BadField(param, f"{param} must be a base64 string (or a multipart file)")
    if image_bytes is not None or given is not None:
        if not image.accepted:
            raise BadField(param, f"{param}: this model takes no image")
        try:
            raw = image_bytes if image_bytes is not None else base64_image_bytes(given, param)
            kw["image"] = decode_image(raw, param, image.max_height, image.max_width)
        except ServingError as e:
            raise BadField(param, str(e)) from None
    return kw


def api_status(stored: str) -> tuple[str, str | None]:
    """(the API's status, an error code it implies): `cancelled` (an older index's status, or an engine outcome)
    is `failed` with code `cancelled`."""
    if stored == "cancelled":
        return "failed", "cancelled"
    return (stored, None) if stored in API_STATUSES else ("failed", "unknown_status")


def list_page(items: list, after: str | None, limit: Any, order: Any) -> tuple[list, bool]:
    """One page of `items` (sorted oldest first, each with `.id`) after the cursor id: (page, has_more). BadField
    for a bad limit / order / unknown cursor."""
    order = "desc" if order is None else order
    if order not in ("asc", "desc"):
        raise BadField("order", f"order must be asc or desc, got {str(order)[:40]!r}")
    n = 20 if limit is None else _as_int("limit", limit)
    if not 1 <= n <= 100:
        raise BadField("limit", f"limit must be in 1..100, got {n}")
    seq = items if order == "asc" else items[::-1]
    start = 0
    if after:
        ids = [e.id for e in seq]
        if after not in ids:
            raise BadField("after", f"after: no video with id {after[:80]!r} (deleted or evicted?)", 400)
        start = ids.index(after) + 1
    page = seq[start:start + n]
    return page, start + n < len(seq)


def scrub(obj: Any, roots: tuple[str, ...]) -> Any:
    """`obj` with every occurrence of a server directory (`roots`) removed from its strings (recursively): a
    response or event never tells a client where files live."""
    if isinstance(obj, str):
        for root in roots:
            obj = obj.replace(root + "/", "").replace(root, "")
        return obj
    if isinstance(obj, dict):
        return {k: scrub(v, roots) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, roots) for v in obj]
    return obj


def content_urls(vid: str, kinds: Any) -> dict:
    """Artifact kind -> the URL that serves it (what events say instead of paths)."""
    base = f"/v1/videos/{vid}/content"
    return {k: base if k == "video" else f"{base}?variant={k}" for k in kinds}


def request_schema(caps: dict) -> dict:
    """The JSON body's OpenAPI schema (what clients and fuzzers read; the server checks every field itself)."""
    ids = {"oneOf": [{"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                     {"type": "string"}]}
    frames = {"type": "integer", "minimum": 1, "maximum": caps.get("max_frames") or 4096}
    steps, number = {"type": "integer", "minimum": 1}, {"type": "number"}
    return {"type": "object", "additionalProperties": False, "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string"}, "negative_prompt": {"type": "string"},
        "prompt_ids": ids, "negative_prompt_ids": ids,
        "size": {"type": "string", "pattern": r"^\d+x\d+$", "description": "WIDTHxHEIGHT (OpenAI's order)"},
        "height": {"type": "integer", "minimum": 1, "maximum": caps.get("max_height") or 16384},
        "width": {"type": "integer", "minimum": 1, "maximum": caps.get("max_width") or 16384},
        "seconds": {"type": "string", "pattern": r"^\d+(\.\d+)?$", "description": "num_frames = seconds * fps + 1"},
        "num_frames": frames, "frames": frames, "fps": number, "num_inference_steps": steps, "steps": steps,
        "guidance_scale": number, "guidance": number, "guidance_scale_2": number, "flow_shift": number,
        "boundary_ratio": number, "seed": {"type": "integer", "minimum": 0},
        "image": {"type": "string", "description": "base64 PNG / JPEG or a data: URL"},
        "input_reference": {"type": "string", "description": "base64 PNG / JPEG or a data: URL (or a multipart file)"},
        "lora": {"type": "string"},
        "accel": {"type": "string", "description": "NAME[:knob=value,...] (fvparity certify), or none"}}}


__all__ = ["ALIASES", "API_STATUSES", "BadField", "FIELDS", "FrameRule", "ImageLimits", "api_status", "content_urls",
           "error", "error_type", "frames_to_seconds", "guess_param", "list_page", "parse_fields", "public_param", "request_schema",
           "scrub", "seconds_to_frames", "set_lora_resolver"]
