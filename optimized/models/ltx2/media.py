"""ltx2's serving hooks (`FamilyEntry.media` / `request_from_fields` / `processor_options`): the instance's own video
VAE decodes the de-normalised latents through the engine's "vae_decode" loop (the whole clip in one step, requests
of one latent shape batched), at the decode timestep 0 (LTX2Pipeline's default); the audio latents go through the
audio VAE and the vocoder (`sound`), at the vocoder's output rate; clips play at the request's frame_rate. The video
program writes OUT.mp4 with that audio muxed in (MediaChain.mux_audio)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from manifests.ltx2.request import Ltx2GenerateRequest
from optimized.runtime.family import RequestCost
from optimized.runtime.loop import LoopKernel, ResourceRequest, WorkPlan
from optimized.serving.families import MediaChain, RequestFields, ServingError

DECODE_LOOP = "ltx2.vae_decode"


@dataclass(frozen=True)
class Ltx2DecodeRequest:
    request_id: str
    latents: torch.Tensor                 # [B, C, F, H, W], de-normalised
    chunk_frames: int = 0                 # the whole clip in one step (0: every latent frame)

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk_frames", self.chunk_frames or int(self.latents.shape[2]))


@dataclass
class Ltx2DecodeState:
    request: Ltx2DecodeRequest
    video: torch.Tensor | None = None


class Ltx2VaeDecodeKernel(LoopKernel[Ltx2DecodeState]):
    loop_id = DECODE_LOOP

    def __init__(self, instance: Any):
        self.model = instance

    def init_state(self, request: Ltx2DecodeRequest) -> Ltx2DecodeState:
        z, c = request.latents, self.model.cfg.vae
        if z.ndim != 5 or z.shape[1] != c.latent_channels:
            raise ValueError(f"ltx2 vae decode: latents must be [B, {c.latent_channels}, F, H, W], got {list(z.shape)}")
        if not torch.isfinite(z).all():
            raise ValueError("ltx2 vae decode: latents hold NaN or Inf values")
        return Ltx2DecodeState(request)

    def plan_step(self, s: Ltx2DecodeState) -> WorkPlan:
        z = s.request.latents
        sig = f"{DECODE_LOOP}:{tuple(z.shape[1:])}:{self.model.media_dtype}"
        out = 3 * ((z.shape[2] - 1) * self.model.media.temporal_compression + 1) * \
            (z.shape[3] * self.model.media.spatial_compression) * (z.shape[4] * self.model.media.spatial_compression)
        return WorkPlan(request_id="", loop_id=DECODE_LOOP, phase="vae_decode_chunk", step_index=0,
                        batch_key=(sig, str(z.device)), resources=ResourceRequest(device_bytes=out * 4 * 8),
                        shape_signature=sig)

    def run_step(self, states: Sequence[Ltx2DecodeState], plans: Sequence[WorkPlan]) -> list[Ltx2DecodeState]:
        zs = [s.request.latents for s in states]
        video = self.model.decode_video(torch.cat(zs) if len(zs) > 1 else zs[0])
        if not torch.isfinite(video).all():
            raise FloatingPointError(f"{DECODE_LOOP}: non-finite values in the decoded frames")
        parts = video.split([z.shape[0] for z in zs])
        return [replace(s, video=v) for s, v in zip(states, parts)]

    def is_done(self, s: Ltx2DecodeState) -> bool:
        return s.video is not None

    def finalize(self, s: Ltx2DecodeState) -> torch.Tensor:
        return s.video


class Ltx2Sound:
    """The media chain's sound decoder: de-normalised audio latents -> waveform (audio VAE, then vocoder)."""

    def __init__(self, instance: Any):
        self.model = instance

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.model.decode_audio(latents).clamp(-1, 1)


SOLVER_COPIES = 4        # latents held per row: x, the prediction, x0 and the guided velocity (fp32)
ACTIVATION_WIDTHS = 12   # stream-width activations alive per token at a DiT block's widest (q, k, v, attention out,
                         # the feed-forward's 4x input ...)


def request_cost(engine: Any, request: Any, phases: tuple[str, ...]) -> RequestCost | None:
    """An Ltx2GenerateRequest's peak bytes by phase, from its fields alone (None for other requests or fields its
    validation refuses): denoise = the packed latents and text rows held + the widest DiT step over [uncond, cond];
    decode = the latents + the decoder's full-resolution activations + the decoded clip (fp32); artifact = the
    decoded clip + its uint8 frames + the writer's copies."""
    if not isinstance(request, Ltx2GenerateRequest):
        return None
    inst = engine.model
    cfg, media = inst.cfg, inst.media
    try:
        samp = request.sampling()
        (f, h, w), n_audio = samp.latent_grid(media), samp.audio_frames(media)
        rows = 2 if samp.do_cfg else 1
        frames, height, width = int(request.num_frames), int(request.height), int(request.width)
    except (TypeError, ValueError, ArithmeticError, ZeroDivisionError):
        return None
    if min(f, h, w, n_audio, frames, height, width) <= 0:
        return None
    t = cfg.transformer
    elem = inst.dtype.itemsize
    video_tokens, text = f * h * w, cfg.max_sequence_length
    held = rows * 4 * SOLVER_COPIES * (video_tokens * t.in_channels + n_audio * t.audio_in_channels) + \
        rows * text * (t.caption_channels * 2) * elem
    step = rows * elem * ACTIVATION_WIDTHS * (video_tokens * t.inner_dim + n_audio * t.audio_inner_dim
                                              + text * max(t.inner_dim, t.audio_inner_dim))
    out = {"denoise": held + step}
    pixels = 3 * frames * height * width
    widest = max(cfg.vae.decoder_block_out_channels)
    decoded = pixels * 4
    out["decode"] = held + decoded + 3 * frames * height * width // (cfg.vae.patch_size ** 2) * widest * 4 * 2
    out["artifact"] = decoded + 2 * (pixels * 4 + pixels)
    return RequestCost({k: v for k, v in out.items() if k in phases}, ("num_frames", "height", "width"))


def request_from_fields(engine: Any, f: RequestFields) -> Ltx2GenerateRequest:
    f = f.filled(dict(engine.family.request_defaults))
    if f.image is not None:
        raise ServingError("image: this ltx2 model is text-to-video+audio (image-to-video is not ported)")
    # token ids given directly: the model's tokenizer (when it has one) still says what pads and what the empty
    # negative prompt is; without one, Gemma's <pad> 0 and <bos> 2
    from optimized.serving.requests import processor_for
    proc = processor_for(engine)
    tokens = {} if proc is None else {"pad_id": int(proc.pad_id),
                                      **({"bos_id": int(proc.bos_id)} if proc.bos_id is not None else {})}
    return Ltx2GenerateRequest(text_ids=f.text_ids, negative_text_ids=f.negative_text_ids, num_frames=f.num_frames,
                               height=f.height, width=f.width, num_steps=f.num_steps,
                               guidance_scale=float(f.guidance_scale), seed=f.seed if f.seed is not None else 0,
                               **tokens)


def processor_options(engine: Any) -> dict:
    return {"max_sequence_length": engine.model.cfg.max_sequence_length}


def media(engine: Any) -> MediaChain:
    inst = engine.model

    class _Vae:           # what serving reads from the chain's VAE: the clip geometry (frame_step)
        cfg = inst.media
        dtype = inst.media_dtype

    return MediaChain(_Vae(), engine.loop("vae_decode"), None, lambda rid, z: Ltx2DecodeRequest(rid, z), None, None,
                      fps=lambda r: float(r.frame_rate), sound=Ltx2Sound(inst), sample_rate=inst.cfg.sample_rate,
                      mux_audio=True)


__all__ = ["DECODE_LOOP", "Ltx2DecodeRequest", "Ltx2Sound", "Ltx2VaeDecodeKernel", "media", "processor_options",
           "request_cost", "request_from_fields"]
