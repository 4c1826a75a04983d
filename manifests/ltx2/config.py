"""ltx2 architecture config: the constructor arguments of diffusers:LTX2VideoTransformer3DModel (diffusers 0.42.1), one field each,
same names, so the upstream config.json maps by identity. Variants are JSON files in variants/."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manifests.errors import ManifestError
from manifests.serialise import config_from_dict, config_to_dict, read_json_object

VARIANTS_DIR = Path(__file__).parent / "variants"
UPSTREAM_CLASS = "LTX2VideoTransformer3DModel"


@dataclass(frozen=True)
class Ltx2Config:
    in_channels: int = 128
    out_channels: int = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    cross_attention_dim: int = 4096
    vae_scale_factors: tuple[int, ...] = (8, 32, 32)
    pos_embed_max_pos: int = 20
    base_height: int = 2048
    base_width: int = 2048
    gated_attn: bool = False
    cross_attn_mod: bool = False
    audio_in_channels: int = 128
    audio_out_channels: int = 128
    audio_patch_size: int = 1
    audio_patch_size_t: int = 1
    audio_num_attention_heads: int = 32
    audio_attention_head_dim: int = 64
    audio_cross_attention_dim: int = 2048
    audio_scale_factor: int = 4
    audio_pos_embed_max_pos: int = 20
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    audio_gated_attn: bool = False
    audio_cross_attn_mod: bool = False
    num_layers: int = 48
    activation_fn: str = 'gelu-approximate'
    qk_norm: str = 'rms_norm_across_heads'
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-06
    caption_channels: int = 3840
    attention_bias: bool = True
    attention_out_bias: bool = True
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_offset: int = 1
    timestep_scale_multiplier: int = 1000
    cross_attn_timestep_scale_multiplier: int = 1000
    rope_type: str = 'interleaved'
    use_prompt_embeddings: bool = True
    perturbed_attn: bool = False
    ff_bias: bool = True
    audio_ff_bias: bool = True
    use_prompt_adaln_single: bool = True
    use_keyframes_abs_pos_embedding: bool = False

    def validate(self) -> Ltx2Config:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and v < 0:
                raise ManifestError(f"ltx2 config: {f.name} must be >= 0, got {v}")
        return self

    @property
    def inner_dim(self) -> int:
        """The video stream's width."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def audio_inner_dim(self) -> int:
        """The audio stream's width (also the audio <-> video cross-attention's)."""
        return self.audio_num_attention_heads * self.audio_attention_head_dim

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ltx2Config:
        return config_from_dict(cls, d, "ltx2")

    @classmethod
    def from_diffusers_config(cls, d: dict[str, Any]) -> Ltx2Config:
        """An upstream config.json (diffusers' `_class_name`, `_diffusers_version` ... dropped)."""
        if d.get("_class_name", UPSTREAM_CLASS) != UPSTREAM_CLASS:
            raise ManifestError(f"_class_name is {d['_class_name']!r}, not {UPSTREAM_CLASS}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls.from_dict({k: v for k, v in d.items() if not k.startswith("_") and k in known})


def list_variants() -> list[str]:
    return sorted(p.stem for p in VARIANTS_DIR.glob("*.json"))


def load_variant(name: str) -> Ltx2Config:
    if name not in list_variants():
        raise ManifestError(f"unknown ltx2 variant {name!r}; variants: {', '.join(list_variants())}")
    return Ltx2Config.from_dict(read_json_object(VARIANTS_DIR / f"{name}.json", f"ltx2 variant {name}"))
