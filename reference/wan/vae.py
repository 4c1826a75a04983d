"""Wan VAE (2.1 and 2.2), encoder and decoder, written to be read top to bottom.

Upstream (diffusers 0.42.1 `AutoencoderKLWan`) runs the encoder on frame 0 and then on chunks of 4 frames, and the
decoder one latent frame at a time, carrying a cache of the last two input frames of every causal convolution.
This module processes the **whole clip at once** and reproduces what that chunking computes:

  * a causal 3D conv sees two zero frames before frame 0 (the chunk cache makes it an ordinary causal conv);
  * a temporal *down*sample lets frame 0 through untouched and runs its stride-2 conv over frames 0, 1, 2, ...
    (upstream: the first chunk skips the conv, later chunks prepend the previous chunk's last frame);
  * a temporal *up*sample lets frame 0 through as one frame and doubles frames 1.. with a causal conv that sees
    zeros, never frame 0, before frame 1 (upstream caches the marker "Rep", then zeros, on the first chunks);
  * 2.2's DupUp3D shortcut drops its first (factor_t - 1) frames (upstream `first_chunk=True`).

Clips have 4k+1 frames, latents 1+k frames: frame 0 is an image, every later latent frame codes 4 video frames.
Parameter names here ARE the canonical checkpoint layout (manifests/wan/keys.py; = diffusers' names).
Tensors are [B, C, T, H, W].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from manifests.wan import WanVAEConfig, canonical_key_shapes

Trace = Callable[[str, torch.Tensor], None]


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------

class CausalConv3d(nn.Module):
    """3D conv, zero-padded `time_pad` frames in front only (causal), symmetric spatial padding."""

    def __init__(self, cin: int, cout: int, kernel=(3, 3, 3), time_stride: int = 1, time_pad: int | None = None):
        super().__init__()
        kt, kh, kw = kernel
        self.weight = nn.Parameter(torch.empty(cout, cin, kt, kh, kw))
        self.bias = nn.Parameter(torch.empty(cout))
        self.time_stride = time_stride
        self.time_pad = kt - 1 if time_pad is None else time_pad
        self.space_pad = (kh // 2, kw // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ph, pw = self.space_pad
        x = F.pad(x, (pw, pw, ph, ph, self.time_pad, 0))
        return F.conv3d(x, self.weight, self.bias, stride=(self.time_stride, 1, 1))


class RMSNorm(nn.Module):
    """Channel RMS norm: x / ||x||_2 over channels * sqrt(C) * gamma (F.normalize, eps 1e-12; fp32 for half dtypes)."""

    def __init__(self, dim: int, spatial_dims: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim, *([1] * spatial_dims)))
        self.scale = dim ** 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return F.normalize(xf, dim=1).to(x.dtype) * self.scale * self.gamma


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = RMSNorm(cin, 3)
        self.conv1 = CausalConv3d(cin, cout)
        self.norm2 = RMSNorm(cout, 3)
        self.conv2 = CausalConv3d(cout, cout)
        self.conv_shortcut = CausalConv3d(cin, cout, (1, 1, 1)) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x = self.conv1(F.silu(self.norm1(x)))
        x = self.conv2(F.silu(self.norm2(x)))
        return x + skip


def frames_to_images(x: torch.Tensor) -> torch.Tensor:
    """[B, C, T, H, W] -> [B*T, C, H, W] (2D ops run on every frame independently)."""
    B, C, T, H, W = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(B * T, C, H, W)


def images_to_frames(y: torch.Tensor, B: int) -> torch.Tensor:
    BT, C, H, W = y.shape
    return y.reshape(B, BT // B, C, H, W).permute(0, 2, 1, 3, 4)


class AttentionBlock(nn.Module):
    """Single-head self-attention over the H*W positions of each frame (no attention across time)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim, 2)
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, T, H, W = x.shape
        y = self.to_qkv(self.norm(frames_to_images(x)))             # [BT, 3C, H, W]
        q, k, v = y.flatten(2).transpose(1, 2).unsqueeze(1).chunk(3, dim=-1)   # each [BT, 1, HW, C]
        y = F.scaled_dot_product_attention(q, k, v)
        y = y.squeeze(1).transpose(1, 2).reshape(B * T, C, H, W)
        return x + images_to_frames(self.proj(y), B)


class MidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        x = self.attentions[0](x)
        return self.resnets[1](x)


class Downsample(nn.Module):
    """2x spatial (pad right/bottom by 1, 3x3 conv stride 2) on every frame; with `temporal`, then 2x in time."""

    def __init__(self, dim: int, temporal: bool):
        super().__init__()
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
        self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), time_stride=2, time_pad=0) if temporal else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = images_to_frames(self.resample(frames_to_images(x)), x.shape[0])
        if self.time_conv is None or x.shape[2] == 1:
            return x
        # frame 0 passes untouched; windows (0,1,2), (2,3,4), ... give the rest (upstream chunk cache)
        return torch.cat([x[:, :, :1], self.time_conv(x)], dim=2)


class Upsample(nn.Module):
    """With `temporal`, first 2x in time; then 2x nearest spatial upsample + 3x3 conv to `out` channels."""

    def __init__(self, dim: int, out: int, temporal: bool):
        super().__init__()
        self.time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1)) if temporal else None
        self.resample = nn.Sequential(nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                                      nn.Conv2d(dim, out, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, T, H, W = x.shape
        if self.time_conv is not None and T > 1:
            # frame 0 stays one frame; frames 1.. become two each, and their causal conv sees zeros, not frame 0,
            # before frame 1 (upstream's "Rep" cache marker)
            y = self.time_conv(x[:, :, 1:])                            # [B, 2C, T-1, H, W]
            y = y.reshape(B, 2, C, T - 1, H, W).permute(0, 2, 3, 1, 4, 5).reshape(B, C, 2 * (T - 1), H, W)
            x = torch.cat([x[:, :, :1], y], dim=2)
        y = frames_to_images(x)
        y = self.resample[1](F.interpolate(y.float(), scale_factor=2.0, mode="nearest-exact").to(y.dtype))
        return images_to_frames(y, B)


def avg_down(x: torch.Tensor, cout: int, ft: int, fs: int) -> torch.Tensor:
    """2.2 shortcut (AvgDown3D): space/time-to-channel, then the mean of each group of channels.
    Time is zero-padded in front to a multiple of ft (frame 0 is averaged with a zero frame)."""
    pad_t = (ft - x.shape[2] % ft) % ft
    x = F.pad(x, (0, 0, 0, 0, pad_t, 0))
    B, C, T, H, W = x.shape
    x = x.reshape(B, C, T // ft, ft, H // fs, fs, W // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6)
    x = x.reshape(B, cout, C * ft * fs * fs // cout, T // ft, H // fs, W // fs)
    return x.mean(dim=2)


def dup_up(x: torch.Tensor, cout: int, ft: int, fs: int) -> torch.Tensor:
    """2.2 shortcut (DupUp3D): repeat channels, channel-to-space/time; the first ft-1 frames are dropped."""
    B, C, T, H, W = x.shape
    x = x.repeat_interleave(cout * ft * fs * fs // C, dim=1)
    x = x.reshape(B, cout, ft, fs, fs, T, H, W).permute(0, 1, 5, 2, 6, 3, 7, 4)
    x = x.reshape(B, cout, T * ft, H * fs, W * fs)
    return x[:, :, ft - 1:]  # upstream drops them on the first chunk only, i.e. once, at the clip start


class ResidualDownBlock(nn.Module):
    """2.2 encoder stage: res blocks + downsample, plus a parameter-free AvgDown3D shortcut of the stage input."""

    def __init__(self, cin: int, cout: int, num_res: int, temporal: bool, down: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(cin if r == 0 else cout, cout) for r in range(num_res)])
        self.downsampler = Downsample(cout, temporal) if down else None
        self.cout, self.ft, self.fs = cout, 2 if temporal else 1, 2 if down else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = avg_down(x, self.cout, self.ft, self.fs)
        for block in self.resnets:
            x = block(x)
        if self.downsampler is not None:
            x = self.downsampler(x)
        return x + skip


class UpBlock(nn.Module):
    """Decoder stage: num_res+1 res blocks and an optional upsample; 2.2 adds a DupUp3D shortcut of the input."""

    def __init__(self, cin: int, cout: int, num_res: int, temporal: bool, up: bool, residual: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(cin if r == 0 else cout, cout) for r in range(num_res + 1)])
        self.residual = residual
        if residual:
            self.upsampler = Upsample(cout, cout, temporal) if up else None
        else:  # 2.1: upsample conv halves the channels
            self.upsamplers = nn.ModuleList([Upsample(cout, cout // 2, temporal)]) if up else None
        self.cout, self.ft, self.up = cout, 2 if temporal else 1, up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = dup_up(x, self.cout, self.ft, 2) if self.residual and self.up else None
        for block in self.resnets:
            x = block(x)
        upsample = self.upsampler if self.residual else (self.upsamplers[0] if self.upsamplers else None)
        if upsample is not None:
            x = upsample(x)
        return x if skip is None else x + skip


# ----------------------------------------------------------------------------------------------
# Encoder and decoder
# ----------------------------------------------------------------------------------------------

class Encoder(nn.Module):
    def __init__(self, cfg: WanVAEConfig):
        super().__init__()
        dims, last = cfg.encoder_dims(), len(cfg.dim_mult) - 1
        self.conv_in = CausalConv3d(cfg.in_channels, dims[0])
        blocks: list[nn.Module] = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            down, temporal = i != last, i != last and cfg.temporal_downsample[i]
            if cfg.is_residual:
                blocks.append(ResidualDownBlock(cin, cout, cfg.num_res_blocks, temporal, down))
            else:  # 2.1: one flat list of res blocks and resamples
                blocks += [ResidualBlock(cin if r == 0 else cout, cout) for r in range(cfg.num_res_blocks)]
                if down:
                    blocks.append(Downsample(cout, temporal))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1], 3)
        self.conv_out = CausalConv3d(dims[-1], 2 * cfg.z_dim)

    def forward(self, x: torch.Tensor, trace: Trace | None = None) -> torch.Tensor:
        record = trace or (lambda name, t: None)
        x = self.conv_in(x)
        record("encoder.conv_in", x)
        for i, block in enumerate(self.down_blocks):
            x = block(x)
            record(f"encoder.down_blocks.{i}", x)
        x = self.mid_block(x)
        record("encoder.mid_block", x)
        x = self.conv_out(F.silu(self.norm_out(x)))
        record("encoder.conv_out", x)
        return x


class Decoder(nn.Module):
    def __init__(self, cfg: WanVAEConfig):
        super().__init__()
        dims, last = cfg.decoder_dims(), len(cfg.dim_mult) - 1
        self.conv_in = CausalConv3d(cfg.z_dim, dims[0])
        self.mid_block = MidBlock(dims[0])
        blocks = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            up, temporal = i != last, i != last and cfg.temporal_upsample[i]
            if i > 0 and not cfg.is_residual:
                cin //= 2  # 2.1: the previous stage's upsample conv halved the channels
            blocks.append(UpBlock(cin, cout, cfg.num_res_blocks, temporal, up, cfg.is_residual))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = RMSNorm(dims[-1], 3)
        self.conv_out = CausalConv3d(dims[-1], cfg.out_channels)

    def forward(self, x: torch.Tensor, trace: Trace | None = None) -> torch.Tensor:
        record = trace or (lambda name, t: None)
        x = self.conv_in(x)
        record("decoder.conv_in", x)
        x = self.mid_block(x)
        record("decoder.mid_block", x)
        for i, block in enumerate(self.up_blocks):
            x = block(x)
            record(f"decoder.up_blocks.{i}", x)
        x = self.conv_out(F.silu(self.norm_out(x)))
        record("decoder.conv_out", x)
        return x


# ----------------------------------------------------------------------------------------------
# Patchify (2.2) and the posterior
# ----------------------------------------------------------------------------------------------

def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, C*p*p, T, H/p, W/p]; channel = c*p*p + (w offset)*p + (h offset): w before h."""
    if p == 1:
        return x
    B, C, T, H, W = x.shape
    x = x.reshape(B, C, T, H // p, p, W // p, p).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(B, C * p * p, T, H // p, W // p)


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    if p == 1:
        return x
    B, Cpp, T, h, w = x.shape
    x = x.reshape(B, Cpp // (p * p), p, p, T, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(B, Cpp // (p * p), T, h * p, w * p)


@dataclass
class Posterior:
    """Diagonal Gaussian over latents: `moments` = [mean | logvar] on channels; logvar clamped to [-30, 20]."""
    mean: torch.Tensor
    logvar: torch.Tensor

    @classmethod
    def from_moments(cls, moments: torch.Tensor) -> "Posterior":
        mean, logvar = moments.chunk(2, dim=1)
        return cls(mean, logvar.clamp(-30.0, 20.0))

    @property
    def std(self) -> torch.Tensor:
        return torch.exp(0.5 * self.logvar)

    def mode(self) -> torch.Tensor:
        return self.mean

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        noise = torch.randn(self.mean.shape, generator=generator, dtype=self.mean.dtype, device="cpu")
        return self.mean + self.std * noise.to(self.mean.device)


# ----------------------------------------------------------------------------------------------
# The VAE
# ----------------------------------------------------------------------------------------------

class WanVAE(nn.Module):
    def __init__(self, cfg: WanVAEConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.quant_conv = CausalConv3d(2 * cfg.z_dim, 2 * cfg.z_dim, (1, 1, 1))
        self.post_quant_conv = CausalConv3d(cfg.z_dim, cfg.z_dim, (1, 1, 1))
        self.decoder = Decoder(cfg)

    def encode(self, video: torch.Tensor, trace: Trace | None = None) -> Posterior:
        """[B, 3, 4k+1, H, W] in [-1, 1] -> posterior over [B, z, 1+k, H/s, W/s]."""
        check_video(self.cfg, video)
        moments = self.quant_conv(self.encoder(patchify(video, self.cfg.patch_size), trace))
        if trace:
            trace("quant_conv", moments)
        return Posterior.from_moments(moments)

    def decode(self, latents: torch.Tensor, trace: Trace | None = None) -> torch.Tensor:
        """[B, z, T, h, w] -> video [B, 3, 1+4(T-1), h*s, w*s], clamped to [-1, 1]."""
        check_latents(self.cfg, latents)
        x = self.post_quant_conv(latents)
        if trace:
            trace("post_quant_conv", x)
        video = unpatchify(self.decoder(x, trace), self.cfg.patch_size).clamp(-1.0, 1.0)
        if trace:
            trace("video", video)
        return video


def check_video(cfg: WanVAEConfig, video: torch.Tensor) -> None:
    if video.ndim != 5 or video.shape[1] * cfg.patch_size ** 2 != cfg.in_channels:
        raise ValueError(f"wan VAE {cfg.version}: video must be [B, {cfg.in_channels // cfg.patch_size ** 2}, T, H, W],"
                         f" got {list(video.shape)}")
    cfg.check_video_shape(*video.shape[2:])
    if not torch.isfinite(video).all():
        raise ValueError(f"wan VAE {cfg.version}: video holds NaN or Inf values")


def check_latents(cfg: WanVAEConfig, latents: torch.Tensor) -> None:
    if latents.ndim != 5 or latents.shape[1] != cfg.z_dim or min(latents.shape[2:]) < 1:
        raise ValueError(f"wan VAE {cfg.version}: latents must be [B, {cfg.z_dim}, T, h, w], got {list(latents.shape)}")
    if not torch.isfinite(latents).all():
        raise ValueError(f"wan VAE {cfg.version}: latents hold NaN or Inf values")


def normalize_latents(cfg: WanVAEConfig, mean: torch.Tensor) -> torch.Tensor:
    """Posterior mean -> the diffusion model's latent space: (mu - latents_mean) / latents_std per channel."""
    m = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1).to(mean)
    s = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1).to(mean)
    return (mean - m) / s


def denormalize_latents(cfg: WanVAEConfig, z: torch.Tensor) -> torch.Tensor:
    """The diffusion model's latents -> what the decoder takes: z * latents_std + latents_mean per channel."""
    m = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1).to(z)
    s = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1).to(z)
    return z * s + m


def load_vae(cfg: WanVAEConfig, state: dict[str, torch.Tensor], device: str = "cpu",
             dtype: torch.dtype = torch.float32) -> WanVAE:
    """Build the VAE and load a canonical state dict strictly (every key, every shape)."""
    cfg.validate()
    want = canonical_key_shapes(cfg)
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise KeyError(f"wan VAE state dict: missing {missing[:6]}, unexpected {unexpected[:6]}")
    model = WanVAE(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()
