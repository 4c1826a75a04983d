"""ltx2 reference text connectors: diffusers 0.42.1 `LTX2TextConnectors` (pipelines/ltx2/connectors.py), read top
to bottom.

Input: the text encoder's hidden states of every layer, [B, L, C * K] (LTX2Pipeline stacks Gemma 3's K = layers + 1
hidden states on the last axis and flattens, so channel c of layer k sits at c * K + k), and the tokenizer's
0/1 mask [B, L] (left padding: Gemma's). Output: the video and audio text tokens the DiT cross-attends to, and the
mask the pipeline passes to the DiT for both.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from manifests.ltx2.connectors import Ltx2ConnectorsConfig, connector_key_shapes
from reference.ltx2.model import _tree, attention, feed_forward, linear, rms_norm, rope


class Ltx2Connectors(nn.Module):
    def __init__(self, cfg: Ltx2ConnectorsConfig):
        super().__init__()
        if not cfg.rope_double_precision:
            raise ValueError("ltx2 reference connectors: rope_double_precision=False is not ported")
        self.cfg = cfg.validate()
        _tree(self, connector_key_shapes(cfg))

    def forward(self, text_encoder_hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                padding_side: str = "left", scale_factor: int = 8, trace=None):
        c = self.cfg
        record = trace or (lambda name, t: None)
        x = text_encoder_hidden_states
        if x.ndim == 3:
            x = x.unflatten(2, (c.caption_channels, -1))                  # [B, L, C, K]
        valid = attention_mask.bool()                                     # [B, L]

        # 1. normalise the hidden states, then project them (one projection, or one per modality)
        if c.per_modality_projections:    # LTX-2.3: RMS over the channels of each token and layer, padding zeroed
            normed = x * torch.rsqrt(x.pow(2).mean(dim=2, keepdim=True) + 1e-6)
            normed = normed.flatten(2, 3) * valid[..., None]
            video_text = linear(self.video_text_proj_in, normed * math.sqrt(c.video_hidden_dim / c.caption_channels))
            audio_text = linear(self.audio_text_proj_in, normed * math.sqrt(c.audio_hidden_dim / c.caption_channels))
        else:                             # LTX-2.0: per sample and layer, (x - masked mean) / masked range * 8
            normed = masked_mean_range_norm(x, valid, padding_side, scale_factor)
            video_text = audio_text = linear(self.text_proj_in, normed)
        record("text_proj_in", video_text)

        # 2. one 1-D transformer per modality
        video = connector(self.video_connector, video_text, valid, c, c.video_connector_num_attention_heads,
                          "video_connector", record)
        audio = connector(self.audio_connector, audio_text, valid, c, c.audio_connector_num_attention_heads,
                          "audio_connector", record)
        # the mask the connectors hand on marks every position valid, registers or not (upstream: the additive
        # mask is 0 or -max, and both are < 1e-6)
        out_mask = torch.ones(video.shape[:2], dtype=torch.int64)
        return video * out_mask[..., None], audio, out_mask


def masked_mean_range_norm(x: torch.Tensor, valid: torch.Tensor, padding_side: str, scale: int) -> torch.Tensor:
    """[B, L, C, K] -> [B, L, C * K]: over the valid tokens and all channels of each layer, (x - mean) /
    (max - min + 1e-6) * scale; padded positions become 0. The valid tokens are recounted from the mask's sum and
    the padding side (upstream), not read from the mask itself."""
    batch, length, channels, _ = x.shape
    lengths = valid.sum(-1)
    pos = torch.arange(length)[None]
    if padding_side == "left":
        keep = pos >= length - lengths[:, None]
    elif padding_side == "right":
        keep = pos < lengths[:, None]
    else:
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    k = keep[:, :, None, None]
    mean = x.masked_fill(~k, 0.0).sum(dim=(1, 2), keepdim=True) / ((lengths * channels).view(batch, 1, 1, 1) + 1e-6)
    lo = x.masked_fill(~k, float("inf")).amin(dim=(1, 2), keepdim=True)
    hi = x.masked_fill(~k, float("-inf")).amax(dim=(1, 2), keepdim=True)
    out = (x - mean) / (hi - lo + 1e-6) * scale
    return out.flatten(2).masked_fill(~keep[..., None], 0.0)


def connector(mod: nn.Module, x: torch.Tensor, valid: torch.Tensor, c: Ltx2ConnectorsConfig, heads: int,
              name: str, record) -> torch.Tensor:
    """Registers in place of the padding (then no mask), 1-D RoPE, pre-norm blocks, a final RMSNorm."""
    batch, length, width = x.shape
    bias = None
    if "learnable_registers" in mod._parameters:
        regs = mod.learnable_registers
        if length % regs.shape[0]:
            raise ValueError(f"text length {length} is not a multiple of the {regs.shape[0]} learnable registers")
        tiled = regs.repeat(length // regs.shape[0], 1)                  # register j sits at positions j (mod R)
        rows = []
        for b in range(batch):    # the valid tokens move to the front, in order; the tail takes the registers
            tokens = x[b][valid[b]]
            rows.append(torch.cat([tokens, tiled[tokens.shape[0]:].to(x.dtype)]))
        x = torch.stack(rows)
    else:                         # padding masked out of the keys: 0 or -max, added to the scores (upstream)
        bias = ((valid.to(torch.int64) - 1).to(x.dtype) * torch.finfo(x.dtype).max)[:, None, None, :]
    # 1-D RoPE: token i at i / base_seq_len (a [i, i] interval's midpoint, as the DiT's RoPE reads coordinates)
    ids = torch.arange(length, dtype=torch.float32)
    coords = torch.stack([ids, ids], -1)[None, None].expand(batch, 1, -1, -1)
    freqs = rope(coords, (c.connector_rope_base_seq_len,), width, c.rope_theta,
                 heads if c.rope_type == "split" else None)
    for i, blk in enumerate(mod.transformer_blocks):
        y = rms_norm(x, 1e-6)
        x = x + attention(blk.attn1, y, y, heads, freqs, freqs, bias=bias)
        x = x + feed_forward(blk.ff, rms_norm(x, 1e-6))
        record(f"{name}.transformer_blocks.{i}", x)
    x = rms_norm(x, 1e-6)
    record(name, x)
    return x


def load_connectors(cfg: Ltx2ConnectorsConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                    dtype: torch.dtype = torch.float32) -> Ltx2Connectors:
    """Strict: exactly the canonical keys at their shapes."""
    model = Ltx2Connectors(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()
