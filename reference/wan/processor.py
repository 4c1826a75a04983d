"""Readable Wan processor: prompt -> UMT5 token ids, image -> VAE pixels + CLIP pixels, all -> `WanGenerateRequest`.

Reproduces diffusers 0.42.1 `WanPipeline` / `WanImageToVideoPipeline` up to (not including) the models:

    prompt     `prompt_clean` = whitespace_clean(basic_clean(text)): ftfy.fix_text (see below), html.unescape
               twice, strip; then every whitespace run becomes one space, strip
    tokens     the tokenizer with padding="max_length", truncation=True, max_length=max_sequence_length and the
               special tokens (UMT5: "</s>" appended); the request takes the ids where the attention mask is 1
               (the text encoder pads them again with 0 and trims its output to their length)
    negative   encoded only when CFG runs (guidance > 1), `negative_prompt or ""`
    image      `VideoProcessor.preprocess(image, height, width)`: PIL -> resize to (width, height) with LANCZOS,
               / 255, 2x - 1; float tensors in [0, 1] -> nearest resize, 2x - 1; tensors with negative values are
               taken as [-1, 1] and only resized
    CLIP       `CLIPImageProcessor` (transformers' PIL backend, what it falls back to without torchvision):
               RGB, shortest edge -> 224 (BICUBIC, PIL), centre crop 224, x / 255 (float64 then float32),
               (x - mean) / std in float32; the CLIP vision model itself is not here: `build_request` takes
               `image_embeds`, or `image_encoder` (e.g. `WanReferencePipeline.encode_image`), which it runs on
               the ORIGINAL image (upstream encode_image runs before the VAE's resize to height x width)

ftfy: upstream calls `ftfy.fix_text` unconditionally (and fails with NameError when ftfy is not installed). Here
ftfy is used when it is installed (exactly upstream); without it `fix_text` is the identity, so prompts ftfy would
change (mojibake, curly quotes, ligatures, full-width characters, terminal escapes) tokenise differently.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from manifests.wan.sampling import WanGenerateRequest

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)   # OPENAI_CLIP_MEAN
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)   # OPENAI_CLIP_STD


class ProcessorError(ValueError):
    """Input a processor cannot turn into a request; the message names the argument."""


def fix_text(text: str) -> str:
    try:
        import ftfy
    except ImportError:
        return text  # deviation: upstream needs ftfy installed (see the module docstring)
    return ftfy.fix_text(text)


def prompt_clean(text: str) -> str:
    text = html.unescape(html.unescape(fix_text(text))).strip()   # basic_clean
    return re.sub(r"\s+", " ", text).strip()                     # whitespace_clean (upstream uses `regex`; same here)


@dataclass
class Tokens:
    ids: torch.Tensor          # int64 [L]: the real tokens (the request's text_ids)
    padded: torch.Tensor       # int64 [max_sequence_length]: ids then the pad id
    mask: torch.Tensor         # int64 [max_sequence_length]: 1 on the real tokens


class UMT5Tokenizer:
    """tokenizer.json through the `tokenizers` library, padded / truncated as the pipeline asks transformers to."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer  # the optional `text` extra

        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise ProcessorError(f"tokenizer_dir {d}: no tokenizer.json")
        config = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
        pad = config.get("pad_token", "<pad>")
        pad = pad.get("content") if isinstance(pad, dict) else pad
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.pad_id = self.tokenizer.token_to_id(pad)
        if self.pad_id is None:
            raise ProcessorError(f"the tokenizer has no pad token {pad!r}")

    def __call__(self, text: str, max_length: int) -> Tokens:
        self.tokenizer.enable_truncation(max_length)   # keeps room for the appended "</s>", as transformers does
        ids = self.tokenizer.encode(text, add_special_tokens=True).ids
        n = len(ids)
        padded = ids + [self.pad_id] * (max_length - n)
        mask = [1] * n + [0] * (max_length - n)
        return Tokens(torch.tensor(ids, dtype=torch.int64), torch.tensor(padded, dtype=torch.int64),
                      torch.tensor(mask, dtype=torch.int64))


def _is_pil(image: Any) -> bool:
    return hasattr(image, "convert") and hasattr(image, "getbands")


def vae_pixels(image: Any, height: int, width: int) -> torch.Tensor:
    """`VideoProcessor.preprocess(image, height, width)` (the Wan VAE's input): [1, 3, height, width] float32."""
    if _is_pil(image):
        from PIL import Image
        image = image.resize((width, height), resample=Image.Resampling.LANCZOS, reducing_gap=None)
        array = np.array(image).astype(np.float32) / 255.0
        if array.ndim != 3 or array.shape[2] != 3:
            raise ProcessorError(f"image must be an RGB image, got an array of shape {array.shape}")
        x = torch.from_numpy(array.transpose(2, 0, 1))[None]
    elif isinstance(image, np.ndarray) and image.dtype.kind == "f":
        x = torch.from_numpy(image[None] if image.ndim == 3 else image).permute(0, 3, 1, 2)  # HWC in [0, 1]
        x = F.interpolate(x, size=(height, width))           # nearest (upstream default)
    elif isinstance(image, torch.Tensor) and image.is_floating_point():
        x = image[None] if image.ndim == 3 else image        # CHW, [0, 1] (or [-1, 1])
        x = F.interpolate(x, size=(height, width))
    else:
        raise ProcessorError("image must be a PIL image, a float numpy HWC array or a float [3, H, W] tensor")
    if x.ndim != 4 or x.shape[0] != 1 or x.shape[1] != 3:
        raise ProcessorError(f"image must be one RGB image, got shape {tuple(x.shape)}")
    if x.min() < 0:
        return x  # taken as already in [-1, 1]: no normalisation (upstream, with a FutureWarning)
    return 2.0 * x - 1.0


def clip_pixels(image: Any, size: int = 224, crop: int = 224, mean=CLIP_MEAN, std=CLIP_STD) -> torch.Tensor:
    """CLIPImageProcessor (PIL backend) pixel_values: [1, 3, crop, crop] float32."""
    from PIL import Image

    if _is_pil(image):
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            raise ProcessorError("image has an alpha channel; give an RGB image")
        image = image.convert("RGB")
    elif isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3:
        image = Image.fromarray(image)
    else:
        raise ProcessorError("the CLIP image must be a PIL image or a uint8 HWC RGB array")
    w, h = image.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    image = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC, reducing_gap=None)
    x = np.array(image).transpose(2, 0, 1)                        # [3, H, W] uint8
    top, left = (new_h - crop) // 2, (new_w - crop) // 2          # (inputs are at least crop x crop after resize)
    x = x[:, top:top + crop, left:left + crop]
    x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)     # rescale: float64 then float32 (upstream)
    m, s = np.array(mean, dtype=np.float32), np.array(std, dtype=np.float32)
    x = ((x.T - m) / s).T
    return torch.from_numpy(np.ascontiguousarray(x))[None]


def clip_source(image: Any, signed: bool | None = None) -> Any:
    """What the CLIP preprocessing is given: a PIL image or uint8 HWC array as is; a float [3, H, W] tensor (or float
    HWC array) is taken as an 8-bit image and rounded back to uint8 (fvgen / the server decode uploads to
    u / 127.5 - 1), read as [-1, 1] when `signed` (None: when it has a negative value, else [0, 1])."""
    if _is_pil(image) or (isinstance(image, np.ndarray) and image.dtype == np.uint8):
        return image
    if isinstance(image, np.ndarray) and image.dtype.kind == "f" and image.ndim == 3:
        x = torch.from_numpy(image).permute(2, 0, 1)
    elif isinstance(image, torch.Tensor) and image.is_floating_point():
        x = image[0] if image.ndim == 4 and image.shape[0] == 1 else image
    else:
        raise ProcessorError("image must be a PIL image, a uint8 HWC array or one float [3, H, W] RGB image")
    if x.ndim != 3 or x.shape[0] != 3:
        raise ProcessorError(f"image must be one RGB image, got shape {tuple(x.shape)}")
    x = x.double()
    if (x.min() < 0) if signed is None else signed:
        x = (x + 1) / 2
    return (x * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


class WanProcessor:
    """prompt (+ image) -> WanGenerateRequest, exactly as WanPipeline / WanImageToVideoPipeline prepare them."""

    def __init__(self, tokenizer_dir: str | Path | None, max_sequence_length: int = 512):
        self.tokenizer = UMT5Tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
        self.max_sequence_length = max_sequence_length

    def tokenize(self, prompt: str, max_sequence_length: int | None = None) -> Tokens:
        if not isinstance(prompt, str):
            raise ProcessorError(f"prompt must be a str, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ProcessorError("this processor has no tokenizer (tokenizer_dir was None)")
        return self.tokenizer(prompt_clean(prompt), max_sequence_length or self.max_sequence_length)

    def build_request(self, prompt: str, negative_prompt: str | None = None, image: Any = None, *,
                      num_frames: int = 81, height: int = 480, width: int = 832, steps: int = 50,
                      guidance: float = 5.0, guidance_2: float | None = None, seed: int | None = 0,
                      solver: str | None = None, flow_shift: float | None = None, image_embeds: Any = None,
                      max_sequence_length: int | None = None, image_encoder: Any = None) -> WanGenerateRequest:
        """`image_embeds`: CLIP vision penultimate hidden states [N, image_dim] for Wan2.1 I2V; without them and
        with `image_encoder` (image -> [N, image_dim], e.g. WanReferencePipeline.encode_image), the encoder's
        embeddings of the original image."""
        if image is not None and image_embeds is None and image_encoder is not None:
            image_embeds = image_encoder(clip_source(image))
        n = max_sequence_length or self.max_sequence_length
        text = self.tokenize(prompt, n).ids
        negative = self.tokenize(negative_prompt or "", n).ids if guidance > 1.0 else None  # only with CFG (upstream)
        pixels = vae_pixels(image, height, width)[0] if image is not None else None
        if image_embeds is not None and image_embeds.ndim == 3:
            image_embeds = image_embeds[0]
        return WanGenerateRequest(text_ids=text, num_frames=num_frames, height=height, width=width, num_steps=steps,
                                  guidance_scale=guidance, guidance_scale_2=guidance_2, negative_text_ids=negative,
                                  seed=seed, solver=solver, flow_shift=flow_shift, image=pixels,
                                  image_embeds=image_embeds)


def processor(tokenizer_dir: str | Path | None) -> WanProcessor:
    return WanProcessor(tokenizer_dir)
