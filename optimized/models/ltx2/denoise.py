"""ltx2 denoising as a LoopKernel: the runtime owns the loop, this file owns one step of LTX2Pipeline's
text-to-video+audio loop (the contract: manifests/ltx2/sampling.py; the batched helpers of pipeline.py).

init_state: the request's prompts -> Gemma 3 hidden states -> connectors ([uncond, cond] when CFG runs), its noise
from its own generator (video, then audio), its sigma table. run_step: one DiT call over every request in the batch
(any mix of step indices, seeds, guidance scales), rows [uncond of each | cond of each], per-row timesteps, then
each request's guided Euler step in fp32. finalize: unpack + de-normalise -> {"latents": {"vision", "sound"}}.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from manifests.ltx2.request import Ltx2GenerateRequest
from optimized.models.ltx2.instance import Ltx2ModelInstance
from optimized.models.ltx2.pipeline import _guided_step, _positions, schedule
from optimized.runtime.loop import LoopKernel, ResourceRequest, WorkPlan

LOOP_ID = "ltx2.denoise"


@dataclass(frozen=True)
class Ltx2DenoiseJob:
    request: Ltx2GenerateRequest
    record_trajectory: bool = False


@dataclass
class Ltx2DenoiseState:
    job: Ltx2DenoiseJob
    sigmas: torch.Tensor              # fp32 [N + 1]
    video: torch.Tensor               # fp32 [1, F*H*W, C] packed
    audio: torch.Tensor               # fp32 [1, L, C*M] packed
    text: tuple[torch.Tensor, ...]    # (video text, audio text, mask), rows [uncond, cond] with CFG
    grid: tuple[int, int, int]
    audio_frames: int
    step: int = 0
    trajectory: list = field(default_factory=list)

    @property
    def request(self) -> Ltx2GenerateRequest:
        return self.job.request


class Ltx2DenoiseLoop(LoopKernel[Ltx2DenoiseState]):
    loop_id = LOOP_ID

    def __init__(self, model: Ltx2ModelInstance, cfg_policy: str = "batched"):
        if cfg_policy not in ("batched", "two-forward"):
            raise ValueError(f"ltx2 denoise: cfg policy {cfg_policy!r} is not supported (batched, two-forward)")
        self.model, self.cfg = model, model.cfg

    def init_state(self, job) -> Ltx2DenoiseState:
        job = job if isinstance(job, Ltx2DenoiseJob) else Ltx2DenoiseJob(job)
        req = job.request
        try:
            req.validate(self.cfg)
        except ValueError as e:
            raise ValueError(str(e)) from None
        m, media, samp = self.model, self.model.media, req.sampling()
        ids = ([req.negative()] if samp.do_cfg else []) + [req.text_ids]
        hidden, mask = m.encode_text(ids, req.pad_id)
        with torch.no_grad():
            vid_txt, aud_txt, txt_mask = m.connectors(hidden, mask, padding_side="left")
        grid, n_audio = samp.latent_grid(media), samp.audio_frames(media)
        bins = media.mel_bins // media.mel_compression
        g = torch.Generator().manual_seed(req.seed)      # CPU generator: video noise, then audio (upstream order)
        video = torch.randn((1, media.latent_channels, *grid), generator=g).flatten(2).transpose(1, 2)
        audio = torch.randn((1, media.audio_latent_channels, n_audio, bins), generator=g) \
            .permute(0, 2, 1, 3).reshape(1, n_audio, -1)
        sig = schedule(req.num_steps, video.shape[1], self.cfg.scheduler).to(m.device)
        return Ltx2DenoiseState(job, sig, video.to(m.device), audio.to(m.device),
                                (vid_txt, aud_txt, txt_mask.to(m.device)), grid, n_audio)

    def plan_step(self, s: Ltx2DenoiseState) -> WorkPlan:
        req = s.request
        cfg_on = req.uses_cfg
        key = (s.grid, s.audio_frames, float(req.frame_rate), cfg_on, int(s.text[0].shape[1]), str(self.model.dtype))
        sig = f"{LOOP_ID}:{s.grid}:{s.audio_frames}:{'cfg' if cfg_on else 'nocfg'}:{self.model.dtype}"
        rows = 2 if cfg_on else 1
        nbytes = rows * (s.video.numel() + s.audio.numel()) * 4 * 16
        return WorkPlan(request_id="", loop_id=LOOP_ID, phase="denoise_step", step_index=s.step, batch_key=key,
                        resources=ResourceRequest(device_bytes=nbytes), shape_signature=sig,
                        info={"sigma": float(s.sigmas[s.step])})

    def run_step(self, states: Sequence[Ltx2DenoiseState], plans: Sequence[WorkPlan]) -> list[Ltx2DenoiseState]:
        if len({p.batch_key for p in plans}) != 1:
            raise ValueError("run_step: plans of one call must share a batch_key")
        m, head = self.model, states[0]
        cfg_on = head.request.uses_cfg
        R = len(states)
        x, y = torch.cat([s.video for s in states]), torch.cat([s.audio for s in states])
        sig = torch.stack([s.sigmas[s.step] for s in states]).view(R, 1, 1)
        nxt = torch.stack([s.sigmas[s.step + 1] for s in states]).view(R, 1, 1)
        k = 2 if cfg_on else 1
        # text rows [uncond of each request | cond of each request]
        text = [torch.cat([s.text[j][i:i + 1] for i in range(k) for s in states]) for j in range(3)]
        t = (sig.flatten() * self.cfg.scheduler.num_train_timesteps).repeat(k)
        vpos, apos = _positions(self.cfg.transformer, head.grid, float(head.request.frame_rate), head.audio_frames)
        vpos, apos = vpos.expand(k * R, -1, -1, -1).to(m.device), apos.expand(k * R, -1, -1, -1).to(m.device)
        xin, yin = (torch.cat([x, x]), torch.cat([y, y])) if cfg_on else (x, y)
        with torch.no_grad():
            pv, pa = m.transformer(xin.to(m.dtype), yin.to(m.dtype), text[0], text[1], t.to(m.device),
                                   encoder_attention_mask=text[2], audio_encoder_attention_mask=text[2],
                                   video_coords=vpos, audio_coords=apos, sigma=t.to(m.device))

        def col(name: str) -> torch.Tensor:
            return torch.tensor([float(getattr(s.request.sampling(), name)) for s in states],
                                dtype=torch.float32, device=x.device).view(R, 1, 1)
        x = _guided_step(x, pv.float(), sig, nxt - sig, col("guidance_scale"), col("guidance_rescale"), cfg_on)
        y = _guided_step(y, pa.float(), sig, nxt - sig, col("audio_guidance"), col("audio_rescale"), cfg_on)
        out = []
        for i, s in enumerate(states):
            v, a = x[i:i + 1], y[i:i + 1]
            traj = s.trajectory + [(v, a)] if s.job.record_trajectory else s.trajectory
            out.append(replace(s, video=v, audio=a, step=s.step + 1, trajectory=traj))
        return out

    def is_done(self, s: Ltx2DenoiseState) -> bool:
        return s.step >= s.request.num_steps

    def finalize(self, s: Ltx2DenoiseState) -> dict:
        st = self.model.stats()
        media = self.model.media
        bins = media.mel_bins // media.mel_compression
        video = s.video.transpose(1, 2).reshape(1, -1, *s.grid)
        video = torch.addcmul(st["video_mean"].view(1, -1, 1, 1, 1).to(video), video,
                              st["video_std"].view(1, -1, 1, 1, 1).to(video))
        audio = torch.addcmul(st["audio_mean"].to(s.audio), s.audio, st["audio_std"].to(s.audio))
        audio = audio.view(1, s.audio_frames, -1, bins).permute(0, 2, 1, 3)
        out = {"latents": {"vision": video, "sound": audio}}
        if s.job.record_trajectory:
            out["trajectory"] = {"video": [v for v, _ in s.trajectory], "audio": [a for _, a in s.trajectory]}
        return out


__all__ = ["LOOP_ID", "Ltx2DenoiseJob", "Ltx2DenoiseLoop", "Ltx2DenoiseState"]
