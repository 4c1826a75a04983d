"""ltx2 fast audio VAE: diffusers 0.42.1 `AutoencoderKLLTX2Audio` on the runtime path, written independently of
reference/. Weights: a flat dict of canonical names (manifests/ltx2/audio_vae.py); q / k / v 1x1 convs fused into
one matmul at load, attention through scaled_dot_product_attention, pixel norm as one rsqrt, causal padding folded
into one F.pad per conv. `trace` under the reference's names."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from manifests.ltx2.audio_vae import GROUPS, Ltx2AudioVaeConfig, audio_vae_key_shapes
from optimized.runtime.spec import ComponentSpec, LoadTransform, apply_load_transforms

_EPS = 1e-6
_DOWN_PAD = {"none": (0, 1, 0, 1), "width": (2, 0, 0, 1), "height": (0, 1, 2, 0), "width-compatibility": (1, 0, 0, 1)}


def audio_vae_component(cfg: Ltx2AudioVaeConfig) -> ComponentSpec:
    shapes = audio_vae_key_shapes(cfg)
    return ComponentSpec("audio_vae", "ltx2_audio_vae", tuple(shapes.items()), tuple(
        LoadTransform(f"cast.{k}", (k,), k, "cast") for k in shapes)).validate()


def _pad(k: int, axis: str) -> tuple[int, int, int, int]:
    p = k - 1
    sym = (p // 2, p - p // 2)
    if axis == "none":
        return sym + sym
    return (p, 0) + sym if axis in ("width", "width-compatibility") else sym + (p, 0)


class FastLtx2AudioVae:
    def __init__(self, cfg: Ltx2AudioVaeConfig, params: dict[str, torch.Tensor], dtype: torch.dtype):
        self.cfg, self.p, self.dtype = cfg.validate(), params, dtype
        self.axis = cfg.causality_axis
        self.qkv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for k in params:
            if k.endswith(".q.weight"):
                a = k[: -len(".q.weight")]
                self.qkv[a] = (torch.cat([params[f"{a}.{n}.weight"] for n in "qkv"]).flatten(1),
                               torch.cat([params[f"{a}.{n}.bias"] for n in "qkv"]))

    def _conv(self, name: str, x: torch.Tensor) -> torch.Tensor:
        w = self.p[name + ".weight"]
        return F.conv2d(F.pad(x, _pad(w.shape[2], self.axis)), w, self.p[name + ".bias"])

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.norm_type == "pixel":
            return x * torch.rsqrt(x.square().mean(1, keepdim=True) + _EPS)
        return F.group_norm(x, GROUPS, self.p[name + ".weight"], self.p[name + ".bias"], _EPS)

    def _resnet(self, name: str, x: torch.Tensor) -> torch.Tensor:
        h = self._conv(f"{name}.conv1.conv", F.silu(self._norm(f"{name}.norm1", x)))
        h = self._conv(f"{name}.conv2.conv", F.silu(self._norm(f"{name}.norm2", h)))
        if f"{name}.nin_shortcut.conv.weight" in self.p:
            x = self._conv(f"{name}.nin_shortcut.conv", x)
        return h.add_(x)

    def _attn(self, name: str, x: torch.Tensor) -> torch.Tensor:
        b, ch, hh, ww = x.shape
        h = self._norm(f"{name}.norm", x).flatten(2).transpose(1, 2)             # [B, N, C]
        w, bias = self.qkv[name]
        q, k, v = F.linear(h, w, bias).chunk(3, dim=-1)
        o = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]   # one head, scale C^-1/2
        o = o.transpose(1, 2).reshape(b, ch, hh, ww)
        return x + F.conv2d(o, self.p[f"{name}.proj_out.weight"], self.p[f"{name}.proj_out.bias"])

    def _mid(self, part: str, x: torch.Tensor) -> torch.Tensor:
        x = self._resnet(f"{part}.block_1", x)
        if self.cfg.mid_block_add_attention:
            x = self._attn(f"{part}.attn_1", x)
        return self._resnet(f"{part}.block_2", x)

    def encode(self, mel: torch.Tensor, trace=None) -> torch.Tensor:
        c = self.cfg
        emit = trace or (lambda n, t: None)
        attn = c.encoder_attn_levels()
        x = self._conv("encoder.conv_in.conv", mel)
        emit("encoder.conv_in", x)
        for level in range(len(c.ch_mult)):
            for b in range(c.num_res_blocks):
                x = self._resnet(f"encoder.down.{level}.block.{b}", x)
                if attn[level]:
                    x = self._attn(f"encoder.down.{level}.attn.{b}", x)
            if level != len(c.ch_mult) - 1:
                d = f"encoder.down.{level}.downsample.conv"
                x = F.conv2d(F.pad(x, _DOWN_PAD[self.axis]), self.p[d + ".weight"], self.p[d + ".bias"], stride=2)
            emit(f"encoder.down.{level}", x)
        x = self._mid("encoder.mid", x)
        emit("encoder.mid", x)
        x = self._conv("encoder.conv_out.conv", F.silu(self._norm("encoder.norm_out", x)))
        emit("encoder.conv_out", x)
        return x

    def decode(self, z: torch.Tensor, trace=None) -> torch.Tensor:
        c = self.cfg
        emit = trace or (lambda n, t: None)
        attn = c.decoder_attn_levels()
        _, _, t, f = c.decoded_shape(tuple(z.shape))
        x = self._conv("decoder.conv_in.conv", z)
        emit("decoder.conv_in", x)
        x = self._mid("decoder.mid", x)
        emit("decoder.mid", x)
        for level in reversed(range(len(c.ch_mult))):
            for b in range(c.num_res_blocks + 1):
                x = self._resnet(f"decoder.up.{level}.block.{b}", x)
                if attn[level]:
                    x = self._attn(f"decoder.up.{level}.attn.{b}", x)
            if level != 0:
                x = self._conv(f"decoder.up.{level}.upsample.conv.conv", F.interpolate(x, scale_factor=2.0,
                                                                                         mode="nearest"))
                x = x[:, :, 1:] if self.axis == "height" else x[..., 1:] if self.axis == "width" else x
            emit(f"decoder.up.{level}", x)
        x = self._conv("decoder.conv_out.conv", F.silu(self._norm("decoder.norm_out", x)))
        emit("decoder.conv_out", x)
        out = x.new_zeros(x.shape[0], x.shape[1], t, f)
        tt, ff = min(t, x.shape[2]), min(f, x.shape[3])
        out[:, :, :tt, :ff] = x[:, :, :tt, :ff]
        return out

    def __call__(self, z: torch.Tensor, trace=None) -> torch.Tensor:
        return self.decode(z, trace=trace)

    def latent_mean(self, moments: torch.Tensor) -> torch.Tensor:
        return moments[:, : self.cfg.latent_channels]

    def normalize(self, packed: torch.Tensor) -> torch.Tensor:
        return (packed - self.p["latents_mean"]) / self.p["latents_std"]

    def denormalize(self, packed: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.p["latents_mean"], packed, self.p["latents_std"])


class FastLtx2AudioEncoder:
    def __init__(self, vae: FastLtx2AudioVae):
        self.vae = vae

    def __call__(self, mel: torch.Tensor, trace=None) -> torch.Tensor:
        return self.vae.encode(mel, trace=trace)


def load_audio_vae(cfg: Ltx2AudioVaeConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> FastLtx2AudioVae:
    """Strict: the canonical state dict must match the ComponentSpec exactly (names, shapes)."""
    return FastLtx2AudioVae(cfg, apply_load_transforms(audio_vae_component(cfg), state, dtype=dtype, device=device),
                            dtype)


def load_audio_encoder(cfg, state, device: str = "cpu", dtype: torch.dtype = torch.float32) -> FastLtx2AudioEncoder:
    return FastLtx2AudioEncoder(load_audio_vae(cfg, state, device, dtype))
