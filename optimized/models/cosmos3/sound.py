"""cosmos3 sound tokenizer (AVAE: the Oobleck-style decoder, the SpecConvNeXt encoder) on the v2 runtime.

Load transforms: every canonical key cast to the run dtype (declared in `sound_component`); then, at load, each
weight-normalised conv's `weight_g`/`weight_v` is folded once into a plain weight (g * v / ||v||, norm over all
dims but 0) and each Snake's exp(alpha), 1/(exp(beta) + 1e-9) precomputed, so a forward recomputes none of them.

`FastSoundEncoder` (waveform -> posterior mean / std) folds its weight norms the same way and runs its ConvNeXt
blocks channels-last. `decode` runs the whole clip; `decode_chunked` runs `chunk` latent frames at a time with a
halo of `halo_frames(cfg)` latent frames each side (the decoder's receptive radius), keeping only each chunk's centre: the same numbers as the
whole clip, with memory bounded by the chunk, and chunks available as they finish (streaming).
The vision VAE chain around the diffusion model (condition encode, output decode) is in `vae_chain.py`.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.nn.functional as F

from manifests.cosmos3.sound import DILATIONS, Cosmos3SoundConfig, decoder_key_shapes, encoder_key_shapes
from optimized.runtime.spec import ComponentSpec, LoadTransform, apply_load_transforms

SOUND_DECODER = "sound_decoder"


def sound_component(cfg: Cosmos3SoundConfig) -> ComponentSpec:
    shapes = decoder_key_shapes(cfg)
    return ComponentSpec(SOUND_DECODER, "oobleck_decoder", tuple(shapes.items()),
                         tuple(LoadTransform(f"cast.{k}", (k,), k, "cast") for k in shapes)).validate()


def halo_frames(cfg: Cosmos3SoundConfig) -> int:
    """Latent frames each side that can influence a latent frame's output samples (receptive radius, rounded up)."""
    r, rate = 3.0, 1  # conv1: k7 at the latent rate
    for s in reversed(cfg.dec_strides):
        r += 2.0 / rate                       # transposed conv k=2s: <= 2 input samples each side
        rate *= s
        r += sum(3 * d for d in DILATIONS) / rate   # residual units k7, dilations 1, 3, 9
    r += 3.0 / rate                           # final conv k7
    return math.ceil(r) + 1


class FastSoundDecoder:
    def __init__(self, cfg: Cosmos3SoundConfig, p: dict[str, torch.Tensor]):
        self.cfg, self.dtype = cfg, next(iter(p.values())).dtype
        self.w: dict[str, torch.Tensor] = {}
        for k in p:
            if k.endswith(".weight_v"):
                name = k[: -len(".weight_v")]
                v, g = p[k].float(), p[f"{name}.weight_g"].float()
                self.w[name] = (g * v / v.flatten(1).norm(dim=1).view(-1, 1, 1)).to(self.dtype)
                if f"{name}.bias" in p:
                    self.w[f"{name}.bias"] = p[f"{name}.bias"]
        self.snake = {k[: -len(".alpha")]: (torch.exp(p[k]), (torch.exp(p[k[:-6] + ".beta"]) + 1e-9).reciprocal())
                      for k in p if k.endswith(".alpha")}
        self.stages = cfg.decoder_stages()

    def _snake(self, x: torch.Tensor, name: str) -> torch.Tensor:
        a, inv_b = self.snake[name]
        return x + inv_b * torch.sin(a * x).pow_(2)

    def _conv(self, x, name, padding=0, dilation=1):
        return F.conv1d(x, self.w[name], self.w.get(f"{name}.bias"), padding=padding, dilation=dilation)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """[B, C, T] -> unclamped waveform [B, audio_channels, T * hop]."""
        x = self._conv(z.to(self.dtype), "decoder.conv1", padding=3)
        for i, (_, _, s) in enumerate(self.stages):
            p = f"decoder.block.{i}"
            x = F.conv_transpose1d(self._snake(x, f"{p}.snake1"), self.w[f"{p}.conv_t1"], self.w[f"{p}.conv_t1.bias"],
                                   stride=s, padding=math.ceil(s / 2), output_padding=s % 2)
            for u, d in zip((1, 2, 3), DILATIONS):
                q = f"{p}.res_unit{u}"
                y = self._conv(self._snake(x, f"{q}.snake1"), f"{q}.conv1", padding=3 * d, dilation=d)
                x = x + self._conv(self._snake(y, f"{q}.snake2"), f"{q}.conv2")
        return self._conv(self._snake(x, "decoder.snake1"), "decoder.conv2", padding=3)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, T] or [C, T] -> waveform [B, audio_channels, T * hop] (or unbatched), clamped to [-1, 1]."""
        z = self._check(latents)
        with torch.no_grad():
            out = self.forward(z).clamp_(-1.0, 1.0)
        return out[0] if latents.ndim == 2 else out

    def decode_chunks(self, latents: torch.Tensor, chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (first sample, waveform chunk) for `chunk` latent frames at a time (halo'd, exact)."""
        z = self._check(latents)
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 latent frame, got {chunk}")
        T, hop, halo = z.shape[2], self.cfg.hop, halo_frames(self.cfg)
        for a in range(0, T, chunk):
            b = min(a + chunk, T)
            lo, hi = max(0, a - halo), min(T, b + halo)
            with torch.no_grad():
                y = self.forward(z[:, :, lo:hi])[:, :, (a - lo) * hop:(b - lo) * hop].clamp_(-1.0, 1.0)
            yield a * hop, (y[0] if latents.ndim == 2 else y)

    def decode_chunked(self, latents: torch.Tensor, chunk: int) -> torch.Tensor:
        return torch.cat([y for _, y in self.decode_chunks(latents, chunk)], dim=-1)

    def _check(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents[None] if latents.ndim == 2 else latents
        if z.ndim != 3 or z.shape[1] != self.cfg.latent_dim or z.shape[2] < 1:
            raise ValueError(f"cosmos3 sound: latents must be [B, {self.cfg.latent_dim}, T], got {list(latents.shape)}")
        if not torch.isfinite(z).all():
            raise ValueError("cosmos3 sound: latents hold NaN or Inf values")
        return z


def load_fast_sound_decoder(cfg: Cosmos3SoundConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                            dtype: torch.dtype = torch.float32) -> FastSoundDecoder:
    """Takes the decoder keys of a canonical sound-tokenizer state dict (encoder keys, if any, are ignored)."""
    dec = {k: v for k, v in state.items() if k.startswith("decoder.")}
    return FastSoundDecoder(cfg, apply_load_transforms(sound_component(cfg), dec, dtype=dtype, device=device))


# ------------------------------------------------------------------------------------------------
# Encoder (SpecConvNeXt): waveform -> posterior over sound latents
# ------------------------------------------------------------------------------------------------

SOUND_ENCODER = "sound_encoder"


def sound_encoder_component(cfg: Cosmos3SoundConfig) -> ComponentSpec:
    shapes = encoder_key_shapes(cfg)
    return ComponentSpec(SOUND_ENCODER, "spec_convnext_encoder", tuple(shapes.items()),
                         tuple(LoadTransform(f"cast.{k}", (k,), k, "cast") for k in shapes)).validate()


class FastSoundEncoder:
    """The encoder with every weight norm folded at load and the ConvNeXt blocks run channels-last: the depthwise
    conv in [B, C, T], then LayerNorm / pointwise projections / Snake as matmuls on [B, T, C] (no transposes back
    and forth per op). The spectrogram is framed with `unfold` and an rFFT (the same numbers as a non-centred STFT)."""

    def __init__(self, cfg: Cosmos3SoundConfig, p: dict[str, torch.Tensor]):
        if not cfg.has_encoder:
            raise ValueError("cosmos3 sound: this config has no encoder (has_encoder=False)")
        self.cfg, self.dtype = cfg, next(iter(p.values())).dtype
        self.w: dict[str, torch.Tensor] = {}
        for k, v in p.items():
            if k.endswith(".weight_v"):
                name = k[: -len(".weight_v")]
                g = p[f"{name}.weight_g"].float()
                self.w[name] = (g * v.float() / v.float().flatten(1).norm(dim=1).view(-1, 1, 1)).to(self.dtype)
            elif not k.endswith(".weight_g"):
                self.w[k] = v
        self.plan: list[tuple[str, str, int]] = []     # (kind, layer prefix, stride) in order
        j = 1
        for s in cfg.enc_strides:
            self.plan += [("block", f"encoder.layers.{j + b}", 1) for b in range(cfg.enc_num_blocks)]
            j += cfg.enc_num_blocks
            self.plan.append(("down", f"encoder.layers.{j}", s))
            j += 1
        self.last = f"encoder.layers.{j}"
        n_fft = cfg.enc_n_fft
        self.window = torch.hann_window(n_fft, dtype=torch.float32, device=next(iter(p.values())).device)

    def spectrogram(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, N] -> [B, C * (n_fft + 2), frames]: per channel the real parts of the bins, then the imaginary."""
        n_fft, hop = self.cfg.enc_n_fft, self.cfg.enc_hop_length
        B, C, N = x.shape
        pad = n_fft - hop
        frames = F.pad(x.float(), (pad // 2, pad - pad // 2)).unfold(-1, n_fft, hop)   # [B, C, frames, n_fft]
        spec = torch.fft.rfft(frames * self.window, dim=-1)                             # [B, C, frames, bins]
        feats = torch.cat([spec.real, spec.imag], dim=-1).to(x.dtype)                   # [B, C, frames, 2 bins]
        return feats.permute(0, 1, 3, 2).reshape(B, C * feats.shape[-1], feats.shape[2])

    def _block(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        h = F.conv1d(F.pad(x, (3, 3)), w[f"{p}.dwconv.1.weight"], w[f"{p}.dwconv.1.bias"], groups=x.shape[1])
        h = h.transpose(1, 2)                                                            # [B, T, C]
        h = F.layer_norm(h.float(), h.shape[-1:], w[f"{p}.norm.weight"].float(), None, 1e-5).to(x.dtype)
        h = F.linear(h, w[f"{p}.pwconv1.weight"][..., 0], w[f"{p}.pwconv1.bias"])
        if self.cfg.enc_use_snake:
            a, b = w[f"{p}.act.alpha"].view(-1).exp(), w[f"{p}.act.beta"].view(-1).exp()
            h = h + (b + 1e-9).reciprocal() * torch.sin(a * h).pow(2)
        else:
            h = F.gelu(h)
        h = F.linear(h, w[f"{p}.pwconv2.weight"][..., 0], w[f"{p}.pwconv2.bias"])
        return x + h.transpose(1, 2)

    def forward(self, audio: torch.Tensor, trace=None) -> torch.Tensor:
        """Padded waveform [B, C, N] -> moments [B, 2 * latent_dim, frames]. `trace(name, tensor)`: each layer's
        output under its canonical prefix (for localisation)."""
        spec = self.spectrogram(audio.to(self.dtype))
        x = F.conv1d(spec, self.w["encoder.layers.0"])
        if trace is not None:
            trace("encoder.spectrogram", spec)
            trace("encoder.layers.0", x)
        for kind, p, s in self.plan:
            if kind == "block":
                x = self._block(x, p)
            else:
                x = F.conv1d(x, self.w[p], self.w[f"{p}.bias"], stride=s, padding=math.ceil(s / 2))
            if trace is not None:
                trace(p, x)
        x = F.conv1d(x, self.w[self.last])
        if trace is not None:
            trace(self.last, x)
        return x

    def encode(self, audio: torch.Tensor, trace=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Waveform [B, C, N] -> (posterior mean, posterior std), each [B, latent_dim, ceil(N / hop)]."""
        cfg = self.cfg
        if audio.ndim != 3 or audio.shape[1] != cfg.encoder_channels or audio.shape[2] < 1:
            raise ValueError(f"cosmos3 sound: audio must be [B, {cfg.encoder_channels}, N], got {list(audio.shape)}")
        if not torch.isfinite(audio).all():
            raise ValueError("cosmos3 sound: audio holds NaN or Inf values")
        x = audio
        if cfg.normalize_volume:  # (upstream) one peak over the whole batch tensor, not per sample
            x = x / (x.abs().max() + 1e-5) * 0.95
        x = F.pad(x, (0, (-x.shape[-1]) % cfg.hop))
        with torch.no_grad():
            mean, scale = self.forward(x, trace).chunk(2, dim=1)
        return mean, F.softplus(scale) + 1e-4   # (upstream) Oobleck bottleneck: std = softplus(scale) + 1e-4

    @staticmethod
    def sample(mean: torch.Tensor, std: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """mean + std * noise, the noise drawn on the CPU generator in the latents' dtype (upstream's draw)."""
        noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device="cpu")
        return mean + std * noise.to(mean.device)


def load_fast_sound_encoder(cfg: Cosmos3SoundConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                            dtype: torch.dtype = torch.float32) -> FastSoundEncoder:
    """Takes the encoder keys of a canonical sound-tokenizer state dict (decoder keys, if any, are ignored)."""
    enc = {k: v for k, v in state.items() if k.startswith("encoder.")}
    return FastSoundEncoder(cfg, apply_load_transforms(sound_encoder_component(cfg), enc, dtype=dtype, device=device))
