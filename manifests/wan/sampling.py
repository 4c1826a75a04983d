"""The Wan generation request contract, shared by the reference pipeline and the engine.

A request carries token ids (the processors that build them from a prompt are not part of this contract), the
pixel size, the solver settings and, for image-to-video, the conditioning image (pixels in [-1, 1]) and, for
Wan2.1 I2V, its CLIP image embeddings (the DiT's image branch). Semantics are WanPipeline /
WanImageToVideoPipeline's of diffusers 0.42.1:
  * CFG runs when guidance_scale > 1 (upstream `do_classifier_free_guidance`; 1 and below run cond only);
  * two experts: `guidance_scale_2` (default: guidance_scale) applies while the low-noise expert runs;
  * noise: one float32 `randn` draw of the whole [1, C, T, h, w] latent from a CPU generator seeded with `seed`,
    unless `noise` is given (then it is cast to float32, as upstream casts caller latents);
  * text: each prompt's UMT5 output is trimmed to its real length and zero-padded to max_sequence_length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from manifests.accel import AccelSpec
from manifests.bounds import RequestBounds
from manifests.errors import ManifestError, RequestFieldError
from manifests.solvers import SDEConfig
from manifests.wan.model import SOLVERS, WanModelConfig

# what a wan request may ask for at all (the prompt also within the model's max_sequence_length)
BOUNDS = RequestBounds(max_steps=1000, max_abs_guidance=1e4, max_prompt_tokens=512)


@dataclass(frozen=True)
class WanGenerateRequest:
    text_ids: Any                                 # LongTensor [L], 1 <= L <= max_sequence_length (EOS included)
    num_frames: int                               # 4k + 1 pixel frames
    height: int                                   # multiple of the VAE spatial compression x DiT patch
    width: int
    num_steps: int = 50
    guidance_scale: float = 5.0
    guidance_scale_2: float | None = None         # two experts only; None = guidance_scale
    negative_text_ids: Any = None                 # LongTensor [L']; required when guidance_scale > 1
    seed: int | None = 0
    solver: str | None = None                     # "unipc" | "euler"; None = the model's default
    flow_shift: float | None = None               # None = the model's default
    noise: Any = None                             # float tensor [1, C, T, h, w]: explicit initial latents
    image: Any = None                             # i2v / ti2v: float tensor [3, height, width] in [-1, 1]
    image_embeds: Any = None                      # 2.1 I2V: float tensor [N, image_dim] (CLIP penultimate layer)
    sde: SDEConfig | None = None                  # SDE rollout steps on the solver's schedule (RL); None = ODE
    lora: tuple = ()                              # LoraRef(name, scale) per adapter, applied unmerged (manifests/lora.py)
    accel: AccelSpec | None = None                # an acceleration (manifests/accel); None = the exact path

    @property
    def uses_cfg(self) -> bool:
        return self.guidance_scale > 1.0  # (upstream) `guidance_scale > 1.0`, not `!= 1`

    def guidance_for_expert(self, expert: int) -> float:
        if expert == 2 and self.guidance_scale_2 is not None:
            return self.guidance_scale_2
        return self.guidance_scale

    def latent_shape(self, cfg: WanModelConfig) -> tuple[int, int, int, int]:
        """[C, T, h, w] of the latents the DiT denoises."""
        return cfg.vae.latent_shape(self.num_frames, self.height, self.width)

    def validate(self, cfg: WanModelConfig) -> "WanGenerateRequest":
        import torch

        who = "wan request"

        def need(c: bool, msg: str, field: str | None = None) -> None:
            if not c:
                raise RequestFieldError(f"{who}: {msg}", field)

        def ids_ok(t, name: str) -> None:
            need(isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_floating_point() and not t.is_complex(),
                 f"{name} must be a 1-D integer tensor", name)
            BOUNDS.check_prompt(who, t.numel(), name, cfg.max_sequence_length)
            need(int(t.min()) >= 0 and int(t.max()) < cfg.text_encoder.vocab_size,
                 f"{name} must be token ids in [0, {cfg.text_encoder.vocab_size})", name)

        ids_ok(self.text_ids, "text_ids")
        for name in ("num_frames", "height", "width"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{name} must be a positive int, got {v!r}",
                 name)
        BOUNDS.check_steps(who, self.num_steps)
        try:
            cfg.vae.check_video_shape(self.num_frames, self.height, self.width)
        except ValueError as e:
            t, sc = cfg.vae.temporal_compression, cfg.vae.spatial_compression
            field = "num_frames" if (self.num_frames - 1) % t else "height" if self.height % sc else "width"
            raise RequestFieldError(f"{who}: {e}", field) from None
        _, T, h, w = self.latent_shape(cfg)
        _, ph, pw = cfg.dit.patch_size
        need(h % ph == 0 and w % pw == 0, f"latent size {h}x{w} must be a multiple of the DiT patch {ph}x{pw} "
             f"(pixel size a multiple of {cfg.vae.spatial_compression * ph}x{cfg.vae.spatial_compression * pw})",
             "height" if h % ph else "width")
        for name in ("guidance_scale",) + (("guidance_scale_2",) if self.guidance_scale_2 is not None else ()):
            BOUNDS.check_guidance(who, getattr(self, name), name)
        need(self.guidance_scale_2 is None or cfg.two_experts,
             "guidance_scale_2 needs a two-expert model (upstream refuses it without boundary_ratio)",
             "guidance_scale_2")
        if self.uses_cfg:
            need(self.negative_text_ids is not None, "guidance_scale > 1 needs negative_text_ids", "negative_text_ids")
        if self.negative_text_ids is not None:
            ids_ok(self.negative_text_ids, "negative_text_ids")
        need(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and 0 <= self.seed < 2 ** 64),  # torch manual_seed takes an unsigned 64-bit int
             f"seed must be an int in [0, 2**64) or None, got {self.seed!r}", "seed")
        need(self.solver is None or self.solver in SOLVERS, f"solver must be one of {SOLVERS}, got {self.solver!r}",
             "solver")
        if self.sde is not None:  # the SDE draws its per-step noise from the request's seeded generator
            need(isinstance(self.sde, SDEConfig), "sde must be an SDEConfig", "sde")
            self.sde.validate(self.num_steps)
            need(self.seed is not None, "sde sampling needs a seed (its step noise is drawn from it)", "seed")
        need(self.flow_shift is None or (isinstance(self.flow_shift, (int, float)) and 0 < self.flow_shift < 1e3),
             f"flow_shift must be a positive number, got {self.flow_shift!r}", "flow_shift")
        if self.noise is not None:
            need(isinstance(self.noise, torch.Tensor) and self.noise.is_floating_point()
                 and tuple(self.noise.shape) == (1, *self.latent_shape(cfg)),
                 f"noise must be a float tensor of shape {[1, *self.latent_shape(cfg)]}", "noise")
        if cfg.task == "i2v":
            need(self.image is not None, "an i2v model needs an image", "image")
        if self.image is not None:
            need(cfg.task in ("i2v", "ti2v"), f"a {cfg.task} model takes no image", "image")
            need(isinstance(self.image, torch.Tensor) and self.image.is_floating_point()
                 and tuple(self.image.shape) == (3, self.height, self.width),
                 f"image must be a float tensor of shape [3, {self.height}, {self.width}] in [-1, 1]", "image")
        if cfg.dit.has_image_branch:
            need(isinstance(self.image_embeds, torch.Tensor) and self.image_embeds.is_floating_point()
                 and self.image_embeds.dim() == 2 and self.image_embeds.shape[1] == cfg.dit.image_dim,
                 f"this model's DiT has an image branch: image_embeds must be a float tensor [N, {cfg.dit.image_dim}]",
                 "image_embeds")
        else:
            need(self.image_embeds is None, "this model's DiT has no image branch: image_embeds must be None",
                 "image_embeds")
        if self.accel is not None:
            need(isinstance(self.accel, AccelSpec), f"accel must be an AccelSpec (manifests.accel.parse_accel), got "
                 f"{type(self.accel).__name__}", "accel")
            need("wan.denoise" in self.accel.kind.loops, f"acceleration {self.accel.name!r} does not apply to the wan "
                 f"denoising loop (it applies to: {', '.join(self.accel.kind.loops) or 'none'})", "accel")
        return self

