"""Readable Wan generation: token ids (+ image) -> latents -> video, one plain `for` loop over the timesteps.

Reproduces diffusers 0.42.1 `WanPipeline.__call__` (t2v, and ti2v without an image) and
`WanImageToVideoPipeline.__call__` (i2v, and ti2v with an image) for one video per request:

    text      each prompt through UMT5, trimmed to its length and zero-padded to max_sequence_length
    noise     one float32 randn draw of [1, C, T, h, w] from a CPU generator seeded with `seed`
    schedule  UniPC (flow, `flow_shift`) or FlowMatch Euler (static `shift`)
    each step pick the expert (two-expert models), run cond (+ uncond when guidance > 1), combine, solver step
    i2v       DiT input = [noisy latents, 4-channel first-frame mask, VAE latents of (image, zeros...)]
    image     2.1 I2V: `encode_image(image)` = the CLIP encoder's hidden_states[-2] of the processor's pixels of
              the ORIGINAL image (WanImageToVideoPipeline.encode_image runs before the VAE's resize), fp32
    ti2v      per-token timesteps from a first-frame mask; with an image, latent frame 0 is the image's latents
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from manifests.solvers import FlowMatchEulerConfig, UniPCConfig
from manifests.wan.model import WanModelConfig
from manifests.wan.sampling import WanGenerateRequest
from reference.solvers.euler import FlowMatchEuler
from reference.solvers.guidance import cfg_combine
from reference.solvers.sde import FlowSDE
from reference.solvers.unipc import UniPCFlow
from reference.wan.accel import BranchCache
from reference.wan.image_encoder import load_clip_vision, preprocess_image
from reference.wan.text_encoder import encode_prompts, load_umt5
from reference.wan.transformer import load_wan_transformer
from reference.wan.vae import load_vae


@dataclass
class WanGenerateResult:
    latents: torch.Tensor                                   # [1, C, T, h, w] float32, what the decoder is given
    trajectory: list[torch.Tensor] = field(default_factory=list)  # latents after each solver step (if kept)
    timesteps: list[int | float] = field(default_factory=list)    # model timestep of each step
    experts: list[int] = field(default_factory=list)        # 1 (`transformer`) or 2 (`transformer_2`) per step
    initial: torch.Tensor | None = None                     # the initial (noise) latents
    logprobs: list = field(default_factory=list)            # SDE: one log-probability per step (None on ODE steps)
    noise: list = field(default_factory=list)               # SDE: the standard-normal draw of each step (or None)
    accel: list = field(default_factory=list)               # request.accel: AccelDecision per step and branch


def sparse_attention():
    """The reference sparse self-attention (written by the sparse-attention work), imported when first needed."""
    try:
        from reference.wan.sparse_attention import sparse_self_attention
    except ImportError:
        return None
    return sparse_self_attention


@dataclass
class ImageCondition:
    """What an image contributes to the loop (built once per request, before the first step)."""
    latents: torch.Tensor                  # i2v: [1, 4 + C, T, h, w] = [mask, condition]; ti2v: [1, C, 1, h, w]
    first_frame_mask: torch.Tensor | None  # ti2v only: [1, 1, T, h, w], 0 on latent frame 0, 1 elsewhere


def latent_stats(cfg: WanModelConfig, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents_mean, 1 / latents_std) as [1, C, 1, 1, 1]: upstream keeps the reciprocal of the std."""
    mean = torch.tensor(cfg.vae.latents_mean).view(1, -1, 1, 1, 1).to(like)
    inv_std = 1.0 / torch.tensor(cfg.vae.latents_std).view(1, -1, 1, 1, 1).to(like)  # (upstream) multiply by 1/std
    return mean, inv_std


class WanReferencePipeline:
    def __init__(self, cfg: WanModelConfig, weights: dict[str, dict[str, torch.Tensor]]):
        self.cfg = cfg.validate()
        self.transformer = load_wan_transformer(cfg.dit, weights["transformer"]).eval()
        self.transformer_2 = None
        if cfg.two_experts:
            self.transformer_2 = load_wan_transformer(cfg.dit_2, weights["transformer_2"]).eval()
        self.text_encoder = load_umt5(cfg.text_encoder, weights["text_encoder"]).eval()
        # the VAE is only needed for image conditioning and decoding; a t2v loop runs without it
        self.vae = load_vae(cfg.vae, weights["vae"]) if weights.get("vae") is not None else None
        # 2.1 I2V's CLIP image encoder, when the model has one and its weights are given (else: explicit image_embeds)
        self.image_encoder = load_clip_vision(cfg.image_encoder, weights["image_encoder"]) \
            if cfg.has_image_encoder and weights.get("image_encoder") is not None else None

    @torch.no_grad()
    def encode_image(self, image) -> torch.Tensor:
        """WanImageToVideoPipeline.encode_image for one image (PIL or uint8 [H, W, 3]): [N, image_dim] float32."""
        if self.image_encoder is None:
            raise ValueError("wan reference pipeline: encoding an image needs the 'image_encoder' weights")
        pixels = preprocess_image(image, self.cfg.image_processor)
        return self.image_encoder(pixels)[0].to(torch.float32)   # .to(transformer_dtype): fp32 here (upstream)

    # ---------------------------------------------------------------- pieces of the loop

    def make_solver(self, request: WanGenerateRequest) -> UniPCFlow | FlowMatchEuler:
        solver = request.solver or self.cfg.solver
        shift = request.flow_shift if request.flow_shift is not None else self.cfg.flow_shift
        T = self.cfg.num_train_timesteps
        if solver == "unipc":
            return UniPCFlow(UniPCConfig(num_train_timesteps=T, flow_shift=float(shift)), request.num_steps)
        return FlowMatchEuler(FlowMatchEulerConfig(num_train_timesteps=T, shift=float(shift)), request.num_steps)

    def encode_text(self, request: WanGenerateRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(cond, uncond or None) text embeddings [1, max_sequence_length, d_model]."""
        L = self.cfg.max_sequence_length
        cond = encode_prompts(self.text_encoder, [request.text_ids.long()], L)  # one encoder call per prompt (upstream)
        uncond = None
        if request.uses_cfg:  # the negative prompt is encoded only when CFG runs (upstream)
            uncond = encode_prompts(self.text_encoder, [request.negative_text_ids.long()], L)
        return cond, uncond

    def initial_latents(self, request: WanGenerateRequest, generator: torch.Generator | None = None) -> torch.Tensor:
        """`generator`: the request's own when the caller keeps drawing from it (SDE steps); else a fresh one."""
        shape = (1, *request.latent_shape(self.cfg))
        if request.noise is not None:
            return request.noise.to(torch.float32)  # caller latents are cast to float32 (upstream)
        if generator is None:
            generator = torch.Generator().manual_seed(request.seed) if request.seed is not None else None
        return torch.randn(shape, generator=generator, dtype=torch.float32)  # randn_tensor on CPU (upstream)

    def encode_condition(self, request: WanGenerateRequest, latent_shape: tuple[int, ...]) -> ImageCondition:
        """WanImageToVideoPipeline.prepare_latents: VAE-encode the image (i2v: followed by zero frames)."""
        if self.vae is None:
            raise ValueError("wan reference pipeline: image conditioning needs the 'vae' weights")
        _, _, T, h, w = latent_shape
        image = request.image.to(torch.float32)[None, :, None]  # [1, 3, 1, H, W]
        if self.cfg.expand_timesteps:
            video = image  # ti2v encodes the image alone (upstream)
        else:
            zeros = image.new_zeros(1, 3, request.num_frames - 1, request.height, request.width)
            video = torch.cat([image, zeros], dim=2)
        mean, inv_std = latent_stats(self.cfg, image)
        latents = (self.vae.encode(video).mode() - mean) * inv_std  # posterior mode ("argmax"), normalised
        if self.cfg.expand_timesteps:
            first_frame_mask = torch.ones(1, 1, T, h, w, dtype=torch.float32)
            first_frame_mask[:, :, 0] = 0
            return ImageCondition(latents=latents, first_frame_mask=first_frame_mask)
        # 4-channel mask: pixel frame 0 repeated temporal_compression times, then folded into latent frames (upstream)
        t = self.cfg.vae.temporal_compression
        mask = torch.ones(1, 1, request.num_frames, h, w)
        mask[:, :, 1:] = 0
        mask = torch.cat([torch.repeat_interleave(mask[:, :, 0:1], t, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(1, -1, t, h, w).transpose(1, 2)  # [1, t, T, h, w]
        return ImageCondition(latents=torch.cat([mask, latents], dim=1), first_frame_mask=None)

    def model_inputs(self, latents: torch.Tensor, t: torch.Tensor, condition: ImageCondition | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(DiT input, DiT timestep) for one step, as the pipelines build them."""
        if self.cfg.expand_timesteps:
            if condition is not None:
                m = condition.first_frame_mask
                x = (1 - m) * condition.latents + m * latents  # frame 0 replaced by the image latents (upstream)
            else:
                m = torch.ones(latents.shape, dtype=torch.float32)  # WanPipeline: an all-ones mask (upstream)
                x = latents
            # per-token timesteps: the mask subsampled by a hard-coded 2 (the patch), times t, flattened (upstream)
            timestep = (m[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0)
            return x, timestep
        x = latents if condition is None else torch.cat([latents, condition.latents], dim=1)
        return x, t.expand(latents.shape[0])  # int64 (UniPC) or float32 (Euler) as the scheduler holds it (upstream)

    def expert_at(self, t: torch.Tensor) -> int:
        """1 (`transformer`) while t >= boundary_ratio * num_train_timesteps, else 2 (upstream)."""
        if not self.cfg.two_experts:
            return 1
        return 1 if t >= self.cfg.boundary_ratio * self.cfg.num_train_timesteps else 2

    def guided_velocity(self, request: WanGenerateRequest, latents: torch.Tensor, t: torch.Tensor, expert: int,
                        text: torch.Tensor, negative_text: torch.Tensor | None, image_embeds: torch.Tensor | None,
                        condition: ImageCondition | None, caches: dict | None = None, step: int = 0,
                        decisions: list | None = None) -> torch.Tensor:
        """One step's velocity: cond, and with CFG the uncond branch combined (the expert's guidance scale).
        `caches`: request.accel's BranchCache per branch (reference/wan/accel.py); its decisions go to `decisions`."""
        model = self.transformer if expert == 1 else self.transformer_2
        x, timestep = self.model_inputs(latents, t, condition)
        if caches is not None:
            velocity, decision = caches["cond"].forward(model, step, x, timestep, text, image_embeds,
                                                        sparse_attention())
            decisions.append(decision)
            if request.uses_cfg:
                uncond, decision = caches["uncond"].forward(model, step, x, timestep, negative_text, image_embeds,
                                                            sparse_attention(), cond_output=velocity)
                decisions.append(decision)
                if uncond is not None:   # a skipped uncond branch (guidance interval): the cond velocity alone
                    velocity = cfg_combine(velocity, uncond, request.guidance_for_expert(expert))
            return velocity
        velocity = model(x, timestep, text, image_embeds)
        if request.uses_cfg:  # decided by guidance_scale alone, even when guidance_scale_2 applies (upstream)
            velocity_uncond = model(x, timestep, negative_text, image_embeds)
            velocity = cfg_combine(velocity, velocity_uncond, request.guidance_for_expert(expert))
        return velocity

    # ---------------------------------------------------------------- the loop

    @torch.no_grad()
    def generate(self, request: WanGenerateRequest, keep_trajectory: bool = False) -> WanGenerateResult:
        cfg = self.cfg
        request.validate(cfg)
        text, negative_text = self.encode_text(request)
        image_embeds = None
        if cfg.dit.has_image_branch:  # only the 2.1 I2V DiT takes CLIP image embeddings (upstream)
            image_embeds = request.image_embeds.to(torch.float32)[None]
        solver = self.make_solver(request)
        generator = torch.Generator().manual_seed(request.seed) if request.seed is not None else None
        latents = self.initial_latents(request, generator)
        sde = FlowSDE(request.sde, solver.sigmas) if request.sde is not None else None  # SDE on the solver's tables
        result = WanGenerateResult(latents=latents, initial=latents.clone())
        condition = self.encode_condition(request, tuple(latents.shape)) if request.image is not None else None
        caches = None
        if request.accel is not None:   # one cache per CFG branch for the whole run
            if cfg.two_experts and request.accel.name in ("fbcache", "dbcache", "taylorseer", "magcache", "cfg_delta"):
                raise ValueError(f"wan reference: accel {request.accel.name} on a two-expert model is not supported")
            caches = {b: BranchCache(request.accel, b, request.num_steps, cfg.dit.num_layers)
                      for b in (("cond", "uncond") if request.uses_cfg else ("cond",))}

        for i, t in enumerate(solver.timesteps):
            expert = self.expert_at(t)
            velocity = self.guided_velocity(request, latents, t, expert, text, negative_text, image_embeds, condition,
                                            caches, i, result.accel)
            if sde is not None:  # one fp32 randn of the latent shape per SDE step, from the request's generator
                noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32) \
                    if sde.is_sde_step(i) else None
                latents, logprob = sde.step(velocity, latents, i, noise)
                result.logprobs.append(logprob)
                result.noise.append(noise)
            else:
                latents = solver.step(velocity, latents)
            result.timesteps.append(t.item())
            result.experts.append(expert)
            if keep_trajectory:
                result.trajectory.append(latents.clone())  # what callback_on_step_end sees (before any blend)

        if condition is not None and condition.first_frame_mask is not None:
            m = condition.first_frame_mask
            latents = (1 - m) * condition.latents + m * latents  # ti2v: frame 0 = image latents at the end (upstream)
        result.latents = latents
        return result

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> video [1, 3, F, H, W] in [-1, 1]: de-normalise as WanPipeline does, then the VAE decoder."""
        if self.vae is None:
            raise ValueError("wan reference pipeline: decoding needs the 'vae' weights")
        latents = latents.to(torch.float32)
        mean, inv_std = latent_stats(self.cfg, latents)
        return self.vae.decode(latents / inv_std + mean)  # divide by the reciprocal std (upstream)
