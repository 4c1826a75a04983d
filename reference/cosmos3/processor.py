"""Readable cosmos3 processor: prompt -> token ids, conditioning images -> pixels, all -> `Cosmos3GenerateRequest`.

Reproduces diffusers 0.42.1 `Cosmos3OmniPipeline` up to (not including) the VAE and the transformer:

    prompt     `tokenize_prompt`: resolution / duration sentences appended (inverse ones to the negative prompt),
               or, in action mode, the structured JSON caption of `_build_action_json_prompt`; then the checkpoint's
               chat template (system prompt + user turn + generation prompt), tokenised, then [eos, <|vision_start|>]
    i2v image  `_preprocess_conditioning_image`: cover-resize (bilinear, antialias) + centre crop, rounded to 8 bits
    action     `_prepare_action_video_conditioning`: the VideoProcessor's resize to a multiple of 16, the tier's canvas
               (closest aspect), downscale only (bicubic, antialias), pad right / bottom (reflect or replicate)
    sound      T_sound = ceil(int(num_frames / fps * sampling_rate) / hop)

Tokenisation reads the checkpoint's tokenizer files with the `tokenizers` library (tokenizer.json) and renders the
chat template with jinja2 the way transformers' `apply_chat_template` does; transformers is never imported.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from manifests.cosmos3.sampling import ActionSpec, Cosmos3GenerateRequest, UniPCConfig

SYSTEM_PROMPT_IMAGE = "You are a helpful assistant who will generate images from a give prompt."  # "give" (upstream)
SYSTEM_PROMPT_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."

DURATION = "The video is {duration:.1f} seconds long and is of {fps:.0f} FPS."
IMAGE_RESOLUTION = "This image is of {height}x{width} resolution."
VIDEO_RESOLUTION = "This video is of {height}x{width} resolution."
NOT_DURATION = "The video is not {duration:.1f} seconds long and is not of {fps:.0f} FPS."
NOT_IMAGE_RESOLUTION = "This image is not of {height}x{width} resolution."
NOT_VIDEO_RESOLUTION = "This video is not of {height}x{width} resolution."

# action conditioning canvases: tier -> {height / width ratio (as upstream's string keys): (height, width)}
ACTION_CANVASES = {
    256: {"1.0": (256, 256), "0.8": (256, 320), "1.25": (320, 256), "0.6": (192, 320),
          "1.6666666666666667": (320, 192)},
    480: {"1.0": (640, 640), "0.7391304347826086": (544, 736), "1.3529411764705883": (736, 544),
          "0.5769230769230769": (480, 832), "1.7333333333333334": (832, 480)},
    704: {"1.0": (960, 960), "0.7647058823529411": (832, 1088), "1.3076923076923077": (1088, 832),
          "0.55": (704, 1280), "1.8181818181818181": (1280, 704)},
    720: {"1.0": (960, 960), "0.7536231884057971": (832, 1104), "1.3269230769230769": (1104, 832),
          "0.5625": (720, 1280), "1.7777777777777777": (1280, 720)},
}
VIEWPOINT_FRAMING = {
    "ego_view": "This video is captured from a first-person perspective looking at the scene.",
    "third_person_view": "This video is captured from a third-person perspective looking towards the agent from the front.",
    "wrist_view": "This video is captured from a wrist-mounted camera.",
    "concat_view": "This video contains concatenated views from multiple camera perspectives.",
}
DOMAIN_IDS = {"no_action": 0, "av": 1, "camera_pose": 2, "hand_pose": 3, "pusht": 4, "libero": 5, "umi": 6,
              "bridge_orig_lerobot": 7, "droid_lerobot": 8, "robomind-franka": 8, "galbot": 9,
              "robomind-franka-dual": 12, "robomind-ur": 13, "agibotworld": 15, "agibot_gear_gripper": 15,
              "agibot_gear_gripper_ext": 15, "fractal": 20}
RAW_ACTION_DIMS = {"av": 9, "camera_pose": 9, "pusht": 2, "umi": 10, "bridge_orig_lerobot": 10, "droid_lerobot": 10,
                   "robomind-franka": 10, "robomind-franka-dual": 20, "robomind-ur": 10, "galbot": 30,
                   "agibotworld": 29, "agibot_gear_gripper": 29, "agibot_gear_gripper_ext": 29, "fractal": 10,
                   "hand_pose": 57}
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ProcessorError(ValueError):
    """Input a processor cannot turn into a request; the message names the argument."""


# ------------------------------------------------------------------------------------------------
# tokenizer files
# ------------------------------------------------------------------------------------------------

def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken serialised as {"content": ...}
        return value.get("content")
    return value


@dataclass
class TokenizerFiles:
    """What a checkpoint's tokenizer folder says: the `tokenizers` pipeline, named special tokens, chat template."""
    tokenizer: Any                      # tokenizers.Tokenizer
    special_tokens: dict[str, str]      # bos_token / eos_token / ... -> token text (the chat template sees them)
    chat_template: str | None

    @classmethod
    def load(cls, directory: str | Path) -> "TokenizerFiles":
        from tokenizers import Tokenizer  # the optional `text` extra

        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise ProcessorError(f"tokenizer_dir {d}: no tokenizer.json")
        config = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
        special_map = json.loads((d / "special_tokens_map.json").read_text()) \
            if (d / "special_tokens_map.json").is_file() else {}
        special = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_content(config.get(name, special_map.get(name)))
            if text is not None:
                special[name] = text
        # chat_template.jinja takes priority over tokenizer_config's entry, as transformers loads them
        template = None
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        elif "chat_template" in config:
            template = config["chat_template"]
            if isinstance(template, list):  # named templates: the "default" one
                template = {t["name"]: t["template"] for t in template}.get("default")
        return cls(Tokenizer.from_file(str(d / "tokenizer.json")), special, template)

    def token_id(self, text: str) -> int:
        i = self.tokenizer.token_to_id(text)
        if i is None:
            raise ProcessorError(f"the tokenizer has no token {text!r}")
        return i


def render_chat(template: str, messages: list[dict], special_tokens: dict[str, str], **variables) -> str:
    """A chat template rendered as transformers' `apply_chat_template` does (sandboxed jinja2, trim_blocks +
    lstrip_blocks, loop controls, its `tojson` / `raise_exception` / `strftime_now` helpers)."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, tools=None, documents=None,
                                            **{**special_tokens, **variables})


# ------------------------------------------------------------------------------------------------
# prompts
# ------------------------------------------------------------------------------------------------

def _append_sentence(base: str, sentence: str) -> str:
    base = base.rstrip(".")  # every trailing period goes (upstream)
    return f"{base}. {sentence}" if base else sentence


def templated_prompt(text: str, *, negative: bool, num_frames: int, height: int, width: int, fps: float,
                     add_resolution: bool = True, add_duration: bool = True) -> str:
    """The prompt with the duration sentence (videos only) and the resolution sentence appended."""
    is_image = num_frames == 1
    if not is_image and add_duration:
        text = _append_sentence(text, (NOT_DURATION if negative else DURATION).format(duration=num_frames / fps, fps=fps))
    if add_resolution:
        if is_image:
            template = NOT_IMAGE_RESOLUTION if negative else IMAGE_RESOLUTION
        else:
            template = NOT_VIDEO_RESOLUTION if negative else VIDEO_RESOLUTION
        text = _append_sentence(text, template.format(height=height, width=width))
    return text


def action_json_prompt(description: str, *, view_point: str | None, num_frames: int, fps: float, height: int,
                       width: int) -> str:
    """The structured caption action checkpoints were trained on, as a JSON string."""
    seconds = num_frames / fps if fps > 0 else 0.0
    finite = seconds >= 0 and math.isfinite(seconds)
    whole_seconds = int(seconds) if finite else 0          # "duration" truncates ...
    end = round(seconds) if finite else 0                   # ... the action's end time rounds (upstream)
    minutes, secs = divmod(end, 60)
    desc = description.strip()
    if desc and not desc.endswith((".", "!", "?")):
        desc += "."
    caption: dict[str, Any] = {}
    framing = VIEWPOINT_FRAMING.get(view_point) if view_point is not None else None
    if framing:  # an unknown viewpoint drops the field (upstream logs a warning)
        caption["cinematography"] = {"framing": framing}
    ratio = width / height if height > 0 else 1.0
    aspect = min(("1,1", "4,3", "3,4", "16,9", "9,16"),
                 key=lambda r: abs(int(r.split(",")[0]) / int(r.split(",")[1]) - ratio))
    caption["actions"] = [{"time": f"0:00-{minutes}:{secs:02d}", "description": desc}]
    caption["duration"] = f"{whole_seconds}s"
    caption["fps"] = float(fps)
    caption["resolution"] = {"H": int(height), "W": int(width)}
    caption["aspect_ratio"] = aspect
    return json.dumps(caption)


# ------------------------------------------------------------------------------------------------
# images
# ------------------------------------------------------------------------------------------------

def _is_pil(image: Any) -> bool:
    return hasattr(image, "convert") and hasattr(image, "getbands")


def conditioning_image(image: Any, height: int, width: int) -> torch.Tensor:
    """One i2v conditioning image -> [1, 3, height, width] float32 in [-1, 1].

    Accepts a PIL image, an HWC numpy array, or a [3, H, W] / [1, 3, H, W] tensor. Integer inputs are 0..255;
    float inputs are read as [-1, 1] if any value is negative, else [0, 1] if the maximum is <= 1, else 0..255.
    """
    if _is_pil(image):
        x = torch.from_numpy(np.array(image.convert("RGB"), copy=True)).permute(2, 0, 1).unsqueeze(0)
    elif isinstance(image, np.ndarray):
        x = torch.from_numpy(image)
        x = x.unsqueeze(0) if x.ndim == 3 else x
        x = x.permute(0, 3, 1, 2)
    elif isinstance(image, torch.Tensor):
        x = image.unsqueeze(0) if image.ndim == 3 else image
    else:
        raise ProcessorError(f"image must be a PIL image, a numpy array or a tensor, got {type(image).__name__}")
    if x.ndim != 4 or x.shape[0] != 1 or x.shape[1] != 3:
        raise ProcessorError(f"image must be one RGB image, got shape {tuple(x.shape)}")
    integer = not x.is_floating_point()
    x = x.to(torch.float32)
    if not integer:
        if x.min() < 0:
            x = (x + 1.0) * 127.5
        elif x.max() <= 1.0:
            x = x * 255.0
    h, w = x.shape[-2:]
    scale = max(width / w, height / h)  # cover the target, then crop the middle
    rh, rw = math.ceil(scale * h), math.ceil(scale * w)
    x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False, antialias=True)
    top, left = round((rh - height) / 2), round((rw - width) / 2)  # Python's round: halves to even (upstream)
    x = x[:, :, top:top + height, left:left + width]
    return x.round().clamp(0, 255) / 127.5 - 1.0


def _frame_to_unit_tensor(frame: Any) -> torch.Tensor:
    """One frame as diffusers' VaeImageProcessor reads it: [C, H, W] float32 in [0, 1] (PIL: 8-bit / 255)."""
    if _is_pil(frame):
        return torch.from_numpy(np.array(frame).astype(np.float32) / 255.0).permute(2, 0, 1)
    if isinstance(frame, torch.Tensor) and frame.ndim == 3 and frame.is_floating_point():
        return frame.to(torch.float32)
    raise ProcessorError("action frames must be PIL images or float [3, H, W] tensors in [0, 1]")


def action_frames_unit(clip: Any) -> torch.Tensor:
    """The action conditioning clip as VideoProcessor.preprocess_video(clip) gives it: [1, 3, T, H16, W16] in
    [-1, 1], each frame resized to its size rounded down to a multiple of 16 (PIL: bilinear; tensors: nearest)."""
    frames = list(clip) if isinstance(clip, (list, tuple)) else [clip]
    if isinstance(clip, torch.Tensor) and clip.ndim == 4:
        frames = list(clip)
    if not frames:
        raise ProcessorError("the action clip has no frame")
    out = []
    for frame in frames:
        if _is_pil(frame):
            w, h = frame.size
            h16, w16 = h - h % 16, w - w % 16
            from PIL import Image
            frame = frame.resize((w16, h16), resample=Image.Resampling.BILINEAR, reducing_gap=None)
            x = _frame_to_unit_tensor(frame)
        else:
            x = _frame_to_unit_tensor(frame)
            h, w = x.shape[-2:]
            x = F.interpolate(x[None], size=(h - h % 16, w - w % 16))[0]  # default mode: nearest (upstream)
        if x.shape[0] != 3:
            raise ProcessorError(f"action frames must have 3 channels, got {x.shape[0]}")
        out.append(x)
    video = torch.stack(out, dim=0)                     # [T, 3, H, W] in [0, 1]
    if video.min() >= 0:                                # [-1, 1] inputs are left alone (upstream)
        video = 2.0 * video - 1.0
    return video.permute(1, 0, 2, 3).unsqueeze(0)


def action_canvas(source_height: int, source_width: int, tier: int) -> tuple[int, int]:
    """The tier's canvas whose height / width ratio is closest to the source's."""
    if tier not in ACTION_CANVASES:
        raise ProcessorError(f"resolution_tier must be one of {sorted(ACTION_CANVASES)}, got {tier!r}")
    ratio = float(source_height / source_width)
    bins = ACTION_CANVASES[tier]
    return bins[min(bins, key=lambda k: abs(float(k) - ratio))]


@dataclass(frozen=True)
class ActionPixels:
    frames: torch.Tensor        # [1, 3, num_frames, canvas_h, canvas_w]
    canvas: tuple[int, int]     # (height, width) of the canvas: the resolution the prompt names
    content: tuple[int, int]    # (height, width) of the image inside the canvas (the rest is padding)


def action_conditioning(clip: Any, tier: int, num_frames: int, dtype: torch.dtype = torch.float32) -> ActionPixels:
    """`_prepare_action_video_conditioning`: the clip fitted (downscale only) into the tier's canvas, padded."""
    frames = action_frames_unit(clip).to(dtype)  # upstream casts to the transformer dtype before resizing
    canvas_h, canvas_w = action_canvas(frames.shape[-2], frames.shape[-1], tier)
    if frames.shape[2] < num_frames:  # repeat the last frame
        frames = torch.cat([frames, frames[:, :, -1:].expand(-1, -1, num_frames - frames.shape[2], -1, -1)], dim=2)
    frames = frames[:, :, :num_frames]
    h, w = frames.shape[-2:]
    scale = min(canvas_w / w, canvas_h / h, 1.0)
    content_h, content_w = max(1, int(scale * h + 0.5)), max(1, int(scale * w + 0.5))
    x = frames[0].permute(1, 0, 2, 3)               # [T, 3, h, w]
    if (content_h, content_w) != (h, w):
        x = F.interpolate(x, size=(content_h, content_w), mode="bicubic", align_corners=False, antialias=True)
    pad_right, pad_bottom = canvas_w - content_w, canvas_h - content_h
    if pad_right or pad_bottom:
        # reflect needs a pad smaller than the content (upstream's choice of mode)
        mode = "replicate" if pad_right >= content_w or pad_bottom >= content_h else "reflect"
        x = F.pad(x, (0, pad_right, 0, pad_bottom), mode=mode)
    return ActionPixels(x.permute(1, 0, 2, 3).unsqueeze(0).to(dtype), (canvas_h, canvas_w), (content_h, content_w))


# ------------------------------------------------------------------------------------------------
# the processor
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ActionInput:
    """What `CosmosActionCondition` carries: mode, chunk (the clip has chunk_size + 1 frames), embodiment, tier."""
    mode: str                               # policy | forward_dynamics | inverse_dynamics
    chunk_size: int
    domain_name: str
    clip: Any                               # one PIL image / [3, H, W] tensor, or a list of frames
    resolution_tier: int = 480
    raw_actions: torch.Tensor | None = None
    view_point: str | None = "ego_view"


class Cosmos3Processor:
    """prompt (+ image / action clip) -> Cosmos3GenerateRequest, exactly as Cosmos3OmniPipeline prepares them."""

    def __init__(self, tokenizer_dir: str | Path | None, use_system_prompt: bool = True,
                 spatial_compression: int = 16, temporal_compression: int = 4):
        self.files = TokenizerFiles.load(tokenizer_dir) if tokenizer_dir is not None else None
        self.use_system_prompt = use_system_prompt   # the pipeline's `default_use_system_prompt`
        self.spatial_compression = spatial_compression
        self.temporal_compression = temporal_compression

    def _chat_ids(self, text: str, is_image: bool, use_system_prompt: bool) -> list[int]:
        files = self.files
        if files is None:
            raise ProcessorError("this processor has no tokenizer (tokenizer_dir was None)")
        if not files.chat_template:
            raise ProcessorError("the tokenizer has no chat template")
        if "eos_token" not in files.special_tokens:
            raise ProcessorError("the tokenizer config names no eos_token")
        messages = []
        if use_system_prompt:
            messages.append({"role": "system", "content": SYSTEM_PROMPT_IMAGE if is_image else SYSTEM_PROMPT_VIDEO})
        messages.append({"role": "user", "content": text})
        rendered = render_chat(files.chat_template, messages, files.special_tokens,
                               add_generation_prompt=True, add_vision_id=False)
        ids = files.tokenizer.encode(rendered, add_special_tokens=False).ids  # the template wrote them already
        return list(ids) + [files.token_id(files.special_tokens["eos_token"]), files.token_id("<|vision_start|>")]

    def tokenize_prompt(self, prompt: str, negative_prompt: str | None = None, *, num_frames: int, height: int,
                        width: int, fps: float = 24.0, use_system_prompt: bool | None = None,
                        add_resolution_template: bool = True, add_duration_template: bool = True,
                        action_mode: str | None = None, action_view_point: str | None = None,
                        ) -> tuple[list[int], list[int]]:
        """(cond ids, uncond ids) as `Cosmos3OmniPipeline.tokenize_prompt`."""
        if not isinstance(prompt, str):
            raise ProcessorError(f"prompt must be a str, got {type(prompt).__name__}")
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            raise ProcessorError(f"negative_prompt must be a str or None, got {type(negative_prompt).__name__}")
        system = self.use_system_prompt if use_system_prompt is None else use_system_prompt
        negative = "" if negative_prompt is None else negative_prompt
        if action_mode is not None:
            cond = action_json_prompt(prompt, view_point=action_view_point, num_frames=num_frames, fps=fps,
                                      height=height, width=width)
            uncond = negative  # not templated in action mode (upstream)
        else:
            kw = dict(num_frames=num_frames, height=height, width=width, fps=fps,
                      add_resolution=add_resolution_template, add_duration=add_duration_template)
            cond = templated_prompt(prompt, negative=False, **kw)
            uncond = templated_prompt(negative, negative=True, **kw)
        is_image = num_frames == 1
        return self._chat_ids(cond, is_image, system), self._chat_ids(uncond, is_image, system)

    def sound_frames(self, num_frames: int, fps: float, sampling_rate: int, hop_size: int) -> int:
        samples = int(num_frames / fps * sampling_rate)
        return (samples + hop_size - 1) // hop_size

    def build_request(self, prompt: str, negative_prompt: str | None = None, image: Any = None, *,
                      num_frames: int = 189, height: int = 720, width: int = 1280, steps: int = 35,
                      guidance: float = 6.0, seed: int | None = 0, fps: float = 24.0,
                      use_system_prompt: bool | None = None, add_resolution_template: bool = True,
                      add_duration_template: bool = True, action: ActionInput | None = None,
                      sound: tuple[int, int] | None = None, scheduler: UniPCConfig | None = None,
                      encode_vision: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      condition_latents: torch.Tensor | None = None,
                      pixel_dtype: torch.dtype = torch.float32) -> Cosmos3GenerateRequest:
        """One request. Conditioning pixels (i2v image, action clip) become latents through `encode_vision`
        (pixels [1, 3, F, H, W] in [-1, 1] -> normalised VAE latents [1, C, T, h, w]: the caller's VAE), or give
        `condition_latents` directly. `sound` = (sampling_rate, hop_size) of the sound tokenizer turns sound on."""
        sc, tc = self.spatial_compression, self.temporal_compression
        spec = None
        if action is not None:
            if image is not None:
                raise ProcessorError("image: pass the action's conditioning frames as action.clip, not image")
            if action.domain_name not in RAW_ACTION_DIMS:
                raise ProcessorError(f"action.domain_name {action.domain_name!r} has no action width; "
                                     f"supported: {sorted(RAW_ACTION_DIMS)}")
            num_frames = action.chunk_size + 1
            pixels = action_conditioning(action.clip, action.resolution_tier, num_frames, pixel_dtype)
            height, width = pixels.canvas  # the prompt names the canvas (upstream)
            video = pixels.frames
            raw = action.raw_actions
            if action.mode == "forward_dynamics":
                if raw is None or raw.ndim != 2 or raw.shape[1] != RAW_ACTION_DIMS[action.domain_name]:
                    raise ProcessorError("action.raw_actions must be [n, raw_action_dim] for forward_dynamics")
                raw = raw[:action.chunk_size]
            spec = ActionSpec(action.mode, action.chunk_size, DOMAIN_IDS[action.domain_name],
                              RAW_ACTION_DIMS[action.domain_name], raw if action.mode == "forward_dynamics" else None)
        elif image is not None and num_frames > 1:  # with num_frames == 1 the image is ignored (upstream)
            frame = conditioning_image(image, height, width).to(pixel_dtype)
            video = frame.unsqueeze(2).expand(-1, -1, num_frames, -1, -1).contiguous()  # repeated (upstream)
        else:
            video = None
        for name, v in (("height", height), ("width", width)):
            if not isinstance(v, int) or v <= 0 or v % sc:
                raise ProcessorError(f"{name} must be a positive multiple of {sc}, got {v!r}")
        if not isinstance(num_frames, int) or num_frames < 1:
            raise ProcessorError(f"num_frames must be a positive int, got {num_frames!r}")
        cond, uncond = self.tokenize_prompt(
            prompt, negative_prompt, num_frames=num_frames, height=height, width=width, fps=fps,
            use_system_prompt=use_system_prompt, add_resolution_template=add_resolution_template,
            add_duration_template=add_duration_template, action_mode=action.mode if action else None,
            action_view_point=action.view_point if action else None)
        T, h, w = (num_frames - 1) // tc + 1, height // sc, width // sc
        frames: tuple[int, ...] = ()
        if video is not None:
            if condition_latents is None:
                if encode_vision is None:
                    raise ProcessorError("conditioning pixels need encode_vision (a VAE) or condition_latents")
                condition_latents = encode_vision(video)
            if spec is not None:  # latents of the padding are cut off (upstream)
                content_h, content_w = action_conditioning_content(pixels, sc)
                condition_latents = condition_latents[:, :, :, :content_h, :content_w].contiguous()
                h, w = content_h, content_w
            frames = tuple(range(T)) if spec is not None and spec.mode == "inverse_dynamics" else (0,)
        kw = {} if scheduler is None else {"scheduler": scheduler}
        return Cosmos3GenerateRequest(
            text_ids=torch.tensor(cond, dtype=torch.int64), negative_text_ids=torch.tensor(uncond, dtype=torch.int64),
            latent_frames=T, latent_height=h, latent_width=w, num_steps=steps, guidance_scale=guidance, fps=fps,
            seed=seed, vision_condition_frames=frames, condition_latents=condition_latents,
            sound_frames=self.sound_frames(num_frames, fps, *sound) if sound else 0, action=spec, **kw)


def action_conditioning_content(pixels: ActionPixels, spatial_compression: int) -> tuple[int, int]:
    """Latent size of the content inside the canvas (at least 1 x 1)."""
    return (max(pixels.content[0] // spatial_compression, 1), max(pixels.content[1] // spatial_compression, 1))


def processor(tokenizer_dir: str | Path | None) -> Cosmos3Processor:
    return Cosmos3Processor(tokenizer_dir)
