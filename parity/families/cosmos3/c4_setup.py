"""cosmos3 C4 set-up: the components each side runs and the two sides' whole chains.

Components (seeded random weights, CPU seconds): the variant's transformer with the Wan2.2 latent geometry imposed
(`c4_transformer_config`: latent_channels 48, patch 2, patch_latent_dim 192), a tiny Wan2.2-geometry VAE
(`c4_vae_config`: manifests/wan tiny-2.2 with z_dim = latent_channels and non-trivial latents_mean / std) and a tiny
decoder-only sound tokenizer whose latent rate equals the transformer's `sound_latent_fps` (`c4_sound_config`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from manifests import ManifestError
from manifests.cosmos3 import Cosmos3Config, canonical_key_shapes, load_variant
from manifests.cosmos3.sampling import Cosmos3GenerateRequest
from manifests.cosmos3.sound import Cosmos3SoundConfig
from manifests.cosmos3.sound import load_variant as load_sound_variant
from manifests.wan import WanVAEConfig
from manifests.wan import canonical_key_shapes as wan_vae_keys
from manifests.wan import load_variant as load_wan_variant
from parity.errors import SetupError
from parity.families.cosmos3.common import DEFAULT_VARIANTS, resolve_models
from parity.families.cosmos3_sound import sound_random_state
from parity.weights import random_state_dict

LATENT_CHANNELS, LATENT_PATCH = 48, 2          # the Wan2.2 geometry the pipeline's VAE imposes


# ------------------------------------------------------------------------------------------------
# Components: configs with one latent geometry, seeded weights
# ------------------------------------------------------------------------------------------------

def c4_transformer_config(cfg: Cosmos3Config) -> Cosmos3Config:
    """The variant with the Wan2.2 latent geometry: latent_channels 48, patch 2 (patch_latent_dim 192)."""
    try:
        return replace(cfg, latent_channels=LATENT_CHANNELS, patch_size=LATENT_PATCH,
                       patch_latent_dim=LATENT_PATCH ** 2 * LATENT_CHANNELS).validate()
    except ManifestError as e:
        raise SetupError(f"cosmos3 C4: {e}") from None


def c4_vae_config(z_dim: int) -> WanVAEConfig:
    """manifests/wan tiny-2.2 (patch 2, residual paths, 16x / 4x) with `z_dim` latent channels and per-channel
    latents_mean in [-0.3, 0.3], latents_std in [0.5, 1.5] (so a de-normalisation mistake shows)."""
    mean = tuple(round(0.3 * math.sin(1.7 * i + 0.3), 4) for i in range(z_dim))
    std = tuple(round(1.0 + 0.5 * math.cos(2.3 * i), 4) for i in range(z_dim))
    try:
        return replace(load_wan_variant("tiny-2.2"), z_dim=z_dim, latents_mean=mean, latents_std=std).validate()
    except ManifestError as e:
        raise SetupError(f"cosmos3 C4: {e}") from None


def c4_sound_config(cfg: Cosmos3Config) -> Cosmos3SoundConfig | None:
    """A tiny decoder-only AVAE (manifests/cosmos3/sound tiny, strides (2, 3): hop 6) with latent_dim = the
    transformer's sound_dim and sampling rate hop * sound_latent_fps (150 Hz at 25 latent Hz)."""
    if not cfg.has_sound:
        return None
    hop = 6
    rate = cfg.sound_latent_fps * hop
    if rate != int(rate):
        raise SetupError(f"cosmos3 C4: sound_latent_fps {cfg.sound_latent_fps} * hop {hop} is not an integer rate")
    try:
        return replace(load_sound_variant("tiny"), latent_dim=cfg.sound_dim, sampling_rate=int(rate),
                       dec_c_mults=(1, 2), dec_strides=(2, 3), has_encoder=False).validate()
    except ManifestError as e:
        raise SetupError(f"cosmos3 C4: {e}") from None


def check_geometry(cfg: Cosmos3Config, vcfg: WanVAEConfig, scfg: Cosmos3SoundConfig | None) -> None:
    """The three components must agree on the latent spaces they pass between them."""
    problems = []
    if vcfg.z_dim != cfg.latent_channels:
        problems.append(f"VAE z_dim {vcfg.z_dim} != transformer latent_channels {cfg.latent_channels}")
    if vcfg.temporal_compression != cfg.vae_temporal_compression:
        problems.append(f"VAE temporal compression {vcfg.temporal_compression} != transformer "
                        f"vae_temporal_compression {cfg.vae_temporal_compression}")
    if scfg is not None:
        if scfg.latent_dim != cfg.sound_dim:
            problems.append(f"sound latent_dim {scfg.latent_dim} != transformer sound_dim {cfg.sound_dim}")
        if scfg.latent_fps != cfg.sound_latent_fps:
            problems.append(f"sound latent rate {scfg.latent_fps} Hz != transformer sound_latent_fps "
                            f"{cfg.sound_latent_fps}")
    if problems:
        raise SetupError("cosmos3 C4: components disagree: " + "; ".join(problems))


def wan_vae_init(name: str, shape: tuple[int, ...], r: torch.Tensor) -> torch.Tensor:
    """Wan VAE weights that decode to structured frames mostly inside the [-1, 1] clamp (the golden makers'
    recipe): RMS-norm gamma 1 + 0.1r, biases 0.1r, weights r / sqrt(fan_in), decoder.conv_out halved."""
    if name.endswith("gamma"):
        return 1 + 0.1 * r
    if len(shape) == 1:
        return 0.1 * r
    return r / math.sqrt(math.prod(shape[1:])) * (0.5 if name == "decoder.conv_out.weight" else 1.0)


def vae_random_state(vcfg: WanVAEConfig, seed: int) -> dict[str, torch.Tensor]:
    return random_state_dict(wan_vae_keys(vcfg), seed, init=wan_vae_init)


def synthetic_image(height: int, width: int) -> torch.Tensor:
    """A deterministic picture [3, H, W] in [-1, 1] on the uint8 grid (x / 127.5 - 1, what the pipeline's image
    preprocessing yields): a red horizontal and green vertical gradient, a blue disc, a bright rectangle and a
    dark diagonal stripe."""
    y = torch.linspace(0, 1, height).view(-1, 1).expand(height, width)
    x = torch.linspace(0, 1, width).view(1, -1).expand(height, width)
    r, g = x.clone(), y.clone()
    b = 0.15 + 0.7 * (((x - 0.62) ** 2 + (y - 0.4) ** 2) < 0.06).float()
    rect = (x > 0.1) & (x < 0.35) & (y > 0.55) & (y < 0.9)
    r[rect], g[rect], b[rect] = 0.95, 0.9, 0.85
    stripe = ((x - y).abs() < 0.06)
    r[stripe], g[stripe], b[stripe] = 0.05, 0.1, 0.2
    rgb = torch.stack([r, g, b]).clamp(0, 1)
    return (rgb * 255).round() / 127.5 - 1.0


def conditioning_clip(image: torch.Tensor, num_frames: int) -> torch.Tensor:
    """[3, H, W] -> [1, 3, num_frames, H, W]: the image on every frame (the pipeline's i2v repeat-padding)."""
    return image[None, :, None].expand(1, 3, num_frames, *image.shape[1:]).contiguous()


# ------------------------------------------------------------------------------------------------
# The two sides, each behind one adapter (the only place the harness knows their APIs)
# ------------------------------------------------------------------------------------------------

@dataclass
class SideOutput:
    video: torch.Tensor                     # [1, 3, T, H, W] in [-1, 1]
    audio: torch.Tensor | None              # [channels, N] in [-1, 1]
    latents: dict[str, torch.Tensor]        # final latents per modality
    condition: torch.Tensor | None = None   # i2v: this side's encoded (normalised) conditioning latents


@dataclass
class Components:
    cfg: Cosmos3Config
    vcfg: WanVAEConfig
    scfg: Cosmos3SoundConfig | None
    state: dict[str, torch.Tensor]
    vae_state: dict[str, torch.Tensor]
    sound_state: dict[str, torch.Tensor] | None


class ReferenceSide:
    def __init__(self, c: Components, device: str = "cpu", dtype: torch.dtype = torch.float32):
        import reference.cosmos3 as ref
        import reference.cosmos3.sound as ref_sound
        import reference.wan as ref_wan
        self.ref, self.ref_sound, self.ref_wan = ref, ref_sound, ref_wan
        self.model = ref.load_transformer(c.cfg, c.state, device=device, dtype=dtype)
        self.vae = ref_wan.load_vae(c.vcfg, c.vae_state, device)
        self.sound = None if c.scfg is None else ref_sound.load_sound_tokenizer(c.scfg, c.sound_state, device)

    def encode_condition(self, clip: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.ref_wan.normalize_latents(self.vae.cfg, self.vae.encode(clip).mean)

    def generate(self, req: Cosmos3GenerateRequest) -> SideOutput:
        res = self.ref.generate(self.model, req)
        video, audio = self.ref_sound.decode_cosmos3_outputs(self.vae, self.sound, res.vision, res.sound)
        latents = {"vision": res.vision, **({"sound": res.sound} if res.sound is not None else {})}
        return SideOutput(video, audio, latents)


class EngineSide:
    def __init__(self, c: Components, device: str = "cpu", dtype: torch.dtype = torch.float32):
        import optimized
        import optimized.models.cosmos3.sound as opt_sound
        import optimized.models.cosmos3.vae_chain as opt_chain
        import optimized.models.wan as opt_wan
        self.opt_sound = opt_chain  # the decode / encode seams (vae_chain); the sound decoder is opt_sound's
        self.engine = optimized.Engine.from_state_dict(c.cfg, c.state, device, dtype, batching="greedy")
        self.vae = opt_wan.load_fast_vae(c.vcfg, c.vae_state, device)
        self.sound = None if c.scfg is None else opt_sound.load_fast_sound_decoder(c.scfg, c.sound_state, device)

    def encode_condition(self, clip: torch.Tensor) -> torch.Tensor:
        return self.opt_sound.encode_cosmos3_condition(self.vae, clip)

    def generate(self, req: Cosmos3GenerateRequest) -> SideOutput:
        lat = self.engine.generate(req)["latents"]
        video, audio = self.opt_sound.decode_cosmos3_outputs(self.vae, self.sound, lat["vision"], lat.get("sound"))
        return SideOutput(video, audio, dict(lat))


def resolve_components(variants: list[str], checkpoint: str | None, seed: int) -> list[tuple[str, Components]]:
    if checkpoint is not None:
        models = resolve_models(variants, checkpoint, seed)
    else:
        try:
            models = []
            for v in variants or DEFAULT_VARIANTS:
                cfg = c4_transformer_config(load_variant(v))
                models.append((v, cfg, random_state_dict(canonical_key_shapes(cfg), seed)))
        except ManifestError as e:
            raise SetupError(str(e)) from None
    out = []
    for name, cfg, state in models:
        vcfg, scfg = c4_vae_config(cfg.latent_channels), c4_sound_config(cfg)
        check_geometry(cfg, vcfg, scfg)
        out.append((name, Components(cfg, vcfg, scfg, state, vae_random_state(vcfg, seed + 1),
                                     None if scfg is None else sound_random_state(scfg, seed + 2))))
    return out
