"""ltx2 fast text connectors: diffusers 0.42.1 `LTX2TextConnectors` on the runtime path, written independently of
reference/. Weights: a flat dict of canonical names (manifests/ltx2/connectors.py), q / k / v fused at load; the
register substitution is one batched gather (no per-sample loop). `trace` under the reference's names."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from manifests.ltx2.connectors import Ltx2ConnectorsConfig, connector_key_shapes
from optimized.attention import attend
from optimized.models.ltx2.model import _norm, _rope, _rotate
from optimized.runtime.spec import ComponentSpec, LoadTransform, apply_load_transforms

STREAMS = ("video_connector", "audio_connector")


def connectors_component(cfg: Ltx2ConnectorsConfig) -> ComponentSpec:
    shapes = connector_key_shapes(cfg)
    return ComponentSpec("connectors", "ltx2_connectors", tuple(shapes.items()), tuple(
        LoadTransform(f"cast.{k}", (k,), k, "cast") for k in shapes)).validate()


class FastLtx2Connectors:
    def __init__(self, cfg: Ltx2ConnectorsConfig, params: dict[str, torch.Tensor], dtype: torch.dtype):
        if not cfg.rope_double_precision:
            raise ValueError("ltx2 optimized connectors: rope_double_precision=False is not ported")
        self.cfg, self.p, self.dtype = cfg.validate(), params, dtype
        self.qkv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for stream in STREAMS:
            for i in range(cfg.stream(stream.split("_")[0])[2]):
                a = f"{stream}.transformer_blocks.{i}.attn1"
                self.qkv[a] = (torch.cat([params[f"{a}.to_{n}.weight"] for n in "qkv"]),
                               torch.cat([params[f"{a}.to_{n}.bias"] for n in "qkv"]))

    def __call__(self, text_encoder_hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                 padding_side: str = "left", scale_factor: int = 8, trace=None):
        c = self.cfg
        emit = trace or (lambda name, t: None)
        h = text_encoder_hidden_states.to(self.dtype)
        B, L = attention_mask.shape
        h = h.view(B, L, c.caption_channels, -1)
        keep = attention_mask > 0
        if c.per_modality_projections:
            flat = (h * torch.rsqrt(h.square().mean(2, keepdim=True) + 1e-6)).reshape(B, L, -1)
            flat = torch.where(keep[..., None], flat, torch.zeros((), dtype=flat.dtype, device=flat.device))
            vid = self._lin("video_text_proj_in", flat * math.sqrt(c.video_hidden_dim / c.caption_channels))
            aud = self._lin("audio_text_proj_in", flat * math.sqrt(c.audio_hidden_dim / c.caption_channels))
        else:
            vid = aud = self._lin("text_proj_in", _mean_range(h, attention_mask.sum(-1), padding_side, scale_factor))
        emit("text_proj_in", vid)
        vid = self._stream("video_connector", vid, keep, emit)
        aud = self._stream("audio_connector", aud, keep, emit)
        return vid, aud, torch.ones(B, L, dtype=torch.int64, device=attention_mask.device)  # every position valid afterwards (upstream)

    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.p[name + ".weight"], self.p.get(name + ".bias"))

    def _stream(self, stream: str, x: torch.Tensor, keep: torch.Tensor, emit) -> torch.Tensor:
        c, P = self.cfg, self.p
        heads, _, layers, registers, _ = c.stream(stream.split("_")[0])
        B, L, D = x.shape
        key_mask = None
        if registers is not None:
            if L % registers:
                raise ValueError(f"text length {L} is not a multiple of the {registers} learnable registers")
            # valid tokens first (stable order), then register (p mod R) at every position p past them
            order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
            front = x.gather(1, order[..., None].expand(-1, -1, D))
            n_valid = keep.sum(1, keepdim=True)
            regs = P[stream + ".learnable_registers"].repeat(L // registers, 1)
            valid = torch.arange(L, device=x.device)[None] < n_valid          # on x's device (was always CPU)
            x = torch.where(valid[..., None], front, regs[None].to(x.dtype))
        else:
            key_mask = (keep | ~keep.any(-1, keepdim=True))[:, None, None, :]
        ids = torch.arange(L, dtype=torch.float32, device=x.device)
        rope = _rope(torch.stack([ids, ids], -1).expand(B, 1, L, 2), (c.connector_rope_base_seq_len,), D,
                     c.rope_theta, heads if c.rope_type == "split" else None)
        for i in range(layers):
            a = f"{stream}.transformer_blocks.{i}.attn1"
            y = _norm(x, 1e-6)
            q, k, v = F.linear(y, *self.qkv[a]).chunk(3, -1)
            q = _rotate(F.rms_norm(q, (D,), P[a + ".norm_q.weight"], 1e-6), rope)
            k = _rotate(F.rms_norm(k, (D,), P[a + ".norm_k.weight"], 1e-6), rope)
            q, k, v = (t.view(B, L, heads, -1).transpose(1, 2) for t in (q, k, v))
            o = attend(q, k, v, key_mask=key_mask)
            if a + ".to_gate_logits.weight" in P:
                o = o * (2.0 * torch.sigmoid(self._lin(a + ".to_gate_logits", y))).transpose(1, 2)[..., None]
            x = x + self._lin(a + ".to_out.0", o.transpose(1, 2).reshape(B, L, D))
            f = f"{stream}.transformer_blocks.{i}.ff.net."
            x = x + self._lin(f + "2", F.gelu(self._lin(f + "0.proj", _norm(x, 1e-6)), approximate="tanh"))
            emit(f"{stream}.transformer_blocks.{i}", x)
        x = _norm(x, 1e-6)
        emit(stream, x)
        return x


def _mean_range(h: torch.Tensor, lengths: torch.Tensor, padding_side: str, scale: int) -> torch.Tensor:
    """Per sample and layer over valid tokens x channels: (h - mean) / (max - min + 1e-6) * scale, padding zeroed."""
    B, L, C, _ = h.shape
    pos = torch.arange(L, device=h.device)[None]
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    keep = (pos >= L - lengths[:, None]) if padding_side == "left" else (pos < lengths[:, None])
    k4 = keep[:, :, None, None]
    zero = torch.zeros((), dtype=h.dtype, device=h.device)
    mean = torch.where(k4, h, zero).sum((1, 2), keepdim=True) / ((lengths * C).view(B, 1, 1, 1) + 1e-6)
    lo = torch.where(k4, h, torch.full((), float("inf"), dtype=h.dtype, device=h.device)).amin((1, 2), keepdim=True)
    hi = torch.where(k4, h, torch.full((), float("-inf"), dtype=h.dtype, device=h.device)).amax((1, 2), keepdim=True)
    out = ((h - mean) / (hi - lo + 1e-6) * scale).flatten(2)
    return torch.where(keep[..., None], out, zero).to(h.dtype)      # back to the input dtype (upstream)


def load_connectors(cfg: Ltx2ConnectorsConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                    dtype: torch.dtype = torch.float32) -> FastLtx2Connectors:
    """Strict: the canonical state dict must match the ComponentSpec exactly (names, shapes)."""
    return FastLtx2Connectors(cfg, apply_load_transforms(connectors_component(cfg), state, dtype=dtype,
                                                         device=device), dtype)
