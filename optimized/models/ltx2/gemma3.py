"""ltx2 fast Gemma 3 text path (manifests/ltx2/gemma3.py), written independently of reference/: q / k / v fused at
load, SDPA with grouped-query heads and one boolean mask per layer kind, RoPE tables built once per call."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from manifests.ltx2.gemma3 import Gemma3TextSpec, gemma3_key_shapes


class FastGemma3Text:
    def __init__(self, spec: Gemma3TextSpec, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        want = gemma3_key_shapes(spec.validate())
        bad = sorted(set(want) ^ set(state)) or [k for k in want if tuple(state[k].shape) != want[k]]
        if bad:
            raise ValueError(f"gemma3 optimized: keys missing, unexpected or misshapen: {bad[:5]}")
        self.spec, self.dtype = spec, dtype
        self.p = {k: v.to(dtype) for k, v in state.items()}
        self.qkv = [torch.cat([self.p[f"layers.{i}.self_attn.{n}_proj.weight"] for n in "qkv"])
                    for i in range(spec.num_hidden_layers)]

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.rms_norm(x.float(), x.shape[-1:], eps=self.spec.rms_norm_eps).mul(1.0 + self.p[name].float()) \
            .to(x.dtype)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        s, P = self.spec, self.p
        B, L = input_ids.shape
        H, KV, d = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        x = P["embed_tokens.weight"][input_ids] * torch.tensor(math.sqrt(s.hidden_size), dtype=self.dtype)
        states = [x]
        idx = torch.arange(L, device=input_ids.device)
        keys = attention_mask.bool()[:, None, None, :]
        full = keys & (idx[None, :] <= idx[:, None])
        masks = {"full_attention": full, "sliding_attention": full & (idx[None, :] > idx[:, None] - s.sliding_window)}
        sees = {k: m.any(-1, keepdim=True) for k, m in masks.items()}              # rows that see some key
        masks = {k: m | ~sees[k] for k, m in masks.items()}                         # (their output is zeroed)
        tables = {}
        for kind, (theta, factor) in (("sliding_attention", (s.rope_local_theta, 1.0)),
                                      ("full_attention", (s.rope_global_theta, s.rope_global_linear_factor))):
            inv = (1.0 / theta ** (torch.arange(0, d, 2, device=idx.device).float() / d)) / factor
            ang = torch.outer(idx.float(), inv).repeat(1, 2)
            tables[kind] = ang.cos(), ang.sin()
        for i, kind in enumerate(s.types()):
            p = f"layers.{i}."
            q, k, v = F.linear(self._norm(x, p + "input_layernorm.weight"), self.qkv[i]).split(
                [H * d, KV * d, KV * d], -1)
            cos, sin = tables[kind]
            q = _rot(self._norm(q.view(B, L, H, d), p + "self_attn.q_norm.weight").transpose(1, 2), cos, sin)
            k = _rot(self._norm(k.view(B, L, KV, d), p + "self_attn.k_norm.weight").transpose(1, 2), cos, sin)
            o = F.scaled_dot_product_attention(q, k, v.view(B, L, KV, d).transpose(1, 2), attn_mask=masks[kind],
                                               scale=s.query_pre_attn_scalar ** -0.5, enable_gqa=H != KV)
            o = o * sees[kind].to(o.dtype)
            o = F.linear(o.transpose(1, 2).reshape(B, L, H * d), P[p + "self_attn.o_proj.weight"])
            x = x + self._norm(o, p + "post_attention_layernorm.weight")
            h = self._norm(x, p + "pre_feedforward_layernorm.weight")
            m = F.gelu(F.linear(h, P[p + "mlp.gate_proj.weight"]), approximate="tanh") * F.linear(
                h, P[p + "mlp.up_proj.weight"])
            x = x + self._norm(F.linear(m, P[p + "mlp.down_proj.weight"]), p + "post_feedforward_layernorm.weight")
            states.append(x)
        states[-1] = self._norm(x, "norm.weight")
        return torch.stack(states, -1)


def _rot(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)          # the tables in the run dtype (transformers' rotary does too)
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat((-b, a), -1) * sin
