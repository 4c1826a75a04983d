"""ltx2 reference audio VAE: diffusers 0.42.1 `AutoencoderKLLTX2Audio` (models/autoencoders/autoencoder_kl_ltx2_audio.py),
read top to bottom: `encode(mel) -> moments`, `decode(latents) -> mel`.

Spectrograms are [B, C, T, F] (time on the height axis). A causal conv pads k - 1 on the past side of
`causality_axis` ("height" = time) and symmetrically on the other axis; "none" pads both symmetrically.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from manifests.ltx2.audio_vae import GROUPS, Ltx2AudioVaeConfig, audio_vae_key_shapes
from reference.ltx2.model import _tree

NORM_EPS = 1e-6   # pixel norm and group norm both


def causal_padding(kernel: int, axis: str) -> tuple[int, int, int, int]:
    """F.pad order (w_left, w_right, h_top, h_bottom) of LTX2AudioCausalConv2d."""
    p = kernel - 1
    if axis == "none":
        return (p // 2, p - p // 2, p // 2, p - p // 2)
    if axis in ("width", "width-compatibility"):
        return (p, 0, p // 2, p - p // 2)
    return (p // 2, p - p // 2, p, 0)                      # height


def causal_conv(conv: nn.Module, x: torch.Tensor, axis: str) -> torch.Tensor:
    return F.conv2d(F.pad(x, causal_padding(conv.weight.shape[2], axis)), conv.weight, conv.bias)


def norm(module: nn.Module | None, x: torch.Tensor, norm_type: str) -> torch.Tensor:
    if norm_type == "pixel":
        return x / torch.sqrt(torch.mean(x ** 2, dim=1, keepdim=True) + NORM_EPS)
    return F.group_norm(x, GROUPS, module.weight, module.bias, NORM_EPS)


def resnet(block: nn.Module, x: torch.Tensor, c: Ltx2AudioVaeConfig) -> torch.Tensor:
    """LTX2AudioResnetBlock without timestep (temb_channels = 0 in the VAE): norm, SiLU, conv, twice; a 1x1
    causal conv shortcut when the width changes."""
    h = causal_conv(block.conv1.conv, F.silu(norm(getattr(block, "norm1", None), x, c.norm_type)), c.causality_axis)
    h = causal_conv(block.conv2.conv, F.silu(norm(getattr(block, "norm2", None), h, c.norm_type)), c.causality_axis)
    if hasattr(block, "nin_shortcut"):
        x = causal_conv(block.nin_shortcut.conv, x, c.causality_axis)
    return x + h


def attention(block: nn.Module, x: torch.Tensor, c: Ltx2AudioVaeConfig) -> torch.Tensor:
    """LTX2AudioAttnBlock: one head over every (t, f) position, 1x1 conv projections, residual."""
    h = norm(getattr(block, "norm", None), x, c.norm_type)
    q, k, v = (F.conv2d(h, getattr(block, n).weight, getattr(block, n).bias) for n in "qkv")
    b, ch, hh, ww = q.shape
    q, k, v = q.reshape(b, ch, hh * ww), k.reshape(b, ch, hh * ww), v.reshape(b, ch, hh * ww)
    weights = torch.softmax(torch.einsum("bcq,bck->bqk", q, k) * ch ** -0.5, dim=2)   # [B, query, key]
    out = torch.einsum("bck,bqk->bcq", v, weights).reshape(b, ch, hh, ww)
    return x + F.conv2d(out, block.proj_out.weight, block.proj_out.bias)


def downsample(conv: nn.Module, x: torch.Tensor, axis: str) -> torch.Tensor:
    """Zero-pad one step toward the past (two on the causal axis), then a stride-2 3x3 conv."""
    pad = {"none": (0, 1, 0, 1), "width": (2, 0, 0, 1), "height": (0, 1, 2, 0), "width-compatibility": (1, 0, 0, 1)}
    return F.conv2d(F.pad(x, pad[axis]), conv.weight, conv.bias, stride=2)


def upsample(block: nn.Module, x: torch.Tensor, axis: str) -> torch.Tensor:
    """Nearest x2, causal conv, then drop the first row / column on a causal axis (width-compatibility keeps it)."""
    x = causal_conv(block.conv.conv, F.interpolate(x, scale_factor=2.0, mode="nearest"), axis)
    if axis == "height":
        return x[:, :, 1:, :]
    if axis == "width":
        return x[:, :, :, 1:]
    return x


class Ltx2AudioVae(nn.Module):
    def __init__(self, cfg: Ltx2AudioVaeConfig):
        super().__init__()
        self.cfg = cfg.validate()
        _tree(self, audio_vae_key_shapes(cfg))

    def _mid(self, mid: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = resnet(mid.block_1, x, self.cfg)
        if self.cfg.mid_block_add_attention:
            x = attention(mid.attn_1, x, self.cfg)
        return resnet(mid.block_2, x, self.cfg)

    def encode(self, mel: torch.Tensor, trace=None) -> torch.Tensor:
        """[B, in_channels, T, F] -> moments [B, 2L, T', F'] (mean, then log-variance; double_z)."""
        c, enc = self.cfg, self.encoder
        record = trace or (lambda name, t: None)
        attn = c.encoder_attn_levels()
        x = causal_conv(enc.conv_in.conv, mel, c.causality_axis)
        record("encoder.conv_in", x)
        for level in range(len(c.ch_mult)):
            stage = enc.down[level]
            for b in range(c.num_res_blocks):
                x = resnet(stage.block[b], x, c)
                if attn[level]:
                    x = attention(stage.attn[b], x, c)
            if level != len(c.ch_mult) - 1:
                x = downsample(stage.downsample.conv, x, c.causality_axis)
            record(f"encoder.down.{level}", x)
        x = self._mid(enc.mid, x)
        record("encoder.mid", x)
        x = causal_conv(enc.conv_out.conv, F.silu(norm(getattr(enc, "norm_out", None), x, c.norm_type)),
                        c.causality_axis)
        record("encoder.conv_out", x)
        return x

    def decode(self, z: torch.Tensor, trace=None) -> torch.Tensor:
        """Latents [B, L, T, F] (denormalised, unpatchified) -> mel [B, output_channels, max(4T - 3, 1), mel_bins]
        (upstream's fixed factor 4, whatever ch_mult's ratio is)."""
        c, dec = self.cfg, self.decoder
        record = trace or (lambda name, t: None)
        attn = c.decoder_attn_levels()
        target = c.decoded_shape(tuple(z.shape))
        x = causal_conv(dec.conv_in.conv, z, c.causality_axis)
        record("decoder.conv_in", x)
        x = self._mid(dec.mid, x)
        record("decoder.mid", x)
        for level in reversed(range(len(c.ch_mult))):
            stage = dec.up[level]
            for b in range(c.num_res_blocks + 1):
                x = resnet(stage.block[b], x, c)
                if attn[level]:
                    x = attention(stage.attn[b], x, c)
            if level != 0:
                x = upsample(stage.upsample, x, c.causality_axis)
            record(f"decoder.up.{level}", x)
        x = causal_conv(dec.conv_out.conv, F.silu(norm(getattr(dec, "norm_out", None), x, c.norm_type)),
                        c.causality_axis)
        record("decoder.conv_out", x)
        # to the target size: crop what is too long, zero-pad what is too short (time, then mel bins)
        t, f = target[2], target[3]
        x = x[:, :, :t, :f]
        return F.pad(x, (0, f - x.shape[3], 0, t - x.shape[2]))

    def forward(self, z: torch.Tensor, trace=None) -> torch.Tensor:
        """The parity kit's forward: decode."""
        return self.decode(z, trace=trace)

    def latent_mean(self, moments: torch.Tensor) -> torch.Tensor:
        return moments[:, : self.cfg.latent_channels]

    # LTX2Pipeline's audio latent statistics act on the patchified latents [B, T, L * F]
    def normalize(self, packed: torch.Tensor) -> torch.Tensor:
        return (packed - self.latents_mean) / self.latents_std

    def denormalize(self, packed: torch.Tensor) -> torch.Tensor:
        return packed * self.latents_std + self.latents_mean


def pack_audio_latents(z: torch.Tensor) -> torch.Tensor:
    """[B, L, T, F] -> [B, T, L * F] (LTX2Pipeline._pack_audio_latents / the patchifier, patch size 1)."""
    b, ch, t, f = z.shape
    return z.permute(0, 2, 1, 3).reshape(b, t, ch * f)


def unpack_audio_latents(packed: torch.Tensor, mel_bins: int) -> torch.Tensor:
    """[B, T, L * F] -> [B, L, T, F]."""
    b, t, _ = packed.shape
    return packed.reshape(b, t, -1, mel_bins).permute(0, 2, 1, 3)


class Ltx2AudioEncoderView(nn.Module):
    def __init__(self, vae: Ltx2AudioVae):
        super().__init__()
        self.vae = vae

    def forward(self, mel: torch.Tensor, trace=None) -> torch.Tensor:
        return self.vae.encode(mel, trace=trace)


def load_audio_vae(cfg: Ltx2AudioVaeConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> Ltx2AudioVae:
    model = Ltx2AudioVae(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device, dtype).eval()


def load_audio_encoder(cfg, state, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Ltx2AudioEncoderView:
    return Ltx2AudioEncoderView(load_audio_vae(cfg, state, device, dtype))


