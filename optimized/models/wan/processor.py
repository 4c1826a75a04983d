"""Wan processor on the serving path: prompts -> UMT5 ids (batched, memoised), images -> VAE / CLIP pixels, ->
`WanGenerateRequest`. Contract: diffusers 0.42.1 WanPipeline / WanImageToVideoPipeline text and image preparation
(golden/README.md, probe `wan.processor`). Runtime needs `tokenizers` (the `text` extra) and Pillow; never
transformers. ftfy: used when installed (exact); otherwise no text fixing (upstream would fail without it).
CLIP: the pixels of transformers' PIL-backend CLIPImageProcessor. A model with an image encoder (2.1 I2V) computes
`image_embeds` from the ORIGINAL image (before the VAE's resize to height x width), as WanImageToVideoPipeline
.encode_image does: `build_request(..., encode_image=instance.encode_image)` (the family entry's processor_options
pass the loaded model's); explicit `image_embeds` still win.
"""

from __future__ import annotations

import html
import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from manifests.wan.sampling import WanGenerateRequest

_WS = re.compile(r"\s+")
_CLIP_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073], dtype=torch.float32).view(3, 1, 1)
_CLIP_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711], dtype=torch.float32).view(3, 1, 1)


class ProcessorError(ValueError):
    """A prompt / image the processor refuses; names the offending argument."""


def _ftfy():
    try:
        import ftfy
        return ftfy.fix_text
    except ImportError:
        return None


_FIX_TEXT = _ftfy()


def clean(text: str) -> str:
    """WanPipeline's prompt_clean."""
    if _FIX_TEXT is not None:
        text = _FIX_TEXT(text)
    text = html.unescape(html.unescape(text)).strip()
    return _WS.sub(" ", text).strip()


class WanProcessor:
    def __init__(self, tokenizer_dir: str | Path | None, *, max_sequence_length: int = 512, cache_size: int = 512):
        self.max_sequence_length = max_sequence_length
        self._backend = None
        self._cache: OrderedDict[tuple[str, int], tuple[int, ...]] = OrderedDict()
        self._cache_size = cache_size
        if tokenizer_dir is not None:
            from tokenizers import Tokenizer

            root = Path(tokenizer_dir)
            try:
                self._backend = Tokenizer.from_file(str(root / "tokenizer.json"))
            except Exception as e:
                raise ProcessorError(f"tokenizer_dir {root}: cannot read tokenizer.json ({e})") from None
            conf_file = root / "tokenizer_config.json"
            conf = json.loads(conf_file.read_text()) if conf_file.is_file() else {}
            pad = conf.get("pad_token", "<pad>")
            self.pad_token = pad["content"] if isinstance(pad, dict) else pad
            if self._backend.token_to_id(self.pad_token) is None:
                raise ProcessorError(f"tokenizer has no pad token {self.pad_token!r}")

    # ------------------------------------------------------------------ text

    def encode(self, prompts: Sequence[str], max_sequence_length: int | None = None) -> list[torch.Tensor]:
        """Real token ids per prompt (cleaned, "</s>" appended, truncated to max_sequence_length)."""
        if self._backend is None:
            raise ProcessorError("no tokenizer loaded (tokenizer_dir=None)")
        n = max_sequence_length or self.max_sequence_length
        for p in prompts:
            if not isinstance(p, str):
                raise ProcessorError(f"prompt must be a str, got {type(p).__name__}")
        keys = [(clean(p), n) for p in prompts]
        todo = sorted({k[0] for k in keys if k not in self._cache})
        if todo:
            self._backend.enable_truncation(max_length=n)
            for text, enc in zip(todo, self._backend.encode_batch(todo, add_special_tokens=True)):
                self._cache[(text, n)] = tuple(enc.ids)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return [torch.tensor(self._cache[k], dtype=torch.int64) for k in keys]

    def padded(self, prompt: str, max_sequence_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) [max_sequence_length] as the pipeline hands them to UMT5."""
        n = max_sequence_length or self.max_sequence_length
        ids = self.encode([prompt], n)[0]
        pad_id = self._backend.token_to_id(self.pad_token)
        out = torch.full((n,), pad_id, dtype=torch.int64)
        out[:ids.numel()] = ids
        return out, (torch.arange(n) < ids.numel()).to(torch.int64)

    # ------------------------------------------------------------------ pixels

    @staticmethod
    def vae_image(image: Any, height: int, width: int) -> torch.Tensor:
        """[1, 3, height, width] float32: the VideoProcessor's preprocess of the conditioning image."""
        if hasattr(image, "getbands"):
            from PIL import Image
            arr = np.asarray(image.resize((width, height), Image.Resampling.LANCZOS), dtype=np.uint8)
            if arr.ndim != 3 or arr.shape[-1] != 3:
                raise ProcessorError(f"image must be RGB, got an array of shape {arr.shape}")
            t = torch.from_numpy(arr.astype(np.float32) / 255.0).permute(2, 0, 1).unsqueeze(0)
        else:
            if isinstance(image, np.ndarray) and image.dtype.kind == "f":
                t = torch.from_numpy(image).unsqueeze(0) if image.ndim == 3 else torch.from_numpy(image)
                t = t.permute(0, 3, 1, 2)
            elif isinstance(image, torch.Tensor) and image.is_floating_point():
                t = image.unsqueeze(0) if image.ndim == 3 else image
            else:
                raise ProcessorError("image must be a PIL image, a float HWC array or a float [3, H, W] tensor")
            if t.ndim != 4 or t.shape[:2] != (1, 3):
                raise ProcessorError(f"image must be one RGB image, got shape {tuple(t.shape)}")
            t = F.interpolate(t, size=(height, width), mode="nearest")
        if t.shape[:2] != (1, 3):
            raise ProcessorError(f"image must be one RGB image, got shape {tuple(t.shape)}")
        return t if bool((t < 0).any()) else t * 2.0 - 1.0   # negative values: already [-1, 1], kept (upstream)

    @staticmethod
    def clip_image(image: Any, size: int = 224, crop: int = 224) -> torch.Tensor:
        """[1, 3, crop, crop] float32: CLIPImageProcessor pixel_values (PIL backend)."""
        from PIL import Image

        if isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.shape[-1:] == (3,) and image.ndim == 3:
            image = Image.fromarray(image)
        if not hasattr(image, "getbands"):
            raise ProcessorError("the CLIP image must be a PIL image or a uint8 HWC RGB array")
        if "A" in image.getbands() or "transparency" in image.info:
            raise ProcessorError("image has an alpha channel; give an RGB image")
        image = image.convert("RGB")
        w, h = image.size
        if w <= h:
            tw, th = size, int(size * h / w)
        else:
            tw, th = int(size * w / h), size
        t = torch.from_numpy(np.asarray(image.resize((tw, th), Image.Resampling.BICUBIC)).copy()).permute(2, 0, 1)
        y, x = (th - crop) // 2, (tw - crop) // 2
        t = (t[:, y:y + crop, x:x + crop].double() * (1 / 255)).float()
        return ((t - _CLIP_MEAN) / _CLIP_STD).unsqueeze(0)

    @staticmethod
    def clip_source(image: Any, signed: bool | None = None):
        """The image CLIP preprocessing starts from, as a PIL RGB image: PIL / uint8 HWC arrays as given; float
        tensors / arrays (the 8-bit uploads fvgen and the server decode to x / 127.5 - 1) back to uint8 by rounding,
        read as [-1, 1] when `signed` (None: when any value is negative, else [0, 1]: the VAE path's rule)."""
        from PIL import Image

        if hasattr(image, "getbands"):
            return image
        if isinstance(image, np.ndarray) and image.dtype == np.uint8:
            return Image.fromarray(image)
        if isinstance(image, np.ndarray) and image.dtype.kind == "f":
            t = torch.from_numpy(image).permute(2, 0, 1) if image.ndim == 3 else None
        elif isinstance(image, torch.Tensor) and image.is_floating_point():
            t = image[0] if image.ndim == 4 and image.shape[0] == 1 else image
        else:
            t = None
        if t is None or t.ndim != 3 or t.shape[0] != 3:
            raise ProcessorError("image must be a PIL image, a uint8 HWC array or one float [3, H, W] RGB image")
        t = t.detach().to("cpu", torch.float64)
        unit = (t + 1) / 2 if (bool((t < 0).any()) if signed is None else signed) else t
        u8 = (unit * 255).round().clamp(0, 255).to(torch.uint8)
        return Image.fromarray(u8.permute(1, 2, 0).contiguous().numpy())

    # ------------------------------------------------------------------ request

    def build_request(self, prompt: str, negative_prompt: str | None = None, image: Any = None, *,
                      num_frames: int = 81, height: int = 480, width: int = 832, steps: int = 50,
                      guidance: float = 5.0, guidance_2: float | None = None, seed: int | None = 0,
                      solver: str | None = None, flow_shift: float | None = None, image_embeds: Any = None,
                      max_sequence_length: int | None = None, encode_image: Any = None) -> WanGenerateRequest:
        """`encode_image`: the model's CLIP image encoder (images -> [B, N, D]); with it, an image and no
        `image_embeds` give the request the embeddings of that image (upstream encode_image)."""
        cfg_on = guidance > 1.0
        if image is not None and image_embeds is None and encode_image is not None:
            image_embeds = encode_image([self.clip_source(image)])   # the original image, not the VAE's resize
        ids = self.encode([prompt, negative_prompt or ""] if cfg_on else [prompt], max_sequence_length)
        embeds = image_embeds[0] if image_embeds is not None and image_embeds.ndim == 3 else image_embeds
        return WanGenerateRequest(
            text_ids=ids[0], negative_text_ids=ids[1] if cfg_on else None, num_frames=num_frames, height=height,
            width=width, num_steps=steps, guidance_scale=guidance, guidance_scale_2=guidance_2, seed=seed,
            solver=solver, flow_shift=flow_shift, image=None if image is None else self.vae_image(image, height,
                                                                                                  width)[0],
            image_embeds=embeds)


def processor(tokenizer_dir: str | Path | None) -> WanProcessor:
    """The family entry's processor factory."""
    return WanProcessor(tokenizer_dir)
