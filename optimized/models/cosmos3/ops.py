"""cosmos3 tensor ops with upstream's numerics policy (models/cosmos3.md 1.3-1.4).

Module-level functions, looked up through this module at call time, so a negative-control test can
monkeypatch one of them (e.g. `mrope_axis_of_column`) to plant a fault.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

TIME_FREQS = 128  # Timesteps(256): 128 cos + 128 sin channels


# ---- RMSNorm: two variants ----
def rms_norm_silu(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen-style (diffusers RMSNorm): fp32 variance; cast to the weight dtype when it is half; * w."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(var + eps)
    if w.dtype in (torch.float16, torch.bfloat16):
        y = y.to(w.dtype)
    return y * w


def rms_norm_relu2(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Nemotron: everything in fp32, (w.float() * y).to(input dtype); plain weight (no 1 + w)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * y).to(x.dtype)


def rms_norm_for(hidden_act: str):
    return rms_norm_relu2 if hidden_act == "relu2" else rms_norm_silu


# ---- MLPs (weights already fused at load for silu) ----
def mlp_silu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def mlp_relu2(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(torch.relu(F.linear(x, up)).square(), down)


# ---- timestep embedding (fp32 sinusoid -> fp32 MLP -> activation dtype) ----
def timestep_sinusoid(t: torch.Tensor) -> torch.Tensor:
    """[N] fp32 (already * timestep_scale) -> [N, 256] = [cos(t f_k), sin(t f_k)], f_k = exp(-ln(1e4) k/128)."""
    k = torch.arange(TIME_FREQS, dtype=torch.float32, device=t.device)
    freqs = torch.exp(-math.log(10000) * k / TIME_FREQS)
    arg = t.float()[:, None] * freqs[None, :]
    return torch.cat([torch.cos(arg), torch.sin(arg)], dim=-1)


def time_embedding(t_scaled: torch.Tensor, w1, b1, w2, b2, out_dtype: torch.dtype, min_rows: int = 16) -> torch.Tensor:
    """[N] scaled timesteps -> [N, D] in `out_dtype`. Rows are padded to `min_rows`: CPU BLAS takes a gemv
    path for a handful of rows whose fp32 rounding differs from the gemm path upstream's per-token batch
    uses; padding is free (one row per sample, not per token) and keeps fp32 parity tight."""
    n = t_scaled.shape[0]
    if n < min_rows:
        t_scaled = torch.cat([t_scaled, t_scaled[-1:].expand(min_rows - n)])
    e = timestep_sinusoid(t_scaled).to(w1.dtype)
    return F.linear(F.silu(F.linear(e, w1, b1)), w2, b2)[:n].to(out_dtype)


# ---- interleaved 3D mRoPE ----
def mrope_axis_of_column(half_dim: int, rope_axes_dim: tuple[int, int, int]) -> torch.Tensor:
    """Axis (0=T, 1=H, 2=W) feeding each of the head_dim/2 frequency columns:
    H if k%3==1 and k<3*axes[1]; W if k%3==2 and k<3*axes[2]; else T (axes[0] is never read)."""
    axis = torch.zeros(half_dim, dtype=torch.int64)
    for k in range(half_dim):
        if k % 3 == 1 and k < 3 * rope_axes_dim[1]:
            axis[k] = 1
        elif k % 3 == 2 and k < 3 * rope_axes_dim[2]:
            axis[k] = 2
    return axis


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, axis_of_column: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [3, N] -> cos, sin [N, head_dim] in `dtype` (positions and products in fp32)."""
    pos = position_ids.to(device=inv_freq.device, dtype=torch.float32)
    freqs = pos[axis_of_column.to(inv_freq.device)].T * inv_freq      # [N, d/2]: pos[axis[k], n] * f_k
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (NeoX) on x [N, heads, d] with cos/sin [N, d]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


# ---- patchify ----
def patchify(latent: torch.Tensor, p: int) -> torch.Tensor:
    """[1, C, T, H, W] -> [T*h*w, p*p*C]: bottom/right zero-pad to multiples of p; feature (py*p+px)*C + c."""
    _, C, T, H, W = latent.shape
    h, w = -(-H // p), -(-W // p)
    x = F.pad(latent[0], (0, w * p - W, 0, h * p - H))
    return x.reshape(C, T, h, p, w, p).permute(1, 2, 4, 3, 5, 0).reshape(T * h * w, p * p * C)


def unpatchify(tokens: torch.Tensor, grid: tuple[int, int, int], p: int, C: int, H: int, W: int) -> torch.Tensor:
    """[t*h*w, p*p*C] -> [C, t, H, W] (cropped)."""
    t, h, w = grid
    x = tokens.reshape(t, h, w, p, p, C).permute(5, 0, 1, 3, 2, 4).reshape(C, t, h * p, w * p)
    return x[:, :, :H, :W]
