"""ltx2 reference model: diffusers:LTX2VideoTransformer3DModel (diffusers 0.42.1), written to be read top to bottom.

The weights live under their canonical names (manifests/ltx2/keys.py) as a tree of modules built from the keys:
`self.<path>.weight`, a numbered level is an nn.ModuleList. One call denoises both streams of LTX-2: video tokens
and audio tokens, each with its own AdaLN-single timestep conditioning, self-attention (own RoPE) and text
cross-attention, then audio <-> video cross-attention over time only, then feed-forward. `trace(name, tensor)` gets
the canonical module names upstream's modules have (embedders, each attention and feed-forward, each block, the
heads) plus `transformer_blocks.<i>.audio` (the block's audio stream), so C0 and `fvparity align` name the first
one that diverges.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from manifests.ltx2 import Ltx2Config, key_shapes


def _tree(root: nn.Module, shapes: dict[str, tuple[int, ...]]) -> None:
    """One nn.Parameter per canonical key, under its dotted name (numbered levels become ModuleLists)."""
    for key, shape in shapes.items():
        *path, leaf = key.split(".")
        node = root
        for part, nxt in zip(path, path[1:] + [leaf]):
            make = nn.ModuleList if nxt.isdigit() else nn.Module
            if isinstance(node, nn.ModuleList):
                while len(node) <= int(part):
                    node.append(make())
                node = node[int(part)]
            else:
                if part not in node._modules:
                    node.add_module(part, make())
                node = node._modules[part]
        node.register_parameter(leaf, nn.Parameter(torch.empty(shape), requires_grad=False))


class Ltx2Model(nn.Module):
    def __init__(self, cfg: Ltx2Config):
        super().__init__()
        unsupported = [f"{k}={getattr(cfg, k)!r}" for k, ok in UNSUPPORTED.items() if getattr(cfg, k) != ok]
        if unsupported:
            raise ValueError(f"ltx2 reference: not ported yet: {', '.join(unsupported)}")
        self.cfg = cfg
        _tree(self, key_shapes(cfg))

    def forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states,
                timestep, audio_timestep=None, encoder_attention_mask=None, audio_encoder_attention_mask=None,
                video_coords=None, audio_coords=None, sigma=None, audio_sigma=None, video_keyframes_mask=None,
                trace=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Video tokens [B, N, in_channels] and audio tokens [B, M, audio_in_channels] -> both denoised, one step.
        `sigma` / `audio_sigma` [B] drive the text cross-attention's key / value modulation (LTX-2.3 only);
        `video_keyframes_mask` [B, N, 1] marks tokens that get the keyframe embedding (LTX-2.5 only)."""
        c = self.cfg
        record = trace or (lambda name, t: None)

        def record_out(name: str, t: torch.Tensor) -> torch.Tensor:
            record(name, t)
            return t
        batch = hidden_states.shape[0]
        if video_coords is None or audio_coords is None:
            raise ValueError("ltx2 reference: pass video_coords and audio_coords (LTX2Pipeline always does)")
        audio_timestep = timestep if audio_timestep is None else audio_timestep
        audio_sigma = sigma if audio_sigma is None else audio_sigma
        text_bias = mask_to_bias(encoder_attention_mask, hidden_states.dtype)
        audio_text_bias = mask_to_bias(audio_encoder_attention_mask, audio_hidden_states.dtype)

        # 1. RoPE: each stream over its own axes; the cross-modal attention over time only, on a shared time base
        cross_base = max(c.pos_embed_max_pos, c.audio_pos_embed_max_pos)
        split = c.rope_type == "split"
        video_rope = rope(video_coords, (c.pos_embed_max_pos, c.base_height, c.base_width), c.inner_dim, c.rope_theta,
                          c.num_attention_heads if split else None)
        audio_rope = rope(audio_coords, (c.audio_pos_embed_max_pos,), c.audio_inner_dim, c.rope_theta,
                          c.audio_num_attention_heads if split else None)
        # split RoPE: the video side of the cross-modal attention groups its (audio-width) channels by the VIDEO
        # head count, though that attention has the audio stream's heads (upstream)
        video_time_rope = rope(video_coords[:, 0:1], (cross_base,), c.audio_cross_attention_dim, c.rope_theta,
                               c.num_attention_heads if split else None)
        audio_time_rope = rope(audio_coords[:, 0:1], (cross_base,), c.audio_cross_attention_dim, c.rope_theta,
                               c.audio_num_attention_heads if split else None)

        # 2. token and text projections
        x = linear(self.proj_in, hidden_states)
        a = linear(self.audio_proj_in, audio_hidden_states)
        record("proj_in", x)
        record("audio_proj_in", a)
        if c.use_keyframes_abs_pos_embedding and video_keyframes_mask is not None:
            x = x + (video_keyframes_mask > 0).to(x.dtype) * self.keyframes_abs_pos_embedding   # after the trace
        text, audio_text = encoder_hidden_states, audio_encoder_hidden_states
        if c.use_prompt_embeddings:  # LTX-2.0; 2.3's connectors project per modality instead
            text = caption_projection(self.caption_projection, encoder_hidden_states)
            audio_text = caption_projection(self.audio_caption_projection, audio_encoder_hidden_states)
            record("caption_projection", text)
            record("audio_caption_projection", audio_text)

        # 3. timestep conditioning, per modality: [B, T, k * D] (T = 1 or one per token)
        video_mod, video_emb = ada_single(self.time_embed, timestep, batch, x.dtype)
        audio_mod, audio_emb = ada_single(self.audio_time_embed, audio_timestep, batch, a.dtype)
        # the cross-modal scale / shift and gates follow each stream's own timestep (upstream's LTX-2.0 default)
        video_ca, _ = ada_single(self.av_cross_attn_video_scale_shift, timestep, batch, x.dtype)
        audio_ca, _ = ada_single(self.av_cross_attn_audio_scale_shift, audio_timestep, batch, a.dtype)
        gate_factor = c.cross_attn_timestep_scale_multiplier / c.timestep_scale_multiplier
        video_gate, _ = ada_single(self.av_cross_attn_video_a2v_gate, timestep * gate_factor, batch, x.dtype)
        audio_gate, _ = ada_single(self.av_cross_attn_audio_v2a_gate, audio_timestep * gate_factor, batch, a.dtype)
        record("time_embed", video_mod.flatten(0, 1))          # upstream's module returns [B * T, k * D]
        record("audio_time_embed", audio_mod.flatten(0, 1))
        # LTX-2.3: the text keys / values are modulated too, by sigma through an AdaLN-single, or by a fixed
        # per-layer table alone (use_prompt_adaln_single=False: cacheable across steps)
        prompt_mod = c.cross_attn_mod or c.audio_cross_attn_mod
        video_prompt = audio_prompt = None
        if prompt_mod and c.use_prompt_adaln_single:
            video_prompt, _ = ada_single(self.prompt_adaln, sigma, batch, x.dtype)
            audio_prompt, _ = ada_single(self.audio_prompt_adaln, audio_sigma, batch, a.dtype)

        # 4. the blocks
        for i, blk in enumerate(self.transformer_blocks):
            eps = c.norm_eps
            video_rows = modulation(blk.scale_shift_table, video_mod)     # 6 rows, 9 with cross_attn_mod
            audio_rows = modulation(blk.audio_scale_shift_table, audio_mod)
            v_shift, v_scale, v_gate, v_shift_ff, v_scale_ff, v_gate_ff = video_rows[:6]
            a_shift, a_scale, a_gate, a_shift_ff, a_scale_ff, a_gate_ff = audio_rows[:6]
            # 4.1 self-attention, each stream with its own RoPE
            b = f"transformer_blocks.{i}."
            y = rms_norm(x, eps) * (1 + v_scale) + v_shift
            x = x + record_out(b + "attn1", attention(blk.attn1, y, y, c.num_attention_heads, video_rope,
                                                      video_rope)) * v_gate
            y = rms_norm(a, eps) * (1 + a_scale) + a_shift
            a = a + record_out(b + "audio_attn1", attention(blk.audio_attn1, y, y, c.audio_num_attention_heads,
                                                            audio_rope, audio_rope)) * a_gate
            # 4.2 text cross-attention, no RoPE; ungated unless cross_attn_mod (then its query is modulated too)
            kv, audio_kv = text, audio_text
            if prompt_mod:  # both modalities' text is modulated when either switch is on (upstream)
                kv = modulate_text(text, blk.prompt_scale_shift_table, video_prompt)
                audio_kv = modulate_text(audio_text, blk.audio_prompt_scale_shift_table, audio_prompt)
            y = rms_norm(x, eps)
            if c.cross_attn_mod:
                y = y * (1 + video_rows[7]) + video_rows[6]
            o = record_out(b + "attn2", attention(blk.attn2, y, kv, c.num_attention_heads, bias=text_bias))
            x = x + (o * video_rows[8] if c.cross_attn_mod else o)
            y = rms_norm(a, eps)
            if c.audio_cross_attn_mod:
                y = y * (1 + audio_rows[7]) + audio_rows[6]
            o = record_out(b + "audio_attn2", attention(blk.audio_attn2, y, audio_kv, c.audio_num_attention_heads,
                                                        bias=audio_text_bias))
            a = a + (o * audio_rows[8] if c.audio_cross_attn_mod else o)
            # 4.3 audio <-> video cross-attention (heads and width of the audio stream, time-only RoPE); both
            # directions read the streams as they were before either update (upstream normalises once)
            xn, an = rms_norm(x, eps), rms_norm(a, eps)
            v_ca = modulation(blk.video_a2v_cross_attn_scale_shift_table[:4], video_ca)
            a_ca = modulation(blk.audio_a2v_cross_attn_scale_shift_table[:4], audio_ca)
            a2v_gate = modulation(blk.video_a2v_cross_attn_scale_shift_table[4:], video_gate)[0]
            v2a_gate = modulation(blk.audio_a2v_cross_attn_scale_shift_table[4:], audio_gate)[0]
            # the per-stream tables are (scale, shift) pairs, scale first (upstream order): a2v, then v2a
            q, kv = xn * (1 + v_ca[0]) + v_ca[1], an * (1 + a_ca[0]) + a_ca[1]
            x_new = x + a2v_gate * record_out(b + "audio_to_video_attn", attention(
                blk.audio_to_video_attn, q, kv, c.audio_num_attention_heads, video_time_rope, audio_time_rope))
            q, kv = an * (1 + a_ca[2]) + a_ca[3], xn * (1 + v_ca[2]) + v_ca[3]
            a = a + v2a_gate * record_out(b + "video_to_audio_attn", attention(
                blk.video_to_audio_attn, q, kv, c.audio_num_attention_heads, audio_time_rope, video_time_rope))
            x = x_new
            # 4.4 feed-forward
            x = x + record_out(b + "ff", feed_forward(blk.ff, rms_norm(x, eps) * (1 + v_scale_ff) + v_shift_ff)
                               ) * v_gate_ff
            a = a + record_out(b + "audio_ff", feed_forward(blk.audio_ff, rms_norm(a, eps) * (1 + a_scale_ff)
                                                            + a_shift_ff)) * a_gate_ff
            record(f"transformer_blocks.{i}", x)
            record(f"transformer_blocks.{i}.audio", a)

        # 5. output heads: LayerNorm (no affine), modulated by the embedded timestep (before its SiLU + linear)
        # the same embedding is added to both rows of the table, shift and scale (upstream)
        shift, scale = (self.scale_shift_table[None, None] + video_emb[:, :, None]).unbind(2)
        out = linear(self.proj_out, F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale) + shift)
        shift, scale = (self.audio_scale_shift_table[None, None] + audio_emb[:, :, None]).unbind(2)
        audio_out = linear(self.audio_proj_out, F.layer_norm(a, a.shape[-1:], eps=1e-6) * (1 + scale) + shift)
        record("proj_out", out)
        record("audio_proj_out", audio_out)
        return out, audio_out


# config values this port covers (LTX-2.0, 2.3 and 2.5 switches ported); STG, patches > 1 refused by name
UNSUPPORTED = {"patch_size": 1, "patch_size_t": 1, "audio_patch_size": 1, "audio_patch_size_t": 1,
               "perturbed_attn": False, "norm_elementwise_affine": False,
               "attention_bias": True, "attention_out_bias": True, "qk_norm": "rms_norm_across_heads",
               "activation_fn": "gelu-approximate"}


def linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, mod.weight, mod._parameters.get("bias"))     # ff_bias=False (LTX-2.5): no bias


def modulate_text(text: torch.Tensor, table: torch.Tensor, temb: torch.Tensor | None) -> torch.Tensor:
    """Text keys / values * (1 + scale) + shift; rows (shift, scale) of the table, plus sigma's AdaLN if given."""
    shift, scale = modulation(table, temb) if temb is not None else table[None, None].unbind(2)
    return text * (1 + scale) + shift


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a gain, computed in fp32 and cast back (upstream)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def mask_to_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A 0 / 1 key mask [B, L] -> an additive bias [B, 1, 1, L]: 0 kept, -10000 dropped (upstream, not -inf)."""
    if mask is None:
        return None
    return ((1 - mask.to(dtype)) * -10000.0)[:, None, None, :]


def timestep_embedding(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """256 sinusoidal channels, cos first, frequencies exp(-ln(10000) * j / 128) (diffusers Timesteps, shift 0)."""
    freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32) / 128)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def ada_single(mod: nn.Module, t: torch.Tensor, batch: int, dtype: torch.dtype):
    """AdaLN-single: (SiLU -> linear of the timestep embedding, the embedding itself), both [B, T, *]."""
    te = mod.emb.timestep_embedder
    emb = linear(te.linear_2, F.silu(linear(te.linear_1, timestep_embedding(t.flatten(), dtype))))
    return linear(mod.linear, F.silu(emb)).view(batch, -1, mod.linear.weight.shape[0]), emb.view(batch, -1,
                                                                                                 emb.shape[-1])


def modulation(table: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A per-layer table [k, D] plus the global conditioning [B, T, k * D] -> k tensors [B, T, D]."""
    k = table.shape[0]
    values = table[None, None] + temb.reshape(temb.shape[0], temb.shape[1], k, -1)
    return values.unbind(dim=2)


def caption_projection(mod: nn.Module, text: torch.Tensor) -> torch.Tensor:
    return linear(mod.linear_2, F.gelu(linear(mod.linear_1, text), approximate="tanh"))


def feed_forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return linear(mod.net[2], F.gelu(linear(mod.net[0].proj, x), approximate="tanh"))


def rope(coords: torch.Tensor, max_positions: tuple, dim: int, theta: float,
         split_heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (cos, sin) from [start, end) coordinates [B, P, N, 2]: each token sits at its patch midpoint as a
    fraction of the base extent, mapped to [-1, 1]; frequencies theta^linspace(0, 1) * pi / 2 (float64, then
    float32: upstream), axis-minor. Interleaved: [B, N, dim], the dim % (2P) leftover channels lead, unrotated.
    Split (`split_heads`): [B, N, H, dim / 2H], padded to dim / 2 frequencies at the front, then cut per head."""
    pos = coords.mean(-1)                                                        # [B, P, N] midpoints
    axes = pos.shape[1]
    grid = torch.stack([pos[:, i] / max_positions[i] for i in range(axes)], dim=-1)        # [B, N, P]
    freqs = (theta ** torch.linspace(0.0, 1.0, dim // (2 * axes), dtype=torch.float64) * math.pi / 2).float()
    angles = ((grid[..., None] * 2 - 1) * freqs).transpose(-1, -2).flatten(2)    # [B, N, F * P], frequency-major
    if split_heads is not None:
        pad = dim // 2 - angles.shape[-1]
        cos, sin = angles.cos(), angles.sin()
        if pad:
            cos = torch.cat([torch.ones_like(cos[..., :pad]), cos], -1)
            sin = torch.cat([torch.zeros_like(sin[..., :pad]), sin], -1)
        return cos.unflatten(-1, (split_heads, -1)), sin.unflatten(-1, (split_heads, -1))
    cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
    pad = dim % (2 * axes)
    if pad:
        cos = torch.cat([torch.ones_like(cos[..., :pad]), cos], -1)
        sin = torch.cat([torch.zeros_like(sin[..., :pad]), sin], -1)
    return cos, sin


def rotate(x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Interleaved rotation over the full width (all heads at once): pairs (x0, x1) -> (x0 c - x1 s, x1 c + x0 s).
    Split (4-d freqs): each of the rope's heads' channels in two halves (a, b) -> (a c - b s, b c + a s), fp32."""
    cos, sin = freqs
    if cos.ndim == 4:
        a, b = x.float().unflatten(-1, (cos.shape[2], 2, -1)).unbind(-2)       # [B, S, H, r] each
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -2).flatten(-3).to(x.dtype)
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-x1, x0], dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def attention(attn: nn.Module, x: torch.Tensor, context: torch.Tensor, heads: int,
              q_rope=None, k_rope=None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """LTX-2 attention: q / k RMS-normalised across all heads (gain, eps 1e-6), then RoPE, then SDPA; gated
    attention (LTX-2.3) scales each head's output by 2 sigmoid(a linear of the query input) before to_out."""
    q = F.rms_norm(linear(attn.to_q, x), attn.to_q.weight.shape[:1], attn.norm_q.weight, eps=1e-6)
    k = F.rms_norm(linear(attn.to_k, context), attn.to_k.weight.shape[:1], attn.norm_k.weight, eps=1e-6)
    v = linear(attn.to_v, context)
    if q_rope is not None:
        q, k = rotate(q, q_rope), rotate(k, k_rope)
    n, s = x.shape[:2]
    q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2)      # [B, S, H, d]
    if "to_gate_logits" in attn._modules:
        o = o * (2.0 * torch.sigmoid(linear(attn.to_gate_logits, x)))[..., None]
    return linear(attn.to_out[0], o.reshape(n, s, -1))


def load_model(cfg: Ltx2Config, state: dict[str, torch.Tensor], device: str = "cpu",
               dtype: torch.dtype = torch.float32) -> Ltx2Model:
    """Strict: exactly the canonical keys at their shapes."""
    model = Ltx2Model(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()
