"""ltx2 text connectors: the constructor arguments of diffusers 0.42.1 `LTX2TextConnectors` (pipelines/ltx2/
connectors.py), one field each, same names (the upstream config.json maps by identity), and their canonical keys
(upstream's state-dict names unchanged).

What the connectors do (both sides implement it): the text encoder's hidden states of every layer [B, L, C, K]
(C = caption_channels, K = text_proj_in_factor = layers + 1) are normalised per sample and layer (LTX-2.0: masked
mean / range, x 8; LTX-2.3 `per_modality_projections`: per-token RMS), projected, then one small 1-D transformer per
modality (RMSNorm, self-attention with 1-D RoPE, GELU feed-forward) turns them into the DiT's video / audio text
tokens. With learnable registers the padding is replaced by registers and the mask becomes all-ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from manifests.errors import ManifestError
from manifests.serialise import config_from_dict, config_to_dict

UPSTREAM_CLASS = "LTX2TextConnectors"


@dataclass(frozen=True)
class Ltx2ConnectorsConfig:
    caption_channels: int = 3840
    text_proj_in_factor: int = 49
    video_connector_num_attention_heads: int = 30
    video_connector_attention_head_dim: int = 128
    video_connector_num_layers: int = 2
    video_connector_num_learnable_registers: int | None = 128
    video_gated_attn: bool = False
    audio_connector_num_attention_heads: int = 30
    audio_connector_attention_head_dim: int = 128
    audio_connector_num_layers: int = 2
    audio_connector_num_learnable_registers: int | None = 128
    audio_gated_attn: bool = False
    connector_rope_base_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_temporal_positioning: bool = False
    rope_type: str = "interleaved"
    per_modality_projections: bool = False
    video_hidden_dim: int = 4096
    audio_hidden_dim: int = 2048
    proj_bias: bool = False

    def stream(self, name: str) -> tuple[int, int, int, int | None, bool]:
        """(heads, head_dim, layers, registers, gated) of the `video` or `audio` connector."""
        p = f"{name}_connector_"
        return (getattr(self, p + "num_attention_heads"), getattr(self, p + "attention_head_dim"),
                getattr(self, p + "num_layers"), getattr(self, p + "num_learnable_registers"),
                getattr(self, f"{name}_gated_attn"))

    def inner_dim(self, name: str) -> int:
        heads, head_dim, *_ = self.stream(name)
        return heads * head_dim

    def validate(self) -> Ltx2ConnectorsConfig:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and v <= 0 and f.name != "causal_temporal_positioning":
                raise ManifestError(f"ltx2 connectors: {f.name} must be > 0, got {v}")
        if self.rope_type not in ("interleaved", "split"):
            raise ManifestError(f"ltx2 connectors: rope_type must be 'interleaved' or 'split', got {self.rope_type!r}")
        for name in ("video", "audio"):
            want = (self.video_hidden_dim if name == "video" else self.audio_hidden_dim) \
                if self.per_modality_projections else self.caption_channels
            if self.inner_dim(name) != want:
                raise ManifestError(f"ltx2 connectors: the {name} connector is {self.inner_dim(name)} wide but its "
                                    f"projection gives {want}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ltx2ConnectorsConfig:
        return config_from_dict(cls, d, "ltx2 connectors").validate()

    @classmethod
    def from_diffusers_config(cls, d: dict[str, Any]) -> Ltx2ConnectorsConfig:
        if d.get("_class_name", UPSTREAM_CLASS) != UPSTREAM_CLASS:
            raise ManifestError(f"_class_name is {d['_class_name']!r}, not {UPSTREAM_CLASS}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls.from_dict({k: v for k, v in d.items() if not k.startswith("_") and k in known})


# tiny: 16 wide to match the tiny transformer's caption_channels (LTX-2.0: one projection feeds both connectors)
VARIANTS: dict[str, Ltx2ConnectorsConfig] = {
    "tiny": Ltx2ConnectorsConfig(
        caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=2, video_connector_num_learnable_registers=4,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=4),
    # LTX-2.3 switches, as wide as the tiny-2.3 transformer's text cross-attention: per-modality projections
    # (with bias), gated attention, split RoPE, no audio registers
    "tiny-2.3": Ltx2ConnectorsConfig(
        caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1, video_connector_num_learnable_registers=4,
        video_gated_attn=True, audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=None, audio_gated_attn=True,
        rope_type="split", per_modality_projections=True, video_hidden_dim=16, audio_hidden_dim=16, proj_bias=True),
    "upstream-default": Ltx2ConnectorsConfig(),
}


def load_connectors_variant(name: str) -> Ltx2ConnectorsConfig:
    if name not in VARIANTS:
        raise ManifestError(f"unknown ltx2 connectors variant {name!r}; variants: {', '.join(sorted(VARIANTS))}")
    return VARIANTS[name].validate()


def connector_key_shapes(c: Ltx2ConnectorsConfig) -> dict[str, tuple[int, ...]]:
    """Canonical keys (= upstream's state-dict names) and shapes."""
    shapes: dict[str, tuple[int, ...]] = {}
    text_dim = c.caption_channels * c.text_proj_in_factor
    projections = ((("video_text_proj_in", c.video_hidden_dim), ("audio_text_proj_in", c.audio_hidden_dim))
                   if c.per_modality_projections else (("text_proj_in", c.caption_channels),))
    for name, out in projections:
        shapes[f"{name}.weight"] = (out, text_dim)
        if c.proj_bias:
            shapes[f"{name}.bias"] = (out,)
    for stream in ("video", "audio"):
        heads, _, layers, registers, gated = c.stream(stream)
        d = c.inner_dim(stream)
        root = f"{stream}_connector."
        if registers is not None:
            shapes[root + "learnable_registers"] = (registers, d)
        for i in range(layers):
            b = f"{root}transformer_blocks.{i}."
            shapes[b + "attn1.norm_q.weight"] = (d,)
            shapes[b + "attn1.norm_k.weight"] = (d,)
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                shapes[f"{b}attn1.{proj}.weight"] = (d, d)
                shapes[f"{b}attn1.{proj}.bias"] = (d,)
            if gated:
                shapes[b + "attn1.to_gate_logits.weight"] = (heads, d)
                shapes[b + "attn1.to_gate_logits.bias"] = (heads,)
            shapes[b + "ff.net.0.proj.weight"] = (4 * d, d)
            shapes[b + "ff.net.0.proj.bias"] = (4 * d,)
            shapes[b + "ff.net.2.weight"] = (d, 4 * d)
            shapes[b + "ff.net.2.bias"] = (d,)
    return shapes


def connector_gains(c: Ltx2ConnectorsConfig) -> tuple[str, ...]:
    """Norm gains (random weights draw these as ones, as upstream initialises them)."""
    return tuple(k for k in connector_key_shapes(c) if k.endswith(("norm_q.weight", "norm_k.weight")))
