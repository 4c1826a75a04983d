"""ltx2 fast model: diffusers:LTX2VideoTransformer3DModel on the runtime path, written independently of reference/.

The weights are a flat dict of canonical names -> tensors after the ComponentSpec's declared load transforms (cast,
fp32 pins from manifests/ltx2/keys.py fp32_keys), fused once at load (FastLtx2). `trace(name, tensor)` under the
same canonical names as the reference.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from manifests.ltx2 import Ltx2Config, fp32_keys, key_shapes
from optimized.attention import attend
from optimized.runtime.spec import ComponentSpec, LoadTransform, apply_load_transforms


def component(cfg: Ltx2Config) -> ComponentSpec:
    shapes, fp32 = key_shapes(cfg), set(fp32_keys(cfg))
    return ComponentSpec("transformer", "ltx2_transformer", tuple(shapes.items()), tuple(
        LoadTransform(f"cast.{k}", (k,), k, "cast", dtype="float32" if k in fp32 else None) for k in shapes)).validate()


class FastLtx2:
    """One denoising call of both streams. Weights fused once at load: self-attention q / k / v as one matmul,
    every cross-attention's k / v as one, the three timestep MLPs that share a stream's timestep as one first layer."""

    def __init__(self, cfg: Ltx2Config, params: dict[str, torch.Tensor], dtype: torch.dtype):
        bad = [f"{k}={getattr(cfg, k)!r}" for k, v in PORTED.items() if getattr(cfg, k) != v]
        if bad:
            raise ValueError(f"ltx2 optimized: not ported yet: {', '.join(bad)}")
        self.cfg, self.p, self.dtype = cfg, params, dtype
        P = params
        self.fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(cfg.num_layers):
            b = f"transformer_blocks.{i}."
            for a in ("attn1", "audio_attn1"):
                self.fused[b + a] = _cat(P, [f"{b}{a}.to_{n}" for n in "qkv"])
            for a in ("attn2", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn"):
                self.fused[b + a] = _cat(P, [f"{b}{a}.to_{n}" for n in "kv"])
        for stream, names in TIME_MLPS.items():
            self.fused[stream] = _cat(P, [f"{n}.emb.timestep_embedder.linear_1" for n in names])

    def __call__(self, hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states,
                 timestep, audio_timestep=None, encoder_attention_mask=None, audio_encoder_attention_mask=None,
                 video_coords=None, audio_coords=None, sigma=None, audio_sigma=None, video_keyframes_mask=None,
                 trace=None) -> tuple[torch.Tensor, torch.Tensor]:
        c, P = self.cfg, self.p
        tr = trace or (lambda name, t: None)
        if video_coords is None or audio_coords is None:
            raise ValueError("ltx2 optimized: pass video_coords and audio_coords (LTX2Pipeline always does)")
        B = hidden_states.shape[0]
        t_audio = timestep if audio_timestep is None else audio_timestep
        s_audio = sigma if audio_sigma is None else audio_sigma
        hv, ha = c.num_attention_heads, c.audio_num_attention_heads
        text_keep = _keep(encoder_attention_mask)
        audio_text_keep = _keep(audio_encoder_attention_mask)
        common = max(c.pos_embed_max_pos, c.audio_pos_embed_max_pos)
        # split RoPE cuts each table by the heads of the stream it came from (video heads for the video side of
        # the cross-modal attention too)
        split = c.rope_type == "split"
        hs_v, hs_a = (hv, ha) if split else (None, None)
        rope_v = _rope(video_coords, (c.pos_embed_max_pos, c.base_height, c.base_width), c.inner_dim, c.rope_theta,
                       hs_v)
        rope_a = _rope(audio_coords, (c.audio_pos_embed_max_pos,), c.audio_inner_dim, c.rope_theta, hs_a)
        rope_vt = _rope(video_coords[:, :1], (common,), c.audio_cross_attention_dim, c.rope_theta, hs_v)
        rope_at = _rope(audio_coords[:, :1], (common,), c.audio_cross_attention_dim, c.rope_theta, hs_a)

        x, a = self.lin("proj_in", hidden_states), self.lin("audio_proj_in", audio_hidden_states)
        tr("proj_in", x)
        tr("audio_proj_in", a)
        if c.use_keyframes_abs_pos_embedding and video_keyframes_mask is not None:
            x = torch.where(video_keyframes_mask > 0, x + P["keyframes_abs_pos_embedding"], x)
        ctx, actx = encoder_hidden_states, audio_encoder_hidden_states
        if c.use_prompt_embeddings:
            ctx = self.lin("caption_projection.linear_2",
                           F.gelu(self.lin("caption_projection.linear_1", ctx), approximate="tanh"))
            actx = self.lin("audio_caption_projection.linear_2",
                            F.gelu(self.lin("audio_caption_projection.linear_1", actx), approximate="tanh"))
            tr("caption_projection", ctx)
            tr("audio_caption_projection", actx)

        gate_mult = c.cross_attn_timestep_scale_multiplier / c.timestep_scale_multiplier
        (tv, ev), (cav, _), (gv, _) = self.time_mlps("video", timestep, gate_mult, B, x.dtype)
        (ta, ea), (caa, _), (ga, _) = self.time_mlps("audio", t_audio, gate_mult, B, a.dtype)
        tr("time_embed", tv.flatten(0, 1))
        tr("audio_time_embed", ta.flatten(0, 1))
        text_mod = c.cross_attn_mod or c.audio_cross_attn_mod            # modulates both streams' text
        pv = pa = None
        if text_mod and c.use_prompt_adaln_single:
            pv = self.ada("prompt_adaln", sigma, B, x.dtype)
            pa = self.ada("audio_prompt_adaln", s_audio, B, a.dtype)

        eps = c.norm_eps
        for i in range(c.num_layers):
            b = f"transformer_blocks.{i}."
            mv = _mods(P[b + "scale_shift_table"], tv)
            ma = _mods(P[b + "audio_scale_shift_table"], ta)
            # self-attention
            o = self.self_attn(b + "attn1", _norm(x, eps) * (1 + mv[1]) + mv[0], hv, rope_v)
            tr(b + "attn1", o)
            x = torch.addcmul(x, o, mv[2])
            o = self.self_attn(b + "audio_attn1", _norm(a, eps) * (1 + ma[1]) + ma[0], ha, rope_a)
            tr(b + "audio_attn1", o)
            a = torch.addcmul(a, o, ma[2])
            # text cross-attention (LTX-2.3: query modulated and gated, text modulated by sigma or a table)
            kv, akv = ctx, actx
            if text_mod:
                kv = _text(ctx, P[b + "prompt_scale_shift_table"], pv)
                akv = _text(actx, P[b + "audio_prompt_scale_shift_table"], pa)
            y = _norm(x, eps)
            o = self.cross_attn(b + "attn2", y * (1 + mv[7]) + mv[6] if c.cross_attn_mod else y, kv, hv,
                                keep=text_keep)
            tr(b + "attn2", o)
            x = torch.addcmul(x, o, mv[8]) if c.cross_attn_mod else x + o
            y = _norm(a, eps)
            o = self.cross_attn(b + "audio_attn2", y * (1 + ma[7]) + ma[6] if c.audio_cross_attn_mod else y, akv, ha,
                                keep=audio_text_keep)
            tr(b + "audio_attn2", o)
            a = torch.addcmul(a, o, ma[8]) if c.audio_cross_attn_mod else a + o
            # audio <-> video, both from the same normalised streams
            vt, at = P[b + "video_a2v_cross_attn_scale_shift_table"], P[b + "audio_a2v_cross_attn_scale_shift_table"]
            sv, sa = _mods(vt[:4], cav), _mods(at[:4], caa)        # a2v scale, a2v shift, v2a scale, v2a shift
            g_a2v, g_v2a = _mods(vt[4:], gv)[0], _mods(at[4:], ga)[0]
            xn, an = _norm(x, eps), _norm(a, eps)
            o_v = self.cross_attn(b + "audio_to_video_attn", xn * (1 + sv[0]) + sv[1], an * (1 + sa[0]) + sa[1],
                                  ha, rope_vt, rope_at)
            o_a = self.cross_attn(b + "video_to_audio_attn", an * (1 + sa[2]) + sa[3], xn * (1 + sv[2]) + sv[3],
                                  ha, rope_at, rope_vt)
            tr(b + "audio_to_video_attn", o_v)
            tr(b + "video_to_audio_attn", o_a)
            x = torch.addcmul(x, g_a2v, o_v)
            a = torch.addcmul(a, g_v2a, o_a)
            # feed-forward
            o = self.ff(b + "ff", _norm(x, eps) * (1 + mv[4]) + mv[3])
            tr(b + "ff", o)
            x = torch.addcmul(x, o, mv[5])
            o = self.ff(b + "audio_ff", _norm(a, eps) * (1 + ma[4]) + ma[3])
            tr(b + "audio_ff", o)
            a = torch.addcmul(a, o, ma[5])
            tr(f"transformer_blocks.{i}", x)
            tr(f"transformer_blocks.{i}.audio", a)

        out = self.head("", x, ev)
        audio_out = self.head("audio_", a, ea)
        tr("proj_out", out)
        tr("audio_proj_out", audio_out)
        return out, audio_out

    # ---- pieces ----
    def lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.p[name + ".weight"], self.p.get(name + ".bias"))     # ff_bias=False: none

    def ada(self, name: str, t: torch.Tensor, B: int, dtype: torch.dtype) -> torch.Tensor:
        """One AdaLN-single's modulation [B, T, kD] (the prompt's, by sigma)."""
        h = F.silu(self.lin(f"{name}.emb.timestep_embedder.linear_1", _sinusoid(t.flatten(), dtype)))
        mod = self.lin(f"{name}.linear", F.silu(self.lin(f"{name}.emb.timestep_embedder.linear_2", h)))
        return mod.view(B, -1, mod.shape[-1])

    def time_mlps(self, stream: str, t: torch.Tensor, gate_mult: float, B: int, dtype: torch.dtype):
        """The stream's three AdaLN-single MLPs (its modulation, the cross-modal scale / shift, the cross-modal
        gate): one fused first layer when the gate's timestep is the same, [(mod [B, T, kD], emb [B, T, D])]."""
        names = TIME_MLPS[stream]
        w1, b1 = self.fused[stream]
        sin = _sinusoid(t.flatten(), dtype)
        if gate_mult == 1.0:
            h = F.silu(F.linear(sin, w1, b1)).chunk(3, dim=-1)
        else:
            h1 = F.silu(F.linear(sin, w1, b1)).chunk(3, dim=-1)
            h = (*h1[:2], F.silu(F.linear(_sinusoid(t.flatten() * gate_mult, dtype), w1, b1)).chunk(3, -1)[2])
        out = []
        for name, hi in zip(names, h):
            emb = self.lin(f"{name}.emb.timestep_embedder.linear_2", hi)
            mod = self.lin(f"{name}.linear", F.silu(emb))
            out.append((mod.view(B, -1, mod.shape[-1]), emb.view(B, -1, emb.shape[-1])))
        return out

    def self_attn(self, name: str, x: torch.Tensor, heads: int, rope) -> torch.Tensor:
        q, k, v = F.linear(x, *self.fused[name]).chunk(3, dim=-1)
        return self._attend(name, x, q, k, v, heads, rope, rope, None)

    def cross_attn(self, name: str, x: torch.Tensor, ctx: torch.Tensor, heads: int, q_rope=None, k_rope=None,
                   keep: torch.Tensor | None = None) -> torch.Tensor:
        k, v = F.linear(ctx, *self.fused[name]).chunk(2, dim=-1)
        return self._attend(name, x, self.lin(name + ".to_q", x), k, v, heads, q_rope, k_rope, keep)

    def _attend(self, name, x, q, k, v, heads, q_rope, k_rope, keep) -> torch.Tensor:
        P = self.p
        q = F.rms_norm(q, q.shape[-1:], P[name + ".norm_q.weight"], 1e-6)     # across heads, eps fixed at 1e-6
        k = F.rms_norm(k, k.shape[-1:], P[name + ".norm_k.weight"], 1e-6)
        if q_rope is not None:
            q, k = _rotate(q, q_rope), _rotate(k, k_rope)
        B, N, _ = q.shape
        q, k, v = (t.view(B, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
        o = attend(q, k, v, key_mask=keep)                                  # [B, H, N, d]
        if name + ".to_gate_logits.weight" in P:                            # gated attention: 2 sigmoid per head
            o = o * (2.0 * torch.sigmoid(self.lin(name + ".to_gate_logits", x))).transpose(1, 2)[..., None]
        return self.lin(name + ".to_out.0", o.transpose(1, 2).reshape(B, N, -1))

    def ff(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.lin(name + ".net.2", F.gelu(self.lin(name + ".net.0.proj", x), approximate="tanh"))

    def head(self, prefix: str, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.p[prefix + "scale_shift_table"] + emb[:, :, None]).unbind(2)   # emb on both rows
        return self.lin(prefix + "proj_out", torch.addcmul(shift, F.layer_norm(x, x.shape[-1:], eps=1e-6), 1 + scale))


# what this port covers (the 2.3 / 2.5 switches are ported); STG, patches > 1 are refused by name
PORTED = {"patch_size": 1, "patch_size_t": 1, "audio_patch_size": 1, "audio_patch_size_t": 1, "perturbed_attn": False,
          "norm_elementwise_affine": False, "attention_bias": True, "attention_out_bias": True,
          "qk_norm": "rms_norm_across_heads", "activation_fn": "gelu-approximate"}
TIME_MLPS = {"video": ("time_embed", "av_cross_attn_video_scale_shift", "av_cross_attn_video_a2v_gate"),
             "audio": ("audio_time_embed", "av_cross_attn_audio_scale_shift", "av_cross_attn_audio_v2a_gate")}


def _text(ctx: torch.Tensor, table: torch.Tensor, temb: torch.Tensor | None) -> torch.Tensor:
    shift, scale = _mods(table, temb) if temb is not None else table.unbind(0)    # rows: shift, scale
    return torch.addcmul(shift, ctx, 1 + scale)


def _cat(P: dict, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([P[n + ".weight"] for n in names]), torch.cat([P[n + ".bias"] for n in names])


def _norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)     # gainless, in fp32


def _keep(mask: torch.Tensor | None) -> torch.Tensor | None:
    """0 / 1 text mask [B, L] -> bool keep [B, 1, 1, L]. Upstream adds -10000 instead, which softmax turns into an
    exact 0 unless a row keeps nothing: there the shift cancels, so such a row keeps everything (upstream's fp32
    logits - 10000 are rounded to ~1e-3 there; the pipeline's masks always keep a token)."""
    if mask is None:
        return None
    keep = mask > 0.5
    keep = keep | ~keep.any(-1, keepdim=True)
    return keep[:, None, None, :]


def _sinusoid(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    ang = t.float()[:, None] * torch.exp(torch.arange(128, dtype=torch.float32, device=t.device) * (-math.log(10000.0) / 128))
    return torch.cat([torch.cos(ang), torch.sin(ang)], -1).to(dtype)


def _mods(table: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    B, T, _ = temb.shape
    return (temb.view(B, T, table.shape[0], -1) + table).unbind(2)


def _rope(coords: torch.Tensor, extent: tuple, dim: int, theta: float,
          heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, N, dim] for interleaved pairs; leading dim % (2 * axes) channels pass through. With `heads`
    (split RoPE): [B, N, heads, dim / heads], each head's half-table twice (rotate-half form)."""
    n_axes = coords.shape[1]
    mid = (coords[..., 0] + coords[..., 1]) / 2.0                                   # [B, P, N]
    frac = mid / torch.tensor(extent[:n_axes], dtype=mid.dtype, device=mid.device)[:, None]
    base = torch.pow(theta, torch.linspace(0.0, 1.0, dim // (2 * n_axes), dtype=torch.float64))
    w = (base * torch.pi / 2.0).float().to(coords.device)
    ang = (frac.permute(0, 2, 1)[..., None, :] * 2 - 1) * w[:, None]                 # [B, N, F, P]
    ang = ang.flatten(2)
    if heads is not None:
        ang = F.pad(ang, (dim // 2 - ang.shape[-1], 0))                     # angle 0: cos 1, sin 0
        half_c, half_s = ang.cos().view(*ang.shape[:2], heads, -1), ang.sin().view(*ang.shape[:2], heads, -1)
        return torch.cat([half_c, half_c], -1), torch.cat([half_s, half_s], -1)
    cos = torch.repeat_interleave(ang.cos(), 2, -1)
    sin = torch.repeat_interleave(ang.sin(), 2, -1)
    lead = dim - cos.shape[-1]
    if lead:
        cos = F.pad(cos, (lead, 0), value=1.0)
        sin = F.pad(sin, (lead, 0), value=0.0)
    return cos, sin


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope
    if cos.ndim == 4:                                                      # split: rotate-half within each head
        xh = x.float().view(*x.shape[:-1], cos.shape[2], -1)
        first, second = xh.chunk(2, -1)
        return (xh * cos + torch.cat((-second, first), -1) * sin).flatten(-2).to(x.dtype)
    pairs = x.view(*x.shape[:-1], -1, 2)
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).view_as(x)
    return (x.float() * cos + turned.float() * sin).to(x.dtype)


def load_model(cfg: Ltx2Config, state: dict[str, torch.Tensor], device: str = "cpu",
               dtype: torch.dtype = torch.float32) -> FastLtx2:
    """Strict: the canonical state dict must match the ComponentSpec exactly (names, shapes)."""
    return FastLtx2(cfg, apply_load_transforms(component(cfg), state, dtype=dtype, device=device), dtype)
