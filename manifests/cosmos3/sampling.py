"""The cosmos3 generation request and sampler settings: data both sides' loops consume (each side has its own
UniPC and its own loop; only this contract is shared)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from manifests.accel import AccelSpec
from manifests.cosmos3.config import Cosmos3Config
from manifests.bounds import RequestBounds
from manifests.errors import ManifestError, RequestFieldError
from manifests.solvers import UniPCConfig  # noqa: F401  (re-exported: the cosmos3 request's sampler settings)
from manifests.solvers import SDEConfig  # noqa: F401  (sde: stochastic rollout steps with logprobs)

ACCEL_LOOP = "cosmos3.denoise"              # the loop id an acceleration's kind must list to apply here
# kinds listing this loop whose upstream semantics it cannot reproduce on cosmos3, and why (one line each)
ACCEL_REFUSED = {
    "taylorseer": "diffusers 0.42.1 TaylorSeer (lite) on Cosmos3OmniTransformer predicts only proj_out (the vision "
                  "head) and still runs every layer (its block pattern matches no cosmos3 module): nothing to skip, "
                  "and a whole-output prediction would not be upstream's",
}
ACTION_MODES = ("policy", "forward_dynamics", "inverse_dynamics")
# what a cosmos3 generation may ask for at all (upstream's text encoder pads prompts to 512 tokens)
BOUNDS = RequestBounds(max_steps=1000, max_abs_guidance=1e4, max_prompt_tokens=512, max_fps=1000.0)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class ActionSpec:
    mode: str                                  # policy | forward_dynamics | inverse_dynamics
    chunk_size: int                            # action rows; the clip has chunk_size + 1 pixel frames
    domain_id: int                             # embodiment domain
    raw_action_dim: int | None = None          # channels >= this are re-zeroed (init, velocity, every step)
    raw_actions: torch.Tensor | None = None    # forward_dynamics: the given actions [n <= chunk_size, raw_dim]


@dataclass(frozen=True)
class Cosmos3GenerateRequest:
    """One generation, at the latent level (decoding to pixels is separate).

    Noise: either `seed` (one CPU generator draws vision, then sound, then action noise, as upstream) or the
    explicit `noise_*` tensors. Conditioned latent frames (`vision_condition_frames`) take their values from
    `condition_latents` (i2v / v2v / action modes); velocity there is 0.
    """
    text_ids: torch.Tensor                     # cond prompt ids (int64 [L])
    negative_text_ids: torch.Tensor            # uncond prompt ids (used when guidance_scale != 1)
    latent_frames: int                         # T (latent): (num_frames - 1) // 4 + 1
    latent_height: int
    latent_width: int
    num_steps: int = 35
    guidance_scale: float = 6.0
    fps: float = 24.0
    seed: int | None = 0
    scheduler: UniPCConfig = field(default_factory=UniPCConfig)
    vision_condition_frames: tuple[int, ...] = ()
    condition_latents: torch.Tensor | None = None   # [1, C, T, H, W] clean latents for conditioned frames
    sound_frames: int = 0                      # T_s; 0 = no sound
    action: ActionSpec | None = None
    noise_vision: torch.Tensor | None = None   # explicit initial latents (already mixed with conditioning)
    noise_sound: torch.Tensor | None = None
    noise_action: torch.Tensor | None = None
    sde: SDEConfig | None = None              # SDE rollout steps on the UniPC schedule (RL); None = ODE
    accel: AccelSpec | None = None            # a step cache / guidance interval (manifests/accel); None = exact

    def validate(self, cfg: Cosmos3Config) -> "Cosmos3GenerateRequest":
        who = "cosmos3 request"

        def need(cond: bool, msg: str, field: str | None = None) -> None:
            if not cond:
                raise RequestFieldError(f"{who}: {msg}", field)

        for name in ("text_ids", "negative_text_ids"):
            ids = getattr(self, name)
            need(isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.ndim == 1 and ids.numel() > 0,
                 f"{name} must be a non-empty int64 [L] tensor", name)
            BOUNDS.check_prompt(who, ids.numel(), name)
            need(int(ids.min()) >= 0 and int(ids.max()) < cfg.vocab_size,
                 f"{name} has token ids outside [0, {cfg.vocab_size})", name)
        for name in ("latent_frames", "latent_height", "latent_width"):
            v = getattr(self, name)
            need(_is_int(v) and v > 0, f"{name} must be a positive int, got {v!r}", name)
        BOUNDS.check_steps(who, self.num_steps)
        BOUNDS.check_guidance(who, self.guidance_scale)
        need(_is_number(self.fps) and math.isfinite(self.fps) and 0 < self.fps <= BOUNDS.max_fps,
             f"fps must be in (0, {BOUNDS.max_fps:g}], got {self.fps!r}", "fps")
        need(self.seed is not None or self.noise_vision is not None, "give a seed or explicit noise", "seed")
        need(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2 ** 64),
             f"seed must be an int in [0, 2**64) or None, got {self.seed!r}", "seed")
        self.scheduler.validate()
        if self.sde is not None:  # the SDE draws its per-step noise from the request's seeded generator
            need(isinstance(self.sde, SDEConfig), "sde must be an SDEConfig")
            self.sde.validate(self.num_steps)
            need(self.seed is not None, "sde sampling needs a seed (its step noise is drawn from it)")
        if self.accel is not None:
            need(isinstance(self.accel, AccelSpec), f"accel must be an AccelSpec (manifests.accel.parse_accel), got "
                 f"{type(self.accel).__name__}", "accel")
            need(ACCEL_LOOP in self.accel.kind.loops, f"accel {self.accel.name} does not apply to the cosmos3 "
                 f"denoising loop (it applies to: {', '.join(self.accel.kind.loops)})", "accel")
            need(self.accel.name not in ACCEL_REFUSED, f"accel {self.accel.name} is refused on cosmos3: "
                 f"{ACCEL_REFUSED.get(self.accel.name)}", "accel")
            # cache-dit runs the last Bn blocks on its cached (approximate) und stream; this loop's text K/V are exact
            need(self.accel.name != "dbcache" or self.accel.get("bn") == 0, "accel dbcache on cosmos3 needs bn=0 "
                 "(cache-dit feeds the last Bn blocks its cached approximation of the text stream; this loop's text "
                 "keys / values are always exact)", "accel")
        T = self.latent_frames
        need(all(0 <= f < T for f in self.vision_condition_frames),
             f"vision_condition_frames {list(self.vision_condition_frames)} out of range for {T} latent frames")
        shape = (1, cfg.latent_channels, T, self.latent_height, self.latent_width)
        if self.vision_condition_frames:
            need(self.condition_latents is not None and tuple(self.condition_latents.shape) == shape,
                 f"condition_latents of shape {list(shape)} are required with vision_condition_frames",
                 "condition_latents")
        if self.noise_vision is not None:
            need(tuple(self.noise_vision.shape) == shape, f"noise_vision must have shape {list(shape)}", "noise_vision")
        need(_is_int(self.sound_frames) and self.sound_frames >= 0, f"sound_frames must be an int >= 0, got "
             f"{self.sound_frames!r}", "sound_frames")
        if self.sound_frames:
            need(cfg.has_sound, "sound requested but the model has no sound head", "sound_frames")
            if self.noise_sound is not None:
                need(tuple(self.noise_sound.shape) == (cfg.sound_dim, self.sound_frames),
                     f"noise_sound must have shape [{cfg.sound_dim}, {self.sound_frames}]")
        a = self.action
        if a is not None:
            need(cfg.has_action, "action requested but the model has no action head", "action")
            need(a.mode in ACTION_MODES, f"unknown action mode {a.mode!r}; expected one of {list(ACTION_MODES)}")
            need(isinstance(a.chunk_size, int) and a.chunk_size > 0, "action chunk_size must be > 0")
            need(0 <= a.domain_id < cfg.num_embodiment_domains,
                 f"action domain_id {a.domain_id} out of range [0, {cfg.num_embodiment_domains})")
            need(a.raw_action_dim is None or 0 < a.raw_action_dim <= cfg.action_dim,
                 f"raw_action_dim must be in (0, {cfg.action_dim}]")
            want = tuple(range(T)) if a.mode == "inverse_dynamics" else (0,)
            need(tuple(sorted(self.vision_condition_frames)) == want,
                 f"action mode {a.mode} conditions latent frames {list(want)}; got {list(self.vision_condition_frames)}")
            if a.mode == "forward_dynamics":
                need(a.raw_actions is not None and a.raw_actions.ndim == 2 and a.raw_actions.shape[0] >= 1
                     and a.raw_actions.shape[1] <= cfg.action_dim,
                     "forward_dynamics needs raw_actions [n, <= action_dim]")
            if self.noise_action is not None:
                need(tuple(self.noise_action.shape) == (a.chunk_size, cfg.action_dim),
                     f"noise_action must have shape [{a.chunk_size}, {cfg.action_dim}]")
        return self

    @property
    def uses_cfg(self) -> bool:
        return self.guidance_scale != 1.0  # upstream: guidance exactly 1 skips the uncond branch


def latent_frames_for(num_frames: int, temporal_compression: int = 4) -> int:
    """Pixel frames (4k + 1) -> latent frames; refuses counts the causal VAE cannot encode whole."""
    if num_frames < 1 or (num_frames - 1) % temporal_compression:
        raise ManifestError(f"num_frames must be {temporal_compression}k + 1, got {num_frames}")
    return (num_frames - 1) // temporal_compression + 1


def video_request(cfg: Cosmos3Config, *, num_frames: int, height: int, width: int, spatial_compression: int = 16,
                  temporal_compression: int = 4, **kw) -> Cosmos3GenerateRequest:
    """A request from pixel-space sizes (the Wan2.2 VAE: 16x spatial, 4x causal temporal), validated."""
    for name, v in (("height", height), ("width", width)):
        if not isinstance(v, int) or v <= 0 or v % spatial_compression:
            raise RequestFieldError(f"cosmos3 request: {name} must be a positive multiple of {spatial_compression}, "
                                    f"got {v}", name)
    req = Cosmos3GenerateRequest(latent_frames=latent_frames_for(num_frames, temporal_compression),
                                 latent_height=height // spatial_compression, latent_width=width // spatial_compression,
                                 **kw)
    return req.validate(cfg)
