"""ltx2 sampling contract: what `LTX2Pipeline.__call__` (diffusers 0.42.1, pipelines/ltx2/pipeline_ltx2.py) does
between the text embeddings and the latents, as typed data both sides implement on their own.

Semantics (each side reproduces them; this module holds data and validation only):
- Latent grid: frames (num_frames - 1) // 8 + 1, height / 32, width / 32 (the video VAE's compression), one token
  per latent pixel (patch 1); audio latents round(num_frames / frame_rate * sample_rate / hop / 4) frames of
  mel_bins / 4 bins, packed [B, L, C * M].
- Noise draw order: one CPU generator seeded with `seed`; first the video latents [B, C, F, H, W] (then packed), then
  the audio latents [B, C, L, M] (then packed). Generated noise is not normalised (upstream).
- Schedule: sigmas = linspace(1, 1 / n, n) (float32), shifted by the exponential time shift with
  mu = calculate_shift(video tokens, base_image_seq_len, max_image_seq_len, base_shift, max_shift), stretched so
  the last sigma is `shift_terminal`, then a terminal 0; timesteps = sigma * 1000. Audio uses a copy of the same.
- Each step: one DiT call on [uncond, cond] (CFG) with timestep t for both streams; predictions -> x0 = x - sigma v;
  x0 guided = x0_c + (g - 1)(x0_c - x0_u) per modality (video g, audio g_a); optional guidance rescale (std ratio,
  per sample, in x0 space); back to velocity (x - x0) / sigma; Euler x + (sigma_next - sigma) v in fp32.
- Output latents: video unpacked to [B, C, F, H, W] then de-normalised with the video VAE's latents_mean / std
  (scaling factor 1); audio de-normalised with the audio VAE's mean / std (packed), then unpacked [B, C, L, M].
STG (`stg_scale`) and modality-isolation guidance (`modality_scale`) need DiT features this port does not have
(perturbed attention, isolated cross-modal attention): a request asking for them is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from manifests.errors import ManifestError


@dataclass(frozen=True)
class Ltx2SchedulerConfig:
    """diffusers `FlowMatchEulerDiscreteScheduler` as LTX-2 ships it (dynamic exponential shift + terminal stretch)."""
    num_train_timesteps: int = 1000
    base_image_seq_len: int = 1024
    max_image_seq_len: int = 4096
    base_shift: float = 0.95
    max_shift: float = 2.05
    shift_terminal: float | None = 0.1

    def validate(self) -> Ltx2SchedulerConfig:
        if self.max_image_seq_len <= self.base_image_seq_len:
            raise ManifestError("ltx2 scheduler: max_image_seq_len must exceed base_image_seq_len")
        if self.shift_terminal is not None and not 0 < self.shift_terminal < 1:
            raise ManifestError(f"ltx2 scheduler: shift_terminal must be in (0, 1), got {self.shift_terminal}")
        return self

    def to_diffusers(self) -> dict:
        """The scheduler_config.json this contract is (upstream's remaining fields at LTX's values)."""
        return {"num_train_timesteps": self.num_train_timesteps, "shift": 1.0, "use_dynamic_shifting": True,
                "base_shift": self.base_shift, "max_shift": self.max_shift,
                "base_image_seq_len": self.base_image_seq_len, "max_image_seq_len": self.max_image_seq_len,
                "invert_sigmas": False, "shift_terminal": self.shift_terminal, "use_karras_sigmas": False,
                "use_exponential_sigmas": False, "use_beta_sigmas": False, "time_shift_type": "exponential",
                "stochastic_sampling": False}

    @classmethod
    def from_diffusers(cls, d: dict) -> Ltx2SchedulerConfig:
        """Refuses the scheduler settings this contract does not implement, by name."""
        fixed = {"shift": 1.0, "use_dynamic_shifting": True, "invert_sigmas": False, "use_karras_sigmas": False,
                 "use_exponential_sigmas": False, "use_beta_sigmas": False, "time_shift_type": "exponential",
                 "stochastic_sampling": False}
        bad = [f"{k}={d[k]!r}" for k, v in fixed.items() if k in d and d[k] != v]
        if bad:
            raise ManifestError(f"ltx2 scheduler: not supported: {', '.join(bad)}")
        return cls(**{k: d[k] for k in ("num_train_timesteps", "base_image_seq_len", "max_image_seq_len",
                                         "base_shift", "max_shift", "shift_terminal") if k in d}).validate()


@dataclass(frozen=True)
class Ltx2Media:
    """The VAE facts the loop needs (from the video / audio VAE configs; LTX-2's released values by default)."""
    spatial_compression: int = 32
    temporal_compression: int = 8
    latent_channels: int = 128
    audio_latent_channels: int = 8
    mel_bins: int = 64
    mel_compression: int = 4
    audio_temporal_compression: int = 4
    sample_rate: int = 16000
    hop_length: int = 160


@dataclass(frozen=True)
class Ltx2Request:
    """One text-to-video+audio request (LTX2Pipeline's arguments of the same names; defaults are upstream's)."""
    height: int = 512
    width: int = 768
    num_frames: int = 121
    frame_rate: float = 24.0
    num_inference_steps: int = 30
    guidance_scale: float = 3.0
    audio_guidance_scale: float | None = 7.0    # None: the video value (upstream's `or`: 0 also falls back)
    guidance_rescale: float = 0.7
    audio_guidance_rescale: float | None = 0.7
    stg_scale: float = 0.0                      # upstream default 1.0; refused unless 0 (see the module doc)
    modality_scale: float = 1.0                 # upstream default 3.0; refused unless 1
    seed: int = 0

    @property
    def audio_guidance(self) -> float:
        return self.audio_guidance_scale or self.guidance_scale           # (upstream) `or`, not `is None`

    @property
    def audio_rescale(self) -> float:
        return self.audio_guidance_rescale or self.guidance_rescale

    @property
    def do_cfg(self) -> bool:
        return self.guidance_scale > 1.0 or self.audio_guidance > 1.0     # either modality's scale turns it on

    def latent_grid(self, m: Ltx2Media) -> tuple[int, int, int]:
        return ((self.num_frames - 1) // m.temporal_compression + 1, self.height // m.spatial_compression,
                self.width // m.spatial_compression)

    def audio_frames(self, m: Ltx2Media) -> int:
        per_second = m.sample_rate / m.hop_length / float(m.audio_temporal_compression)
        return round(self.num_frames / self.frame_rate * per_second)

    def validate(self, m: Ltx2Media | None = None) -> Ltx2Request:
        m = m or Ltx2Media()
        for name in ("height", "width", "num_frames", "num_inference_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ManifestError(f"ltx2 request: {name} must be a positive int, got {v!r}")
        for name, k in (("height", m.spatial_compression), ("width", m.spatial_compression)):
            if getattr(self, name) % k:
                raise ManifestError(f"ltx2 request: {name} must be divisible by {k}, got {getattr(self, name)}")
        if (self.num_frames - 1) % m.temporal_compression:
            raise ManifestError(f"ltx2 request: num_frames must be {m.temporal_compression} k + 1, "
                                f"got {self.num_frames}")
        for name in ("frame_rate", "guidance_scale", "guidance_rescale"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ManifestError(f"ltx2 request: {name} must be a finite number >= 0, got {v!r}")
        if self.frame_rate <= 0:
            raise ManifestError("ltx2 request: frame_rate must be > 0")
        if self.stg_scale != 0.0:
            raise ManifestError("ltx2 request: stg_scale (spatio-temporal guidance) is not ported; pass 0")
        if self.modality_scale != 1.0:
            raise ManifestError("ltx2 request: modality_scale (modality-isolation guidance) is not ported; pass 1")
        if self.audio_frames(m) < 1:
            raise ManifestError("ltx2 request: the clip is too short for one audio latent frame")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ManifestError(f"ltx2 request: seed must be an int >= 0, got {self.seed!r}")
        return self
