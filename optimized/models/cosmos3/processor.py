"""cosmos3 processor on the serving path: prompts -> token ids (cached), pixels -> conditioning, -> request.

Same contract as diffusers 0.42.1 `Cosmos3OmniPipeline.tokenize_prompt` / `_preprocess_conditioning_image` /
`_prepare_action_video_conditioning` (see golden/README.md, probe `cosmos3.processor`), written for serving: the
chat template is compiled once per processor, token ids are memoised per (text, mode) so a repeated prompt or
negative prompt costs a dict lookup, and pixels may be prepared on the device that will encode them.
Runtime dependencies: `tokenizers` (the `text` extra) and jinja2 (installed with torch); never transformers.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from manifests.cosmos3.sampling import ActionSpec, Cosmos3GenerateRequest, UniPCConfig


class ProcessorError(ValueError):
    """A prompt / image / option the processor refuses; names the offending argument."""


_SYSTEM = {True: "You are a helpful assistant who will generate images from a give prompt.",
           False: "You are a helpful assistant who will generate videos from a give prompt."}  # keyed by is_image
# (positive, inverse) sentence per metadata kind
_SENTENCES = {
    "duration": ("The video is {duration:.1f} seconds long and is of {fps:.0f} FPS.",
                 "The video is not {duration:.1f} seconds long and is not of {fps:.0f} FPS."),
    "image": ("This image is of {height}x{width} resolution.", "This image is not of {height}x{width} resolution."),
    "video": ("This video is of {height}x{width} resolution.", "This video is not of {height}x{width} resolution."),
}
# tier -> list of (height/width ratio, (canvas height, canvas width)); ratios are upstream's dict keys as floats
_TIERS: dict[int, list[tuple[float, tuple[int, int]]]] = {
    256: [(1.0, (256, 256)), (0.8, (256, 320)), (1.25, (320, 256)), (0.6, (192, 320)),
          (1.6666666666666667, (320, 192))],
    480: [(1.0, (640, 640)), (0.7391304347826086, (544, 736)), (1.3529411764705883, (736, 544)),
          (0.5769230769230769, (480, 832)), (1.7333333333333334, (832, 480))],
    704: [(1.0, (960, 960)), (0.7647058823529411, (832, 1088)), (1.3076923076923077, (1088, 832)),
          (0.55, (704, 1280)), (1.8181818181818181, (1280, 704))],
    720: [(1.0, (960, 960)), (0.7536231884057971, (832, 1104)), (1.3269230769230769, (1104, 832)),
          (0.5625, (720, 1280)), (1.7777777777777777, (1280, 720))],
}
_FRAMING = {
    "ego_view": "This video is captured from a first-person perspective looking at the scene.",
    "third_person_view": "This video is captured from a third-person perspective looking towards the agent from the front.",
    "wrist_view": "This video is captured from a wrist-mounted camera.",
    "concat_view": "This video contains concatenated views from multiple camera perspectives.",
}
_ASPECTS = (("1,1", 1.0), ("4,3", 4 / 3), ("3,4", 3 / 4), ("16,9", 16 / 9), ("9,16", 9 / 16))
# embodiment -> (domain id, raw action width); "no_action" / "libero" have no fixed width and are refused
_EMBODIMENTS = {"av": (1, 9), "camera_pose": (2, 9), "hand_pose": (3, 57), "pusht": (4, 2), "umi": (6, 10),
                "bridge_orig_lerobot": (7, 10), "droid_lerobot": (8, 10), "robomind-franka": (8, 10),
                "galbot": (9, 30), "robomind-franka-dual": (12, 20), "robomind-ur": (13, 10),
                "agibotworld": (15, 29), "agibot_gear_gripper": (15, 29), "agibot_gear_gripper_ext": (15, 29),
                "fractal": (20, 10)}


def _compile_template(source: str):
    """The chat template compiled like transformers' `_compile_jinja_template` (sandbox, trim + lstrip blocks)."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def _fail(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=_fail, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(source)


class _Tokenizer:
    """tokenizer.json through `tokenizers` + the named specials and chat template of the tokenizer folder."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        root = Path(directory)
        try:
            self.backend = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # missing or unreadable file
            raise ProcessorError(f"tokenizer_dir {root}: cannot read tokenizer.json ({e})") from None
        cfg = self._json(root / "tokenizer_config.json")
        fallback = self._json(root / "special_tokens_map.json")
        self.specials: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
            v = cfg[key] if key in cfg else fallback.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            if v is not None:
                self.specials[key] = v
        jinja_file = root / "chat_template.jinja"
        source = jinja_file.read_text() if jinja_file.is_file() else cfg.get("chat_template")
        if isinstance(source, list):
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        self.template = _compile_template(source) if source else None

    @staticmethod
    def _json(path: Path) -> dict:
        return json.loads(path.read_text()) if path.is_file() else {}

    def id_of(self, token: str) -> int:
        found = self.backend.token_to_id(token)
        if found is None:
            raise ProcessorError(f"tokenizer has no token {token!r}")
        return found


@dataclass(frozen=True)
class ActionInput:
    mode: str                               # policy | forward_dynamics | inverse_dynamics
    chunk_size: int                         # the clip has chunk_size + 1 frames
    domain_name: str                        # embodiment
    clip: Any                               # PIL image / float [3, H, W] in [0, 1], or a list of them
    resolution_tier: int = 480
    raw_actions: torch.Tensor | None = None
    view_point: str | None = "ego_view"


@dataclass(frozen=True)
class ActionCanvas:
    pixels: torch.Tensor                    # [1, 3, F, canvas_h, canvas_w] in [-1, 1]
    canvas_hw: tuple[int, int]
    content_hw: tuple[int, int]


class Cosmos3Processor:
    """Builds `Cosmos3GenerateRequest`s from prompts and images; one instance per served tokenizer."""

    def __init__(self, tokenizer_dir: str | Path | None, *, use_system_prompt: bool = True,
                 spatial_compression: int = 16, temporal_compression: int = 4, cache_size: int = 256,
                 device: str | torch.device = "cpu"):
        self.tok = _Tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
        self.use_system_prompt = use_system_prompt
        self.sc, self.tc = spatial_compression, temporal_compression
        self.device = torch.device(device)
        self._ids: OrderedDict[tuple[str, bool, bool], tuple[int, ...]] = OrderedDict()
        self._cache_size = cache_size

    # -------------------------------------------------------------------------------- text

    def _encode_turn(self, user_text: str, is_image: bool, system: bool) -> tuple[int, ...]:
        key = (user_text, is_image, system)
        hit = self._ids.get(key)
        if hit is not None:
            self._ids.move_to_end(key)
            return hit
        tok = self.tok
        if tok is None:
            raise ProcessorError("no tokenizer loaded (tokenizer_dir=None)")
        if tok.template is None:
            raise ProcessorError("the tokenizer folder has no chat template")
        eos = tok.specials.get("eos_token")
        if eos is None:
            raise ProcessorError("the tokenizer folder names no eos_token")
        turns = ([{"role": "system", "content": _SYSTEM[is_image]}] if system else []) + \
            [{"role": "user", "content": user_text}]
        text = tok.template.render(messages=turns, tools=None, documents=None,
                                   **{**tok.specials, "add_generation_prompt": True, "add_vision_id": False})
        ids = tuple(tok.backend.encode(text, add_special_tokens=False).ids) + (tok.id_of(eos),
                                                                              tok.id_of("<|vision_start|>"))
        self._ids[key] = ids
        if len(self._ids) > self._cache_size:
            self._ids.popitem(last=False)
        return ids

    @staticmethod
    def _with_metadata(text: str, inverse: bool, num_frames: int, height: int, width: int, fps: float,
                       resolution: bool, duration: bool) -> str:
        sentences = []
        if num_frames != 1 and duration:
            sentences.append(_SENTENCES["duration"][inverse].format(duration=num_frames / fps, fps=fps))
        if resolution:
            sentences.append(_SENTENCES["image" if num_frames == 1 else "video"][inverse].format(height=height,
                                                                                                 width=width))
        for s in sentences:  # each join strips the trailing periods first (upstream `_append`)
            head = text.rstrip(".")
            text = head + ". " + s if head else s
        return text

    @staticmethod
    def _action_caption(description: str, view_point: str | None, num_frames: int, fps: float, height: int,
                        width: int) -> str:
        dur = num_frames / fps if fps > 0 else 0.0
        ok = dur >= 0 and math.isfinite(dur)
        m, s = divmod(round(dur) if ok else 0, 60)
        text = description.strip()
        if text and text[-1] not in ".!?":
            text = text + "."
        body: dict[str, Any] = {}
        if view_point is not None and view_point in _FRAMING:
            body["cinematography"] = {"framing": _FRAMING[view_point]}
        target = width / height if height > 0 else 1.0
        best = min(_ASPECTS, key=lambda a: abs(a[1] - target))[0]  # first of equals wins, as upstream's min
        body["actions"] = [{"time": "0:00-%d:%02d" % (m, s), "description": text}]
        body["duration"] = "%ds" % (int(dur) if ok else 0)
        body["fps"] = float(fps)
        body["resolution"] = {"H": int(height), "W": int(width)}
        body["aspect_ratio"] = best
        return json.dumps(body)

    def tokenize_prompt(self, prompt: str, negative_prompt: str | None = None, *, num_frames: int, height: int,
                        width: int, fps: float = 24.0, use_system_prompt: bool | None = None,
                        add_resolution_template: bool = True, add_duration_template: bool = True,
                        action_mode: str | None = None, action_view_point: str | None = None,
                        ) -> tuple[list[int], list[int]]:
        if not isinstance(prompt, str):
            raise ProcessorError(f"prompt must be a str, got {type(prompt).__name__}")
        if not (negative_prompt is None or isinstance(negative_prompt, str)):
            raise ProcessorError(f"negative_prompt must be a str or None, got {type(negative_prompt).__name__}")
        system = self.use_system_prompt if use_system_prompt is None else bool(use_system_prompt)
        neg = negative_prompt or ""
        if action_mode is not None:
            texts = (self._action_caption(prompt, action_view_point, num_frames, fps, height, width), neg)
        else:
            texts = tuple(self._with_metadata(t, inv, num_frames, height, width, fps, add_resolution_template,
                                              add_duration_template) for t, inv in ((prompt, False), (neg, True)))
        is_image = num_frames == 1
        return [list(self._encode_turn(t, is_image, system)) for t in texts]  # type: ignore[return-value]

    # -------------------------------------------------------------------------------- pixels

    @staticmethod
    def _as_nchw(image: Any) -> torch.Tensor:
        if hasattr(image, "getbands"):  # PIL
            return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)[None]
        if isinstance(image, np.ndarray):
            t = torch.from_numpy(image)
            return (t[None] if t.ndim == 3 else t).permute(0, 3, 1, 2)
        if isinstance(image, torch.Tensor):
            return image[None] if image.ndim == 3 else image
        raise ProcessorError(f"image must be a PIL image, numpy array or tensor, got {type(image).__name__}")

    def conditioning_image(self, image: Any, height: int, width: int) -> torch.Tensor:
        """i2v: [1, 3, height, width] float32 in [-1, 1] (cover-resize, centre crop, 8-bit rounding)."""
        x = self._as_nchw(image)
        if x.ndim != 4 or tuple(x.shape[:2]) != (1, 3):
            raise ProcessorError(f"image must be one RGB image, got shape {tuple(x.shape)}")
        as_int = not x.is_floating_point()
        x = x.to(self.device, torch.float32)
        if not as_int:
            lo, hi = x.aminmax()
            x = (x + 1.0) * 127.5 if lo < 0 else (x * 255.0 if hi <= 1.0 else x)
        src_h, src_w = x.shape[-2:]
        s = max(width / src_w, height / src_h)
        new_h, new_w = math.ceil(s * src_h), math.ceil(s * src_w)
        x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True)
        y0, x0 = round((new_h - height) / 2), round((new_w - width) / 2)
        return x[..., y0:y0 + height, x0:x0 + width].round().clamp(0, 255) / 127.5 - 1.0

    def _clip_to_unit(self, clip: Any) -> torch.Tensor:
        """[3, T, H16, W16]: the VideoProcessor view of the clip (PIL frames: bilinear to a multiple of 16)."""
        items: Sequence[Any] = clip if isinstance(clip, (list, tuple)) else (list(clip) if (
            isinstance(clip, torch.Tensor) and clip.ndim == 4) else [clip])
        if len(items) == 0:
            raise ProcessorError("action clip is empty")
        planes = []
        for it in items:
            if hasattr(it, "getbands"):
                from PIL import Image
                w, h = it.size
                it = it.resize((w // 16 * 16, h // 16 * 16), resample=Image.Resampling.BILINEAR, reducing_gap=None)
                arr = np.array(it).astype(np.float32) / 255.0
                if arr.ndim != 3 or arr.shape[2] != 3:
                    raise ProcessorError(f"action frames must be RGB, got array shape {arr.shape}")
                planes.append(torch.from_numpy(arr).permute(2, 0, 1))
            elif isinstance(it, torch.Tensor) and it.is_floating_point() and it.ndim == 3 and it.shape[0] == 3:
                h, w = it.shape[-2:]
                planes.append(F.interpolate(it.float()[None], size=(h // 16 * 16, w // 16 * 16))[0])
            else:
                raise ProcessorError("action frames must be RGB PIL images or float [3, H, W] tensors in [0, 1]")
        stack = torch.stack(planes, 0)
        if not bool((stack < 0).any()):
            stack = stack * 2.0 - 1.0
        return stack.transpose(0, 1)

    def action_canvas(self, clip: Any, tier: int, num_frames: int, dtype: torch.dtype = torch.float32) -> ActionCanvas:
        if tier not in _TIERS:
            raise ProcessorError(f"resolution_tier must be one of {sorted(_TIERS)}, got {tier!r}")
        v = self._clip_to_unit(clip).to(self.device, dtype)                      # [3, T, h, w]
        h, w = v.shape[-2:]
        ratio = float(h / w)
        ch, cw = min(_TIERS[tier], key=lambda e: abs(e[0] - ratio))[1]
        t = v.shape[1]
        idx = torch.arange(num_frames, device=v.device).clamp(max=t - 1)          # repeat the last frame
        frames = v[:, idx].transpose(0, 1)                                       # [F, 3, h, w]
        scale = min(cw / w, ch / h, 1.0)
        kh, kw = max(1, int(scale * h + 0.5)), max(1, int(scale * w + 0.5))
        if (kh, kw) != (h, w):
            frames = F.interpolate(frames, size=(kh, kw), mode="bicubic", align_corners=False, antialias=True)
        pr, pb = cw - kw, ch - kh
        if pr or pb:
            frames = F.pad(frames, (0, pr, 0, pb), mode="replicate" if (pr >= kw or pb >= kh) else "reflect")
        return ActionCanvas(frames.transpose(0, 1)[None].to(dtype), (ch, cw), (kh, kw))

    # -------------------------------------------------------------------------------- requests

    def build_request(self, prompt: str, negative_prompt: str | None = None, image: Any = None, *,
                      num_frames: int = 189, height: int = 720, width: int = 1280, steps: int = 35,
                      guidance: float = 6.0, seed: int | None = 0, fps: float = 24.0,
                      use_system_prompt: bool | None = None, add_resolution_template: bool = True,
                      add_duration_template: bool = True, action: ActionInput | None = None,
                      sound: tuple[int, int] | None = None, scheduler: UniPCConfig | None = None,
                      encode_vision: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      condition_latents: torch.Tensor | None = None,
                      pixel_dtype: torch.dtype = torch.float32) -> Cosmos3GenerateRequest:
        """See reference/cosmos3/processor.py for the semantics; `encode_vision` maps [1, 3, F, H, W] pixels to
        normalised latents [1, C, T, h, w] (the caller's VAE), or `condition_latents` are given."""
        spec, pixels, canvas = None, None, None
        if action is not None:
            if image is not None:
                raise ProcessorError("image: action runs take their frames from action.clip")
            if action.domain_name not in _EMBODIMENTS:
                raise ProcessorError(f"action.domain_name {action.domain_name!r} is not supported "
                                     f"(supported: {sorted(_EMBODIMENTS)})")
            domain, raw_dim = _EMBODIMENTS[action.domain_name]
            num_frames = action.chunk_size + 1
            canvas = self.action_canvas(action.clip, action.resolution_tier, num_frames, pixel_dtype)
            height, width = canvas.canvas_hw
            pixels = canvas.pixels
            given = None
            if action.mode == "forward_dynamics":
                r = action.raw_actions
                if r is None or r.ndim != 2 or r.shape[1] != raw_dim:
                    raise ProcessorError(f"action.raw_actions must be [n, {raw_dim}] for forward_dynamics")
                given = r[:action.chunk_size]
            spec = ActionSpec(action.mode, action.chunk_size, domain, raw_dim, given)
        if not (isinstance(height, int) and isinstance(width, int) and height > 0 and width > 0
                and height % self.sc == 0 and width % self.sc == 0):
            raise ProcessorError(f"height / width must be positive multiples of {self.sc}, got {height}x{width}")
        if not isinstance(num_frames, int) or num_frames < 1:
            raise ProcessorError(f"num_frames must be a positive int, got {num_frames!r}")
        if action is None and image is not None and num_frames > 1:
            first = self.conditioning_image(image, height, width).to(pixel_dtype)
            pixels = first[:, :, None].repeat(1, 1, num_frames, 1, 1)
        cond, uncond = self.tokenize_prompt(
            prompt, negative_prompt, num_frames=num_frames, height=height, width=width, fps=fps,
            use_system_prompt=use_system_prompt, add_resolution_template=add_resolution_template,
            add_duration_template=add_duration_template, action_mode=None if action is None else action.mode,
            action_view_point=None if action is None else action.view_point)
        lt, lh, lw = (num_frames - 1) // self.tc + 1, height // self.sc, width // self.sc
        cond_frames: tuple[int, ...] = ()
        latents = condition_latents
        if pixels is not None:
            if latents is None:
                if encode_vision is None:
                    raise ProcessorError("conditioning pixels need encode_vision (a VAE) or condition_latents")
                latents = encode_vision(pixels)
            if canvas is not None:
                lh, lw = max(canvas.content_hw[0] // self.sc, 1), max(canvas.content_hw[1] // self.sc, 1)
                latents = latents[..., :lh, :lw].contiguous()
            cond_frames = tuple(range(lt)) if spec is not None and spec.mode == "inverse_dynamics" else (0,)
        n_sound = 0
        if sound:
            rate, hop = sound
            n_sound = -(-int(num_frames / fps * rate) // hop)
        extra = {"scheduler": scheduler} if scheduler is not None else {}
        return Cosmos3GenerateRequest(
            text_ids=torch.as_tensor(cond, dtype=torch.int64), negative_text_ids=torch.as_tensor(uncond,
                                                                                             dtype=torch.int64),
            latent_frames=lt, latent_height=lh, latent_width=lw, num_steps=steps, guidance_scale=guidance, fps=fps,
            seed=seed, vision_condition_frames=cond_frames, condition_latents=latents, sound_frames=n_sound,
            action=spec, **extra)


def processor(tokenizer_dir: str | Path | None) -> Cosmos3Processor:
    """The family entry's processor factory."""
    return Cosmos3Processor(tokenizer_dir)
