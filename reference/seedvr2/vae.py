"""SeedVR2 causal video VAE (upstream video_vae_v3), readable reference. Layout (b, c, t, h, w).

3 -> 16 latent channels, x8 space, x4 time with a causal first frame (latent T = (T-1)/4 + 1). Every 3D conv is
causal in time (front-padded by repeating the first frame) and zero-padded in space; GroupNorm runs per frame.
Pipeline scaling: DiT latent = z * 0.9152 (applied by the sampler, not here). One-shot (no temporal slicing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from manifests.seedvr2.config import VAEConfig
from manifests.seedvr2.keys import vae_key_shapes, vae_temporal_down, vae_temporal_up


def causal_pad(x: torch.Tensor, frames: int) -> torch.Tensor:
    """Front-pad time by repeating the first frame."""
    return torch.cat([x[:, :, :1].expand(-1, -1, frames, -1, -1), x], dim=2) if frames else x


class CausalConv3d(nn.Conv3d):
    def __init__(self, cin: int, cout: int, kernel: tuple[int, int, int], stride=(1, 1, 1), spatial_pad: bool = True):
        super().__init__(cin, cout, kernel, stride=stride)
        self.spatial_pad = spatial_pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kt, kh, kw = self.kernel_size
        x = causal_pad(x, kt - 1)
        if self.spatial_pad:
            x = F.pad(x, (kw // 2, kw // 2, kh // 2, kh // 2))
        return F.conv3d(x, self.weight, self.bias, self.stride)


class FrameGroupNorm(nn.GroupNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        y = super().forward(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        return y.view(b, t, c, h, w).permute(0, 2, 1, 3, 4)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, cfg: VAEConfig):
        super().__init__()
        self.norm1 = FrameGroupNorm(cfg.norm_groups, cin, eps=cfg.norm_eps)
        self.conv1 = CausalConv3d(cin, cout, (3, 3, 3))
        self.norm2 = FrameGroupNorm(cfg.norm_groups, cout, eps=cfg.norm_eps)
        self.conv2 = CausalConv3d(cout, cout, (3, 3, 3))
        self.conv_shortcut = nn.Conv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class FrameAttention(nn.Module):
    """Single-head spatial self-attention inside each frame, with a residual."""

    def __init__(self, c: int, cfg: VAEConfig):
        super().__init__()
        self.group_norm = nn.GroupNorm(cfg.norm_groups, c, eps=cfg.norm_eps)
        self.to_q, self.to_k, self.to_v = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.to_out = nn.ModuleList([nn.Linear(c, c)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        tokens = self.group_norm(frames).flatten(2).transpose(1, 2)          # (b*t, h*w, c)
        q, k, v = self.to_q(tokens), self.to_k(tokens), self.to_v(tokens)
        out = self.to_out[0](F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0])
        out = out.transpose(1, 2).reshape(b * t, c, h, w) + frames
        return out.view(b, t, c, h, w).permute(0, 2, 1, 3, 4)


class MidBlock(nn.Module):
    def __init__(self, c: int, cfg: VAEConfig):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(c, c, cfg), ResnetBlock(c, c, cfg)])
        self.attentions = nn.ModuleList([FrameAttention(c, cfg)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class Downsample(nn.Module):
    """Zero pad (right, bottom) by one, then a stride-2 conv; in time too (causal) when `temporal`."""

    def __init__(self, c: int, temporal: bool):
        super().__init__()
        self.temporal = temporal
        kt = 3 if temporal else 1
        self.conv = CausalConv3d(c, c, (kt, 3, 3), stride=(2 if temporal else 1, 2, 2), spatial_pad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """1x1x1 conv to c*(2*2[*2]) channels, pixel shuffle, drop the duplicated first frame when upsampling time,
    then a causal 3x3x3 conv."""

    def __init__(self, c: int, temporal: bool):
        super().__init__()
        self.temporal = temporal
        self.upscale_conv = nn.Conv3d(c, c * (8 if temporal else 4), 1)
        self.conv = CausalConv3d(c, c, (3, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        z = 2 if self.temporal else 1
        y = self.upscale_conv(x).view(b, 2, 2, z, c, t, h, w)                # channels ordered (x, y, z, c)
        y = y.permute(0, 4, 5, 3, 6, 1, 7, 2).reshape(b, c, t * z, h * 2, w * 2)
        if self.temporal:
            y = y[:, :, 1:]
        return self.conv(y)


class Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        ch = cfg.block_out_channels
        self.conv_in = CausalConv3d(cfg.in_channels, ch[0], (3, 3, 3))
        self.down_blocks = nn.ModuleList()
        cin = ch[0]
        for b, cout in enumerate(ch):
            block = nn.Module()
            block.resnets = nn.ModuleList(ResnetBlock(cin if r == 0 else cout, cout, cfg)
                                          for r in range(cfg.layers_per_block))
            if b < len(ch) - 1:
                block.downsamplers = nn.ModuleList([Downsample(cout, vae_temporal_down(cfg, b))])
            self.down_blocks.append(block)
            cin = cout
        self.mid_block = MidBlock(ch[-1], cfg)
        self.conv_norm_out = FrameGroupNorm(cfg.norm_groups, ch[-1], eps=cfg.norm_eps)
        self.conv_out = CausalConv3d(ch[-1], 2 * cfg.latent_channels, (3, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            for r in block.resnets:
                x = r(x)
            if hasattr(block, "downsamplers"):
                x = block.downsamplers[0](x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        rev = cfg.block_out_channels[::-1]
        self.conv_in = CausalConv3d(cfg.latent_channels, rev[0], (3, 3, 3))
        self.mid_block = MidBlock(rev[0], cfg)
        self.up_blocks = nn.ModuleList()
        cin = rev[0]
        for b, cout in enumerate(rev):
            block = nn.Module()
            block.resnets = nn.ModuleList(ResnetBlock(cin if r == 0 else cout, cout, cfg)
                                          for r in range(cfg.layers_per_block + 1))
            if b < len(rev) - 1:
                block.upsamplers = nn.ModuleList([Upsample(cout, vae_temporal_up(cfg, b))])
            self.up_blocks.append(block)
            cin = cout
        self.conv_norm_out = FrameGroupNorm(cfg.norm_groups, rev[-1], eps=cfg.norm_eps)
        self.conv_out = CausalConv3d(rev[-1], cfg.in_channels, (3, 3, 3))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            for r in block.resnets:
                x = r(x)
            if hasattr(block, "upsamplers"):
                x = block.upsamplers[0](x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class VideoVAE(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    def encode_moments(self, x: torch.Tensor) -> torch.Tensor:
        """(b, 3, 4k+1, H, W) in [-1, 1] -> raw [mean | logvar] (b, 32, k+1, H/8, W/8)."""
        return self.encoder(x)

    def posterior(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std), logvar clamped to [-30, 20]."""
        mean, logvar = self.encode_moments(x).chunk(2, dim=1)
        return mean, torch.exp(0.5 * logvar.clamp(-30.0, 20.0))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)


def load_vae(cfg: VAEConfig, state: dict[str, torch.Tensor], device: str = "cpu",
             dtype: torch.dtype = torch.float32) -> VideoVAE:
    want = vae_key_shapes(cfg)
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise KeyError(f"seedvr2 VAE state dict: missing {missing[:5]}, unexpected {extra[:5]}")
    model = VideoVAE(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()
