"""Fast SeedVR2 causal video VAE: functional over the canonical weight dict (no nn.Module tree), frames folded
into the batch for GroupNorm and attention. Same facts as the reference, written independently: causal time
padding by first-frame repetition, per-frame GroupNorm, stride-2 downsampling after a (right, bottom) zero pad,
1x1x1 upscale conv + (x y z c) pixel shuffle with the duplicated first frame dropped, single-head mid attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from manifests.seedvr2.config import VAEConfig
from manifests.seedvr2.keys import vae_temporal_down, vae_temporal_up
from optimized.models.seedvr2.spec import vae_component
from optimized.runtime.spec import apply_load_transforms


class FastVAE:
    def __init__(self, cfg: VAEConfig, params: dict[str, torch.Tensor]):
        self.cfg = cfg.validate()
        self.p = params

    # ---- primitives
    def conv(self, x, name, stride=(1, 1, 1), pad_space=True):
        w = self.p[f"{name}.weight"]
        kt, kh, kw = w.shape[2:]
        if kt > 1:
            x = torch.cat([x[:, :, :1].repeat(1, 1, kt - 1, 1, 1), x], 2)
        return F.conv3d(x, w, self.p[f"{name}.bias"], stride, padding=(0, kh // 2, kw // 2) if pad_space else 0)

    def norm(self, x, name):
        b, c, t, h, w = x.shape
        y = x.transpose(1, 2).reshape(b * t, c, h, w)
        y = F.group_norm(y, self.cfg.norm_groups, self.p[f"{name}.weight"], self.p[f"{name}.bias"], self.cfg.norm_eps)
        return y.view(b, t, c, h, w).transpose(1, 2)

    def resnet(self, x, name):
        h = self.conv(F.silu(self.norm(x, f"{name}.norm1")), f"{name}.conv1")
        h = self.conv(F.silu(self.norm(h, f"{name}.norm2")), f"{name}.conv2")
        skip = f"{name}.conv_shortcut.weight"
        return (F.conv3d(x, self.p[skip], self.p[f"{name}.conv_shortcut.bias"]) if skip in self.p else x) + h

    def attention(self, x, name):
        b, c, t, h, w = x.shape
        fr = x.transpose(1, 2).reshape(b * t, c, h * w)
        n = F.group_norm(fr, self.cfg.norm_groups, self.p[f"{name}.group_norm.weight"],
                         self.p[f"{name}.group_norm.bias"], self.cfg.norm_eps).transpose(1, 2)
        lin = lambda m, y: F.linear(y, self.p[f"{name}.{m}.weight"], self.p[f"{name}.{m}.bias"])
        o = F.scaled_dot_product_attention(lin("to_q", n), lin("to_k", n), lin("to_v", n))
        fr = fr + lin("to_out.0", o).transpose(1, 2)
        return fr.view(b, t, c, h, w).transpose(1, 2)

    def mid(self, x, name):
        x = self.resnet(x, f"{name}.resnets.0")
        return self.resnet(self.attention(x, f"{name}.attentions.0"), f"{name}.resnets.1")

    # ---- encoder / decoder
    def encode_moments(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x = self.conv(x, "encoder.conv_in")
        for b in range(len(cfg.block_out_channels)):
            for r in range(cfg.layers_per_block):
                x = self.resnet(x, f"encoder.down_blocks.{b}.resnets.{r}")
            if b < len(cfg.block_out_channels) - 1:
                st = (2 if vae_temporal_down(cfg, b) else 1, 2, 2)
                x = self.conv(F.pad(x, (0, 1, 0, 1)), f"encoder.down_blocks.{b}.downsamplers.0.conv", st, False)
        x = self.mid(x, "encoder.mid_block")
        return self.conv(F.silu(self.norm(x, "encoder.conv_norm_out")), "encoder.conv_out")

    def posterior(self, x):
        mean, logvar = self.encode_moments(x).chunk(2, 1)
        return mean, (0.5 * logvar.clamp(-30.0, 20.0)).exp()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x = self.mid(self.conv(z, "decoder.conv_in"), "decoder.mid_block")
        n = len(cfg.block_out_channels)
        for b in range(n):
            for r in range(cfg.layers_per_block + 1):
                x = self.resnet(x, f"decoder.up_blocks.{b}.resnets.{r}")
            if b < n - 1:
                u = f"decoder.up_blocks.{b}.upsamplers.0"
                B, c, t, h, w = x.shape
                z_up = 2 if vae_temporal_up(cfg, b) else 1
                y = F.conv3d(x, self.p[f"{u}.upscale_conv.weight"], self.p[f"{u}.upscale_conv.bias"])
                y = y.reshape(B, 2, 2, z_up, c, t, h, w).permute(0, 4, 5, 3, 6, 1, 7, 2)
                y = y.reshape(B, c, t * z_up, 2 * h, 2 * w)
                x = self.conv(y[:, :, 1:] if z_up == 2 else y, f"{u}.conv")
        return self.conv(F.silu(self.norm(x, "decoder.conv_norm_out")), "decoder.conv_out")


def load_fast_vae(cfg: VAEConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                  dtype: torch.dtype = torch.float32) -> FastVAE:
    return FastVAE(cfg, apply_load_transforms(vae_component(cfg), state, dtype=dtype, device=device))
