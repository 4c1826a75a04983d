"""ltx2 generation request on the serving path: token ids (what the Gemma tokenizer gives, or `--prompt-ids`) plus
LTX2Pipeline's sampling arguments (manifests/ltx2/sampling.py Ltx2Request: the same names and defaults, `num_steps`
for num_inference_steps as every serving request spells it).

Text (upstream `_get_gemma_prompt_embeds`): the prompt's ids, left-padded with `pad_id` to the model's
max_sequence_length (mask 0 on the padding), truncated to it by the processor (ids given directly must fit: refused
otherwise). `negative_text_ids` None is the empty negative prompt, which Gemma's tokenizer makes `[bos_id]`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from manifests.errors import ManifestError
from manifests.ltx2.sampling import Ltx2Media, Ltx2Request

_D = Ltx2Request()


@dataclass(frozen=True)
class Ltx2GenerateRequest:
    text_ids: torch.Tensor
    negative_text_ids: torch.Tensor | None = None
    num_frames: int = _D.num_frames
    height: int = _D.height
    width: int = _D.width
    frame_rate: float = _D.frame_rate
    num_steps: int = _D.num_inference_steps
    guidance_scale: float = _D.guidance_scale
    audio_guidance_scale: float | None = _D.audio_guidance_scale
    guidance_rescale: float = _D.guidance_rescale
    audio_guidance_rescale: float | None = _D.audio_guidance_rescale
    seed: int = 0
    pad_id: int = 0          # Gemma's <pad>
    bos_id: int = 2          # Gemma's <bos>: the empty prompt's one token

    @property
    def fps(self) -> float:
        return float(self.frame_rate)

    def sampling(self) -> Ltx2Request:
        """The sampling contract both sides' loops take."""
        return Ltx2Request(height=self.height, width=self.width, num_frames=self.num_frames,
                           frame_rate=float(self.frame_rate), num_inference_steps=self.num_steps,
                           guidance_scale=float(self.guidance_scale), audio_guidance_scale=self.audio_guidance_scale,
                           guidance_rescale=float(self.guidance_rescale),
                           audio_guidance_rescale=self.audio_guidance_rescale, seed=self.seed)

    @property
    def uses_cfg(self) -> bool:
        return self.sampling().do_cfg

    def negative(self) -> torch.Tensor:
        return self.negative_text_ids if self.negative_text_ids is not None else \
            torch.tensor([self.bos_id], dtype=torch.int64)

    def validate(self, cfg: Any = None) -> Ltx2GenerateRequest:
        """`cfg`: an Ltx2ModelConfig (its media and text limits), or None (LTX-2's released media)."""
        media = cfg.media() if hasattr(cfg, "media") else Ltx2Media()
        vocab = getattr(getattr(cfg, "text_encoder", None), "vocab_size", None)
        max_len = getattr(cfg, "max_sequence_length", None)
        for name in ("text_ids", "negative_text_ids"):
            t = getattr(self, name)
            if t is None and name == "negative_text_ids":
                continue
            if not isinstance(t, torch.Tensor) or t.ndim != 1 or t.numel() < 1 or t.dtype not in (
                    torch.int64, torch.int32):
                raise ManifestError(f"ltx2 request: {name} must be a non-empty 1-D integer tensor")
            if max_len is not None and t.numel() > max_len:
                raise ManifestError(f"ltx2 request: {name} has {t.numel()} tokens, more than the model's "
                                    f"max_sequence_length {max_len}")
            if bool((t < 0).any()) or (vocab is not None and bool((t >= vocab).any())):
                raise ManifestError(f"ltx2 request: {name} holds ids outside [0, {vocab})")
        for name in ("pad_id", "bos_id"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or (vocab is not None and v >= vocab):
                raise ManifestError(f"ltx2 request: {name} must be a token id in [0, {vocab}), got {v!r}")
        sched = getattr(cfg, "scheduler", None)
        if sched is not None and sched.shift_terminal and isinstance(self.num_steps, int) and self.num_steps == 1:
            # upstream's terminal stretch divides 1 - sigma by its last value: 0 / 0 at a single step (NaN latents)
            raise ManifestError("ltx2 request: num_steps must be >= 2 with this scheduler's shift_terminal "
                                f"{sched.shift_terminal} (at one step upstream's terminal stretch is 0 / 0)")
        try:
            self.sampling().validate(media)
        except ManifestError as e:
            raise ManifestError(str(e).replace("num_inference_steps", "num_steps")) from None
        return self


def request_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(Ltx2GenerateRequest))


__all__ = ["Ltx2GenerateRequest", "request_fields"]
