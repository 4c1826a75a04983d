"""cosmos3 sound tokenizer (AVAE): config, variants and the canonical checkpoint layout.

Upstream: diffusers 0.42.1 `Cosmos3AVAEAudioTokenizer` (only the shipped configuration: SpecConvNeXt encoder, VAE
bottleneck, Oobleck decoder with log-scale Snake, no latent normalisation). The pipeline uses only the decoder:
latents [B, latent_dim, T] at `sampling_rate / hop` Hz -> waveform [B, audio_channels, T * hop], clamped to [-1, 1].

Canonical names = diffusers' names and shapes (identity mapping). Weight-normalised convolutions keep upstream's
parametrisation `weight_g` [out_or_in, 1, 1] and `weight_v`; the weight is g * v / ||v|| with the norm over every
dim but 0 (for a ConvTranspose1d, dim 0 is the *input* channel: upstream quirk kept). Layout:

    decoder.conv1.{weight_g, weight_v [C0, latent_dim, 7], bias}         C0 = dec_dim * dec_c_mults[-1]
    decoder.block.{i}.snake1.{alpha, beta} [1, Cin, 1]
    decoder.block.{i}.conv_t1.{weight_g [Cin,1,1], weight_v [Cin, Cout, 2s], bias [Cout]}
    decoder.block.{i}.res_unit{1,2,3}.{snake1, conv1 (k7, dilation 1/3/9), snake2, conv2 (k1)}
    decoder.snake1.{alpha, beta} [1, dec_dim, 1];  decoder.conv2.{weight_g, weight_v [audio_channels, dec_dim, 7]}
    encoder.layers.{j}  (optional) flat: WN conv k1 | ConvNeXt blocks + WN strided conv per stage | WN conv k1
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manifests.errors import ManifestError
from manifests.serialise import config_from_dict, config_to_dict

VARIANTS_DIR = Path(__file__).parent / "variants"
DILATIONS = (1, 3, 9)


@dataclass(frozen=True)
class Cosmos3SoundConfig:
    sampling_rate: int = 48000
    latent_dim: int = 64                               # upstream vocoder_input_dim (= transformer sound_dim)
    dec_dim: int = 320
    dec_c_mults: tuple[int, ...] = (1, 2, 4, 8, 16)
    dec_strides: tuple[int, ...] = (2, 4, 5, 6, 8)     # applied in reverse order (8 first)
    audio_channels: int = 2                            # upstream dec_out_channels
    # encoder (only `encode` uses it; None-able via has_encoder)
    has_encoder: bool = True
    stereo: bool = True
    input_channels: int = 1
    normalize_volume: bool = True
    enc_dim: int = 192
    enc_num_blocks: int = 2
    enc_n_fft: int = 64
    enc_hop_length: int = 16
    enc_latent_dim: int = 128
    enc_c_mults: tuple[int, ...] = (1, 2, 4)
    enc_strides: tuple[int, ...] = (4, 5, 6)
    enc_use_snake: bool = True

    @property
    def hop(self) -> int:
        return math.prod(self.dec_strides)

    @property
    def latent_fps(self) -> float:
        return self.sampling_rate / self.hop

    @property
    def encoder_channels(self) -> int:
        return self.input_channels * (2 if self.stereo else 1)

    def decoder_stages(self) -> list[tuple[int, int, int]]:
        """(in_channels, out_channels, stride) per decoder block, in order."""
        cm, strides = (1, *self.dec_c_mults), tuple(reversed(self.dec_strides))
        n = len(strides)
        return [(self.dec_dim * cm[n - i], self.dec_dim * cm[n - i - 1], s) for i, s in enumerate(strides)]

    def validate(self) -> "Cosmos3SoundConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ManifestError(f"cosmos3 sound config: {msg}")

        for name in ("sampling_rate", "latent_dim", "dec_dim", "audio_channels", "input_channels", "enc_dim",
                     "enc_num_blocks", "enc_n_fft", "enc_hop_length", "enc_latent_dim"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{name} must be a positive int, got {v!r}")
        need(len(self.dec_c_mults) == len(self.dec_strides) and len(self.dec_strides) > 0,
             f"dec_c_mults and dec_strides need the same (non-zero) length, got {list(self.dec_c_mults)} / "
             f"{list(self.dec_strides)}")
        need(all(isinstance(s, int) and s > 0 for s in (*self.dec_strides, *self.dec_c_mults)),
             "dec_strides / dec_c_mults must be positive ints")
        if self.has_encoder:
            need(len(self.enc_c_mults) == len(self.enc_strides) > 0, "enc_c_mults and enc_strides need equal length")
            need(self.enc_latent_dim == 2 * self.latent_dim,
                 f"enc_latent_dim ({self.enc_latent_dim}) must be 2 * latent_dim ({2 * self.latent_dim}): mean | scale")
            need(self.enc_hop_length * math.prod(self.enc_strides) == self.hop,
                 f"encoder hop (enc_hop_length * prod(enc_strides) = "
                 f"{self.enc_hop_length * math.prod(self.enc_strides)}) must equal the decoder hop {self.hop}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Cosmos3SoundConfig":
        return config_from_dict(cls, d, "cosmos3 sound")

    @classmethod
    def from_diffusers_config(cls, c: dict[str, Any]) -> "Cosmos3SoundConfig":
        """Map a diffusers `Cosmos3AVAEAudioTokenizer` config.json onto ours (refusing unsupported settings)."""
        for key, want in (("model_type", "autoencoder_v2"), ("enc_type", "spec_convnext"), ("dec_type", "oobleck"),
                          ("bottleneck_type", "vae"), ("activation", "snakebeta"), ("padding_mode", "zeros")):
            if c.get(key, want) != want:
                raise ManifestError(f"cosmos3 sound config: {key}={c[key]!r} not supported (only {want!r})")
        for key in ("causal", "dec_final_tanh", "dec_anti_aliasing", "dec_use_nearest_upsample",
                    "dec_use_tanh_at_final", "anti_aliasing", "use_cuda_kernel"):
            if c.get(key, False):
                raise ManifestError(f"cosmos3 sound config: {key}=true not supported")
        if c.get("hop_size") is not None and c["hop_size"] != math.prod(c.get("dec_strides", (2, 4, 5, 6, 8))):
            raise ManifestError("cosmos3 sound config: hop_size differs from prod(dec_strides)")
        if c.get("latent_mean") is not None or c.get("latent_std") is not None:
            raise ManifestError("cosmos3 sound config: latent normalisation is not part of the shipped tokenizer")
        f = cls()
        return cls(
            sampling_rate=c.get("sampling_rate", f.sampling_rate), latent_dim=c.get("vocoder_input_dim", f.latent_dim),
            dec_dim=c.get("dec_dim", f.dec_dim), dec_c_mults=tuple(c.get("dec_c_mults", f.dec_c_mults)),
            dec_strides=tuple(c.get("dec_strides", f.dec_strides)),
            audio_channels=c.get("dec_out_channels", f.audio_channels),
            has_encoder=c.get("encoder_enabled", True), stereo=c.get("stereo", True),
            input_channels=c.get("input_channels", 1), normalize_volume=c.get("normalize_volume", True),
            enc_dim=c.get("enc_dim", f.enc_dim), enc_num_blocks=c.get("enc_num_blocks", f.enc_num_blocks),
            enc_n_fft=c.get("enc_n_fft", f.enc_n_fft), enc_hop_length=c.get("enc_hop_length", f.enc_hop_length),
            enc_latent_dim=c.get("enc_latent_dim", f.enc_latent_dim),
            enc_c_mults=tuple(c.get("enc_c_mults", f.enc_c_mults)),
            enc_strides=tuple(c.get("enc_strides", f.enc_strides)), enc_use_snake=c.get("enc_use_snake", True),
        ).validate()

    def to_diffusers_config(self) -> dict[str, Any]:
        return {"sampling_rate": self.sampling_rate, "vocoder_input_dim": self.latent_dim, "dec_dim": self.dec_dim,
                "dec_c_mults": list(self.dec_c_mults), "dec_strides": list(self.dec_strides),
                "dec_out_channels": self.audio_channels, "stereo": self.stereo, "input_channels": self.input_channels,
                "normalize_volume": self.normalize_volume, "enc_dim": self.enc_dim,
                "enc_num_blocks": self.enc_num_blocks, "enc_n_fft": self.enc_n_fft,
                "enc_hop_length": self.enc_hop_length, "enc_latent_dim": self.enc_latent_dim,
                "enc_c_mults": list(self.enc_c_mults), "enc_strides": list(self.enc_strides),
                "enc_use_snake": self.enc_use_snake, "encoder_enabled": self.has_encoder}


def _wn_conv(s: dict, name: str, cout: int, cin: int, k: int, bias: bool = True, transposed: bool = False) -> None:
    s[f"{name}.weight_g"] = (cin if transposed else cout, 1, 1)
    s[f"{name}.weight_v"] = (cin, cout, k) if transposed else (cout, cin, k)
    if bias:
        s[f"{name}.bias"] = (cout,)


def _snake(s: dict, name: str, c: int) -> None:
    s[f"{name}.alpha"] = (1, c, 1)
    s[f"{name}.beta"] = (1, c, 1)


def decoder_key_shapes(cfg: Cosmos3SoundConfig) -> dict[str, tuple[int, ...]]:
    s: dict[str, tuple[int, ...]] = {}
    stages = cfg.decoder_stages()
    _wn_conv(s, "decoder.conv1", stages[0][0], cfg.latent_dim, 7)
    for i, (cin, cout, stride) in enumerate(stages):
        p = f"decoder.block.{i}"
        _snake(s, f"{p}.snake1", cin)
        _wn_conv(s, f"{p}.conv_t1", cout, cin, 2 * stride, transposed=True)
        for u in (1, 2, 3):
            _snake(s, f"{p}.res_unit{u}.snake1", cout)
            _wn_conv(s, f"{p}.res_unit{u}.conv1", cout, cout, 7)
            _snake(s, f"{p}.res_unit{u}.snake2", cout)
            _wn_conv(s, f"{p}.res_unit{u}.conv2", cout, cout, 1)
    _snake(s, "decoder.snake1", cfg.dec_dim)
    _wn_conv(s, "decoder.conv2", cfg.audio_channels, cfg.dec_dim, 7, bias=False)
    return s


def encoder_key_shapes(cfg: Cosmos3SoundConfig) -> dict[str, tuple[int, ...]]:
    s: dict[str, tuple[int, ...]] = {}
    if not cfg.has_encoder:
        return s
    dims = [cfg.enc_dim * m for m in cfg.enc_c_mults]
    _wn_conv(s, "encoder.layers.0", dims[0], (cfg.enc_n_fft + 2) * cfg.encoder_channels, 1, bias=False)
    j = 1
    for i, stride in enumerate(cfg.enc_strides):
        d, nxt = dims[i], dims[i + 1] if i + 1 < len(dims) else dims[-1]
        for _ in range(cfg.enc_num_blocks):
            p = f"encoder.layers.{j}"
            s[f"{p}.dwconv.1.weight"], s[f"{p}.dwconv.1.bias"] = (d, 1, 7), (d,)
            s[f"{p}.norm.weight"] = (d,)
            s[f"{p}.pwconv1.weight"], s[f"{p}.pwconv1.bias"] = (4 * d, d, 1), (4 * d,)
            if cfg.enc_use_snake:
                _snake(s, f"{p}.act", 4 * d)
            s[f"{p}.pwconv2.weight"], s[f"{p}.pwconv2.bias"] = (d, 4 * d, 1), (d,)
            j += 1
        _wn_conv(s, f"encoder.layers.{j}", nxt, d, 2 * stride)
        j += 1
    _wn_conv(s, f"encoder.layers.{j}", cfg.enc_latent_dim, dims[-1], 1, bias=False)
    return s


def canonical_key_shapes(cfg: Cosmos3SoundConfig) -> dict[str, tuple[int, ...]]:
    return {**encoder_key_shapes(cfg), **decoder_key_shapes(cfg)}


def list_variants() -> list[str]:
    return sorted(p.stem for p in VARIANTS_DIR.glob("*.json"))


def load_variant(name: str) -> Cosmos3SoundConfig:
    path = VARIANTS_DIR / f"{name}.json"
    if not path.is_file():
        raise ManifestError(f"cosmos3 sound: unknown variant {name!r}; known variants: {', '.join(list_variants())}")
    data = json.loads(path.read_text())
    data.pop("description", None)
    return Cosmos3SoundConfig.from_dict(data)


__all__ = ["Cosmos3SoundConfig", "DILATIONS", "canonical_key_shapes", "decoder_key_shapes", "encoder_key_shapes",
           "list_variants", "load_variant"]
