"""cosmos3 omni transformer (generator forward), written to be read top to bottom.

One packed sample per call, no batch dimension, as upstream (diffusers 0.42.1 `Cosmos3OmniTransformer`).
Every decoder layer has two pathways with separate weights that share one attention:
  und: the causal text ("understanding") stream; it never sees generation tokens.
  gen: vision / sound / action tokens; they attend to all text keys and all gen keys, non-causally.
Parameter names here ARE the canonical checkpoint layout (manifests/cosmos3/keys.py).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from manifests.cosmos3 import Cosmos3Config
from manifests.cosmos3.io import Cosmos3ForwardInputs, Cosmos3Prediction
from manifests.cosmos3.keys import TIME_FREQ_DIM
from reference.cosmos3.packing import PackedSample, pack_sample

Trace = Callable[[str, torch.Tensor], None]


# ----------------------------------------------------------------------------------------------
# Norms
# ----------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """diffusers RMSNorm (silu backbones): fp32 variance; with a half-precision weight the normalised
    value is cast to the weight dtype *before* the multiply (same as HF Qwen3)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        y = x * torch.rsqrt(var + self.eps)  # promotes to fp32
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            y = y.to(self.weight.dtype)
        return y * self.weight  # an fp32 weight keeps the output fp32 (upstream type promotion)


class NemotronRMSNorm(nn.Module):
    """relu2 backbones: everything in fp32, plain weight (no 1+w), cast back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def make_norm(cfg: Cosmos3Config, dim: int) -> nn.Module:
    # relu2 switches *every* norm (q/k norms and final norms included) to the Nemotron variant
    return NemotronRMSNorm(dim, cfg.rms_norm_eps) if cfg.hidden_act == "relu2" else RMSNorm(dim, cfg.rms_norm_eps)


# ----------------------------------------------------------------------------------------------
# Rotary embedding: 3-axis (T, H, W) positions interleaved column by column
# ----------------------------------------------------------------------------------------------

def mrope_cos_sin(cfg: Cosmos3Config, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [L, head_dim] from position ids [3, L]. Computed in fp32, cast to `dtype`."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [d/2]
    freqs = position_ids.float()[:, :, None] * inv_freq[None, None, :]                           # [3, L, d/2]
    # column k of the table takes H if k%3==1 (within 3*axes[1]), W if k%3==2 (within 3*axes[2]), else T;
    # rope_axes_dim[0] is never read: T simply gets the leftover columns (upstream)
    table = freqs[0].clone()
    k = torch.arange(d // 2)
    h_cols = (k % 3 == 1) & (k < 3 * cfg.rope_axes_dim[1])
    w_cols = (k % 3 == 2) & (k < 3 * cfg.rope_axes_dim[2])
    table[:, h_cols] = freqs[1][:, h_cols]
    table[:, w_cols] = freqs[2][:, w_cols]
    emb = torch.cat([table, table], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (NeoX) rotary on x [L, heads, d] with tables [L, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# ----------------------------------------------------------------------------------------------
# One pathway of a decoder layer (und or gen): its own norms, projections and MLP
# ----------------------------------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, cfg: Cosmos3Config):
        super().__init__()
        D, I = cfg.hidden_size, cfg.intermediate_size
        self.act = cfg.hidden_act
        if self.act == "silu":
            self.gate_proj = nn.Linear(D, I, bias=False)
        self.up_proj = nn.Linear(D, I, bias=False)
        self.down_proj = nn.Linear(I, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "silu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.relu(self.up_proj(x)).square())  # relu2


class Pathway(nn.Module):
    def __init__(self, cfg: Cosmos3Config, is_und: bool):
        super().__init__()
        D, H, K, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.attn_norm = make_norm(cfg, D)
        self.q_proj = nn.Linear(D, H * d, bias=bias)
        self.k_proj = nn.Linear(D, K * d, bias=bias)
        self.v_proj = nn.Linear(D, K * d, bias=bias)
        self.o_proj = nn.Linear(H * d, D, bias=bias)
        has_qk_norm = (not is_und) or cfg.qk_norm_for_text  # gen always has q/k norms
        self.q_norm = make_norm(cfg, d) if has_qk_norm else nn.Identity()
        self.k_norm = make_norm(cfg, d) if has_qk_norm else nn.Identity()
        if is_und and cfg.has_und_k_norm_for_gen:
            self.k_norm_for_gen = make_norm(cfg, d)  # extra norm on text keys as seen by gen queries
        self.mlp_norm = make_norm(cfg, D)
        self.mlp = MLP(cfg)
        self.heads, self.kv_heads, self.head_dim = H, K, d

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-norm, project and QK-normalise: q [L, H, d], k/v [L, K, d] (no rope yet)."""
        h = self.attn_norm(x)
        L = x.shape[0]
        q = self.q_norm(self.q_proj(h).view(L, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(h).view(L, self.kv_heads, self.head_dim))
        v = self.v_proj(h).view(L, self.kv_heads, self.head_dim)
        return q, k, v


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """SDPA over one sequence with GQA by repeating K/V heads: q [Lq, H, d], k/v [Lk, K, d] -> [Lq, H*d]."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # query head h reads KV head h // groups
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal)
    return out.transpose(0, 1).reshape(q.shape[0], -1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Cosmos3Config):
        super().__init__()
        self.und = Pathway(cfg, is_und=True)
        self.gen = Pathway(cfg, is_und=False)

    def und_forward(self, und: torch.Tensor, rope_und) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The text stream alone (causal; it never sees gen tokens). Returns (und out, text keys as gen
        queries see them, text values)."""
        q_u, k_u, v_u = self.und.qkv(und)
        k_u_for_gen = self.und.k_norm_for_gen(k_u) if hasattr(self.und, "k_norm_for_gen") else k_u
        q_u, k_u, k_u_for_gen = (apply_rope(t, *rope_und) for t in (q_u, k_u, k_u_for_gen))
        und = und + self.und.o_proj(attention(q_u, k_u, v_u, causal=True))
        return und + self.und.mlp(self.und.mlp_norm(und)), k_u_for_gen, v_u

    def forward(self, und: torch.Tensor, gen: torch.Tensor, rope_und, rope_gen) -> tuple[torch.Tensor, torch.Tensor]:
        und_out, k_u_for_gen, v_u = self.und_forward(und, rope_und)
        q_g, k_g, v_g = self.gen.qkv(gen)
        q_g, k_g = (apply_rope(t, *rope_gen) for t in (q_g, k_g))
        # gen: all text keys + all gen keys, no mask
        o_g = attention(q_g, torch.cat([k_u_for_gen, k_g]), torch.cat([v_u, v_g]), causal=False)
        gen = gen + self.gen.o_proj(o_g)
        return und_out, gen + self.gen.mlp(self.gen.mlp_norm(gen))


# ----------------------------------------------------------------------------------------------
# Embeddings in and heads out
# ----------------------------------------------------------------------------------------------

class TimeEmbedding(nn.Module):
    """Sinusoid (diffusers Timesteps(256, flip_sin_to_cos=True, shift 0)) in fp32 -> Linear -> SiLU -> Linear.
    Kept in fp32 whatever the model dtype (upstream `_keep_in_fp32_modules`)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(TIME_FREQ_DIM, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = TIME_FREQ_DIM // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = t.float()[:, None] * freqs[None, :]
        emb = torch.cat([args.cos(), args.sin()], dim=-1)  # cos first (flip_sin_to_cos)
        emb = emb.to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(emb)))


class DomainAwareLinear(nn.Module):
    """Per-embodiment linear: row n of `weight` reshaped to [in, out] (the transpose of nn.Linear's layout)."""

    def __init__(self, d_in: int, d_out: int, num_domains: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_domains, d_in * d_out))
        self.bias = nn.Parameter(torch.zeros(num_domains, d_out))
        self.d_in, self.d_out = d_in, d_out

    def forward(self, x: torch.Tensor, domain: int) -> torch.Tensor:
        return x @ self.weight[domain].view(self.d_in, self.d_out) + self.bias[domain]


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """[1, C, T, H, W] -> [T*h*w, p*p*C], zero-padding H/W bottom/right; feature = (py*p + px)*C + c."""
    _, C, T, H, W = latents.shape
    x = F.pad(latents[0], (0, (-W) % p, 0, (-H) % p))
    h, w = x.shape[-2] // p, x.shape[-1] // p
    x = x.view(C, T, h, p, w, p).permute(1, 2, 4, 3, 5, 0)  # t, h, w, py, px, c
    return x.reshape(T * h * w, p * p * C)


def unpatchify(tokens: torch.Tensor, frames: int, h: int, w: int, p: int, C: int, H: int, W: int) -> torch.Tensor:
    """[frames*h*w, p*p*C] -> [C, frames, H, W], cropping the padding."""
    x = tokens.view(frames, h, w, p, p, C).permute(5, 0, 1, 3, 2, 4)  # c, t, h, py, w, px
    return x.reshape(C, frames, h * p, w * p)[:, :, :H, :W]


# ----------------------------------------------------------------------------------------------
# The transformer
# ----------------------------------------------------------------------------------------------

class Cosmos3Transformer(nn.Module):
    def __init__(self, cfg: Cosmos3Config):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        D = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.und_norm = make_norm(cfg, D)
        self.gen_norm = make_norm(cfg, D)
        self.lm_head = nn.Linear(D, cfg.vocab_size, bias=False)  # unused by the generator forward (upstream)
        self.vision_in = nn.Linear(cfg.patch_latent_dim, D)
        self.vision_out = nn.Linear(D, cfg.patch_latent_dim)
        self.time_embed = TimeEmbedding(D)
        if cfg.has_sound:
            self.sound_in = nn.Linear(cfg.sound_dim, D)
            self.sound_out = nn.Linear(D, cfg.sound_dim)
            self.sound_modality_embed = nn.Parameter(torch.zeros(D))
        if cfg.has_action:
            self.action_in = DomainAwareLinear(cfg.action_dim, D, cfg.num_embodiment_domains)
            self.action_out = DomainAwareLinear(D, cfg.action_dim, cfg.num_embodiment_domains)
            self.action_modality_embed = nn.Parameter(torch.zeros(D))

    def timestep_embedding(self, timestep: float, n: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.full((n,), timestep, dtype=torch.float32) * self.cfg.timestep_scale
        return self.time_embed(t).to(dtype)

    def embed(self, inp: Cosmos3ForwardInputs, packed: PackedSample) -> torch.Tensor:
        """The packed input hidden states [L, D]: text embeddings, then each modality scattered in."""
        cfg = self.cfg
        text = self.embed_tokens(inp.text_ids)
        dtype = text.dtype
        hidden = text.new_zeros(packed.seq_len, cfg.hidden_size)
        hidden[: packed.text_len] = text

        # vision: patchify -> project; the timestep goes to noisy frames only, and there is no modality embed
        T, h, w = packed.vision_grid
        vision = self.vision_in(patchify(inp.vision_latents.to(dtype), cfg.patch_size))
        noisy_tokens = torch.tensor([f * h * w + j for f in packed.vision_noisy_frames for j in range(h * w)],
                                    dtype=torch.long)
        vision[noisy_tokens] += self.timestep_embedding(inp.timestep, len(noisy_tokens), dtype)
        hidden[packed.vision_sequence_indexes] = vision

        if inp.sound_latents is not None:  # every sound frame is noisy
            sound = self.sound_in(inp.sound_latents.T.to(dtype)) + self.sound_modality_embed
            sound = sound + self.timestep_embedding(inp.timestep, packed.sound_len, dtype)
            hidden[packed.sound_sequence_indexes] = sound

        if inp.action_latents is not None:
            action = self.action_in(inp.action_latents.to(dtype), inp.action_domain_id) + self.action_modality_embed
            rows = torch.tensor(packed.action_noisy_rows, dtype=torch.long)
            if len(rows) > 0:  # upstream embeds the timestep only if some action row is noisy
                action[rows] += self.timestep_embedding(inp.timestep, len(rows), dtype)
            hidden[packed.action_sequence_indexes] = action
        return hidden

    def forward(self, inp: Cosmos3ForwardInputs, trace: Trace | None = None) -> Cosmos3Prediction:
        cfg = self.cfg
        inp.validate(cfg)
        record = trace or (lambda name, t: None)
        packed = pack_sample(cfg, inp)
        hidden = self.embed(inp, packed)
        record("embed", hidden)

        cos, sin = mrope_cos_sin(cfg, packed.position_ids, hidden.dtype)
        n = packed.text_len
        und, gen = hidden[:n], hidden[n:]
        for i, layer in enumerate(self.layers):
            und, gen = layer(und, gen, (cos[:n], sin[:n]), (cos[n:], sin[n:]))
            record(f"layers.{i}.und", und)
            record(f"layers.{i}.gen", gen)
        # the und stream's final norm (and lm_head) never reach a prediction; only gen is normalised here
        out = torch.cat([und, self.gen_norm(gen)])
        record("gen_norm", out[n:])
        return self.decode(inp, packed, out, record)

    def decode(self, inp: Cosmos3ForwardInputs, packed: PackedSample, out: torch.Tensor, record) -> Cosmos3Prediction:
        cfg = self.cfg
        _, C, T, H, W = inp.vision_latents.shape
        _, h, w = packed.vision_grid
        noisy = packed.vision_noisy_frames
        vision = out.new_zeros(1, C, T, H, W)  # conditioned frames come back exactly 0
        if noisy:
            tokens = self.vision_out(out[packed.vision_mse_loss_indexes])
            vision[0, :, noisy] = unpatchify(tokens, len(noisy), h, w, cfg.patch_size, C, H, W)
        record("pred.vision", vision)
        pred = Cosmos3Prediction(vision=vision)

        if inp.sound_latents is not None:
            pred.sound = self.sound_out(out[packed.sound_mse_loss_indexes]).T
            record("pred.sound", pred.sound)
        if inp.action_latents is not None:
            action = out.new_zeros(packed.action_len, cfg.action_dim)
            rows = packed.action_noisy_rows
            if rows:
                action[rows] = self.action_out(out[packed.action_mse_loss_indexes], inp.action_domain_id)
            pred.action = action
            record("pred.action", action)
        return pred


def run_layer(model: Cosmos3Transformer, index: int, und: torch.Tensor, gen: torch.Tensor,
              position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder layer `index` alone on given streams (for component parity)."""
    cos, sin = mrope_cos_sin(model.cfg, position_ids, und.dtype)
    n = und.shape[0]
    with torch.no_grad():
        return model.layers[index](und, gen, (cos[:n], sin[:n]), (cos[n:], sin[n:]))


def load_transformer(cfg: Cosmos3Config, state: dict[str, torch.Tensor], device: str = "cpu",
                     dtype: torch.dtype = torch.float32) -> Cosmos3Transformer:
    """Build from a canonical state dict (strict), cast to `dtype` except the fp32 time embedder."""
    model = Cosmos3Transformer(cfg)
    expected = dict(model.state_dict())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"cosmos3 checkpoint does not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ValueError(f"cosmos3 checkpoint: {k} has shape {list(v.shape)}, expected {list(expected[k].shape)}")
    model.load_state_dict(state, strict=True)
    model.to(device=device, dtype=dtype)
    # upstream keeps the time embedder in fp32 (`_keep_in_fp32_modules`), loaded from the checkpoint's fp32 values:
    # re-copy them, since casting the module back after `.to(dtype)` would keep them rounded to the run dtype
    model.time_embed.float().load_state_dict({k[len("time_embed."):]: v for k, v in state.items()
                                              if k.startswith("time_embed.")})
    return model.eval()
