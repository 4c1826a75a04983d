"""cosmos3 architecture config: one frozen dataclass, named variants as JSON files beside it.

Field names are ours; `from_diffusers_config` maps diffusers' `Cosmos3OmniTransformer` config onto them.
Upstream accepts inconsistent configs and silently truncates (mRoPE sections, patch dim); we refuse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manifests.errors import ManifestError
from manifests.serialise import config_from_dict, config_to_dict, read_json_object

VARIANTS_DIR = Path(__file__).parent / "variants"
HIDDEN_ACTS = ("silu", "relu2")


@dataclass(frozen=True)
class Cosmos3Config:
    # backbone
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"  # "relu2" also switches every norm to the Nemotron (all-fp32) RMSNorm
    qk_norm_for_text: bool = True
    use_und_k_norm_for_gen: bool = False  # only effective when qk_norm_for_text is False (upstream rule)
    # rotary
    rope_theta: float = 5e6
    rope_axes_dim: tuple[int, int, int] = (24, 20, 20)
    # vision latents
    latent_channels: int = 48
    patch_size: int = 2
    patch_latent_dim: int = 192
    vae_temporal_compression: int = 4  # pipeline's vae_scale_factor_temporal; sets the vision mRoPE tcf
    # time / positions
    timestep_scale: float = 0.001
    base_fps: float = 24.0
    enable_fps_modulation: bool = True
    reset_spatial_ids: bool = True
    temporal_modality_margin: int = 15000
    # optional heads (None = modality absent)
    sound_dim: int | None = None
    sound_latent_fps: float = 25.0
    action_dim: int | None = None
    num_embodiment_domains: int = 32

    # ---- derived ----
    @property
    def has_sound(self) -> bool:
        return self.sound_dim is not None

    @property
    def has_action(self) -> bool:
        return self.action_dim is not None

    @property
    def has_und_k_norm_for_gen(self) -> bool:
        return self.use_und_k_norm_for_gen and not self.qk_norm_for_text

    @property
    def gqa_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def validate(self) -> "Cosmos3Config":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ManifestError(f"cosmos3 config: {msg}")

        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "latent_channels", "patch_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{name} must be a positive int, got {v!r}")
        need(self.hidden_act in HIDDEN_ACTS, f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        need(self.num_heads % self.num_kv_heads == 0,
             f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) for GQA")
        need(self.head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        p2c = self.patch_size * self.patch_size * self.latent_channels
        need(self.patch_latent_dim == p2c,
             f"patch_latent_dim ({self.patch_latent_dim}) must equal patch_size^2 * latent_channels ({p2c})")
        half = self.head_dim // 2
        ax = tuple(self.rope_axes_dim)
        need(len(ax) == 3 and all(isinstance(a, int) and a >= 0 for a in ax),
             f"rope_axes_dim must be three non-negative ints, got {self.rope_axes_dim!r}")
        need(sum(ax) == half, f"rope_axes_dim {list(ax)} must sum to head_dim/2 = {half}")
        need(3 * ax[1] <= half and 3 * ax[2] <= half,
             f"rope_axes_dim {list(ax)}: interleaved H/W sections need 3*section <= head_dim/2 = {half} "
             f"(upstream silently truncates them)")
        for name in ("rms_norm_eps", "rope_theta", "timestep_scale", "base_fps", "sound_latent_fps"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and math.isfinite(v) and v > 0, f"{name} must be a positive number, got {v!r}")
        need(self.temporal_modality_margin >= 0, "temporal_modality_margin must be >= 0")
        need(self.vae_temporal_compression >= 1, "vae_temporal_compression must be >= 1")
        if self.sound_dim is not None:
            need(isinstance(self.sound_dim, int) and self.sound_dim > 0, f"sound_dim must be a positive int or null")
        if self.action_dim is not None:
            need(isinstance(self.action_dim, int) and self.action_dim > 0, f"action_dim must be a positive int or null")
            need(self.num_embodiment_domains > 0, "num_embodiment_domains must be > 0 with actions")
        return self

    # ---- serialisation ----
    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Cosmos3Config":
        return config_from_dict(cls, d, "cosmos3")

    @classmethod
    def from_diffusers_config(cls, c: dict[str, Any]) -> "Cosmos3Config":
        """Map a diffusers `Cosmos3OmniTransformer` config.json (defaults as in diffusers 0.42.1) onto ours."""
        axes = c.get("rope_axes_dim")
        if axes is None:  # upstream: rope_scaling["mrope_section"], else [24, 20, 20]
            axes = (c.get("rope_scaling") or {}).get("mrope_section", [24, 20, 20])
        return cls(
            hidden_size=c.get("hidden_size", 4096),
            num_layers=c.get("num_hidden_layers", 36),
            num_heads=c.get("num_attention_heads", 32),
            num_kv_heads=c.get("num_key_value_heads", 8),
            head_dim=c.get("head_dim", 128),
            intermediate_size=c.get("intermediate_size", 12288),
            vocab_size=c.get("vocab_size", 151936),
            attention_bias=c.get("attention_bias", False),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            hidden_act=c.get("hidden_act", "silu"),
            qk_norm_for_text=c.get("qk_norm_for_text", True),
            use_und_k_norm_for_gen=c.get("use_und_k_norm_for_gen", False),
            rope_theta=float(c.get("rope_theta", 5e6)),
            rope_axes_dim=tuple(axes),
            latent_channels=c.get("latent_channel", 48),
            patch_size=c.get("latent_patch_size", 2),
            patch_latent_dim=c.get("patch_latent_dim", 192),
            timestep_scale=c.get("timestep_scale", 0.001),
            base_fps=float(c.get("base_fps", 24)),
            enable_fps_modulation=c.get("enable_fps_modulation", True),
            reset_spatial_ids=c.get("unified_3d_mrope_reset_spatial_ids", True),
            temporal_modality_margin=c.get("unified_3d_mrope_temporal_modality_margin", 15000),
            sound_dim=c.get("sound_dim") if c.get("sound_gen", False) else None,
            sound_latent_fps=float(c.get("sound_latent_fps", 25.0)),
            action_dim=c.get("action_dim") if c.get("action_gen", False) else None,
            num_embodiment_domains=c.get("num_embodiment_domains", 32),
        ).validate()


def list_variants() -> list[str]:
    return sorted(p.stem for p in VARIANTS_DIR.glob("*.json"))


def load_variant(name: str) -> Cosmos3Config:
    path = VARIANTS_DIR / f"{name}.json"
    if not path.is_file():
        raise ManifestError(f"cosmos3: unknown variant {name!r}; known variants: {', '.join(list_variants())}")
    return Cosmos3Config.from_dict(read_json_object(path, "cosmos3 variant file"))


def load_config_file(path: str | Path) -> Cosmos3Config:
    return Cosmos3Config.from_dict(read_json_object(path, "config file"))
