"""Wan VAE (2.1 / 2.2) on the v2 runtime: encode and decode one temporal chunk at a time, the carried state of every
causal convolution being explicit, typed loop state (`ConvCache`) instead of module attributes.

Any chunk size gives the same numbers as a whole-clip pass (lossless): a chunk is `n` latent frames, i.e. video
frames [0, 4n-3) for the first chunk and 4n frames after. Per layer the cache holds
  * causal 3D conv (k_t = 3): the last <= 2 frames of its input stream (fewer only right after frame 0);
  * temporal upsample conv: the same, over the stream *without* frame 0 (frame 0 bypasses it, upstream semantics);
  * temporal downsample conv (stride 2): the last frame of its input stream.
Weights are the canonical state dict after the spec's load transforms (cast); RMS-norm scales sqrt(C) * gamma are
derived once at load. Trace names match the reference's (`trace(name, chunk)`; the harness concatenates chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from manifests.wan import WanVAEConfig
from optimized.models.wan.spec import vae_component
from optimized.runtime.spec import apply_load_transforms

Trace = Callable[[str, torch.Tensor], None]


# ----------------------------------------------------------------------------------------------
# Convolutions. On CPU, PyTorch's conv dispatch sends a batch-1, 3x3-kernel fp32 conv whose N*C*D*H (3D) or N*C*H*W
# (2D) is <= 20480 to the native `slow_conv3d` / `_slow_conv2d` (im2col + GEMM) instead of oneDNN. The test ignores
# W, so a chunk of 1-4 latent frames at the decoder's wide stages (e.g. [1, 6, 6, 64, 64]: N*C*D*H = 2304 but 147k
# elements) lands there, while the reference's whole clip (large D) does not: that alone made the chunked loop 2-3x
# slower than the reference (not memory format, padding or dtype). For fp32 CPU inputs of >= MKLDNN_MIN_NUMEL
# elements we call the oneDNN convolution directly (measured, 1 thread: 5x faster at [1, 12, 6, 32, 32]); smaller
# ones keep the default dispatch, where the native kernel is the faster one (0.07 vs 0.14 ms at [1, 12, 3, 8, 8]).
# CUDA, bf16 and a user-disabled oneDNN keep the default dispatch. The numbers are those of the reference's own
# oneDNN path (rel L2 vs the whole-clip reference unchanged, ~2e-6 at most in wan C0).
# ----------------------------------------------------------------------------------------------

MKLDNN_MIN_NUMEL = 8192


def _direct_mkldnn(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.numel() >= MKLDNN_MIN_NUMEL
            and not x.requires_grad and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


def conv3d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride=(1, 1, 1),
           padding=(0, 0, 0)) -> torch.Tensor:
    if _direct_mkldnn(x):
        return torch.ops.aten.mkldnn_convolution(x.contiguous(), w, b, list(padding), list(stride), [1, 1, 1], 1)
    return F.conv3d(x, w, b, stride=stride, padding=padding)


def conv2d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: int = 1, padding: int = 0) -> torch.Tensor:
    if _direct_mkldnn(x):
        return torch.ops.aten.mkldnn_convolution(x.contiguous(), w, b, [padding] * 2, [stride] * 2, [1, 1], 1)
    return F.conv2d(x, w, b, stride=stride, padding=padding)


def _channel_normalize(x: torch.Tensor) -> torch.Tensor:
    """F.normalize(x, dim=1) (x / max(||x||_2, 1e-12) over channels), as a sum of squares: `linalg_vector_norm` over
    a non-innermost dim of a [B, C, T, H, W] tensor is ~25x slower on CPU (2.0 vs 0.08 ms at [1, 6, 4, 64, 64]); the
    results agree to ~1e-7 relative."""
    return x / (x * x).sum(1, keepdim=True).sqrt_().clamp_min_(1e-12)


@dataclass(frozen=True)
class ConvCache:
    """Carried state between chunks: layer name -> tail frames of that layer's input stream."""
    frames: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.frames.values())

    @staticmethod
    def concat(caches: list["ConvCache"]) -> "ConvCache":
        """Batch several requests' caches (same layers, same shapes but batch) along dim 0."""
        keys = caches[0].frames.keys()
        return ConvCache({k: torch.cat([c.frames[k] for c in caches], 0) for k in keys})

    def split(self, sizes: list[int]) -> list["ConvCache"]:
        parts = {k: torch.split(t, sizes, 0) for k, t in self.frames.items()}
        return [ConvCache({k: parts[k][i] for k in parts}) for i in range(len(sizes))]


def _interleave_time(y: torch.Tensor, C: int) -> torch.Tensor:
    """[B, 2C, t, H, W] -> [B, C, 2t, H, W]: channel half 0 is the earlier frame of each pair."""
    B, _, t, H, W = y.shape
    return y.view(B, 2, C, t, H, W).permute(0, 2, 3, 1, 4, 5).reshape(B, C, 2 * t, H, W)


def _to_images(x: torch.Tensor) -> torch.Tensor:
    B, C, T, H, W = x.shape
    return x.transpose(1, 2).reshape(B * T, C, H, W)


def _to_frames(y: torch.Tensor, B: int) -> torch.Tensor:
    BT, C, H, W = y.shape
    return y.view(B, BT // B, C, H, W).transpose(1, 2)


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    if p == 1:
        return x
    B, C, T, H, W = x.shape
    return x.view(B, C, T, H // p, p, W // p, p).permute(0, 1, 6, 4, 2, 3, 5).reshape(B, C * p * p, T, H // p, W // p)


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    if p == 1:
        return x
    B, Cpp, T, h, w = x.shape
    C = Cpp // (p * p)
    return x.view(B, C, p, p, T, h, w).permute(0, 1, 4, 5, 3, 6, 2).reshape(B, C, T, h * p, w * p)


class FastWanVAE:
    """Chunk-wise Wan VAE. `decode_chunk` / `encode_chunk` are pure functions of (input chunk, cache, first)."""

    def __init__(self, cfg: WanVAEConfig, params: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.p = params
        self.norm_scale = {k[: -len(".gamma")]: v * (v.shape[0] ** 0.5) for k, v in params.items()
                           if k.endswith(".gamma")}
        self.enc_plan, self.dec_plan = self._plans(cfg)
        self.dtype = next(iter(params.values())).dtype

    # ---- layer plans (what the reference builds as modules) ----
    @staticmethod
    def _plans(cfg: WanVAEConfig):
        enc, dims, last = [], cfg.encoder_dims(), len(cfg.dim_mult) - 1
        j = 0
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            down, temporal = i != last, i != last and cfg.temporal_downsample[i]
            if cfg.is_residual:
                enc.append(("resdown", f"encoder.down_blocks.{i}", cout, 2 if temporal else 1, 2 if down else 1,
                            cfg.num_res_blocks, down, temporal))
            else:
                for _ in range(cfg.num_res_blocks):
                    enc.append(("res", f"encoder.down_blocks.{j}"))
                    j += 1
                if down:
                    enc.append(("down", f"encoder.down_blocks.{j}", temporal))
                    j += 1
        dec, dims = [], cfg.decoder_dims()
        for i, cout in enumerate(dims[1:]):
            up, temporal = i != last, i != last and cfg.temporal_upsample[i]
            name = (f"decoder.up_blocks.{i}.upsampler" if cfg.is_residual else f"decoder.up_blocks.{i}.upsamplers.0")
            dec.append((f"decoder.up_blocks.{i}", cout, cfg.num_res_blocks + 1, up, temporal, name))
        return enc, dec

    # ---- primitive ops ----
    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return _channel_normalize(xf).to(x.dtype).mul_(self.norm_scale[name])

    def _conv(self, x: torch.Tensor, name: str, cache: ConvCache, out: dict, time_stride: int = 1) -> torch.Tensor:
        """Causal 3D conv over the chunk `x`, continuing the stream whose tail is cached under `name`."""
        w, b = self.p[f"{name}.weight"], self.p[f"{name}.bias"]
        kt, kh, kw = w.shape[2:]
        if kt == 1:
            return conv3d(x, w, b)
        prev = cache.frames.get(name)
        stream = x if prev is None else torch.cat([prev, x], 2)
        out[name] = stream[:, :, -(kt - 1):].clone()  # a view would keep the whole chunk input alive
        missing = kt - 1 - (0 if prev is None else prev.shape[2])
        if missing > 0:  # zero frames before frame 0
            stream = torch.cat([stream.new_zeros(*stream.shape[:2], missing, *stream.shape[3:]), stream], 2)
        return conv3d(stream, w, b, padding=(0, kh // 2, kw // 2))

    def _res(self, x: torch.Tensor, p: str, cache: ConvCache, out: dict) -> torch.Tensor:
        skip = conv3d(x, self.p[f"{p}.conv_shortcut.weight"], self.p[f"{p}.conv_shortcut.bias"]) \
            if f"{p}.conv_shortcut.weight" in self.p else x
        y = self._conv(F.silu(self._norm(x, f"{p}.norm1"), inplace=True), f"{p}.conv1", cache, out)
        y = self._conv(F.silu(self._norm(y, f"{p}.norm2"), inplace=True), f"{p}.conv2", cache, out)
        return y.add_(skip)

    def _attn(self, x: torch.Tensor, p: str) -> torch.Tensor:
        B, C, T, H, W = x.shape
        y = _to_images(x)
        xf = y.float() if y.dtype in (torch.float16, torch.bfloat16) else y
        y = _channel_normalize(xf).to(y.dtype).mul_(self.norm_scale[f"{p}.norm"])
        qkv = conv2d(y, self.p[f"{p}.to_qkv.weight"], self.p[f"{p}.to_qkv.bias"]).flatten(2).transpose(1, 2)
        q, k, v = qkv.unsqueeze(1).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v).squeeze(1).transpose(1, 2).reshape(B * T, C, H, W)
        y = conv2d(y, self.p[f"{p}.proj.weight"], self.p[f"{p}.proj.bias"])
        return x + _to_frames(y, B)

    def _mid(self, x, p, cache, out):
        x = self._res(x, f"{p}.resnets.0", cache, out)
        x = self._attn(x, f"{p}.attentions.0")
        return self._res(x, f"{p}.resnets.1", cache, out)

    def _downsample(self, x, p, temporal, first, cache, out):
        B = x.shape[0]
        y = conv2d(F.pad(_to_images(x), (0, 1, 0, 1)), self.p[f"{p}.resample.1.weight"],
                     self.p[f"{p}.resample.1.bias"], stride=2)
        x = _to_frames(y, B)
        if not temporal:
            return x
        name = f"{p}.time_conv"
        stream = x if first else torch.cat([cache.frames[name], x], 2)
        out[name] = stream[:, :, -1:].clone()  # a view would keep the whole chunk input alive
        y = conv3d(stream, self.p[f"{name}.weight"], self.p[f"{name}.bias"], stride=(2, 1, 1)) \
            if stream.shape[2] >= 3 else stream[:, :, :0]
        return torch.cat([x[:, :, :1], y], 2) if first else y  # frame 0 bypasses the temporal conv

    def _upsample(self, x, p, temporal, first, cache, out):
        B, C = x.shape[:2]
        if temporal:
            rest = x[:, :, 1:] if first else x
            parts = [x[:, :, :1]] if first else []  # frame 0 bypasses the temporal conv (and is not its context)
            if rest.shape[2]:
                parts.append(_interleave_time(self._conv(rest, f"{p}.time_conv", cache, out), C))
            x = torch.cat(parts, 2) if len(parts) > 1 else parts[0]
        y = F.interpolate(_to_images(x).float(), scale_factor=2.0, mode="nearest-exact").to(x.dtype)
        y = conv2d(y, self.p[f"{p}.resample.1.weight"], self.p[f"{p}.resample.1.bias"], padding=1)
        return _to_frames(y, B)

    @staticmethod
    def _avg_down(x, cout, ft, fs):
        pad_t = (ft - x.shape[2] % ft) % ft
        x = F.pad(x, (0, 0, 0, 0, pad_t, 0))
        B, C, T, H, W = x.shape
        x = x.view(B, C, T // ft, ft, H // fs, fs, W // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6)
        return x.reshape(B, cout, C * ft * fs * fs // cout, T // ft, H // fs, W // fs).mean(2)

    @staticmethod
    def _dup_up(x, cout, ft, first):
        B, C, T, H, W = x.shape
        x = x.repeat_interleave(cout * ft * 4 // C, dim=1).view(B, cout, ft, 2, 2, T, H, W)
        x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(B, cout, T * ft, H * 2, W * 2)
        return x[:, :, ft - 1:] if first else x

    # ---- chunk functions ----
    def decode_chunk(self, z: torch.Tensor, cache: ConvCache, first: bool,
                     trace: Trace | None = None, consume: bool = False) -> tuple[torch.Tensor, ConvCache]:
        """Latent chunk [B, z, n, h, w] (decoder input, de-normalised) -> video frames, clamped; and the new cache.
        `consume=True` updates `cache` in place (each layer's old tail is dropped as its new tail is stored, as
        upstream's feat_cache does): peak memory holds one conv cache instead of two, but `cache` is no longer the
        pre-chunk state (only for a caller that will never retry the chunk from it)."""
        rec = trace or (lambda name, t: None)
        out: dict[str, torch.Tensor] = cache.frames if consume else dict(cache.frames)
        x = conv3d(z.to(self.dtype), self.p["post_quant_conv.weight"], self.p["post_quant_conv.bias"])
        rec("post_quant_conv", x)
        x = self._conv(x, "decoder.conv_in", cache, out)
        rec("decoder.conv_in", x)
        x = self._mid(x, "decoder.mid_block", cache, out)
        rec("decoder.mid_block", x)
        for p, cout, n_res, up, temporal, up_name in self.dec_plan:
            skip = self._dup_up(x, cout, 2 if temporal else 1, first) if self.cfg.is_residual and up else None
            for r in range(n_res):
                x = self._res(x, f"{p}.resnets.{r}", cache, out)
            if up:
                x = self._upsample(x, up_name, temporal, first, cache, out)
            if skip is not None:
                x = x.add_(skip)
            rec(p, x)
        x = self._conv(F.silu(self._norm(x, "decoder.norm_out"), inplace=True), "decoder.conv_out", cache, out)
        rec("decoder.conv_out", x)
        video = unpatchify(x, self.cfg.patch_size).clamp_(-1.0, 1.0)
        rec("video", video)
        return video, ConvCache(out)

    def encode_chunk(self, video: torch.Tensor, cache: ConvCache, first: bool,
                     trace: Trace | None = None) -> tuple[torch.Tensor, ConvCache]:
        """Video chunk [B, 3, f, H, W] (f = 4n-3 first, else 4n) -> moments [B, 2z, n, h, w]; and the new cache."""
        rec = trace or (lambda name, t: None)
        out: dict[str, torch.Tensor] = dict(cache.frames)
        x = self._conv(patchify(video.to(self.dtype), self.cfg.patch_size), "encoder.conv_in", cache, out)
        rec("encoder.conv_in", x)
        for i, step in enumerate(self.enc_plan):
            if step[0] == "res":
                x = self._res(x, step[1], cache, out)
            elif step[0] == "down":
                x = self._downsample(x, step[1], step[2], first, cache, out)
            else:
                _, p, cout, ft, fs, n_res, down, temporal = step
                skip = self._avg_down(x, cout, ft, fs)
                for r in range(n_res):
                    x = self._res(x, f"{p}.resnets.{r}", cache, out)
                if down:
                    x = self._downsample(x, f"{p}.downsampler", temporal, first, cache, out)
                x = x.add_(skip)
            rec(f"encoder.down_blocks.{i}", x)
        x = self._mid(x, "encoder.mid_block", cache, out)
        rec("encoder.mid_block", x)
        x = self._conv(F.silu(self._norm(x, "encoder.norm_out"), inplace=True), "encoder.conv_out", cache, out)
        rec("encoder.conv_out", x)
        moments = conv3d(x, self.p["quant_conv.weight"], self.p["quant_conv.bias"])
        rec("quant_conv", moments)
        return moments, ConvCache(out)


def load_fast_vae(cfg: WanVAEConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                  dtype: torch.dtype = torch.float32) -> FastWanVAE:
    """Validate the canonical state dict strictly and apply exactly the spec's declared load transforms."""
    params = apply_load_transforms(vae_component(cfg), state, dtype=dtype, device=device)
    return FastWanVAE(cfg, params)
