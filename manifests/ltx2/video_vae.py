"""ltx2 video VAE: the constructor arguments of diffusers 0.42.1 `AutoencoderKLLTX2Video`
(models/autoencoders/autoencoder_kl_ltx2.py), one field each, same names (the upstream config.json maps by
identity), the canonical keys (upstream's state-dict names unchanged) and the latent statistics.

What the VAE does (both sides implement it): encode patchifies the video (p x p pixels -> channels), runs causal
3-D conv resnets with space-to-depth downsamplers, and gives the Gaussian moments [B, 2L, T', H', W'] (mean, then
one log-variance channel repeated L times); decode runs the mirror with depth-to-space upsamplers, optionally
conditioned on the decode timestep (PixArt-style timestep embeddings + per-resnet scale/shift tables). The pipeline
normalises latents with `latents_mean` / `latents_std` (persistent buffers in the state dict) and `scaling_factor`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from manifests.errors import ManifestError
from manifests.serialise import config_from_dict, config_to_dict

UPSTREAM_CLASS = "AutoencoderKLLTX2Video"
DOWNSAMPLE_STRIDES = {"spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2)}
TIMESTEP_PROJ_DIM = 256   # PixArtAlphaCombinedTimestepSizeEmbeddings: Timesteps(num_channels=256)


@dataclass(frozen=True)
class Ltx2VideoVaeConfig:
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 128
    block_out_channels: tuple[int, ...] = (256, 512, 1024, 2048)
    down_block_types: tuple[str, ...] = ("LTX2VideoDownBlock3D",) * 4
    decoder_block_out_channels: tuple[int, ...] = (256, 512, 1024)
    layers_per_block: tuple[int, ...] = (4, 6, 6, 2, 2)
    decoder_layers_per_block: tuple[int, ...] = (5, 5, 5, 5)
    spatio_temporal_scaling: tuple[bool, ...] = (True, True, True, True)
    decoder_spatio_temporal_scaling: tuple[bool, ...] = (True, True, True)
    decoder_inject_noise: tuple[bool, ...] = (False, False, False, False)
    downsample_type: tuple[str, ...] = ("spatial", "temporal", "spatiotemporal", "spatiotemporal")
    upsample_type: tuple[str, ...] = ("spatiotemporal", "spatiotemporal", "spatiotemporal")
    upsample_residual: tuple[bool, ...] = (True, True, True)
    upsample_factor: tuple[int, ...] = (2, 2, 2)
    timestep_conditioning: bool = False
    patch_size: int = 4
    patch_size_t: int = 1
    resnet_norm_eps: float = 1e-6
    scaling_factor: float = 1.0
    encoder_causal: bool = True
    decoder_causal: bool = True
    encoder_spatial_padding_mode: str = "zeros"
    decoder_spatial_padding_mode: str = "reflect"
    spatial_compression_ratio: int | None = None
    temporal_compression_ratio: int | None = None

    # ---- derived structure (both sides build from these, never from upstream code) ----
    def encoder_blocks(self) -> list[tuple[int, int, int, tuple[int, int, int] | None]]:
        """Per down block: (channels in, channels out, resnets, downsample stride or None)."""
        blocks, ch = [], self.latent_channels   # upstream quirk: conv_in maps to latent_channels wide
        for i, out in enumerate(self.block_out_channels):
            stride = DOWNSAMPLE_STRIDES[self.downsample_type[i]] if self.spatio_temporal_scaling[i] else None
            blocks.append((ch, out, self.layers_per_block[i], stride))
            ch = out
        return blocks

    def decoder_blocks(self) -> list[tuple[int, int, int, tuple[int, int, int] | None, bool, int]]:
        """Per up block, in run order: (channels in, channels out, resnets, upsample stride or None, residual,
        upscale factor). Upstream reverses the decoder lists; block i reads channels // upsample_factor[i]."""
        chans = tuple(reversed(self.decoder_block_out_channels))
        scaling = tuple(reversed(self.decoder_spatio_temporal_scaling))
        layers = tuple(reversed(self.decoder_layers_per_block))
        residual = tuple(reversed(self.upsample_residual))
        factor = tuple(reversed(self.upsample_factor))
        blocks, ch = [], chans[0]
        for i in range(len(chans)):
            c_in, c_out = ch // factor[i], chans[i] // factor[i]
            stride = DOWNSAMPLE_STRIDES[self.upsample_type[i]] if scaling[i] else None
            blocks.append((c_in, c_out, layers[i + 1], stride, residual[i], factor[i]))
            ch = c_out
        return blocks

    @property
    def decoder_mid_channels(self) -> int:
        return self.decoder_block_out_channels[-1]

    @property
    def decoder_mid_layers(self) -> int:
        return self.decoder_layers_per_block[-1]   # reversed()[0]

    def validate(self) -> Ltx2VideoVaeConfig:
        n_enc, n_dec = len(self.block_out_channels), len(self.decoder_block_out_channels)
        lengths = {"down_block_types": (self.down_block_types, n_enc), "layers_per_block": (self.layers_per_block, n_enc + 1),
                   "spatio_temporal_scaling": (self.spatio_temporal_scaling, n_enc),
                   "downsample_type": (self.downsample_type, n_enc),
                   "decoder_layers_per_block": (self.decoder_layers_per_block, n_dec + 1),
                   "decoder_spatio_temporal_scaling": (self.decoder_spatio_temporal_scaling, n_dec),
                   "decoder_inject_noise": (self.decoder_inject_noise, n_dec + 1),
                   "upsample_type": (self.upsample_type, n_dec), "upsample_residual": (self.upsample_residual, n_dec),
                   "upsample_factor": (self.upsample_factor, n_dec)}
        for name, (value, want) in lengths.items():
            if len(value) != want:
                raise ManifestError(f"ltx2 video vae: {name} has {len(value)} entries, expected {want}")
        for name in ("in_channels", "out_channels", "latent_channels", "patch_size", "patch_size_t"):
            if getattr(self, name) <= 0:
                raise ManifestError(f"ltx2 video vae: {name} must be > 0, got {getattr(self, name)}")
        if any(t != "LTX2VideoDownBlock3D" for t in self.down_block_types):
            raise ManifestError(f"ltx2 video vae: unknown down block type in {self.down_block_types}")
        for name in ("downsample_type", "upsample_type"):
            bad = [t for t in getattr(self, name) if t not in DOWNSAMPLE_STRIDES]
            if bad:
                raise ManifestError(f"ltx2 video vae: {name} {bad[0]!r} is not one of {sorted(DOWNSAMPLE_STRIDES)}"
                                    " ('conv' is not ported)")
        for name in ("encoder_spatial_padding_mode", "decoder_spatial_padding_mode"):
            if getattr(self, name) not in ("zeros", "reflect", "replicate", "circular"):
                raise ManifestError(f"ltx2 video vae: {name} {getattr(self, name)!r} is not a Conv3d padding mode")
        if self.patch_size_t != 1:   # upstream's decoder unpatchify reads p_t channels its conv_out never makes
            raise ManifestError("ltx2 video vae: patch_size_t != 1 is not ported (upstream's decoder breaks on it)")
        if any(self.decoder_inject_noise):
            raise ManifestError("ltx2 video vae: decoder_inject_noise is not ported (no released config uses it)")
        for c_in, c_out, _, stride, _, factor in self.decoder_blocks():
            if c_in != c_out:   # upstream's conv_in resnet there gets the raw timestep or the wrong width
                raise ManifestError(f"ltx2 video vae: an up block from {c_in} to {c_out} channels is not ported")
        ch = self.decoder_mid_channels
        for i, (c_in, c_out, _, stride, residual, factor) in enumerate(self.decoder_blocks()):
            if stride is None and ch != c_out:
                raise ManifestError("ltx2 video vae: an up block without upsampler must keep its width")
            if stride is not None and residual and (c_out * factor) % (stride[0] * stride[1] * stride[2]):
                raise ManifestError(f"ltx2 video vae: up block {i}'s residual splits {c_out * factor} channels by "
                                    f"its stride {stride} (upstream fails on it)")
            ch = c_out
        for c_in, c_out, _, stride in self.encoder_blocks():
            if stride is None and c_in != c_out:
                raise ManifestError("ltx2 video vae: a down block without downsampler must keep its width")
            if stride is not None and (c_in * stride[0] * stride[1] * stride[2]) % c_out:
                raise ManifestError(f"ltx2 video vae: a downsampler from {c_in} to {c_out} channels does not group")
        return self

    # ---- sizes ----
    @property
    def spatial_ratio(self) -> int:
        """Pixels per latent pixel, counted from the strides (upstream's default attribute counts every scaled
        block as spatial: use `spatial_compression_ratio` when the config sets it)."""
        n = sum(s[1] == 2 for s in (DOWNSAMPLE_STRIDES[t] for t, on in
                                    zip(self.upsample_type, self.decoder_spatio_temporal_scaling) if on))
        return self.patch_size * 2 ** n

    @property
    def temporal_ratio(self) -> int:
        n = sum(s[0] == 2 for s in (DOWNSAMPLE_STRIDES[t] for t, on in
                                    zip(self.upsample_type, self.decoder_spatio_temporal_scaling) if on))
        return 2 ** n

    def decoded_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, ...]:
        """[B, L, T, H, W] latents -> [B, out_channels, (T - 1) * r_t + 1, H * r_s, W * r_s] frames."""
        b, _, t, h, w = latent_shape
        return (b, self.out_channels, (t - 1) * self.temporal_ratio + 1, h * self.spatial_ratio, w * self.spatial_ratio)

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ltx2VideoVaeConfig:
        return config_from_dict(cls, d, "ltx2 video vae").validate()

    @classmethod
    def from_diffusers_config(cls, d: dict[str, Any]) -> Ltx2VideoVaeConfig:
        if d.get("_class_name", UPSTREAM_CLASS) != UPSTREAM_CLASS:
            raise ManifestError(f"_class_name is {d['_class_name']!r}, not {UPSTREAM_CLASS}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        out = {k: v for k, v in d.items() if not k.startswith("_") and k in known}
        # upstream accepts one bool for a per-block tuple (broadcast, as its __init__ does)
        n_enc = len(out.get("block_out_channels", cls.block_out_channels))
        n_dec = len(out.get("decoder_block_out_channels", cls.decoder_block_out_channels))
        for name, n in (("spatio_temporal_scaling", n_enc), ("decoder_spatio_temporal_scaling", n_dec),
                        ("decoder_inject_noise", n_dec + 1), ("upsample_residual", n_dec)):
            if isinstance(out.get(name), bool):
                out[name] = [out[name]] * n
        base = config_to_dict(cls())
        return cls.from_dict({**base, **out})


VARIANTS: dict[str, Ltx2VideoVaeConfig] = {
    # 16 x 16 x 5 frames <-> 8 x 2 x 2 x 2 latents; causal encoder, non-causal reflect-padded decoder
    "tiny": Ltx2VideoVaeConfig(
        latent_channels=8, block_out_channels=(16, 32), decoder_block_out_channels=(16, 32),
        down_block_types=("LTX2VideoDownBlock3D",) * 2, layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True), decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False,) * 3, downsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal"), upsample_residual=(True, False), upsample_factor=(2, 2),
        patch_size=2, decoder_causal=False, scaling_factor=0.5),
    # the timestep-conditioned decoder (LTX-2's decode_timestep path), every stride kind, a causal decoder
    "tiny-tc": Ltx2VideoVaeConfig(
        latent_channels=8, block_out_channels=(16, 16, 32), decoder_block_out_channels=(8, 16, 32),
        down_block_types=("LTX2VideoDownBlock3D",) * 3, layers_per_block=(1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 2, 1), spatio_temporal_scaling=(True, True, True),
        decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(False,) * 4,
        downsample_type=("spatial", "temporal", "spatiotemporal"),
        upsample_type=("spatial", "temporal", "spatiotemporal"), upsample_residual=(True, True, True),
        upsample_factor=(1, 2, 2), patch_size=2, timestep_conditioning=True, decoder_causal=True),
    "upstream-default": Ltx2VideoVaeConfig(),
}


def load_video_vae_variant(name: str) -> Ltx2VideoVaeConfig:
    if name not in VARIANTS:
        raise ManifestError(f"unknown ltx2 video vae variant {name!r}; variants: {', '.join(sorted(VARIANTS))}")
    return VARIANTS[name].validate()


def list_video_vae_variants() -> list[str]:
    return sorted(VARIANTS)


def _conv(shapes: dict, name: str, c_out: int, c_in: int, k: int = 3) -> None:
    shapes[f"{name}.weight"] = (c_out, c_in, k, k, k)
    shapes[f"{name}.bias"] = (c_out,)


def _resnet(shapes: dict, name: str, ch: int, timestep: bool) -> None:
    _conv(shapes, f"{name}.conv1.conv", ch, ch)
    _conv(shapes, f"{name}.conv2.conv", ch, ch)
    if timestep:
        shapes[f"{name}.scale_shift_table"] = (4, ch)


def _time_embedder(shapes: dict, name: str, dim: int) -> None:
    t = f"{name}.timestep_embedder."
    shapes[t + "linear_1.weight"], shapes[t + "linear_1.bias"] = (dim, TIMESTEP_PROJ_DIM), (dim,)
    shapes[t + "linear_2.weight"], shapes[t + "linear_2.bias"] = (dim, dim), (dim,)


def video_vae_key_shapes(c: Ltx2VideoVaeConfig) -> dict[str, tuple[int, ...]]:
    """Canonical keys (= upstream's state-dict names, buffers included) and shapes."""
    s: dict[str, tuple[int, ...]] = {}
    _conv(s, "encoder.conv_in.conv", c.latent_channels, c.in_channels * c.patch_size ** 2)
    for i, (c_in, c_out, n, stride) in enumerate(c.encoder_blocks()):
        for j in range(n):
            _resnet(s, f"encoder.down_blocks.{i}.resnets.{j}", c_in, False)
        if stride is not None:
            _conv(s, f"encoder.down_blocks.{i}.downsamplers.0.conv.conv", c_out // (stride[0] * stride[1] * stride[2]),
                  c_in)
    mid = c.block_out_channels[-1]
    for j in range(c.layers_per_block[-1]):
        _resnet(s, f"encoder.mid_block.resnets.{j}", mid, False)
    _conv(s, "encoder.conv_out.conv", c.latent_channels + 1, mid)

    tc = c.timestep_conditioning
    ch = c.decoder_mid_channels
    _conv(s, "decoder.conv_in.conv", ch, c.latent_channels)
    if tc:
        _time_embedder(s, "decoder.mid_block.time_embedder", 4 * ch)
    for j in range(c.decoder_mid_layers):
        _resnet(s, f"decoder.mid_block.resnets.{j}", ch, tc)
    for i, (c_in, c_out, n, stride, _, factor) in enumerate(c.decoder_blocks()):
        b = f"decoder.up_blocks.{i}"
        if tc:
            _time_embedder(s, f"{b}.time_embedder", 4 * c_in)
        if stride is not None:
            up_in = c_out * factor
            _conv(s, f"{b}.upsamplers.0.conv.conv", up_in * stride[0] * stride[1] * stride[2] // factor, up_in)
        for j in range(n):
            _resnet(s, f"{b}.resnets.{j}", c_out, tc)
        ch = c_out
    _conv(s, "decoder.conv_out.conv", c.out_channels * c.patch_size ** 2, ch)
    if tc:
        s["decoder.timestep_scale_multiplier"] = ()
        _time_embedder(s, "decoder.time_embedder", 2 * ch)
        s["decoder.scale_shift_table"] = (2, ch)
    s["latents_mean"] = (c.latent_channels,)
    s["latents_std"] = (c.latent_channels,)
    return s


# drawn near 1 by random weights: the latent std (a divisor in denormalise) and the timestep multiplier (upstream
# initialises it to 1000; near 1 keeps random-weight activations O(1))
VIDEO_VAE_GAINS = ("latents_std", "timestep_scale_multiplier")
