"""ltx2 audio VAE: the constructor arguments of diffusers 0.42.1 `AutoencoderKLLTX2Audio`
(models/autoencoders/autoencoder_kl_ltx2_audio.py), one field each, same names, and its canonical keys (upstream's
state-dict names unchanged).

What it does (both sides implement it): a 2-D VAE over mel spectrograms [B, in_channels, T, mel_bins] (time on the
height axis), with causal 2-D convs (padding only in the past along `causality_axis`), resnets with a pixel
(RMS, eps 1e-6) or 32-group norm, optional single-head conv attention, stride-2 conv downsampling and nearest x2 +
conv upsampling. decode crops / zero-pads the spectrogram to 4 T - 3 frames and `mel_bins` bins (upstream's fixed
LATENT_DOWNSAMPLE_FACTOR 4, whatever ch_mult is). `latents_mean` / `latents_std` are base_channels long: the
pipeline normalises the patchified latents [B, T, latent_channels * latent_mel_bins] with them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from manifests.errors import ManifestError
from manifests.serialise import config_from_dict, config_to_dict

UPSTREAM_CLASS = "AutoencoderKLLTX2Audio"
LATENT_DOWNSAMPLE_FACTOR = 4      # upstream's module constant: the pipeline's and decode's time / mel ratio
CAUSALITY_AXES = ("none", "width", "height", "width-compatibility")
GROUPS = 32                       # nn.GroupNorm(num_groups=32) when norm_type == "group"


@dataclass(frozen=True)
class Ltx2AudioVaeConfig:
    base_channels: int = 128
    output_channels: int = 2
    ch_mult: tuple[int, ...] = (1, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] | None = None
    in_channels: int = 2
    resolution: int = 256
    latent_channels: int = 8
    norm_type: str = "pixel"
    causality_axis: str = "height"
    dropout: float = 0.0
    mid_block_add_attention: bool = False
    sample_rate: int = 16000
    mel_hop_length: int = 160
    is_causal: bool = True
    mel_bins: int | None = 64
    double_z: bool = True

    def level_channels(self) -> list[int]:
        return [self.base_channels * m for m in self.ch_mult]

    def encoder_attn_levels(self) -> list[bool]:
        """Whether encoder level l has attention (upstream: its resolution resolution / 2^l is listed)."""
        res = set(self.attn_resolutions or ())
        return [self.resolution // 2 ** level in res for level in range(len(self.ch_mult))]

    def decoder_attn_levels(self) -> list[bool]:
        """Upstream counts up from resolution // 2^(n-1) (the same as the encoder's when it divides)."""
        res, n = set(self.attn_resolutions or ()), len(self.ch_mult)
        return [(self.resolution // 2 ** (n - 1)) * 2 ** (n - 1 - level) in res for level in range(n)]

    def validate(self) -> Ltx2AudioVaeConfig:
        if self.causality_axis not in CAUSALITY_AXES:
            raise ManifestError(f"ltx2 audio vae: causality_axis {self.causality_axis!r} is not one of "
                                f"{list(CAUSALITY_AXES)}")
        if self.norm_type not in ("pixel", "group"):
            raise ManifestError(f"ltx2 audio vae: norm_type {self.norm_type!r} is not 'pixel' or 'group'")
        if self.norm_type == "group" and self.causality_axis != "none":
            raise ManifestError("ltx2 audio vae: a causal resnet with group norm (upstream refuses it)")
        if self.norm_type == "group" and any(c % GROUPS for c in self.level_channels()):
            raise ManifestError(f"ltx2 audio vae: group norm needs channels divisible by {GROUPS}")
        for name in ("base_channels", "output_channels", "num_res_blocks", "in_channels", "latent_channels",
                     "resolution"):
            if getattr(self, name) <= 0:
                raise ManifestError(f"ltx2 audio vae: {name} must be > 0, got {getattr(self, name)}")
        if not self.ch_mult:
            raise ManifestError("ltx2 audio vae: ch_mult is empty")
        return self

    def decoded_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, ...]:
        """[B, L, T, F] latents -> [B, output_channels, max(4 T - 3, 1), mel_bins or F] spectrogram."""
        b, _, t, f = latent_shape
        return (b, self.output_channels, max(t * LATENT_DOWNSAMPLE_FACTOR - (LATENT_DOWNSAMPLE_FACTOR - 1), 1),
                self.mel_bins if self.mel_bins is not None else f)

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ltx2AudioVaeConfig:
        d = dict(d)
        if isinstance(d.get("attn_resolutions"), list):
            d["attn_resolutions"] = tuple(d["attn_resolutions"])
        return config_from_dict(cls, d, "ltx2 audio vae").validate()

    @classmethod
    def from_diffusers_config(cls, d: dict[str, Any]) -> Ltx2AudioVaeConfig:
        if d.get("_class_name", UPSTREAM_CLASS) != UPSTREAM_CLASS:
            raise ManifestError(f"_class_name is {d['_class_name']!r}, not {UPSTREAM_CLASS}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls.from_dict({**config_to_dict(cls()), **{k: v for k, v in d.items() if k in known}})


VARIANTS: dict[str, Ltx2AudioVaeConfig] = {
    # LTX-2's structure (pixel norm, causal in time, 3 levels) at 8 / 16 / 16 channels, 16 mel bins; as released,
    # base_channels = latent_channels * mel_bins / 4 (the pipeline's packed width, which the statistics cover)
    "tiny": Ltx2AudioVaeConfig(base_channels=8, ch_mult=(1, 2, 2), num_res_blocks=1, latent_channels=2, mel_bins=16,
                               resolution=16),
    # + attention at the middle and at the 8-resolution level, width-causal
    "tiny-attn": Ltx2AudioVaeConfig(base_channels=8, ch_mult=(1, 2, 2), num_res_blocks=1, latent_channels=2,
                                    mel_bins=16, resolution=16, attn_resolutions=(8,), mid_block_add_attention=True,
                                    causality_axis="width"),
    "upstream-default": Ltx2AudioVaeConfig(),
}


def load_audio_vae_variant(name: str) -> Ltx2AudioVaeConfig:
    if name not in VARIANTS:
        raise ManifestError(f"unknown ltx2 audio vae variant {name!r}; variants: {', '.join(sorted(VARIANTS))}")
    return VARIANTS[name].validate()


def list_audio_vae_variants() -> list[str]:
    return sorted(VARIANTS)


def _conv(s: dict, name: str, c_out: int, c_in: int, k: int = 3) -> None:
    s[f"{name}.weight"], s[f"{name}.bias"] = (c_out, c_in, k, k), (c_out,)


def _norm(s: dict, name: str, ch: int, c: Ltx2AudioVaeConfig) -> None:
    if c.norm_type == "group":
        s[f"{name}.weight"], s[f"{name}.bias"] = (ch,), (ch,)


def _resnet(s: dict, name: str, c_in: int, c_out: int, c: Ltx2AudioVaeConfig) -> None:
    _norm(s, f"{name}.norm1", c_in, c)
    _conv(s, f"{name}.conv1.conv", c_out, c_in)
    _norm(s, f"{name}.norm2", c_out, c)
    _conv(s, f"{name}.conv2.conv", c_out, c_out)
    if c_in != c_out:
        _conv(s, f"{name}.nin_shortcut.conv", c_out, c_in, k=1)


def _attn(s: dict, name: str, ch: int, c: Ltx2AudioVaeConfig) -> None:
    _norm(s, f"{name}.norm", ch, c)
    for p in ("q", "k", "v", "proj_out"):
        _conv(s, f"{name}.{p}", ch, ch, k=1)


def audio_vae_key_shapes(c: Ltx2AudioVaeConfig) -> dict[str, tuple[int, ...]]:
    """Canonical keys (= upstream's state-dict names, buffers included) and shapes."""
    s: dict[str, tuple[int, ...]] = {}
    chans, n, attn = c.level_channels(), len(c.ch_mult), c.encoder_attn_levels()
    up_attn = c.decoder_attn_levels()
    _conv(s, "encoder.conv_in.conv", c.base_channels, c.in_channels)
    ch = c.base_channels
    for level in range(n):
        for b in range(c.num_res_blocks):
            _resnet(s, f"encoder.down.{level}.block.{b}", ch, chans[level], c)
            ch = chans[level]
            if attn[level]:
                _attn(s, f"encoder.down.{level}.attn.{b}", ch, c)
        if level != n - 1:
            _conv(s, f"encoder.down.{level}.downsample.conv", ch, ch)
    for part in ("encoder.mid", "decoder.mid"):
        mid = chans[-1]
        _resnet(s, f"{part}.block_1", mid, mid, c)
        if c.mid_block_add_attention:
            _attn(s, f"{part}.attn_1", mid, c)
        _resnet(s, f"{part}.block_2", mid, mid, c)
    _norm(s, "encoder.norm_out", ch, c)
    _conv(s, "encoder.conv_out.conv", 2 * c.latent_channels if c.double_z else c.latent_channels, ch)

    _conv(s, "decoder.conv_in.conv", chans[-1], c.latent_channels)
    ch = chans[-1]
    for level in reversed(range(n)):
        for b in range(c.num_res_blocks + 1):
            _resnet(s, f"decoder.up.{level}.block.{b}", ch, chans[level], c)
            ch = chans[level]
            if up_attn[level]:
                _attn(s, f"decoder.up.{level}.attn.{b}", ch, c)
        if level != 0:
            _conv(s, f"decoder.up.{level}.upsample.conv.conv", ch, ch)
    _norm(s, "decoder.norm_out", ch, c)
    _conv(s, "decoder.conv_out.conv", c.output_channels, ch)
    s["latents_mean"] = (c.base_channels,)   # upstream sizes them base_channels (= L * latent mel bins released)
    s["latents_std"] = (c.base_channels,)
    return s


AUDIO_VAE_GAINS = ("latents_std", "norm1.weight", "norm2.weight", "norm.weight", "norm_out.weight")
