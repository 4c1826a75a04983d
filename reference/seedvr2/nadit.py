"""SeedVR2 NaDiT, readable single-device reference for both releases (3B = upstream dit_v2, 7B = upstream dit).

Inputs are NaViT-style packed: `vid` (sum T*H*W, 33) latent rows per sample flattened row-major over (t,h,w),
`vid_shape` (B,3) latent grids, `txt` (sum L, txt_in_dim), `txt_shape` (B,1), `timestep` (B,). Samples never
interact, so this reference simply runs one sample at a time. Output: `vid_sample` (sum T*H*W, 16), the v_lerp
prediction. Parameter names are the canonical layout (manifests/seedvr2/keys.py).

Every layer partitions the video tokens into 3D windows (regular and shifted layouts alternate) and runs one
attention call per window over [window video tokens ; all text tokens of the sample].
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from manifests.seedvr2.config import TIME_FREQ_DIM, NaDiTConfig
from manifests.seedvr2.keys import ADA_PARAMS, nadit_key_shapes
from reference.seedvr2.windows import windows

Trace = Callable[[str, torch.Tensor], None]


# ---------------------------------------------------------------------------------------------------------------
# Small building blocks
# ---------------------------------------------------------------------------------------------------------------

class TimeEmbedding(nn.Module):
    """256-dim [sin | cos] sinusoid of t, then Linear-SiLU-Linear-SiLU-Linear(-> 6*dim)."""

    def __init__(self, dim: int, emb_dim: int):
        super().__init__()
        self.proj_in = nn.Linear(TIME_FREQ_DIM, dim)
        self.proj_hid = nn.Linear(dim, dim)
        self.proj_out = nn.Linear(dim, emb_dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = TIME_FREQ_DIM // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        angles = t.float()[:, None] * freqs[None]
        x = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1).to(self.proj_in.weight.dtype)
        return self.proj_out(F.silu(self.proj_hid(F.silu(self.proj_in(x)))))


class Ada(nn.Module):
    """Learned per-channel shift/scale/gate for the attention and MLP sub-layers (added to the time embedding)."""

    def __init__(self, dim: int):
        super().__init__()
        for name in ADA_PARAMS:
            self.register_parameter(name, nn.Parameter(torch.zeros(dim)))

    def get(self, emb: torch.Tensor, layer: str, what: str) -> torch.Tensor:
        """emb (6*dim,) is read as (dim, 2, 3) = [channel, {attn, mlp}, {shift, scale, gate}]; no '1 +'."""
        e = emb.view(-1, 2, 3)[:, ("attn", "mlp").index(layer), ("shift", "scale", "gate").index(what)]
        return e + getattr(self, f"{layer}_{what}")


class RMSNormWeight(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj_in_gate = nn.Linear(dim, hidden, bias=False)
        self.proj_in = nn.Linear(dim, hidden, bias=False)
        self.proj_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.silu(self.proj_in_gate(x)) * self.proj_in(x))


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj_in = nn.Linear(dim, hidden)
        self.proj_out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.gelu(self.proj_in(x), approximate="tanh"))


class RopeFreqs(nn.Module):
    """Holds the checkpoint's per-axis frequency buffer (3B: 'lang' 1e4^(-2j/axis_dim); 7B: 'pixel' linspace*pi)."""

    def __init__(self, num_freqs: int):
        super().__init__()
        self.register_buffer("freqs", torch.zeros(num_freqs))


def rope_angles(freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """positions (n, 3) float -> angles (n, 3 * 2 * len(freqs)): axes [t | h | w], each pair (2j, 2j+1) shares f_j."""
    per_axis = [(positions[:, a, None] * freqs[None, :]).repeat_interleave(2, dim=-1) for a in range(3)]
    return torch.cat(per_axis, dim=-1)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x (n, heads, head_dim); rotates the first angles.shape[-1] channels, in fp32; the rest pass through."""
    r = angles.shape[-1]
    rot, rest = x[..., :r].float(), x[..., r:]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    pairs = rot.unflatten(-1, (-1, 2))
    rotated_half = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return torch.cat([(rot * cos + rotated_half * sin).to(x.dtype), rest], dim=-1)


def branches(names: tuple[str, str], make: Callable[[], nn.Module]) -> nn.ModuleDict:
    return nn.ModuleDict({b: make() for b in sorted(set(names))})


# ---------------------------------------------------------------------------------------------------------------
# One transformer block
# ---------------------------------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, cfg: NaDiTConfig, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        self.vid_branch, self.txt_branch = cfg.branch(index)
        names = cfg.branch(index)
        D, d = cfg.dim, cfg.head_dim
        self.attn = nn.Module()
        self.attn.proj_qkv = branches(names, lambda: nn.Linear(D, 3 * D, bias=False))
        self.attn.proj_out = branches(names, lambda: nn.Linear(D, D))
        self.attn.norm_q = branches(names, lambda: RMSNormWeight(d, cfg.norm_eps))
        self.attn.norm_k = branches(names, lambda: RMSNormWeight(d, cfg.norm_eps))
        self.attn.rope = RopeFreqs(cfg.rope_num_freqs)
        mlp = (lambda: SwiGLU(D, cfg.mlp_hidden)) if cfg.is_3b else (lambda: GeluMLP(D, cfg.mlp_hidden))
        self.mlp = branches(names, mlp)
        self.ada = branches(names, lambda: Ada(D))

    def norm(self, x: torch.Tensor) -> torch.Tensor:  # attn_norm / mlp_norm: RMSNorm without affine
        return F.rms_norm(x, (x.shape[-1],), None, self.cfg.norm_eps)

    def qkv(self, x: torch.Tensor, branch: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n, dim) -> q, k, v each (n, heads, head_dim); split as (o h d), o = q,k,v outermost; q/k RMS-normed."""
        q, k, v = self.attn.proj_qkv[branch](x).view(x.shape[0], 3, self.cfg.heads, self.cfg.head_dim).unbind(1)
        return self.attn.norm_q[branch](q), self.attn.norm_k[branch](k), v

    def video_positions(self, box, text_len: int) -> torch.Tensor:
        """Window-local rope positions of the window's tokens, row-major in (t, h, w)."""
        (t0, t1), (h0, h1), (w0, w1) = box
        if self.cfg.is_3b:  # mmrope3d: integer window-local positions, time offset by the text length
            axes = [torch.arange(t1 - t0) + text_len, torch.arange(h1 - h0), torch.arange(w1 - w0)]
        else:  # pixel rope: linspace(-1, 1, extent) over the window's own extent (extent 1 gives -1)
            axes = [torch.linspace(-1, 1, n) for n in (t1 - t0, h1 - h0, w1 - w0)]
        grid = torch.meshgrid(*axes, indexing="ij")
        return torch.stack([g.reshape(-1) for g in grid], dim=-1).float()

    def window_attention(self, vid: torch.Tensor, txt: torch.Tensor, grid) -> tuple[torch.Tensor, torch.Tensor]:
        """vid (T*H*W, dim) of one sample, txt (L, dim). One attention call per window over [window video; text].
        Returns the video output in canonical order and the text output averaged over the windows."""
        cfg = self.cfg
        T, H, W = grid
        L = txt.shape[0]
        qv, kv, vv = (t.view(T, H, W, cfg.heads, cfg.head_dim) for t in self.qkv(vid, self.vid_branch))
        qt, kt, vt = self.qkv(txt, self.txt_branch)
        freqs = self.attn.rope.freqs.float()
        if cfg.is_3b:  # mmrope3d also rotates text: position p on all three axes
            text_angles = rope_angles(freqs, torch.arange(L, device=txt.device)[:, None].expand(L, 3).float())
            qt, kt = apply_rope(qt, text_angles), apply_rope(kt, text_angles)
        vid_out = torch.empty_like(qv)
        txt_sum = torch.zeros_like(qt)
        boxes = windows(grid, cfg.num_windows, cfg.schedule[self.index])
        for box in boxes:
            sl = tuple(slice(a, b) for a, b in box)
            n = qv[sl].shape[:3]
            angles = rope_angles(freqs, self.video_positions(box, L).to(vid.device))
            q = torch.cat([apply_rope(qv[sl].reshape(-1, cfg.heads, cfg.head_dim), angles), qt])
            k = torch.cat([apply_rope(kv[sl].reshape(-1, cfg.heads, cfg.head_dim), angles), kt])
            v = torch.cat([vv[sl].reshape(-1, cfg.heads, cfg.head_dim), vt])
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
            nv = n[0] * n[1] * n[2]
            vid_out[sl] = out[:nv].view(*n, cfg.heads, cfg.head_dim)
            txt_sum = txt_sum + out[nv:]
        txt_out = txt_sum / len(boxes)  # plain mean over the sample's windows (not token-weighted)
        vid_out = self.attn.proj_out[self.vid_branch](vid_out.reshape(T * H * W, cfg.dim))
        txt_out = self.attn.proj_out[self.txt_branch](txt_out.reshape(L, cfg.dim))
        return vid_out, txt_out

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, emb: torch.Tensor, grid) -> tuple[torch.Tensor, torch.Tensor]:
        ada_v, ada_t = self.ada[self.vid_branch], self.ada[self.txt_branch]
        passive = self.cfg.text_passive(self.index)
        a_vid = self.norm(vid) * ada_v.get(emb, "attn", "scale") + ada_v.get(emb, "attn", "shift")
        a_txt = self.norm(txt)
        if not passive:
            a_txt = a_txt * ada_t.get(emb, "attn", "scale") + ada_t.get(emb, "attn", "shift")
        a_vid, a_txt = self.window_attention(a_vid, a_txt, grid)
        vid = vid + a_vid * ada_v.get(emb, "attn", "gate")
        if passive:  # 3B last layer is vid_only: text gets the attention output un-gated, and no MLP
            txt = txt + a_txt
            # quirk: upstream's skipped text MLP hands its input back as the residual, so the text doubles (unused)
            return self.mlp_residual(vid, emb, self.vid_branch), txt + txt
        txt = txt + a_txt * ada_t.get(emb, "attn", "gate")
        return self.mlp_residual(vid, emb, self.vid_branch), self.mlp_residual(txt, emb, self.txt_branch)

    def mlp_residual(self, x: torch.Tensor, emb: torch.Tensor, branch: str) -> torch.Tensor:
        ada = self.ada[branch]
        h = self.norm(x) * ada.get(emb, "mlp", "scale") + ada.get(emb, "mlp", "shift")
        return x + self.mlp[branch](h) * ada.get(emb, "mlp", "gate")


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------

class NaDiT(nn.Module):
    def __init__(self, cfg: NaDiTConfig):
        super().__init__()
        self.cfg = cfg.validate()
        D = cfg.dim
        self.vid_in = nn.Module()
        self.vid_in.proj = nn.Linear(cfg.patch_features, D)
        self.txt_in = nn.Linear(cfg.txt_in_dim, D)
        self.emb_in = TimeEmbedding(D, cfg.emb_dim)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        if cfg.is_3b:
            self.vid_out_norm = RMSNormWeight(D, cfg.norm_eps)
            self.vid_out_ada = nn.Module()
            self.vid_out_ada.out_shift = nn.Parameter(torch.zeros(D))
            self.vid_out_ada.out_scale = nn.Parameter(torch.ones(D))
        self.vid_out = nn.Module()
        self.vid_out.proj = nn.Linear(D, cfg.out_features)

    def patchify(self, latent: torch.Tensor) -> torch.Tensor:
        """(T, H, W, C) -> (T, H/2, W/2, 2*2*C), features ordered (ph, pw, c) with c fastest."""
        T, H, W, C = latent.shape
        _, ph, pw = self.cfg.patch_size
        x = latent.view(T, H // ph, ph, W // pw, pw, C).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(T, H // ph, W // pw, ph * pw * C)

    def unpatchify(self, tokens: torch.Tensor, grid) -> torch.Tensor:
        T, h, w = grid
        _, ph, pw = self.cfg.patch_size
        x = tokens.view(T, h, w, ph, pw, self.cfg.vid_out_channels).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(T * h * ph * w * pw, self.cfg.vid_out_channels)

    def forward(self, vid: torch.Tensor, vid_shape: torch.Tensor, txt: torch.Tensor, txt_shape: torch.Tensor,
                timestep: torch.Tensor, trace: Trace | None = None) -> torch.Tensor:
        # Batch semantics: samples are independent. For B > 1 upstream 3B feeds samples >= 1 another sample's text
        # q/k (a bug, not semantics; official inference uses batch 1): here every sample attends to its own text.
        outputs, row, trow = [], 0, 0
        for b in range(vid_shape.shape[0]):
            T, H, W = (int(x) for x in vid_shape[b])
            L = int(txt_shape[b, 0])
            latent = vid[row:row + T * H * W].view(T, H, W, -1)
            outputs.append(self.forward_sample(latent, txt[trow:trow + L], timestep[b:b + 1], trace if b == 0 else None))
            row, trow = row + T * H * W, trow + L
        return torch.cat(outputs)

    def forward_sample(self, latent: torch.Tensor, txt: torch.Tensor, timestep: torch.Tensor,
                       trace: Trace | None) -> torch.Tensor:
        cfg = self.cfg
        trace = trace or (lambda name, t: None)
        txt = self.txt_in(txt)
        patches = self.patchify(latent)
        grid = tuple(patches.shape[:3])
        vid = self.vid_in.proj(patches.reshape(-1, patches.shape[-1]))
        emb = self.emb_in(timestep)[0]
        trace("emb", emb)
        trace("txt_in", txt)
        trace("vid_in", vid)
        for i, block in enumerate(self.blocks):
            vid, txt = block(vid, txt, emb, grid)
            trace(f"blocks.{i}.vid", vid)
            trace(f"blocks.{i}.txt", txt)
        if cfg.is_3b:
            # vid_out_ada quirk: upstream's output ada reads the first block's cached 'attn' (shift, scale) of emb
            first = emb.view(-1, 2, 3)[:, 0]
            vid = self.vid_out_norm(vid)
            vid = vid * (first[:, 1] + self.vid_out_ada.out_scale) + (first[:, 0] + self.vid_out_ada.out_shift)
        out = self.vid_out.proj(vid)
        trace("vid_out", out)
        return self.unpatchify(out, grid)


def load_nadit(cfg: NaDiTConfig, state: dict[str, torch.Tensor], device: str = "cpu",
               dtype: torch.dtype = torch.float32) -> NaDiT:
    """Build the reference from a canonical state dict, strictly (every key present, none extra, shapes equal)."""
    want = nadit_key_shapes(cfg)
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise KeyError(f"seedvr2 NaDiT state dict: missing {missing[:5]}, unexpected {extra[:5]}")
    bad = [k for k in want if tuple(state[k].shape) != want[k]]
    if bad:
        raise ValueError(f"seedvr2 NaDiT state dict: shape mismatch at {bad[0]}: {tuple(state[bad[0]].shape)} "
                         f"vs {want[bad[0]]}")
    model = NaDiT(cfg)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    rope = {k for k in want if k.endswith(".attn.rope.freqs")}
    model.to(device)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in rope:
            p.data = p.data.to(dtype)
    return model.eval()
