"""ltx2 fast denoise loop: LTX2Pipeline's text-to-video+audio loop (manifests/ltx2/sampling.py), written
independently of reference/, for several requests at once.

Requests that share a latent shape and step count run as one batch: each request draws its own noise from its
own seed (video, then audio: upstream's order), the DiT runs once per step on all requests' [uncond | cond]
rows, guidance scales are per request (a [R, 1, 1] tensor), the schedule is computed once in torch. `trace` gets
`step.<i>.video` / `.audio` per request batch in request order (the reference's names), so C1 compares the two
loops step by step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from manifests.ltx2 import Ltx2Config
from manifests.ltx2.sampling import Ltx2Media, Ltx2Request, Ltx2SchedulerConfig


@dataclass(frozen=True)
class Ltx2Prompt:
    """One request's text-encoder hidden states [b, L, C * K] and 0/1 masks [b, L] (uncond needed with CFG); b > 1
    is one upstream call with b prompts: its rows share the request's generator, as LTX2Pipeline's do."""
    embeds: torch.Tensor
    mask: torch.Tensor
    negative_embeds: torch.Tensor | None = None
    negative_mask: torch.Tensor | None = None


def schedule(steps: int, tokens: int, s: Ltx2SchedulerConfig) -> torch.Tensor:
    """[steps + 1] sigmas in float32 (the shifted, terminal-stretched FlowMatch table, then 0)."""
    base = torch.tensor([1.0 + i * ((1.0 / steps - 1.0) / max(steps - 1, 1)) for i in range(steps)],
                        dtype=torch.float64)
    base[-1] = 1.0 / steps
    sig = base.float()
    mu = s.base_shift + (tokens - s.base_image_seq_len) * (s.max_shift - s.base_shift) / \
        (s.max_image_seq_len - s.base_image_seq_len)
    e = torch.tensor(math.exp(mu), dtype=torch.float32)
    sig = e / (e + (torch.ones_like(sig) / sig - 1))
    if s.shift_terminal:
        rest = 1 - sig
        sig = 1 - rest / (rest[-1] / torch.tensor(1 - s.shift_terminal, dtype=torch.float32))
    return torch.cat([sig, sig.new_zeros(1)])


def _positions(cfg: Ltx2Config, grid: tuple[int, int, int], fps: float, audio_frames: int):
    f, h, w = grid
    ff, hh, ww = torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij")
    lo = torch.stack([ff, hh, ww]).reshape(3, -1).float()
    k = torch.tensor(cfg.vae_scale_factors, dtype=torch.float32).view(3, 1, 1)
    v = torch.stack((lo, lo + 1), -1) * k
    v[0] = torch.clamp(v[0] + (cfg.causal_offset - cfg.vae_scale_factors[0]), min=0) / fps
    s = cfg.audio_scale_factor
    m = torch.arange(audio_frames, dtype=torch.float32) * s
    sec = [(mel + cfg.causal_offset - s).clamp(min=0) * cfg.audio_hop_length / cfg.audio_sampling_rate
           for mel in (m, m + s)]                      # the end as (m + s) + offset - s: upstream's rounding
    a = torch.stack(sec, -1)
    return v[None], a[None, None]


def generate_latents(transformer, connectors, requests: list[Ltx2Request], prompts: list[Ltx2Prompt],
                     stats: dict[str, torch.Tensor], media: Ltx2Media, sched: Ltx2SchedulerConfig,
                     trace=None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> video [R, C, F, H, W], audio [R, C, L, M] de-normalised latents, the requests' rows in order."""
    emit = trace or (lambda name, t: None)
    if not requests or len(requests) != len(prompts):
        raise ValueError("ltx2: one prompt per request, at least one request")
    for r in requests:
        r.validate(media)
    head = requests[0]
    key = (head.latent_grid(media), head.audio_frames(media), head.num_inference_steps, head.frame_rate, head.do_cfg)
    for r in requests[1:]:
        if (r.latent_grid(media), r.audio_frames(media), r.num_inference_steps, r.frame_rate, r.do_cfg) != key:
            raise ValueError("ltx2: requests batched together need one latent shape, step count, fps and CFG mode")
    cfg: Ltx2Config = transformer.cfg
    sizes = [p.embeds.shape[0] for p in prompts]
    R, cfg_on = sum(sizes), head.do_cfg
    grid, n_audio = head.latent_grid(media), head.audio_frames(media)
    bins = media.mel_bins // media.mel_compression

    # text rows: [uncond of every request | cond of every request]
    cond = torch.cat([p.embeds for p in prompts]), torch.cat([p.mask for p in prompts])
    if cfg_on:
        emb = torch.cat([torch.cat([p.negative_embeds for p in prompts]), cond[0]])
        msk = torch.cat([torch.cat([p.negative_mask for p in prompts]), cond[1]])
    else:
        emb, msk = cond
    vid_txt, aud_txt, txt_mask = connectors(emb, msk, padding_side="left")

    # per-request noise, each from its own generator (video then audio)
    vids, auds = [], []
    for r, b in zip(requests, sizes):
        g = torch.Generator().manual_seed(r.seed)
        vids.append(torch.randn((b, media.latent_channels, *grid), generator=g).flatten(2).transpose(1, 2))
        auds.append(torch.randn((b, media.audio_latent_channels, n_audio, bins), generator=g)
                    .permute(0, 2, 1, 3).reshape(b, n_audio, -1))
    x, y = torch.cat(vids), torch.cat(auds)

    sig = schedule(head.num_inference_steps, x.shape[1], sched)
    rows = 2 * R if cfg_on else R
    vpos, apos = _positions(cfg, grid, head.frame_rate, n_audio)
    vpos, apos = vpos.expand(rows, -1, -1, -1), apos.expand(rows, -1, -1, -1)
    def col(values):   # one value per row
        return torch.tensor([v for v, b in zip(values, sizes) for _ in range(b)], dtype=torch.float32).view(R, 1, 1)
    gv, ga = col([r.guidance_scale for r in requests]), col([r.audio_guidance for r in requests])
    rv, ra = col([r.guidance_rescale for r in requests]), col([r.audio_rescale for r in requests])

    for i in range(head.num_inference_steps):
        s, ds = sig[i], sig[i + 1] - sig[i]
        t = (s * sched.num_train_timesteps).expand(rows)
        xin, yin = (torch.cat([x, x]), torch.cat([y, y])) if cfg_on else (x, y)
        pv, pa = transformer(xin, yin, vid_txt, aud_txt, t, encoder_attention_mask=txt_mask,
                             audio_encoder_attention_mask=txt_mask, video_coords=vpos, audio_coords=apos, sigma=t)
        x = _guided_step(x, pv.float(), s, ds, gv, rv, cfg_on)
        y = _guided_step(y, pa.float(), s, ds, ga, ra, cfg_on)
        emit(f"step.{i}.video", x)
        emit(f"step.{i}.audio", y)

    video = x.transpose(1, 2).reshape(R, -1, *grid)
    video = torch.addcmul(stats["video_mean"].view(1, -1, 1, 1, 1), video, stats["video_std"].view(1, -1, 1, 1, 1))
    audio = torch.addcmul(stats["audio_mean"], y, stats["audio_std"])
    return video, audio.view(R, n_audio, -1, bins).permute(0, 2, 1, 3)


def _guided_step(x, pred, s, ds, scale, rescale, cfg_on):
    """x0-space CFG (delta form) + per-request rescale, back to velocity, Euler in fp32."""
    if cfg_on:
        pu, pc = pred.chunk(2)
        x0c, x0u = x - pc * s, x - pu * s
        x0 = x0c + (scale - 1) * (x0c - x0u)
    else:
        x0c = x0 = x - pred * s
    on = rescale > 0
    if bool(on.any()):
        dims = tuple(range(1, x0.ndim))
        ratio = x0c.std(dim=dims, keepdim=True) / x0.std(dim=dims, keepdim=True)
        x0 = torch.where(on, rescale * (x0 * ratio) + (1 - rescale) * x0, x0)
    return x.float() + ds * ((x - x0) / s)
