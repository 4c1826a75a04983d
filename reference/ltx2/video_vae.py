"""ltx2 reference video VAE: diffusers 0.42.1 `AutoencoderKLLTX2Video` (models/autoencoders/autoencoder_kl_ltx2.py),
read top to bottom: `encode(video) -> moments`, `decode(latents, timestep) -> video`, and the pipeline's latent
(de)normalisation.

Video: [B, C, T, H, W] in [-1, 1]; latents: [B, L, (T - 1) / r_t + 1, H / r_s, W / r_s]. Every conv is a causal
3-D conv: time is padded by repeating the first frame (k - 1 times; non-causal: (k - 1) / 2 first and last frames),
height / width by the config's padding mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from manifests.ltx2.video_vae import Ltx2VideoVaeConfig, video_vae_key_shapes
from reference.ltx2.model import _tree

RMS_EPS = 1e-8   # PerChannelRMSNorm's eps (not the config's resnet_norm_eps, which only its LayerNorm reads)


def rms_norm_channels(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean over channels of x^2 + eps), no gain."""
    return x / torch.sqrt(torch.mean(x ** 2, dim=1, keepdim=True) + RMS_EPS)


def causal_conv(conv: nn.Module, x: torch.Tensor, causal: bool, padding_mode: str) -> torch.Tensor:
    """LTX2VideoCausalConv3d: kernel k (always 3 here), stride 1."""
    k = conv.weight.shape[2]
    if causal:
        x = torch.cat([x[:, :, :1].repeat(1, 1, k - 1, 1, 1), x], dim=2)
    else:
        x = torch.cat([x[:, :, :1].repeat(1, 1, (k - 1) // 2, 1, 1), x,
                       x[:, :, -1:].repeat(1, 1, (k - 1) // 2, 1, 1)], dim=2)
    ph, pw = conv.weight.shape[3] // 2, conv.weight.shape[4] // 2
    if padding_mode == "zeros":
        return F.conv3d(x, conv.weight, conv.bias, padding=(0, ph, pw))
    x = F.pad(x, (pw, pw, ph, ph, 0, 0), mode=padding_mode)
    return F.conv3d(x, conv.weight, conv.bias)


def timestep_embedding(embedder: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """PixArtAlphaCombinedTimestepSizeEmbeddings without size conditions: sinusoid (256, cos first, shift 0),
    then linear -> SiLU -> linear. t: [B] -> [B, dim]."""
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    angles = t.float()[:, None] * freqs[None]
    sinusoid = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).to(t.dtype)
    e = embedder.timestep_embedder
    h = F.linear(sinusoid, e.linear_1.weight, e.linear_1.bias)
    return F.linear(F.silu(h), e.linear_2.weight, e.linear_2.bias)


def resnet(block: nn.Module, x: torch.Tensor, temb: torch.Tensor | None, causal: bool, pad: str) -> torch.Tensor:
    """LTX2VideoResnetBlock3d (in == out width): RMS-norm, [scale/shift], SiLU, conv, twice, plus the input.
    temb: [B, 4 * C] (timestep-conditioned) or None."""
    h = rms_norm_channels(x)
    if temb is not None:
        ss = temb.unflatten(1, (4, -1)) + block.scale_shift_table[None]          # [B, 4, C]
        shift_1, scale_1, shift_2, scale_2 = (v[..., None, None, None] for v in ss.unbind(dim=1))
        h = h * (1 + scale_1) + shift_1
    h = causal_conv(block.conv1.conv, F.silu(h), causal, pad)
    h = rms_norm_channels(h)
    if temb is not None:
        h = h * (1 + scale_2) + shift_2
    h = causal_conv(block.conv2.conv, F.silu(h), causal, pad)   # dropout is 0 (eval)
    return h + x


def space_to_depth(x: torch.Tensor, stride: tuple[int, int, int]) -> torch.Tensor:
    """[B, C, T*st, H*sh, W*sw] -> [B, C*st*sh*sw, T, H, W], channel index c * st*sh*sw + (i_t, i_h, i_w)."""
    st, sh, sw = stride
    x = x.unflatten(4, (-1, sw)).unflatten(3, (-1, sh)).unflatten(2, (-1, st))   # B C T st H sh W sw
    return x.permute(0, 1, 3, 5, 7, 2, 4, 6).flatten(1, 4)


def depth_to_space(x: torch.Tensor, stride: tuple[int, int, int]) -> torch.Tensor:
    """The inverse of space_to_depth."""
    st, sh, sw = stride
    b, _, t, h, w = x.shape
    x = x.reshape(b, -1, st, sh, sw, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)   # B C T st H sh W sw
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def downsample(block: nn.Module, x: torch.Tensor, stride, causal: bool, pad: str) -> torch.Tensor:
    """LTX2VideoDownsampler3d: conv then space-to-depth, plus the input space-to-depth'd and averaged in groups
    of channels down to the output width. The first st - 1 frames are repeated in front (T -> (T + st - 1) / st)."""
    x = torch.cat([x[:, :, : stride[0] - 1], x], dim=2)
    residual = space_to_depth(x, stride)
    h = space_to_depth(causal_conv(block.conv.conv, x, causal, pad), stride)
    residual = residual.unflatten(1, (h.shape[1], -1)).mean(dim=2)
    return h + residual


def upsample(block: nn.Module, x: torch.Tensor, stride, residual: bool, factor: int, causal: bool,
             pad: str) -> torch.Tensor:
    """LTX2VideoUpsampler3d: conv then depth-to-space, [plus the input depth-to-space'd and tiled over channels];
    the first st - 1 output frames are dropped (T -> T * st - st + 1)."""
    h = depth_to_space(causal_conv(block.conv.conv, x, causal, pad), stride)[:, :, stride[0] - 1:]
    if residual:
        r = depth_to_space(x, stride)
        r = r.repeat(1, stride[0] * stride[1] * stride[2] // factor, 1, 1, 1)[:, :, stride[0] - 1:]
        h = h + r
    return h


class Ltx2VideoVae(nn.Module):
    def __init__(self, cfg: Ltx2VideoVaeConfig):
        super().__init__()
        self.cfg = cfg.validate()
        _tree(self, video_vae_key_shapes(cfg))

    # ---- encode ----
    def encode(self, video: torch.Tensor, causal: bool | None = None, trace=None) -> torch.Tensor:
        """[B, C, T, H, W] -> Gaussian moments [B, 2L, T', H', W'] (upstream's encoder output: `latent_dist`)."""
        c, enc = self.cfg, self.encoder
        record = trace or (lambda name, t: None)
        causal = causal or c.encoder_causal   # upstream: `causal or self.is_causal` (False cannot switch it off)
        pad = c.encoder_spatial_padding_mode
        p = c.patch_size
        b, ch, t, hh, ww = video.shape
        # patchify: channel index c * p * p + (i_w, i_h) (upstream puts the width offset first)
        x = video.reshape(b, ch, t, 1, hh // p, p, ww // p, p).permute(0, 1, 3, 7, 5, 2, 4, 6).flatten(1, 4)
        x = causal_conv(enc.conv_in.conv, x, causal, pad)
        record("encoder.conv_in", x)
        for i, (_, _, n, stride) in enumerate(c.encoder_blocks()):
            block = enc.down_blocks[i]
            for j in range(n):
                x = resnet(block.resnets[j], x, None, causal, pad)
            if stride is not None:
                x = downsample(block.downsamplers[0], x, stride, causal, pad)
            record(f"encoder.down_blocks.{i}", x)
        for j in range(c.layers_per_block[-1]):
            x = resnet(enc.mid_block.resnets[j], x, None, causal, pad)
        record("encoder.mid_block", x)
        x = causal_conv(enc.conv_out.conv, F.silu(rms_norm_channels(x)), causal, pad)   # [B, L + 1, ...]
        record("encoder.conv_out", x)
        # L means and one log-variance channel, repeated to L channels
        return torch.cat([x, x[:, -1:].repeat(1, x.shape[1] - 2, 1, 1, 1)], dim=1)

    # ---- decode ----
    def decode(self, z: torch.Tensor, timestep: torch.Tensor | None = None, causal: bool | None = None,
               trace=None) -> torch.Tensor:
        """Latents [B, L, T, H, W] (already denormalised) -> video [B, C, (T-1)*r_t+1, H*r_s, W*r_s].
        timestep: [B] decode timesteps (required iff the config is timestep-conditioned)."""
        c, dec = self.cfg, self.decoder
        record = trace or (lambda name, t: None)
        if c.timestep_conditioning and timestep is None:
            raise ValueError("ltx2 video vae: this decoder is timestep-conditioned; pass the decode timestep")
        causal = causal or c.decoder_causal
        pad = c.decoder_spatial_padding_mode
        t = None
        if c.timestep_conditioning:
            t = timestep.to(z.dtype).flatten() * dec.timestep_scale_multiplier   # each block embeds it itself

        x = causal_conv(dec.conv_in.conv, z, causal, pad)
        record("decoder.conv_in", x)
        temb = timestep_embedding(dec.mid_block.time_embedder, t) if t is not None else None
        for j in range(c.decoder_mid_layers):
            x = resnet(dec.mid_block.resnets[j], x, temb, causal, pad)
        record("decoder.mid_block", x)
        for i, (_, _, n, stride, residual, factor) in enumerate(c.decoder_blocks()):
            block = dec.up_blocks[i]
            temb = timestep_embedding(block.time_embedder, t) if t is not None else None
            if stride is not None:
                x = upsample(block.upsamplers[0], x, stride, residual, factor, causal, pad)
            for j in range(n):
                x = resnet(block.resnets[j], x, temb, causal, pad)
            record(f"decoder.up_blocks.{i}", x)
        x = rms_norm_channels(x)
        if t is not None:
            ss = timestep_embedding(dec.time_embedder, t).unflatten(1, (2, -1)) + dec.scale_shift_table[None]
            shift, scale = (v[..., None, None, None] for v in ss.unbind(dim=1))
            x = x * (1 + scale) + shift
        x = causal_conv(dec.conv_out.conv, F.silu(x), causal, pad)
        record("decoder.conv_out", x)
        # unpatchify: channel index c * p * p + (i_w, i_h), as the encoder packed it
        p = c.patch_size
        b, _, tt, hh, ww = x.shape
        x = x.reshape(b, -1, 1, p, p, tt, hh, ww).permute(0, 1, 5, 2, 6, 4, 7, 3)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def forward(self, z: torch.Tensor, timestep: torch.Tensor | None = None, trace=None) -> torch.Tensor:
        """The parity kit's forward: decode."""
        return self.decode(z, timestep, trace=trace)

    # ---- the pipeline's latent statistics ----
    def latent_mean(self, moments: torch.Tensor) -> torch.Tensor:
        """The posterior's mode (what the image-to-video pipeline encodes with)."""
        return moments[:, : self.cfg.latent_channels]

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """LTX2Pipeline._normalize_latents: (x - mean) * scaling_factor / std, per channel."""
        mean, std = self.latents_mean.view(1, -1, 1, 1, 1), self.latents_std.view(1, -1, 1, 1, 1)
        return (latents - mean) * self.cfg.scaling_factor / std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """LTX2Pipeline._denormalize_latents: x * std / scaling_factor + mean, per channel."""
        mean, std = self.latents_mean.view(1, -1, 1, 1, 1), self.latents_std.view(1, -1, 1, 1, 1)
        return latents * std / self.cfg.scaling_factor + mean


class Ltx2VideoEncoderView(nn.Module):
    """The parity kit's forward for encode (video -> moments)."""

    def __init__(self, vae: Ltx2VideoVae):
        super().__init__()
        self.vae = vae

    def forward(self, video: torch.Tensor, trace=None) -> torch.Tensor:
        return self.vae.encode(video, trace=trace)


def load_video_vae(cfg: Ltx2VideoVaeConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> Ltx2VideoVae:
    """Strict load of the canonical state (every key, exact shapes)."""
    model = Ltx2VideoVae(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device, dtype).eval()


def load_video_encoder(cfg, state, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Ltx2VideoEncoderView:
    return Ltx2VideoEncoderView(load_video_vae(cfg, state, device, dtype))
