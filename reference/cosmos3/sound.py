"""cosmos3 sound tokenizer (AVAE), written to be read top to bottom: the Oobleck-style decoder the pipeline uses
(latents [B, C, T] at 25 Hz -> 48 kHz stereo waveform, clamped to [-1, 1]) and the SpecConvNeXt encoder.

Upstream: diffusers 0.42.1 `Cosmos3AVAEAudioTokenizer`. Parameter names here ARE the canonical layout
(manifests/cosmos3/sound; = diffusers' names): weight-normalised convs hold `weight_g` and `weight_v`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from manifests.cosmos3.sound import DILATIONS, Cosmos3SoundConfig, canonical_key_shapes


class Snake(nn.Module):
    """x + 1/(exp(beta) + 1e-9) * sin(exp(alpha) * x)^2, per channel (log-scale alpha/beta)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(1, channels, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.exp(self.alpha), torch.exp(self.beta)
        return x + (b + 1e-9).reciprocal() * torch.sin(a * x).pow(2)


def weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """w = g * v / ||v||, the norm over every dim but 0 (for a transposed conv, dim 0 is the input channel)."""
    return g * v / v.flatten(1).norm(dim=1).view(-1, *([1] * (v.ndim - 1)))


class WNConv1d(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, padding: int = 0, dilation: int = 1,
                 bias: bool = True):
        super().__init__()
        self.weight_g = nn.Parameter(torch.ones(cout, 1, 1))
        self.weight_v = nn.Parameter(torch.empty(cout, cin, k))
        self.bias = nn.Parameter(torch.zeros(cout)) if bias else None
        self.stride, self.padding, self.dilation = stride, padding, dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = weight_norm(self.weight_g, self.weight_v)
        return F.conv1d(x, w, self.bias, stride=self.stride, padding=self.padding, dilation=self.dilation)


class WNConvTranspose1d(nn.Module):
    """Upsample by `stride`: kernel 2s, padding ceil(s/2), output_padding s % 2 -> exactly T * s samples."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.weight_g = nn.Parameter(torch.ones(cin, 1, 1))
        self.weight_v = nn.Parameter(torch.empty(cin, cout, 2 * stride))
        self.bias = nn.Parameter(torch.zeros(cout))
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stride
        w = weight_norm(self.weight_g, self.weight_v)
        return F.conv_transpose1d(x, w, self.bias, stride=s, padding=math.ceil(s / 2), output_padding=s % 2)


class ResidualUnit(nn.Module):
    """x + conv_k1(snake(conv_k7_dilated(snake(x)))); 'same' padding keeps the length."""

    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv1 = WNConv1d(channels, channels, 7, padding=3 * dilation, dilation=dilation)
        self.snake2 = Snake(channels)
        self.conv2 = WNConv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.snake1 = Snake(cin)
        self.conv_t1 = WNConvTranspose1d(cin, cout, stride)
        self.res_unit1, self.res_unit2, self.res_unit3 = (ResidualUnit(cout, d) for d in DILATIONS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_t1(self.snake1(x))
        return self.res_unit3(self.res_unit2(self.res_unit1(x)))


class SoundDecoder(nn.Module):
    def __init__(self, cfg: Cosmos3SoundConfig):
        super().__init__()
        stages = cfg.decoder_stages()
        self.conv1 = WNConv1d(cfg.latent_dim, stages[0][0], 7, padding=3)
        self.block = nn.ModuleList([DecoderBlock(cin, cout, s) for cin, cout, s in stages])
        self.snake1 = Snake(cfg.dec_dim)
        self.conv2 = WNConv1d(cfg.dec_dim, cfg.audio_channels, 7, padding=3, bias=False)

    def forward(self, z: torch.Tensor, trace=None) -> torch.Tensor:
        x = self.conv1(z)
        if trace:
            trace("decoder.conv1", x)
        for i, block in enumerate(self.block):
            x = block(x)
            if trace:
                trace(f"decoder.block.{i}", x)
        return self.conv2(self.snake1(x))


# ----------------------------------------------------------------------------------------------
# Encoder: STFT features -> ConvNeXt stages with strided downsampling -> [mean | scale] moments
# ----------------------------------------------------------------------------------------------

class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, use_snake: bool):
        super().__init__()
        self.dwconv = nn.Sequential(nn.ConstantPad1d((3, 3), 0.0), nn.Conv1d(dim, dim, 7, groups=dim))
        self.norm = nn.LayerNorm(dim, eps=1e-5, bias=False)
        self.pwconv1 = nn.Conv1d(dim, 4 * dim, 1)
        self.act = Snake(4 * dim) if use_snake else nn.GELU()
        self.pwconv2 = nn.Conv1d(4 * dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).transpose(1, 2)
        h = F.layer_norm(h.float(), h.shape[-1:], self.norm.weight.float(), None, 1e-5).to(x.dtype)  # fp32 norm
        return x + self.pwconv2(self.act(self.pwconv1(h.transpose(1, 2))))


class SoundEncoder(nn.Module):
    def __init__(self, cfg: Cosmos3SoundConfig):
        super().__init__()
        self.cfg = cfg
        dims = [cfg.enc_dim * m for m in cfg.enc_c_mults]
        layers: list[nn.Module] = [WNConv1d((cfg.enc_n_fft + 2) * cfg.encoder_channels, dims[0], 1, bias=False)]
        for i, s in enumerate(cfg.enc_strides):
            layers += [ConvNeXtBlock(dims[i], cfg.enc_use_snake) for _ in range(cfg.enc_num_blocks)]
            nxt = dims[i + 1] if i + 1 < len(dims) else dims[-1]
            layers.append(WNConv1d(dims[i], nxt, 2 * s, stride=s, padding=math.ceil(s / 2)))
        layers.append(WNConv1d(dims[-1], cfg.enc_latent_dim, 1, bias=False))
        self.layers = nn.Sequential(*layers)

    def spectrogram(self, audio: torch.Tensor) -> torch.Tensor:
        """[B, C, N] -> [B, C*(n_fft+2), N/hop]: per channel the real parts of all bins, then the imaginary parts."""
        cfg, (B, C, N) = self.cfg, audio.shape
        pad = cfg.enc_n_fft - cfg.enc_hop_length
        x = F.pad(audio.reshape(B * C, N), (pad // 2, pad - pad // 2)).float()
        spec = torch.stft(x, cfg.enc_n_fft, cfg.enc_hop_length, cfg.enc_n_fft,
                          window=torch.hann_window(cfg.enc_n_fft, dtype=x.dtype, device=x.device),
                          center=False, onesided=True, return_complex=True)        # [B*C, bins, frames]
        feats = torch.cat([spec.real, spec.imag], dim=1).to(audio.dtype)
        return feats.reshape(B, C * feats.shape[1], feats.shape[2])

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        return self.layers(self.spectrogram(audio))


@dataclass
class SoundPosterior:
    """Oobleck bottleneck: moments = [mean | scale]; std = softplus(scale) + 1e-4."""
    mean: torch.Tensor
    scale: torch.Tensor

    @property
    def std(self) -> torch.Tensor:
        return F.softplus(self.scale) + 1e-4

    def mode(self) -> torch.Tensor:
        return self.mean

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        noise = torch.randn(self.mean.shape, generator=generator, dtype=self.mean.dtype, device="cpu")
        return self.mean + self.std * noise.to(self.mean.device)


class SoundTokenizer(nn.Module):
    def __init__(self, cfg: Cosmos3SoundConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = SoundEncoder(cfg) if cfg.has_encoder else None
        self.decoder = SoundDecoder(cfg)

    def decode(self, latents: torch.Tensor, trace=None) -> torch.Tensor:
        """[B, latent_dim, T] (or [latent_dim, T]) -> waveform [B, audio_channels, T * hop] in [-1, 1]."""
        squeeze = latents.ndim == 2
        z = latents[None] if squeeze else latents
        if z.ndim != 3 or z.shape[1] != self.cfg.latent_dim or z.shape[2] < 1:
            raise ValueError(f"cosmos3 sound: latents must be [B, {self.cfg.latent_dim}, T], got {list(latents.shape)}")
        if not torch.isfinite(z).all():
            raise ValueError("cosmos3 sound: latents hold NaN or Inf values")
        audio = self.decoder(z, trace).clamp(-1.0, 1.0)
        return audio[0] if squeeze else audio

    def encode(self, audio: torch.Tensor) -> SoundPosterior:
        """Waveform [B, C, N] -> posterior over [B, latent_dim, ceil(N / hop)] (inference: right-pad to the hop)."""
        if self.encoder is None:
            raise ValueError("cosmos3 sound: this tokenizer has no encoder weights")
        if audio.ndim != 3 or audio.shape[1] != self.cfg.encoder_channels:
            raise ValueError(f"cosmos3 sound: audio must be [B, {self.cfg.encoder_channels}, N], got {list(audio.shape)}")
        x = audio
        if self.cfg.normalize_volume:  # one peak over the whole batch tensor (upstream)
            x = x / (x.abs().max() + 1e-5) * 0.95
        x = F.pad(x, (0, (-x.shape[-1]) % self.cfg.hop))
        mean, scale = self.encoder(x).chunk(2, dim=1)
        return SoundPosterior(mean, scale)


def load_sound_tokenizer(cfg: Cosmos3SoundConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                         dtype: torch.dtype = torch.float32) -> SoundTokenizer:
    cfg.validate()
    want = canonical_key_shapes(cfg)
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise KeyError(f"cosmos3 sound state dict: missing {missing[:6]}, unexpected {unexpected[:6]}")
    model = SoundTokenizer(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()


def decode_cosmos3_outputs(vae, sound: SoundTokenizer | None, vision_latents: torch.Tensor,
                           sound_latents: torch.Tensor | None = None):
    """The seam for the cosmos3 pipeline: final latents -> (video [B, 3, T, H, W] in [-1, 1], waveform or None).
    Vision latents are de-normalised with the VAE's per-channel latents_mean/std (z * std + mean) before decoding
    (`vae` is a reference.wan.WanVAE); sound latents [C, T] or [B, C, T] are decoded as they are (no normalisation)."""
    from reference.wan import denormalize_latents

    with torch.no_grad():
        video = vae.decode(denormalize_latents(vae.cfg, vision_latents))
        audio = None if sound_latents is None or sound is None else sound.decode(sound_latents)
    return video, audio
