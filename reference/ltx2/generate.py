"""ltx2 reference, the whole pipeline from one canonical model directory: token ids -> Gemma 3 hidden states ->
connectors -> the LTX2Pipeline loop (pipeline.py) -> de-normalised latents -> video VAE decode (decode timestep 0,
upstream's default) and audio VAE decode -> vocoder. One request, plain calls, read top to bottom; the oracle the
served engine is compared with (`fvgen ltx2 --model OUT` must give these latents).

    model = load_model_dir("OUT")            # what `fvconvert ltx2 --from diffusers <LTX2Pipeline root> OUT` wrote
    out = generate(model, request)           # {"video_latents", "audio_latents", "video", "waveform"}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from manifests.checkpoint import load_state, read_checkpoint
from manifests.ltx2.model import Ltx2ModelConfig
from manifests.ltx2.request import Ltx2GenerateRequest
from reference.ltx2.audio_vae import Ltx2AudioVae, load_audio_vae
from reference.ltx2.connectors import Ltx2Connectors, load_connectors
from reference.ltx2.gemma3 import hidden_states
from reference.ltx2.model import Ltx2Model, load_model
from reference.ltx2.pipeline import generate_latents
from reference.ltx2.video_vae import Ltx2VideoVae, load_video_vae
from reference.ltx2.vocoder import Ltx2Vocoder, load_vocoder


@dataclass
class Ltx2Reference:
    cfg: Ltx2ModelConfig
    transformer: Ltx2Model
    connectors: Ltx2Connectors
    gemma: dict[str, torch.Tensor]            # the text model's canonical weights (reference/ltx2/gemma3.py)
    vae: Ltx2VideoVae
    audio_vae: Ltx2AudioVae
    vocoder: Ltx2Vocoder


def load_model_dir(path: str | Path) -> Ltx2Reference:
    ckpt = read_checkpoint(path, family="ltx2")
    cfg: Ltx2ModelConfig = ckpt.typed_config()

    def state(name: str) -> dict[str, torch.Tensor]:
        return load_state(ckpt, component=name, dtype=torch.float32)
    return Ltx2Reference(cfg, load_model(cfg.transformer, state("transformer")),
                         load_connectors(cfg.connectors, state("connectors")), state("text_encoder"),
                         load_video_vae(cfg.vae, state("vae")), load_audio_vae(cfg.audio_vae, state("audio_vae")),
                         load_vocoder(cfg.vocoder, state("vocoder")))


def encode_prompt(m: Ltx2Reference, ids: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One prompt's ids, left-padded to max_sequence_length (upstream's tokenizer call), -> ([1, L, C * K], [1, L])."""
    L = m.cfg.max_sequence_length
    pad = L - ids.numel()
    input_ids = torch.cat([torch.full((pad,), pad_id, dtype=torch.int64), ids.to(torch.int64)])[None]
    mask = torch.cat([torch.zeros(pad, dtype=torch.int64), torch.ones(ids.numel(), dtype=torch.int64)])[None]
    return hidden_states(m.gemma, m.cfg.text_encoder, input_ids, mask).flatten(2, 3), mask


def generate(m: Ltx2Reference, request: Ltx2GenerateRequest, decode: bool = True, trace=None) -> dict:
    request.validate(m.cfg)
    sampling, media = request.sampling(), m.cfg.media()
    with torch.no_grad():
        embeds, mask = encode_prompt(m, request.text_ids, request.pad_id)
        neg, neg_mask = encode_prompt(m, request.negative(), request.pad_id) if sampling.do_cfg else (None, None)
        stats = {"video_mean": m.vae.latents_mean, "video_std": m.vae.latents_std / m.cfg.vae.scaling_factor,
                 "audio_mean": m.audio_vae.latents_mean, "audio_std": m.audio_vae.latents_std}
        video, audio = generate_latents(m.transformer, m.connectors, sampling, embeds, mask, neg, neg_mask, stats,
                                        media, m.cfg.scheduler, trace=trace)
        out = {"video_latents": video, "audio_latents": audio}
        if decode:
            t = torch.zeros(video.shape[0]) if m.cfg.vae.timestep_conditioning else None
            out["video"] = m.vae.decode(video, t)                       # [B, 3, F, H, W] in about [-1, 1]
            out["waveform"] = m.vocoder(m.audio_vae.decode(audio))       # [B, channels, N]
    return out


__all__ = ["Ltx2Reference", "encode_prompt", "generate", "load_model_dir"]
