"""The input/output contract of one cosmos3 generator forward (one packed sample, one CFG branch).

Data only: both sides build their own packed sequence from these fields (sharing a packer would let
both sides agree on the same bug). `validate()` refuses what upstream would silently mis-handle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from manifests.cosmos3.config import Cosmos3Config
from manifests.errors import ManifestError


@dataclass(frozen=True)
class Cosmos3ForwardInputs:
    text_ids: torch.Tensor                       # int64 [L_text], placed at sequence positions 0..L_text-1
    vision_latents: torch.Tensor                 # [1, C, T, H, W] latent grid (H, W may be odd: padded to patch)
    timestep: float                              # fed to the model as-is (the pipeline passes int(1000*sigma))
    fps_vision: float = 24.0
    vision_condition_frames: tuple[int, ...] = ()  # latent frames kept clean: no timestep, prediction 0
    sound_latents: torch.Tensor | None = None    # [S, T_s]; every sound frame is noisy
    fps_sound: float | None = None               # sound mRoPE fps (the pipeline uses sound_latent_fps)
    action_latents: torch.Tensor | None = None   # [T_a, A]
    action_condition_rows: tuple[int, ...] = ()  # action rows kept clean
    action_domain_id: int | None = None          # embodiment domain selecting the action head weights

    def validate(self, cfg: Cosmos3Config) -> "Cosmos3ForwardInputs":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ManifestError(f"cosmos3 inputs: {msg}")

        ids = self.text_ids
        need(ids.dtype == torch.int64 and ids.ndim == 1 and ids.numel() > 0, "text_ids must be a non-empty int64 [L] tensor")
        need(int(ids.min()) >= 0 and int(ids.max()) < cfg.vocab_size,
             f"text_ids must lie in [0, {cfg.vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]")
        v = self.vision_latents
        need(v.ndim == 5 and v.shape[0] == 1 and v.shape[1] == cfg.latent_channels,
             f"vision_latents must be [1, {cfg.latent_channels}, T, H, W], got {list(v.shape)}")
        need(v.is_floating_point(), "vision_latents must be floating point")
        T = v.shape[2]
        need(all(0 <= f < T for f in self.vision_condition_frames),
             f"vision_condition_frames {list(self.vision_condition_frames)} out of range for T={T}")
        need(len(set(self.vision_condition_frames)) == len(self.vision_condition_frames),
             f"vision_condition_frames {list(self.vision_condition_frames)} has duplicates")
        need(math.isfinite(float(self.timestep)), f"timestep must be finite, got {self.timestep}")
        need(math.isfinite(self.fps_vision) and self.fps_vision > 0, f"fps_vision must be > 0, got {self.fps_vision}")
        if self.sound_latents is not None:
            need(cfg.has_sound, "sound_latents given but the config has no sound head")
            s = self.sound_latents
            need(s.ndim == 2 and s.shape[0] == cfg.sound_dim and s.shape[1] > 0,
                 f"sound_latents must be [{cfg.sound_dim}, T_s], got {list(s.shape)}")
            need(self.fps_sound is not None and self.fps_sound > 0, "fps_sound must be given (> 0) with sound")
        if self.action_latents is not None:
            need(cfg.has_action, "action_latents given but the config has no action head")
            a = self.action_latents
            need(a.ndim == 2 and a.shape[1] == cfg.action_dim and a.shape[0] > 0,
                 f"action_latents must be [T_a, {cfg.action_dim}], got {list(a.shape)}")
            need(self.action_domain_id is not None and 0 <= self.action_domain_id < cfg.num_embodiment_domains,
                 f"action_domain_id must be in [0, {cfg.num_embodiment_domains}), got {self.action_domain_id}")
            need(all(0 <= r < a.shape[0] for r in self.action_condition_rows),
                 f"action_condition_rows {list(self.action_condition_rows)} out of range for T_a={a.shape[0]}")
        return self


@dataclass
class Cosmos3Prediction:
    vision: torch.Tensor                     # [1, C, T, H, W], conditioned frames exactly 0
    sound: torch.Tensor | None = None        # [S, T_s]
    action: torch.Tensor | None = None       # [T_a, A], conditioned rows exactly 0
    extras: dict = field(default_factory=dict)


# Canonical trace names, recorded by both sides for layer-by-layer divergence localisation:
#   "embed"            packed hidden states before layer 0, [L, D]
#   "layers.{i}.und"   und stream after layer i, [L_text, D]
#   "layers.{i}.gen"   gen stream after layer i, [L - L_text, D]
#   "gen_norm"         gen stream after the final gen norm
#   "pred.vision" / "pred.sound" / "pred.action"
TRACE_ORDER_DOC = "embed, layers.0.und, layers.0.gen, ..., gen_norm, pred.*"
