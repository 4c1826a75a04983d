"""Wan 2.1 / 2.2 DiT, written to be read top to bottom (reproduces diffusers 0.42.1 `WanTransformer3DModel`).

One forward, for latents x [B, C_in, T, H, W], timestep t, text context [B, L, text_dim] (and CLIP image tokens):

    tokens  = Conv3d patchify(x)                       [B, S, D], S = (T/pt)(H/ph)(W/pw), t-major then h, w
    temb    = MLP(sinusoid(t))                         [B, D]      ([B, S, D] with per-token timesteps, Wan2.2 TI2V)
    mod     = Linear(SiLU(temb)) -> 6 vectors          shift/scale/gate for self-attn, shift/scale/gate for the FFN
    context = text MLP(text)  (I2V: [image MLP(image), text MLP(text)] concatenated, image tokens first)
    per block:
        x += gate1 * SelfAttn(LN(x) * (1 + scale1) + shift1)         3D RoPE on q, k; RMS norm over all heads on q, k
        x += CrossAttn(LN_affine(x), context)                        I2V adds attention over the image tokens
        x += gate2 * FFN(LN(x) * (1 + scale2) + shift2)              GELU(tanh) MLP
    out = Linear(LN(x) * (1 + scale) + shift) -> unpatchify  [B, C_out, T, H, W]

Parameter names ARE the canonical layout (`manifests.wan.dit.dit_key_shapes`, = diffusers' names).
Norms and modulation run in float32 (upstream keeps them in fp32 for half-precision weights).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from manifests.wan.dit import WanDiTConfig, dit_key_shapes

ROPE_THETA = 10000.0
TEXT_CONTEXT_LEN = 512   # (upstream) the I2V attention processor hard-codes the text length when splitting context


# ----------------------------------------------------------------------------------------------
# Embeddings: timestep sinusoid, 3D rotary angles
# ----------------------------------------------------------------------------------------------

def timestep_sinusoid(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """[N] -> [N, dim]: [cos(t f_i), sin(t f_i)] with f_i = max_period^(-i / (dim/2)), i < dim/2 (fp32).
    (upstream: diffusers `Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0)`; odd dim gets a zero column)"""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t[:, None].float() * freqs[None, :]
    emb = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


def rope_cos_sin(cfg: WanDiTConfig, grid: tuple[int, int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the rotary angles, each [S, head_dim / 2], for the patch grid (f, h, w) in t-major order.

    Head channels are split per axis into (t, h, w) = cfg.rope_dims(); axis dim d gets frequencies
    theta^(-2i/d), i < d/2, times the integer position along that axis. Angles are computed in float64 and
    rounded to float32 after cos / sin (upstream, except on Apple MPS). Positions must be < rope_max_seq_len
    (upstream precomputes that many rows per axis)."""
    per_axis = []
    for dim, n in zip(cfg.rope_dims(), grid):
        if n > cfg.rope_max_seq_len:
            raise ValueError(f"patch grid {grid} exceeds rope_max_seq_len {cfg.rope_max_seq_len}")
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
        per_axis.append(torch.outer(torch.arange(n, device=device, dtype=torch.float64), inv_freq))  # [n, dim/2]
    f, h, w = grid
    angles = torch.cat([per_axis[0][:, None, None, :].expand(f, h, w, -1),
                        per_axis[1][None, :, None, :].expand(f, h, w, -1),
                        per_axis[2][None, None, :, :].expand(f, h, w, -1)], dim=-1).reshape(f * h * w, -1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (x[2i], x[2i+1]) of x [B, S, heads, head_dim] by angle i (complex multiply)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)          # even / odd channels, [B, S, heads, head_dim/2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v over [B, S, heads, head_dim] tensors, no mask (upstream)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2, 3)


def layer_norm_fp32(x: torch.Tensor, eps: float, affine: nn.LayerNorm | None = None) -> torch.Tensor:
    """LayerNorm over the last dim computed in float32, cast back (upstream `FP32LayerNorm`); optional affine."""
    w = affine.weight.float() if affine is not None else None
    b = affine.bias.float() if affine is not None else None
    return F.layer_norm(x.float(), x.shape[-1:], w, b, eps).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Condition embedder: timestep, text and (I2V) image projections
# ----------------------------------------------------------------------------------------------

class MLP2(nn.Module):
    """linear_1 -> activation -> linear_2 (upstream `TimestepEmbedding` / `PixArtAlphaTextProjection` names)."""

    def __init__(self, cin: int, dim: int, act: str):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(cin, dim), nn.Linear(dim, dim)
        self.act = nn.SiLU() if act == "silu" else nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class FeedForward(nn.Module):
    """net.0.proj -> GELU -> net.2 (upstream `FeedForward` index layout: net.1 is a parameter-free dropout)."""

    def __init__(self, dim: int, inner: int, dim_out: int, approximate: str):
        super().__init__()
        proj = nn.Module()
        proj.proj = nn.Linear(dim, inner)
        self.net = nn.ModuleList([proj, nn.Identity(), nn.Linear(inner, dim_out)])
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](F.gelu(self.net[0].proj(x), approximate=self.approximate))


class ImageEmbedder(nn.Module):
    """CLIP image tokens -> D: LN -> GELU(exact) MLP -> LN, both LNs fp32 with eps 1e-5 (upstream: default eps)."""

    def __init__(self, image_dim: int, dim: int, pos_embed_seq_len: int | None):
        super().__init__()
        self.norm1 = nn.LayerNorm(image_dim)          # eps 1e-5, not cfg.eps (upstream)
        self.ff = FeedForward(image_dim, image_dim, dim, approximate="none")
        self.norm2 = nn.LayerNorm(dim)
        if pos_embed_seq_len is not None:             # FLF2V: learned positions over first+last frame tokens
            self.pos_embed = nn.Parameter(torch.zeros(1, pos_embed_seq_len, image_dim))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "pos_embed"):
            # (upstream) view(-1, 2N, E): pairs of batch rows (first / last frame) become one 2N-token sequence
            image = image.view(-1, 2 * image.shape[1], image.shape[2]) + self.pos_embed
        x = layer_norm_fp32(image, self.norm1.eps, self.norm1)
        x = self.ff(x)
        return layer_norm_fp32(x, self.norm2.eps, self.norm2)


class ConditionEmbedder(nn.Module):
    def __init__(self, cfg: WanDiTConfig):
        super().__init__()
        D = cfg.hidden_size
        self.freq_dim = cfg.freq_dim
        self.time_embedder = MLP2(cfg.freq_dim, D, act="silu")
        self.time_proj = nn.Linear(D, 6 * D)
        self.text_embedder = MLP2(cfg.text_dim, D, act="gelu_tanh")
        if cfg.image_dim is not None:
            self.image_embedder = ImageEmbedder(cfg.image_dim, D, cfg.pos_embed_seq_len)

    def forward(self, timestep: torch.Tensor, text: torch.Tensor, image: torch.Tensor | None):
        """timestep [B] or [B, S] -> temb [B, (S,) D] and modulation [B, (S,) 6, D]; text, image -> [B, *, D]."""
        sinus = timestep_sinusoid(timestep.flatten(), self.freq_dim).unflatten(0, timestep.shape)
        sinus = sinus.to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(sinus).type_as(text)
        modulation = self.time_proj(F.silu(temb)).unflatten(-1, (6, -1))
        text = self.text_embedder(text)
        image = self.image_embedder(image) if image is not None else None
        return temb, modulation, text, image


# ----------------------------------------------------------------------------------------------
# Attention and transformer block
# ----------------------------------------------------------------------------------------------

class WanAttention(nn.Module):
    """Multi-head attention with q/k RMS-normalised over all heads together (qk_norm "rms_norm_across_heads").
    Cross-attention with an image branch (I2V) also attends to the image tokens with its own K/V, summed."""

    def __init__(self, dim: int, heads: int, eps: float, image_branch: bool = False):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])   # (upstream) to_out.1 is a parameter-free dropout
        self.norm_q, self.norm_k = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)
        self.image_branch = image_branch
        if image_branch:
            self.add_k_proj, self.add_v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.norm_added_k = nn.RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, attend=attention) -> torch.Tensor:
        """`attend`: the attention function (a sparse one under a sparse-attention acceleration)."""
        image = None
        if self.image_branch:
            # (upstream) everything before the last 512 context tokens is image; text must be exactly 512 long
            n_image = context.shape[1] - TEXT_CONTEXT_LEN
            image, context = context[:, :n_image], context[:, n_image:]
        context = x if context is None else context
        q = self.norm_q(self.to_q(x)).unflatten(2, (self.heads, -1))
        k = self.norm_k(self.to_k(context)).unflatten(2, (self.heads, -1))
        v = self.to_v(context).unflatten(2, (self.heads, -1))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = attend(q, k, v).type_as(q)
        if image is not None:
            k_img = self.norm_added_k(self.add_k_proj(image)).unflatten(2, (self.heads, -1))
            v_img = self.add_v_proj(image).unflatten(2, (self.heads, -1))
            out = out + attention(q, k_img, v_img).type_as(q)   # (upstream) computed first, added after
        return self.to_out[0](out)


class WanBlock(nn.Module):
    def __init__(self, cfg: WanDiTConfig):
        super().__init__()
        D = cfg.hidden_size
        self.eps = cfg.eps
        self.attn1 = WanAttention(D, cfg.num_heads, cfg.eps)
        self.attn2 = WanAttention(D, cfg.num_heads, cfg.eps, image_branch=cfg.has_image_branch)
        self.norm2 = nn.LayerNorm(D, eps=cfg.eps) if cfg.cross_attn_norm else None
        self.ffn = FeedForward(D, cfg.ffn_dim, D, approximate="tanh")
        self.scale_shift_table = nn.Parameter(torch.empty(1, 6, D))

    def forward(self, x: torch.Tensor, context: torch.Tensor, modulation: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], self_attention=attention) -> torch.Tensor:
        # modulation [B, 6, D] (one timestep per sample) or [B, S, 6, D] (per-token timesteps); sums in fp32
        table = self.scale_shift_table if modulation.ndim == 3 else self.scale_shift_table.unsqueeze(0)
        shift1, scale1, gate1, shift2, scale2, gate2 = (table + modulation.float()).unbind(-2)
        if modulation.ndim == 3:                      # [B, D] -> [B, 1, D], broadcast over tokens
            shift1, scale1, gate1, shift2, scale2, gate2 = (m[:, None] for m in (shift1, scale1, gate1, shift2,
                                                                                   scale2, gate2))
        h = (layer_norm_fp32(x.float(), self.eps) * (1 + scale1) + shift1).type_as(x)
        x = (x.float() + self.attn1(h, rope=rope, attend=self_attention) * gate1).type_as(x)
        h = layer_norm_fp32(x.float(), self.eps, self.norm2).type_as(x) if self.norm2 is not None else x
        x = x + self.attn2(h, context)
        h = (layer_norm_fp32(x.float(), self.eps) * (1 + scale2) + shift2).type_as(x)
        return (x.float() + self.ffn(h).float() * gate2).type_as(x)


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------

class WanTransformer(nn.Module):
    def __init__(self, cfg: WanDiTConfig):
        super().__init__()
        self.cfg = cfg.validate()
        D, p = cfg.hidden_size, cfg.patch_size
        self.patch_embedding = nn.Conv3d(cfg.in_channels, D, kernel_size=p, stride=p)
        self.condition_embedder = ConditionEmbedder(cfg)
        self.blocks = nn.ModuleList([WanBlock(cfg) for _ in range(cfg.num_layers)])
        self.proj_out = nn.Linear(D, cfg.out_channels * math.prod(p))
        self.scale_shift_table = nn.Parameter(torch.empty(1, 2, D))

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """latents [B, C_in, T, H, W]; timestep [B] (int or float) or [B, S] float per patch token (expand_timesteps);
        text [B, L, text_dim] (L = 512 with image_embeds); image_embeds [B, N, image_dim] -> [B, C_out, T', H', W']
        with T' = T // pt * pt etc. (the conv drops remainders, upstream)."""
        x, context, modulation, rope, temb, grid = self.embed(latents, timestep, text, image_embeds)
        for block in self.blocks:
            x = block(x, context, modulation, rope)
        return self.head(x, temb, grid)

    def embed(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
              image_embeds: torch.Tensor | None = None):
        """Everything before the blocks: (tokens [B, S, D], context, modulation, rope, temb, grid)."""
        cfg = self.cfg
        B = latents.shape[0]
        pt, ph, pw = cfg.patch_size
        grid = (latents.shape[2] // pt, latents.shape[3] // ph, latents.shape[4] // pw)
        if timestep.ndim == 2 and timestep.shape != (B, math.prod(grid)):
            raise ValueError(f"per-token timestep must be [B, S] = {(B, math.prod(grid))}, got {tuple(timestep.shape)}")
        rope = rope_cos_sin(cfg, grid, latents.device)

        x = self.patch_embedding(latents).flatten(2).transpose(1, 2).contiguous()     # [B, S, D]
        temb, modulation, context, image = self.condition_embedder(timestep, text, image_embeds)
        if image is not None:
            context = torch.cat([image, context], dim=1)          # image tokens first (upstream)
        return x, context, modulation, rope, temb, grid

    def head(self, x: torch.Tensor, temb: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Everything after the blocks: output norm + modulation, proj_out, unpatchify."""
        cfg = self.cfg
        B = x.shape[0]
        pt, ph, pw = cfg.patch_size
        # output head: shift/scale from the final table + temb (not the 6-way modulation), fp32 norm
        if temb.ndim == 3:                                        # per-token: [1, 1, 2, D] + [B, S, 1, D]
            shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).unbind(2)
        else:                                                     # [1, 2, D] + [B, 1, D]
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (layer_norm_fp32(x.float(), cfg.eps) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x)                                      # [B, S, C_out * pt * ph * pw]

        # unpatchify: token (f, h, w) with channels (pt, ph, pw, C) -> [B, C, f*pt, h*ph, w*pw]
        f, h, w = grid
        x = x.reshape(B, f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(B, -1, f * pt, h * ph, w * pw)


def load_wan_transformer(cfg: WanDiTConfig, state_dict: dict[str, torch.Tensor]) -> WanTransformer:
    """Build the model and load a canonical (= diffusers-named) state dict strictly, keeping the given dtype."""
    expected = dit_key_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    if got != expected:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise ValueError(f"wan DiT state dict mismatch: missing {missing[:5]}, unexpected {extra[:5]}, "
                         f"wrong shape {wrong[:5]}")
    with torch.device("meta"):
        model = WanTransformer(cfg)
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model.eval()
