"""ltx2 reference Gemma 3 text path (manifests/ltx2/gemma3.py): transformers' Gemma 3 text model as LTX2Pipeline
uses it, all hidden states, read top to bottom. Weights: a dict of canonical names (the text model's own)."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from manifests.ltx2.gemma3 import Gemma3TextSpec, gemma3_key_shapes


def gemma_norm(x, w, eps):
    """Gemma RMSNorm: in fp32, gain (1 + w)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)


def rope(x, pos, theta, factor):
    """Rotate-half RoPE over the head dim; linear scaling divides the frequencies by `factor`."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)) / factor
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def hidden_states(state: dict[str, torch.Tensor], c: Gemma3TextSpec, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor) -> torch.Tensor:
    """-> [B, L, hidden, layers + 1]: what LTX2Pipeline stacks (torch.stack(outputs.hidden_states, -1))."""
    if set(state) != set(gemma3_key_shapes(c)):
        raise ValueError("gemma3 reference: the weights are not the canonical key set")
    B, L = input_ids.shape
    x = F.embedding(input_ids, state["embed_tokens.weight"]) * torch.tensor(math.sqrt(c.hidden_size),
                                                                          dtype=state["embed_tokens.weight"].dtype)
    outs = [x]
    pos = torch.arange(L)                              # positions count pads too (left padding: upstream)
    q_i, k_i = pos[:, None], pos[None]
    valid = attention_mask.bool()[:, None, None, :]
    causal = (k_i <= q_i)[None, None] & valid
    H, KV, d, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    for i, kind in enumerate(c.types()):
        p = f"layers.{i}."
        sliding = kind == "sliding_attention"
        mask = causal & (k_i > q_i - c.sliding_window)[None, None] if sliding else causal
        theta, factor = (c.rope_local_theta, 1.0) if sliding else (c.rope_global_theta, c.rope_global_linear_factor)
        h = gemma_norm(x, state[p + "input_layernorm.weight"], eps)
        q = F.linear(h, state[p + "self_attn.q_proj.weight"]).view(B, L, H, d).transpose(1, 2)
        k = F.linear(h, state[p + "self_attn.k_proj.weight"]).view(B, L, KV, d).transpose(1, 2)
        v = F.linear(h, state[p + "self_attn.v_proj.weight"]).view(B, L, KV, d).transpose(1, 2)
        q = rope(gemma_norm(q, state[p + "self_attn.q_norm.weight"], eps), pos, theta, factor)
        k = rope(gemma_norm(k, state[p + "self_attn.k_norm.weight"], eps), pos, theta, factor)
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        scores = (q @ k.transpose(-1, -2)) * c.query_pre_attn_scalar ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        a = torch.nan_to_num(scores.softmax(-1)) @ v       # a row that sees no token (left pad) gives 0
        a = F.linear(a.transpose(1, 2).reshape(B, L, H * d), state[p + "self_attn.o_proj.weight"])
        x = x + gemma_norm(a, state[p + "post_attention_layernorm.weight"], eps)
        h = gemma_norm(x, state[p + "pre_feedforward_layernorm.weight"], eps)
        m = F.gelu(F.linear(h, state[p + "mlp.gate_proj.weight"]), approximate="tanh") * \
            F.linear(h, state[p + "mlp.up_proj.weight"])
        x = x + gemma_norm(F.linear(m, state[p + "mlp.down_proj.weight"]),
                           state[p + "post_feedforward_layernorm.weight"], eps)
        outs.append(x)
    outs[-1] = gemma_norm(x, state["norm.weight"], eps)
    return torch.stack(outs, -1)
