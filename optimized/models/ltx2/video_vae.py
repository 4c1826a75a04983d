"""ltx2 fast video VAE: diffusers 0.42.1 `AutoencoderKLLTX2Video` on the runtime path, written independently of
reference/. Weights: a flat dict of canonical names (manifests/ltx2/video_vae.py). At load, every timestep
embedder's first linear is stacked into one matrix (one matmul embeds the decode timestep for all blocks); in the
forward the temporal causal padding is one replicate pad, RMS-norm + scale/shift is one rsqrt and one addcmul, and
the patch / stride shuffles are single reshape-permutes. `trace` under the reference's names."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from manifests.ltx2.video_vae import (
    TIMESTEP_PROJ_DIM,
    Ltx2VideoVaeConfig,
    video_vae_key_shapes,
)
from optimized.runtime.spec import ComponentSpec, LoadTransform, apply_load_transforms

_EPS = 1e-8


def video_vae_component(cfg: Ltx2VideoVaeConfig) -> ComponentSpec:
    shapes = video_vae_key_shapes(cfg)
    return ComponentSpec("video_vae", "ltx2_video_vae", tuple(shapes.items()), tuple(
        LoadTransform(f"cast.{k}", (k,), k, "cast") for k in shapes)).validate()


def _conv(P: dict, name: str, x: torch.Tensor, causal: bool, pad: str) -> torch.Tensor:
    w, b = P[name + ".weight"], P[name + ".bias"]
    k = w.shape[2]
    x = F.pad(x, (0, 0, 0, 0, k - 1, 0) if causal else (0, 0, 0, 0, (k - 1) // 2, (k - 1) // 2), mode="replicate")
    if pad == "zeros":
        return F.conv3d(x, w, b, padding=(0, w.shape[3] // 2, w.shape[4] // 2))
    return F.conv3d(F.pad(x, (w.shape[4] // 2,) * 2 + (w.shape[3] // 2,) * 2 + (0, 0), mode=pad), w, b)


def _norm_mod(x: torch.Tensor, scale: torch.Tensor | None = None, shift: torch.Tensor | None = None) -> torch.Tensor:
    h = x * torch.rsqrt(x.square().mean(1, keepdim=True) + _EPS)
    return h if scale is None else torch.addcmul(shift, h, 1 + scale)


def _shuffle_in(x: torch.Tensor, st: int, sh: int, sw: int) -> torch.Tensor:
    b, c, t, h, w = x.shape
    return (x.reshape(b, c, t // st, st, h // sh, sh, w // sw, sw).permute(0, 1, 3, 5, 7, 2, 4, 6)
            .reshape(b, c * st * sh * sw, t // st, h // sh, w // sw))


def _shuffle_out(x: torch.Tensor, st: int, sh: int, sw: int) -> torch.Tensor:
    b, c, t, h, w = x.shape
    n = c // (st * sh * sw)
    return (x.reshape(b, n, st, sh, sw, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
            .reshape(b, n, t * st, h * sh, w * sw))


class FastLtx2VideoVae:
    def __init__(self, cfg: Ltx2VideoVaeConfig, params: dict[str, torch.Tensor], dtype: torch.dtype):
        self.cfg, self.p, self.dtype = cfg.validate(), params, dtype
        self.embedders: list[str] = []
        if cfg.timestep_conditioning:
            self.embedders = (["decoder.mid_block.time_embedder"]
                              + [f"decoder.up_blocks.{i}.time_embedder" for i in range(len(cfg.decoder_blocks()))]
                              + ["decoder.time_embedder"])
            l1 = [f"{e}.timestep_embedder.linear_1" for e in self.embedders]
            self.temb_w = torch.cat([params[n + ".weight"] for n in l1])
            self.temb_b = torch.cat([params[n + ".bias"] for n in l1])
            self.temb_split = [params[n + ".bias"].shape[0] for n in l1]
            half = TIMESTEP_PROJ_DIM // 2
            self.freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=self.temb_w.device) / half)

    def _embed_all(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        a = t.float()[:, None] * self.freqs.to(t.device)[None]
        s = torch.cat([a.cos(), a.sin()], -1).to(self.dtype)
        hs = F.silu(F.linear(s, self.temb_w, self.temb_b)).split(self.temb_split, dim=1)
        P = self.p
        return {e: F.linear(h, P[f"{e}.timestep_embedder.linear_2.weight"], P[f"{e}.timestep_embedder.linear_2.bias"])
                for e, h in zip(self.embedders, hs)}

    def _resnet(self, name: str, x: torch.Tensor, temb, causal: bool, pad: str) -> torch.Tensor:
        if temb is not None:
            ss = (temb.view(temb.shape[0], 4, -1) + self.p[name + ".scale_shift_table"])[..., None, None, None]
            h = _norm_mod(x, ss[:, 1], ss[:, 0])
        else:
            h = _norm_mod(x)
        h = _conv(self.p, name + ".conv1.conv", F.silu(h), causal, pad)
        h = _norm_mod(h, ss[:, 3], ss[:, 2]) if temb is not None else _norm_mod(h)
        return _conv(self.p, name + ".conv2.conv", F.silu(h), causal, pad).add_(x)

    # ---- encode ----
    def encode(self, video: torch.Tensor, causal: bool | None = None, trace=None) -> torch.Tensor:
        c = self.cfg
        emit = trace or (lambda n, t: None)
        causal = causal or c.encoder_causal   # upstream quirk: False cannot switch a causal encoder off
        pad, p = c.encoder_spatial_padding_mode, c.patch_size
        b, ch, t, h, w = video.shape
        x = video.reshape(b, ch, t, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5).reshape(b, ch * p * p, t, h // p, w // p)
        x = _conv(self.p, "encoder.conv_in.conv", x, causal, pad)
        emit("encoder.conv_in", x)
        for i, (_, c_out, n, stride) in enumerate(c.encoder_blocks()):
            for j in range(n):
                x = self._resnet(f"encoder.down_blocks.{i}.resnets.{j}", x, None, causal, pad)
            if stride is not None:
                st = stride[0]
                x = torch.cat([x[:, :, : st - 1], x], dim=2)
                res = _shuffle_in(x, *stride)
                res = res.view(b, c_out, -1, *res.shape[2:]).mean(2)
                x = _shuffle_in(_conv(self.p, f"encoder.down_blocks.{i}.downsamplers.0.conv.conv", x, causal, pad),
                                *stride).add_(res)
            emit(f"encoder.down_blocks.{i}", x)
        for j in range(c.layers_per_block[-1]):
            x = self._resnet(f"encoder.mid_block.resnets.{j}", x, None, causal, pad)
        emit("encoder.mid_block", x)
        x = _conv(self.p, "encoder.conv_out.conv", F.silu(_norm_mod(x)), causal, pad)
        emit("encoder.conv_out", x)
        return torch.cat([x, x[:, -1:].expand(-1, c.latent_channels - 1, -1, -1, -1)], dim=1)

    # ---- decode ----
    def decode(self, z: torch.Tensor, timestep: torch.Tensor | None = None, causal: bool | None = None,
               trace=None) -> torch.Tensor:
        c, P = self.cfg, self.p
        emit = trace or (lambda n, t: None)
        if c.timestep_conditioning and timestep is None:
            raise ValueError("ltx2 video vae: this decoder is timestep-conditioned; pass the decode timestep")
        causal = causal or c.decoder_causal
        pad = c.decoder_spatial_padding_mode
        embs: dict[str, torch.Tensor] = {}
        if c.timestep_conditioning:
            embs = self._embed_all(timestep.to(z.dtype).flatten() * P["decoder.timestep_scale_multiplier"])
        x = _conv(P, "decoder.conv_in.conv", z, causal, pad)
        emit("decoder.conv_in", x)
        temb = embs.get("decoder.mid_block.time_embedder")
        for j in range(c.decoder_mid_layers):
            x = self._resnet(f"decoder.mid_block.resnets.{j}", x, temb, causal, pad)
        emit("decoder.mid_block", x)
        for i, (_, _, n, stride, residual, factor) in enumerate(c.decoder_blocks()):
            b = f"decoder.up_blocks.{i}"
            temb = embs.get(f"{b}.time_embedder")
            if stride is not None:
                st = stride[0]
                h = _shuffle_out(_conv(P, f"{b}.upsamplers.0.conv.conv", x, causal, pad), *stride)[:, :, st - 1:]
                if residual:
                    r = _shuffle_out(x, *stride)[:, :, st - 1:]
                    h = h + r.repeat(1, h.shape[1] // r.shape[1], 1, 1, 1)
                x = h
            for j in range(n):
                x = self._resnet(f"{b}.resnets.{j}", x, temb, causal, pad)
            emit(b, x)
        if c.timestep_conditioning:
            ss = (embs["decoder.time_embedder"].view(z.shape[0], 2, -1) + P["decoder.scale_shift_table"])
            ss = ss[..., None, None, None]
            x = _norm_mod(x, ss[:, 1], ss[:, 0])
        else:
            x = _norm_mod(x)
        x = _conv(P, "decoder.conv_out.conv", F.silu(x), causal, pad)
        emit("decoder.conv_out", x)
        p = c.patch_size
        bsz, ch, t, h, w = x.shape
        n = ch // (p * p)
        return x.reshape(bsz, n, p, p, t, h, w).permute(0, 1, 4, 5, 3, 6, 2).reshape(bsz, n, t, h * p, w * p)

    def __call__(self, z: torch.Tensor, timestep: torch.Tensor | None = None, trace=None) -> torch.Tensor:
        return self.decode(z, timestep, trace=trace)

    # ---- the pipeline's latent statistics ----
    def latent_mean(self, moments: torch.Tensor) -> torch.Tensor:
        return moments[:, : self.cfg.latent_channels]

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        scale = (self.cfg.scaling_factor / self.p["latents_std"]).view(1, -1, 1, 1, 1)
        return (latents - self.p["latents_mean"].view(1, -1, 1, 1, 1)) * scale

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        scale = (self.p["latents_std"] / self.cfg.scaling_factor).view(1, -1, 1, 1, 1)
        return torch.addcmul(self.p["latents_mean"].view(1, -1, 1, 1, 1), latents, scale)


class FastLtx2VideoEncoder:
    """The parity kit's forward for encode."""

    def __init__(self, vae: FastLtx2VideoVae):
        self.vae = vae

    def __call__(self, video: torch.Tensor, trace=None) -> torch.Tensor:
        return self.vae.encode(video, trace=trace)


def load_video_vae(cfg: Ltx2VideoVaeConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> FastLtx2VideoVae:
    """Strict: the canonical state dict must match the ComponentSpec exactly (names, shapes)."""
    return FastLtx2VideoVae(cfg, apply_load_transforms(video_vae_component(cfg), state, dtype=dtype, device=device),
                            dtype)


def load_video_encoder(cfg, state, device: str = "cpu", dtype: torch.dtype = torch.float32) -> FastLtx2VideoEncoder:
    return FastLtx2VideoEncoder(load_video_vae(cfg, state, device, dtype))
