"""ltx2 vocoder: the constructor arguments of diffusers 0.42.1 `LTX2Vocoder` (pipelines/ltx2/vocoder.py), one field
each, same names, and its canonical keys (upstream's state-dict names unchanged).

What it does (both sides implement it): a HiFi-GAN generator. The mel spectrogram [B, C, T, F] is flattened to
[B, C * F, T] (channel-major), a k7 conv widens it, then per stage: LeakyReLU(0.1), a transposed conv upsampling
time by the stage factor (halving the width), and the mean of parallel multi-dilation resblocks; finally
LeakyReLU(0.01), a k7 conv to `out_channels` and tanh. Waveform: [B, out_channels, T * prod(upsample_factors)] at
`output_sampling_rate`.

Ported: LTX-2.0's `act_fn="leaky_relu"` without anti-aliasing. The snake / anti-aliased path (LTX-2.3's
`LTX2VocoderWithBWE`) is refused by name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from manifests.errors import ManifestError
from manifests.serialise import config_from_dict, config_to_dict

UPSTREAM_CLASS = "LTX2Vocoder"


@dataclass(frozen=True)
class Ltx2VocoderConfig:
    in_channels: int = 128
    hidden_channels: int = 1024
    out_channels: int = 2
    upsample_kernel_sizes: tuple[int, ...] = (16, 15, 8, 4, 4)
    upsample_factors: tuple[int, ...] = (6, 5, 2, 2, 2)
    resnet_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resnet_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    act_fn: str = "leaky_relu"
    leaky_relu_negative_slope: float = 0.1
    antialias: bool = False
    antialias_ratio: int = 2
    antialias_kernel_size: int = 12
    final_act_fn: str | None = "tanh"
    final_bias: bool = True
    output_sampling_rate: int = 24000

    @property
    def total_upsample_factor(self) -> int:
        return math.prod(self.upsample_factors)

    def stage_channels(self) -> list[int]:
        """Width after each upsampler: hidden / 2, hidden / 4, ..."""
        return [self.hidden_channels // 2 ** (i + 1) for i in range(len(self.upsample_factors))]

    def validate(self) -> Ltx2VocoderConfig:
        if len(self.upsample_kernel_sizes) != len(self.upsample_factors):
            raise ManifestError("ltx2 vocoder: upsample_kernel_sizes and upsample_factors differ in length")
        if len(self.resnet_kernel_sizes) != len(self.resnet_dilations):
            raise ManifestError("ltx2 vocoder: resnet_kernel_sizes and resnet_dilations differ in length")
        if self.act_fn != "leaky_relu" or self.antialias:
            raise ManifestError(f"ltx2 vocoder: act_fn={self.act_fn!r} antialias={self.antialias} is not ported "
                                "(only LTX-2.0's leaky_relu without anti-aliasing)")
        if self.final_act_fn not in ("tanh", "clamp", None):
            raise ManifestError(f"ltx2 vocoder: final_act_fn {self.final_act_fn!r} is not tanh / clamp / None")
        if self.hidden_channels % 2 ** len(self.upsample_factors):
            raise ManifestError("ltx2 vocoder: hidden_channels must halve once per upsampler")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = config_to_dict(self)
        d["resnet_dilations"] = [list(x) for x in self.resnet_dilations]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ltx2VocoderConfig:
        d = dict(d)
        if "resnet_dilations" in d:
            d["resnet_dilations"] = tuple(tuple(x) for x in d["resnet_dilations"])
        return config_from_dict(cls, d, "ltx2 vocoder").validate()

    @classmethod
    def from_diffusers_config(cls, d: dict[str, Any]) -> Ltx2VocoderConfig:
        if d.get("_class_name", UPSTREAM_CLASS) != UPSTREAM_CLASS:
            raise ManifestError(f"_class_name is {d['_class_name']!r}, not {UPSTREAM_CLASS}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls.from_dict({**cls().to_dict(), **{k: v for k, v in d.items() if k in known}})


VARIANTS: dict[str, Ltx2VocoderConfig] = {
    # 2 channels x 16 mel bins in, x4 in time, two resblocks per stage (an even and an odd kernel)
    "tiny": Ltx2VocoderConfig(in_channels=32, hidden_channels=16, upsample_kernel_sizes=(4, 5), upsample_factors=(2, 2),
                              resnet_kernel_sizes=(3, 4), resnet_dilations=((1, 3), (1, 2))),
    "upstream-default": Ltx2VocoderConfig(),
}


def load_vocoder_variant(name: str) -> Ltx2VocoderConfig:
    if name not in VARIANTS:
        raise ManifestError(f"unknown ltx2 vocoder variant {name!r}; variants: {', '.join(sorted(VARIANTS))}")
    return VARIANTS[name].validate()


def list_vocoder_variants() -> list[str]:
    return sorted(VARIANTS)


def vocoder_key_shapes(c: Ltx2VocoderConfig) -> dict[str, tuple[int, ...]]:
    """Canonical keys (= upstream's state-dict names) and shapes."""
    s: dict[str, tuple[int, ...]] = {"conv_in.weight": (c.hidden_channels, c.in_channels, 7),
                                     "conv_in.bias": (c.hidden_channels,)}
    ch, n_res = c.hidden_channels, len(c.resnet_kernel_sizes)
    for i, (k, out) in enumerate(zip(c.upsample_kernel_sizes, c.stage_channels())):
        s[f"upsamplers.{i}.weight"], s[f"upsamplers.{i}.bias"] = (ch, out, k), (out,)   # ConvTranspose1d: [in, out, k]
        for j, (rk, dilations) in enumerate(zip(c.resnet_kernel_sizes, c.resnet_dilations)):
            r = f"resnets.{i * n_res + j}"
            for m in range(len(dilations)):
                for conv in ("convs1", "convs2"):
                    s[f"{r}.{conv}.{m}.weight"], s[f"{r}.{conv}.{m}.bias"] = (out, out, rk), (out,)
        ch = out
    s["conv_out.weight"] = (c.out_channels, ch, 7)
    if c.final_bias:
        s["conv_out.bias"] = (c.out_channels,)
    return s


VOCODER_GAINS: tuple[str, ...] = ()
