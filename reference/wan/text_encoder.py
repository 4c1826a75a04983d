"""UMT5 encoder (Wan's text encoder), reproducing transformers `UMT5EncoderModel` and WanPipeline's prompt embeds.

    h = shared[ids]                                           token embedding (the one stored table, `shared.weight`)
    per layer:
        h += o(Attn(q(n), k(n), v(n)) + own relative bias)   n = RMS(h); scores NOT scaled by 1/sqrt(d_kv) (T5)
        h += wo(gelu_tanh(wi_0(n)) * wi_1(n))                 n = RMS(h); gated-GELU FFN
    out = RMS(h)

RMS(x) = weight * x / sqrt(mean(x^2) + eps) with the mean in float32, no mean subtraction and no bias (T5).
Unlike T5, UMT5 gives EVERY layer its own relative position bias table. Padded keys are masked out; padded
queries still produce (non-zero) outputs, which WanPipeline then replaces with zeros (`encode_prompts`).
Parameter names ARE the canonical layout (`manifests.wan.dit.umt5_key_shapes`, = transformers' names).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from manifests.wan.dit import UMT5Config, umt5_key_shapes


class T5RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):   # (upstream) back to half before the scale
            x = x.to(self.weight.dtype)
        return self.weight * x


def relative_position_bucket(relative: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Bidirectional T5 buckets of (key position - query position): half the buckets for keys after the query;
    within a half, distances < num_buckets/4 get their own bucket, larger ones share log-spaced buckets up to
    max_distance, beyond which all land in the last bucket."""
    half = num_buckets // 2
    bucket = (relative > 0).long() * half
    distance = relative.abs()
    max_exact = half // 2
    log_ratio = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)
    large = torch.clamp(max_exact + log_ratio.to(torch.long), max=half - 1)  # log(0) = -inf: not selected below
    return bucket + torch.where(distance < max_exact, distance, large)


class SelfAttention(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        d, inner = cfg.d_model, cfg.inner_dim
        self.q, self.k, self.v = (nn.Linear(d, inner, bias=False) for _ in range(3))
        self.o = nn.Linear(inner, d, bias=False)
        self.relative_attention_bias = nn.Embedding(cfg.relative_attention_num_buckets, cfg.num_heads)
        self.cfg = cfg

    def position_bias(self, length: int, device) -> torch.Tensor:
        """[1, heads, L, L]: this layer's learned bias for each (query, key) distance bucket."""
        pos = torch.arange(length, dtype=torch.long, device=device)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None], self.cfg.relative_attention_num_buckets,
                                           self.cfg.relative_attention_max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [B, L, d]; key_mask [B, L] bool (True = real token)."""
        B, L, _ = x.shape
        heads = lambda t: t.view(B, L, self.cfg.num_heads, self.cfg.d_kv).transpose(1, 2)   # [B, H, L, d_kv]
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        bias = self.position_bias(L, x.device).to(q.dtype)
        # masked keys get the dtype's minimum instead of their bias (upstream sdpa path), so softmax gives them 0
        bias = torch.where(key_mask[:, None, None, :], bias, torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)     # no 1/sqrt(d_kv) (T5)
        return self.o(out.transpose(1, 2).reshape(B, L, -1))


class GatedGeluFFN(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.wi_0(x)
        gelu = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * torch.pow(g, 3.0))))  # gelu_new
        h = gelu * self.wi_1(x)
        return self.wo(h.to(self.wo.weight.dtype))    # (upstream) wo kept in fp32: cast the input to its dtype


class AttentionLayer(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.SelfAttention = SelfAttention(cfg)
        self.layer_norm = T5RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return x + self.SelfAttention(self.layer_norm(x), key_mask)


class FFNLayer(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.DenseReluDense = GatedGeluFFN(cfg)
        self.layer_norm = T5RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


class Block(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.layer = nn.ModuleList([AttentionLayer(cfg), FFNLayer(cfg)])

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = self.layer[0](x, key_mask)
        if x.dtype == torch.float16:                  # (upstream) clamp inf for fp16 after each sub-layer
            x = _clamp_fp16(x)
        x = self.layer[1](x)
        return _clamp_fp16(x) if x.dtype == torch.float16 else x


def _clamp_fp16(x: torch.Tensor) -> torch.Tensor:
    big = torch.finfo(x.dtype).max
    limit = torch.where(torch.isinf(x).any(), big - 1000, big)
    return torch.clamp(x, min=-limit, max=limit)


class Stack(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.block = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
        self.final_layer_norm = T5RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)


class UMT5Encoder(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.cfg = cfg.validate()
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = Stack(cfg)        # upstream's `encoder.embed_tokens` is `shared` (tied, stored once)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids [B, L] int64, mask [B, L] (nonzero = real token) -> last hidden state [B, L, d_model]."""
        key_mask = mask.to(ids.device) != 0
        x = self.shared(ids)
        for block in self.encoder.block:
            x = block(x, key_mask)
        return self.encoder.final_layer_norm(x)


@torch.no_grad()
def encode_prompts(encoder: UMT5Encoder, ids_list: list[torch.Tensor], max_sequence_length: int) -> torch.Tensor:
    """WanPipeline `_get_t5_prompt_embeds` on already-tokenized prompts -> [B, max_sequence_length, d_model].

    Each prompt's ids (with its EOS) are cut to max_sequence_length (the tokenizer truncates, upstream), padded
    with id 0 plus an attention mask, encoded together, trimmed to each prompt's own length and zero-padded
    back (the zeros, not the encoder's outputs at padded positions, reach the DiT)."""
    device = encoder.shared.weight.device
    B = len(ids_list)
    ids = torch.zeros(B, max_sequence_length, dtype=torch.long, device=device)
    mask = torch.zeros(B, max_sequence_length, dtype=torch.long, device=device)
    lengths = []
    for i, t in enumerate(ids_list):
        t = torch.as_tensor(t, dtype=torch.long).flatten()[:max_sequence_length]
        ids[i, :len(t)], mask[i, :len(t)] = t.to(device), 1
        lengths.append(len(t))
    hidden = encoder(ids, mask)
    out = torch.zeros_like(hidden)
    for i, n in enumerate(lengths):
        out[i, :n] = hidden[i, :n]
    return out


def load_umt5(cfg: UMT5Config, state_dict: dict[str, torch.Tensor]) -> UMT5Encoder:
    """Build the encoder and load a canonical state dict strictly (no `encoder.embed_tokens.weight`)."""
    expected = umt5_key_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    if got != expected:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise ValueError(f"UMT5 state dict mismatch: missing {missing[:5]}, unexpected {extra[:5]}, "
                         f"wrong shape {wrong[:5]}")
    with torch.device("meta"):
        model = UMT5Encoder(cfg)
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model.eval()
