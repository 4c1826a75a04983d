"""Wan VAE (2.1 and 2.2) architecture config: one frozen dataclass, named variants as JSON files beside it.

Field names follow diffusers' `AutoencoderKLWan` config (they are already clear), with two spelled right:
`temporal_downsample` (upstream `temperal_downsample`) and `patch_size` 1 for "no patchify" (upstream None).
`from_diffusers_config` maps a diffusers `config.json` onto this; it refuses what the reference does not implement
(non-empty `attn_scales`, which no released Wan VAE uses).

  2.1: z 16, base 96, dim_mult [1,2,4,4], 2 res blocks, temporal_downsample [F,T,T] -> 8x spatial, 4x temporal.
  2.2: z 48, base 160, decoder base 256, patch 2 (12 in/out channels), residual down/up paths -> 16x, 4x.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manifests.errors import ManifestError
from manifests.serialise import config_from_dict, config_to_dict, read_json_object

VARIANTS_DIR = Path(__file__).parent / "variants"


@dataclass(frozen=True)
class WanVAEConfig:
    z_dim: int
    base_dim: int
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]
    decoder_base_dim: int | None = None          # None = base_dim (2.1)
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_downsample: tuple[bool, ...] = (False, True, True)
    is_residual: bool = False                    # 2.2: residual down/up blocks (AvgDown3D / DupUp3D shortcuts)
    in_channels: int = 3                         # pixel channels * patch_size^2 (2.2: 12)
    out_channels: int = 3
    patch_size: int = 1                          # 2.2: 2 (pixel patchify before the encoder, unpatchify after)

    # ---- derived ----
    @property
    def version(self) -> str:
        return "2.2" if self.is_residual else "2.1"

    @property
    def dec_base_dim(self) -> int:
        return self.base_dim if self.decoder_base_dim is None else self.decoder_base_dim

    @property
    def temporal_upsample(self) -> tuple[bool, ...]:
        return tuple(reversed(self.temporal_downsample))

    @property
    def spatial_compression(self) -> int:
        return (2 ** (len(self.dim_mult) - 1)) * self.patch_size

    @property
    def temporal_compression(self) -> int:
        return 2 ** sum(bool(t) for t in self.temporal_downsample)

    @property
    def pixel_channels(self) -> int:
        return self.out_channels // (self.patch_size ** 2)

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """[C, T, h, w] of the latent of a [3, frames, height, width] clip (validated)."""
        self.check_video_shape(frames, height, width)
        s, t = self.spatial_compression, self.temporal_compression
        return (self.z_dim, 1 + (frames - 1) // t, height // s, width // s)

    def video_shape(self, latent_frames: int, h: int, w: int) -> tuple[int, int, int, int]:
        """[3, T, H, W] decoded from a [z, latent_frames, h, w] latent."""
        s, t = self.spatial_compression, self.temporal_compression
        return (self.pixel_channels, 1 + (latent_frames - 1) * t, h * s, w * s)

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        t, s = self.temporal_compression, self.spatial_compression
        if frames < 1 or (frames - 1) % t != 0:
            raise ValueError(f"wan VAE {self.version}: frame count must be {t}k+1 (1, {t + 1}, {2 * t + 1}, ...), "
                             f"got {frames}")
        if height <= 0 or width <= 0 or height % s or width % s:
            raise ValueError(f"wan VAE {self.version}: height and width must be positive multiples of the spatial "
                             f"compression {s}, got {height}x{width}")

    def validate(self) -> "WanVAEConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ManifestError(f"wan VAE config: {msg}")

        for name in ("z_dim", "base_dim", "num_res_blocks", "in_channels", "out_channels", "patch_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{name} must be a positive int, got {v!r}")
        need(self.decoder_base_dim is None or (isinstance(self.decoder_base_dim, int) and self.decoder_base_dim > 0),
             f"decoder_base_dim must be a positive int or null, got {self.decoder_base_dim!r}")
        need(len(self.dim_mult) >= 2 and all(isinstance(m, int) and m > 0 for m in self.dim_mult),
             f"dim_mult must hold >= 2 positive ints, got {list(self.dim_mult)}")
        need(len(self.temporal_downsample) == len(self.dim_mult) - 1,
             f"temporal_downsample needs len(dim_mult) - 1 = {len(self.dim_mult) - 1} entries, "
             f"got {list(self.temporal_downsample)}")
        need(all(isinstance(b, bool) for b in self.temporal_downsample), "temporal_downsample must hold booleans")
        p2 = self.patch_size ** 2
        need(self.in_channels % p2 == 0 and self.out_channels % p2 == 0,
             f"in/out channels ({self.in_channels}/{self.out_channels}) must be multiples of patch_size^2 ({p2})")
        need(len(self.latents_mean) == self.z_dim and len(self.latents_std) == self.z_dim,
             f"latents_mean/std need z_dim = {self.z_dim} values each, got {len(self.latents_mean)}/"
             f"{len(self.latents_std)}")
        need(all(isinstance(v, (int, float)) and math.isfinite(v) for v in self.latents_mean),
             "latents_mean must be finite numbers")
        need(all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in self.latents_std),
             "latents_std must be positive finite numbers")
        if self.is_residual:  # AvgDown3D / DupUp3D regroup channels: upstream asserts these divisibilities
            last = len(self.dim_mult) - 1
            enc = self.encoder_dims()
            for i, (a, b) in enumerate(zip(enc[:-1], enc[1:])):
                f = ((2 if self.temporal_downsample[i] else 1) * 4) if i < last else 1
                need(a * f % b == 0, f"encoder block {i}: in_dim*{f} ({a * f}) must be divisible by {b}")
            dec = self.decoder_dims()
            for i, (a, b) in enumerate(zip(dec[:-1], dec[1:])):
                if i < last:
                    f = (2 if self.temporal_upsample[i] else 1) * 4
                    need(b * f % a == 0, f"decoder block {i}: out_dim*{f} ({b * f}) must be divisible by {a}")
        return self

    def encoder_dims(self) -> list[int]:
        return [self.base_dim * m for m in (1, *self.dim_mult)]

    def decoder_dims(self) -> list[int]:
        return [self.dec_base_dim * m for m in (self.dim_mult[-1], *reversed(self.dim_mult))]

    # ---- serialisation ----
    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WanVAEConfig":
        return config_from_dict(cls, d, "wan VAE")

    @classmethod
    def from_diffusers_config(cls, c: dict[str, Any]) -> "WanVAEConfig":
        """Map a diffusers `AutoencoderKLWan` config.json (defaults as in diffusers 0.42.1) onto ours."""
        if c.get("attn_scales"):
            raise ManifestError(f"wan VAE config: attn_scales {c['attn_scales']} not supported (released VAEs use [])")
        if c.get("dropout", 0.0):
            raise ManifestError("wan VAE config: dropout must be 0 for inference")
        default_mean = WAN21_LATENTS_MEAN if c.get("z_dim", 16) == 16 else None
        default_std = WAN21_LATENTS_STD if c.get("z_dim", 16) == 16 else None
        cfg = cls(
            z_dim=c.get("z_dim", 16),
            base_dim=c.get("base_dim", 96),
            decoder_base_dim=c.get("decoder_base_dim"),
            dim_mult=tuple(c.get("dim_mult", (1, 2, 4, 4))),
            num_res_blocks=c.get("num_res_blocks", 2),
            temporal_downsample=tuple(c.get("temperal_downsample", (False, True, True))),
            is_residual=c.get("is_residual", False),
            in_channels=c.get("in_channels", 3),
            out_channels=c.get("out_channels", 3),
            patch_size=c.get("patch_size") or 1,
            latents_mean=tuple(c.get("latents_mean") or default_mean or ()),
            latents_std=tuple(c.get("latents_std") or default_std or ()),
        ).validate()
        for key, mine in (("scale_factor_spatial", cfg.spatial_compression),
                          ("scale_factor_temporal", cfg.temporal_compression)):
            if c.get(key) is not None and c[key] != mine:
                raise ManifestError(f"wan VAE config: {key} {c[key]} disagrees with the architecture ({mine})")
        return cfg

    def to_diffusers_config(self) -> dict[str, Any]:
        return {"base_dim": self.base_dim, "decoder_base_dim": self.decoder_base_dim, "z_dim": self.z_dim,
                "dim_mult": list(self.dim_mult), "num_res_blocks": self.num_res_blocks, "attn_scales": [],
                "temperal_downsample": list(self.temporal_downsample), "dropout": 0.0,
                "latents_mean": list(self.latents_mean), "latents_std": list(self.latents_std),
                "is_residual": self.is_residual, "in_channels": self.in_channels, "out_channels": self.out_channels,
                "patch_size": None if self.patch_size == 1 else self.patch_size,
                "scale_factor_temporal": self.temporal_compression, "scale_factor_spatial": self.spatial_compression}


# diffusers 0.42.1 AutoencoderKLWan defaults (= the Wan2.1 release)
WAN21_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


def list_variants() -> list[str]:
    return sorted(p.stem for p in VARIANTS_DIR.glob("*.json"))


def load_variant(name: str) -> WanVAEConfig:
    path = VARIANTS_DIR / f"{name}.json"
    if not path.is_file():
        raise ManifestError(f"wan: unknown VAE variant {name!r}; known variants: {', '.join(list_variants())}")
    data = read_json_object(path, "wan variant file")
    data.pop("description", None)
    return WanVAEConfig.from_dict(data)


def load_config_file(path: str | Path) -> WanVAEConfig:
    """Our own config JSON (as `to_dict` writes), or a diffusers `AutoencoderKLWan` config.json."""
    data = read_json_object(path, "config file")
    if "_class_name" in data or "temperal_downsample" in data:
        return WanVAEConfig.from_diffusers_config(data)
    data.pop("description", None)
    return WanVAEConfig.from_dict(data)
