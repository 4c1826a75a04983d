"""From what a user types (a prompt, token ids, a size string, an image file) to a family's request.

Prompt -> token ids is the family processor's job (`FamilyEntry.processor`, with `build_request(prompt=..., ...)`).
Where a family has none yet:
  * token ids are always accepted (`prompt_ids`: fvgen `--prompt-ids 1,2,3`, HTTP `"prompt_ids": [1, 2, 3]`);
  * for random-weight engines only (`--variant`, weights version "random:..."), a prompt falls back to BYTE-LEVEL
    ids: the prompt's UTF-8 bytes, each taken modulo the text vocabulary, truncated to the model's text length (an
    empty prompt is one id 0). No real checkpoint is ever fed these ids: with converted weights and no processor a
    prompt is refused, naming the missing processor.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

import torch

from optimized.serving.families import RequestFields, ServingError, adapter_for, media_chain


def text_limits(engine: Any) -> tuple[int, int]:
    """(vocabulary size, longest prompt in tokens) of the engine's text input."""
    cfg = engine.model.cfg
    te = getattr(cfg, "text_encoder", None)
    vocab = te.vocab_size if te is not None else cfg.vocab_size
    return vocab, int(getattr(cfg, "max_sequence_length", 0) or 512)


def byte_ids(engine: Any, text: str) -> torch.Tensor:
    """The byte-level fallback (random-weight engines only): UTF-8 bytes mod vocab, truncated to the text length."""
    vocab, max_len = text_limits(engine)
    ids = [b % vocab for b in text.encode("utf-8")][:max_len] or [0]
    return torch.tensor(ids, dtype=torch.int64)


def parse_ids(value: Any, field: str = "prompt_ids", vocab: int | None = None) -> torch.Tensor:
    """'1,2,3' or [1, 2, 3] -> int64 tensor; ServingError naming the field otherwise (every id < `vocab` when
    given, and always within int64: a larger integer must never reach torch, whose overflow names nothing)."""
    if isinstance(value, str):
        try:
            value = [int(v) for v in value.replace(" ", "").split(",") if v != ""]
        except ValueError:  # not digits, or more than Python's 4300-digit int limit
            raise ServingError(f"{field} must be comma-separated integers, got {value[:80]!r}") from None
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, int) and not isinstance(v, bool)
                                                                    and v >= 0 for v in value):
        raise ServingError(f"{field} must be a non-empty list of non-negative integers")
    limit = vocab if vocab is not None else 1 << 63
    bad = next((i for i, v in enumerate(value) if v >= limit), None)
    if bad is not None:
        raise ServingError(f"{field}[{bad}] is out of range: token ids must be below "
                           + (f"the vocabulary size {vocab}" if vocab is not None else "2**63"))
    return torch.tensor(list(value), dtype=torch.int64)


def parse_size(value: Any, field: str = "size") -> tuple[int, int]:
    """'640x480' (WIDTHxHEIGHT, OpenAI's and ffmpeg's order) -> (height, width) = (480, 640)."""
    try:
        w, h = (int(v) for v in str(value).lower().split("x"))
    except ValueError:
        raise ServingError(f"{field} must be WIDTHxHEIGHT (e.g. 1280x720), got {str(value)[:80]!r}") from None
    if h <= 0 or w <= 0:
        raise ServingError(f"{field} must be positive, got {str(value)[:80]!r}")
    return h, w


# the largest upload decoded at all (its [3, H, W] float copy is 200 MiB); the family's own side limits apply too
MAX_IMAGE_PIXELS = 4096 * 4096
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # frame headers (not DHT)


def image_header(data: bytes, field: str = "image") -> tuple[str, int, int]:
    """(format, height, width) declared by a PNG (IHDR) or JPEG (SOFn) header, read without decoding anything;
    ServingError naming the field for anything else."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24 and data[12:16] == b"IHDR":
        return "PNG", int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")
    if data[:2] == b"\xff\xd8":
        i = 2
        while i + 4 <= len(data):
            if data[i] != 0xFF:
                break
            marker = data[i + 1]
            if marker == 0xFF:           # fill byte
                i += 1
                continue
            if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:   # markers without a length
                i += 2
                continue
            length = int.from_bytes(data[i + 2:i + 4], "big")
            if marker in _JPEG_SOF and i + 9 <= len(data):
                return "JPEG", int.from_bytes(data[i + 5:i + 7], "big"), int.from_bytes(data[i + 7:i + 9], "big")
            if length < 2:
                break
            i += 2 + length
        raise ServingError(f"{field}: a JPEG without a readable frame header")
    raise ServingError(f"{field}: not a PNG or JPEG image")


def check_image_header(data: bytes, field: str = "image", max_height: int | None = None,
                       max_width: int | None = None) -> tuple[int, int]:
    """(height, width) of an upload whose header declares a size this server decodes; ServingError otherwise."""
    _, h, w = image_header(data, field)
    if h <= 0 or w <= 0:
        raise ServingError(f"{field}: the image declares an empty size {h}x{w}")
    for side, value, limit in (("height", h, max_height), ("width", w, max_width)):
        if limit is not None and value > limit:
            raise ServingError(f"{field}: the image declares {side} {value}, above the family limit of {limit}")
    if h * w > MAX_IMAGE_PIXELS:
        raise ServingError(f"{field}: the image declares {h}x{w} pixels, more than the {MAX_IMAGE_PIXELS} this "
                           f"server decodes; send a smaller image")
    return h, w


def decode_image(data: bytes, field: str = "image", max_height: int | None = None,
                 max_width: int | None = None) -> torch.Tensor:
    """PNG / JPEG bytes -> [3, H, W] float in [-1, 1] (x / 127.5 - 1, the pipelines' mapping). The header's declared
    size is checked first (`check_image_header`): nothing over-large is ever decoded."""
    check_image_header(data, field, max_height, max_width)
    try:
        from PIL import Image
        img = Image.open(io.BytesIO(data)).convert("RGB")
    except ImportError:
        raise ServingError(f"{field}: reading images needs Pillow (pip install pillow)") from None
    except Exception as e:  # noqa: BLE001 - any decoder failure is a bad upload
        raise ServingError(f"{field}: not a readable image ({type(e).__name__})") from None
    import numpy as np
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float()
    return x / 127.5 - 1.0


def base64_image_bytes(text: str, field: str = "image") -> bytes:
    """The bytes of a base64 image (optionally a data: URL); ServingError naming the field otherwise."""
    if text.startswith("data:"):
        text = text.split(",", 1)[-1]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ServingError(f"{field} must be base64 (optionally a data: URL) of a PNG or JPEG") from None


def decode_base64_image(text: str, field: str = "image", **limits: Any) -> torch.Tensor:
    return decode_image(base64_image_bytes(text, field), field, **limits)


def takes_image(engine: Any) -> bool:
    """Whether the engine's model conditions on an image: its media chain has an encoder, or its family's request
    builder accepts one (probed once with a default-sized blank image: the builders refuse an image naming it)."""
    if "_takes_image" not in engine.__dict__:
        chain = media_chain(engine)
        if chain.encode_kernel is not None:
            takes = True
        else:
            adapter = adapter_for(engine)
            d = adapter.defaults
            blank = torch.zeros(3, d["height"], d["width"])
            try:
                adapter.build(engine, RequestFields(torch.zeros(1, dtype=torch.int64), image=blank))
                takes = True
            except ServingError as e:
                takes = not str(e).startswith("image")
        engine.__dict__["_takes_image"] = takes
    return engine.__dict__["_takes_image"]


def tokens_for(engine: Any, prompt: str | None, prompt_ids: Any, field: str = "prompt") -> torch.Tensor:
    if prompt_ids is not None:
        return parse_ids(prompt_ids, f"{field}_ids", vocab=text_limits(engine)[0])
    if prompt is None:
        raise ServingError(f"{field}: give a prompt or {field}_ids")
    if not str(getattr(engine.model, "weights_version", "") or "").startswith("random:"):
        raise ServingError(f"{field}: the {engine.family.name} family has no processor (prompt -> token ids) yet; "
                           f"pass token ids as {field}_ids")
    return byte_ids(engine, prompt)


def build_request(engine: Any, *, prompt: str | None = None, prompt_ids: Any = None,
                  negative_prompt: str | None = None, negative_prompt_ids: Any = None, num_frames: int | None = None,
                  height: int | None = None, width: int | None = None, num_steps: int | None = None,
                  guidance_scale: float | None = None, seed: int | None = 0,
                  image: torch.Tensor | None = None, fps: float | None = None, guidance_scale_2: float | None = None,
                  flow_shift: float | None = None, boundary_ratio: float | None = None,
                  lora: tuple = (), accel: Any = None) -> tuple[Any, torch.Tensor | None]:
    """A family request from plain fields, and the image the video program must encode (None when the request
    carries it). Uses the family's processor for prompts when it has one; see the module doc otherwise. The
    extension fields (fps, guidance_scale_2, flow_shift, boundary_ratio) and the LoRA refs (`lora`, checked by the
    engine's adapter manager) go where the family's request has them (`with_extensions`)."""
    if prompt_ids is None and prompt is not None and processor_for(engine) is not None:
        request, left = request_from_prompt(engine, prompt, negative_prompt=negative_prompt, num_frames=num_frames,
                                            height=height, width=width, num_steps=num_steps,
                                            guidance_scale=guidance_scale, seed=seed, image=image)
        return with_extensions(engine, request, fps, guidance_scale_2, flow_shift, boundary_ratio, lora, accel), left
    adapter = adapter_for(engine)
    in_request = media_chain(engine).image_in_request
    text = tokens_for(engine, prompt, prompt_ids)
    negative = None if negative_prompt is None and negative_prompt_ids is None else \
        tokens_for(engine, negative_prompt, negative_prompt_ids, "negative_prompt")
    fields = RequestFields(text, negative, num_frames, height, width, num_steps, guidance_scale, seed,
                           image if in_request else None)
    try:
        request = adapter.build(engine, fields)
    except ServingError:
        raise
    except ValueError as e:
        raise ServingError(str(e)) from None
    return with_extensions(engine, request, fps, guidance_scale_2, flow_shift, boundary_ratio, lora, accel), \
        None if in_request else image


def default_fps(engine: Any) -> float:
    """The fps the engine's clips play at when a request sets none (its media chain's, on a default request)."""
    if "_default_fps" not in engine.__dict__:
        adapter = adapter_for(engine)
        probe = adapter.build(engine, RequestFields(torch.zeros(1, dtype=torch.int64)))
        engine.__dict__["_default_fps"] = float(media_chain(engine).fps(probe))
    return engine.__dict__["_default_fps"]


def frame_step(engine: Any) -> int:
    """The frame counts the engine makes are frame_step * k + 1 (its media VAE's temporal compression)."""
    cfg = getattr(media_chain(engine).vae, "cfg", None)
    return int(getattr(cfg, "temporal_compression", None) or getattr(cfg, "scale_factor_temporal", None) or 4)


def with_extensions(engine: Any, request: Any, fps: float | None = None, guidance_scale_2: float | None = None,
                    flow_shift: float | None = None, boundary_ratio: float | None = None, lora: tuple = (),
                    accel: Any = None) -> Any:
    """`request` with the vllm-omni / SGLang extension fields set where its type has them; ServingError naming
    the field where it has none. fps: a request field (cosmos3) or the model's fixed clip rate (which a request may
    restate, not change); boundary_ratio: a two-expert model's own switch point (a model property: a request may
    restate it, not change it)."""
    import dataclasses
    names = {f.name for f in dataclasses.fields(request)} if dataclasses.is_dataclass(request) else set()
    family = engine.family.name
    changes: dict = {}
    for name, value in (("guidance_scale_2", guidance_scale_2), ("flow_shift", flow_shift)):
        if value is None:
            continue
        if name not in names:
            raise ServingError(f"{name}: {family} requests take no {name}")
        changes[name] = float(value)
    if fps is not None:
        if "fps" in names:
            changes["fps"] = float(fps)
        else:
            fixed = float(media_chain(engine).fps(request))
            if abs(float(fps) - fixed) > 1e-9:
                raise ServingError(f"fps: this {family} model's clips play at {fixed:g} fps (fixed); got {fps:g}")
    if boundary_ratio is not None:
        own = getattr(getattr(engine.model, "cfg", None), "boundary_ratio", None)
        if own is None:
            raise ServingError(f"boundary_ratio: this {family} model has one expert; boundary_ratio applies to "
                               f"two-expert models")
        if abs(float(boundary_ratio) - float(own)) > 1e-9:
            raise ServingError(f"boundary_ratio: this model switches experts at {own:g} (a property of its "
                               f"weights, not changed per request); got {boundary_ratio:g}")
    if lora:
        if "lora" not in names:
            raise ServingError(f"lora: {family} requests take no LoRA adapters")
        changes["lora"] = tuple(lora)
    spec = resolve_accel(engine, accel)          # `accel`: None -> the engine's default (optimized/serving: serve_accel)
    if "accel" in names:
        if spec is not None or accel is not None:
            changes["accel"] = spec
    elif spec is not None:
        raise ServingError(f"accel: {family} requests take no acceleration")
    return dataclasses.replace(request, **changes) if changes else request


# ---------------------------------------------------------------------------------------------- accelerations
# An engine serves accelerations (issue 21): `serve_accel(engine, "fbcache:threshold=0.05", certificate=PATH)` lists
# one (with its certificate: path, pass / fail, budget) on the DeploymentCard; `default=True` makes it the engine's
# default, taken by every request that names none ("none" / "exact" asks for the exact path). Kept in
# engine.__dict__ (like `tokenizer_dir`): the Engine class is not changed for it.
EXACT_WORDS = ("none", "exact", "off")


def served_accels(engine: Any) -> dict:
    """{"served": {label: {"exact", "certificate", "passed", "budget", "reasons"}}, "default": label | None}."""
    return engine.__dict__.setdefault("served_accels", {"served": {}, "default": None})


def serve_accel(engine: Any, accel: str, certificate: str | Path | None = None, default: bool = False) -> Any:
    """Register a served acceleration (ServingError for a bad spec or an unreadable certificate); its AccelSpec."""
    import json

    from manifests.accel import AccelSpecError, parse_accel
    try:
        spec = parse_accel(accel)
    except AccelSpecError as e:
        raise ServingError(f"accel: {e}") from None
    entry: dict = {"exact": spec.exact, "certificate": None, "passed": None, "budget": None, "reasons": []}
    if certificate is not None:
        try:
            cert = json.loads(Path(certificate).read_text())
        except (OSError, ValueError) as e:
            raise ServingError(f"accel {spec.label()}: certificate {certificate}: unreadable ({e})") from None
        if not isinstance(cert, dict) or cert.get("label") != spec.label():
            raise ServingError(f"accel {spec.label()}: certificate {certificate} certifies "
                               f"{cert.get('label') if isinstance(cert, dict) else None!r}, not this acceleration")
        entry.update(certificate=str(certificate), passed=bool(cert.get("passed")), budget=cert.get("budget"),
                     reasons=list(cert.get("reasons") or []),
                     placeholder=bool((cert.get("requests") or {}).get("placeholder", False)))
    table = served_accels(engine)
    table["served"][spec.label()] = entry
    if default:
        table["default"] = spec.label()
    return spec


def resolve_accel(engine: Any, value: Any) -> Any:
    """A request's `accel` value -> an AccelSpec or None (exact): None takes the engine's default, "none" / "exact"
    the exact path, text is parsed (manifests.accel.parse_accel); ServingError with the AccelSpecError message."""
    from manifests.accel import AccelSpec, AccelSpecError, parse_accel
    if isinstance(value, AccelSpec):
        return value
    if value is None:
        value = served_accels(engine)["default"] if "served_accels" in engine.__dict__ else None
        if value is None:
            return None
    if not isinstance(value, str):
        raise ServingError(f"accel: must be a string NAME[:knob=value,...], got {type(value).__name__}")
    if value.strip().lower() in EXACT_WORDS:
        return None
    try:
        return parse_accel(value)
    except AccelSpecError as e:
        raise ServingError(f"accel: {e}") from None


def tokenizer_dir(engine: Any) -> Path | None:
    """The tokenizer files of the engine's model: `engine.tokenizer_dir` when set, else the `tokenizer` asset of the
    model directory it was loaded from (`engine.checkpoint_path`, set by fvgen / the server), else None."""
    given = engine.__dict__.get("tokenizer_dir")
    if given:
        return Path(given)
    ckpt = engine.__dict__.get("checkpoint_path")
    if ckpt is None:
        return None
    try:
        from manifests.checkpoint import read_checkpoint
        found = read_checkpoint(ckpt).assets.get("tokenizer")
    except Exception:  # noqa: BLE001 - an unreadable index has no tokenizer to offer
        found = None
    found = Path(found) if found is not None else Path(ckpt) / "tokenizer"
    return found if found.is_dir() else None


def processor_for(engine: Any) -> Any | None:
    """The family's processor over the model's tokenizer files (built once per engine); None when the family has
    no processor or the model has no tokenizer files (random-weight variants)."""
    if "_processor" not in engine.__dict__:
        factory, tdir = getattr(engine.family, "processor", None), tokenizer_dir(engine)
        engine.__dict__["_processor"] = None if factory is None or tdir is None else factory(tdir)
    return engine.__dict__["_processor"]


def request_from_prompt(engine: Any, prompt: str, *, image: Any = None, negative_prompt: str | None = None,
                        num_frames: int | None = None, height: int | None = None, width: int | None = None,
                        num_steps: int | None = None, guidance_scale: float | None = None, seed: int | None = 0,
                        **extra: Any) -> tuple[Any, Any]:
    """The family processor's request for `prompt` (`FamilyEntry.processor(tokenizer_dir).build_request(...)`), and
    the image left for the video program to encode (None: the processor put the image into the request itself,
    encoding conditioning pixels through the media chain's VAE encode loop where it asks for an encoder)."""
    import inspect
    accel = extra.pop("accel", None)
    proc = processor_for(engine)
    if proc is None:
        has = getattr(engine.family, "processor", None) is not None
        raise ServingError(f"prompt: the {engine.family.name} " + (
            "model has no tokenizer files (a converted model directory's tokenizer/, or engine.tokenizer_dir)"
            if has else "family has no processor (prompt -> request)") +
            "; pass a request to engine.generate_video(request), or token ids")
    defaults = adapter_for(engine).defaults
    kw = dict(num_frames=num_frames or defaults["num_frames"], height=height or defaults["height"],
              width=width or defaults["width"], steps=num_steps or defaults["num_steps"],
              guidance=defaults["guidance_scale"] if guidance_scale is None else guidance_scale, seed=seed,
              **{**engine.family.processor_options(engine), **extra})   # the loaded model's own settings first
    params = inspect.signature(proc.build_request).parameters
    if image is not None and "encode_vision" in params and "encode_vision" not in kw:
        kw["encode_vision"] = media_chain(engine).encode_pixels
    try:
        request = proc.build_request(prompt, negative_prompt, image, **kw)
    except ValueError as e:
        raise ServingError(str(e)) from None
    return with_extensions(engine, request, accel=accel), None
