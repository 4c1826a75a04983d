"""Fast SeedVR2 NaDiT (3B dit_v2 / 7B dit) with window-aligned sequence parallelism (Plan A).

Every rank keeps all heads and only the video rows of the windows it owns. Tokenwise work (patch embedding,
norms, ada modulation, residuals, MLP, output head) runs on local rows; window attention is grouped SDPA over
local windows (windows of equal size batched into one call, each segment [window video ; replicated text]);
the text stream is replicated: local window text outputs are summed, one SUM all-reduce, divided by the global
window count. Between layers `ensure_layout(current, required)` re-shards rows (optimized.parallel.redistribute).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from manifests.seedvr2.config import TIME_FREQ_DIM, NaDiTConfig
from optimized.models.seedvr2.spec import nadit_component, validate_parallel_plan
from optimized.models.seedvr2.windows import Grid, PlanCache, WindowPlan
from optimized.parallel.group import ParallelPlan, SPGroup
from optimized.parallel.redistribute import Transition, apply_transition, build_transition
from optimized.runtime.spec import apply_load_transforms

Trace = Callable[[str, torch.Tensor], None]


@dataclass
class RunStats:
    transitions: int = 0
    network_transitions: int = 0
    rows_moved: int = 0
    attention_calls: int = 0


@dataclass
class LocalLayout:
    """One window layout as seen by this rank: its rows, rope tables, attention groups, per-sample segments."""

    plan: WindowPlan
    rows: torch.Tensor                                   # canonical ids, local order
    cos: torch.Tensor
    sin: torch.Tensor
    groups: list[tuple[int, torch.Tensor]]               # (sample, (G, n) local row positions)
    segments: list[tuple[int, int, int]]                 # (sample, start, end) local rows of each sample
    windows_per_sample: torch.Tensor                     # (B,) global window counts


@dataclass
class Request:
    """Per-forward state owned by the window runtime: layouts, transitions, text segments."""

    grids: tuple[Grid, ...]
    text_lens: tuple[int, ...]
    layouts: dict[str, LocalLayout] = field(default_factory=dict)
    transitions: dict[tuple[str, str], Transition] = field(default_factory=dict)


def rope_angles_for(cfg: NaDiTConfig, freqs: torch.Tensor, coords: torch.Tensor, extents: torch.Tensor,
                    text_len: torch.Tensor) -> torch.Tensor:
    """Angles (n, 3*2*nf) from window-local coords: 3B integer (L+dt, dh, dw); 7B linspace(-1,1,extent)[c]."""
    if cfg.is_3b:
        pos = coords.double()
        pos[:, 0] += text_len.double()
    else:
        pos = torch.empty(coords.shape, dtype=torch.float64)
        for n in torch.unique(extents).tolist():
            table = torch.linspace(-1, 1, int(n)).double()
            m = extents == n
            pos[m] = table[coords[m]]
    pos = pos.float()
    ang = pos[:, :, None] * freqs.float()[None, None, :]          # (n, 3, nf)
    return ang.repeat_interleave(2, dim=-1).reshape(pos.shape[0], 6 * freqs.numel())


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation of the first cos.shape[-1] channels of x (n, h, d), in fp32."""
    r = cos.shape[-1]
    head, tail = x[..., :r].float(), x[..., r:]
    pairs = head.unflatten(-1, (-1, 2))
    swapped = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return torch.cat([(head * cos[:, None] + swapped * sin[:, None]).to(x.dtype), tail], dim=-1)


class FastNaDiT:
    def __init__(self, cfg: NaDiTConfig, params: dict[str, torch.Tensor], dtype: torch.dtype,
                 parallel: ParallelPlan | None = None):
        self.cfg = cfg.validate()
        self.p = params
        self.dtype = dtype
        self.parallel = validate_parallel_plan(parallel or ParallelPlan())
        self.plan_cache = PlanCache()
        self.stats = RunStats()
        self.last_rank_tokens: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ layouts
    def plan(self, req: Request, method: str, world_size: int) -> WindowPlan:
        return self.plan_cache.get(req.grids, self.cfg.num_windows, method, world_size)

    def local_layout(self, req: Request, method: str, group: SPGroup, layer: int) -> LocalLayout:
        if method in req.layouts:
            return req.layouts[method]
        plan = self.plan(req, method, group.world_size)
        if plan.world_size != group.world_size:
            raise RuntimeError(f"blocks.{layer} ({method} layout): window plan made for sp={plan.world_size} "
                               f"used on an sp={group.world_size} group (stale plan cache entry)")
        g = plan.geometry
        pos = plan.rank_token_positions(group.rank)
        rows = g.token_ids[pos]
        win_of_pos = torch.repeat_interleave(torch.arange(g.num_windows), torch.tensor(g.window_tokens))
        sample_of_window = torch.tensor([s for s, _ in g.boxes])
        text_len = torch.tensor(req.text_lens)[sample_of_window[win_of_pos[pos]]] if pos.numel() else \
            torch.zeros(0, dtype=torch.int64)
        ang = rope_angles_for(self.cfg, self.p[f"blocks.{layer}.attn.rope.freqs"], g.local_coords[pos],
                              g.extents[pos], text_len)
        groups: dict[tuple[int, int], list[torch.Tensor]] = {}
        segments: dict[int, list[int]] = {}
        start = 0
        for w in plan.assignment.items_of(group.rank):
            n, s = g.window_tokens[w], g.boxes[w][0]
            groups.setdefault((s, n), []).append(torch.arange(start, start + n))
            seg = segments.setdefault(s, [start, start + n])
            seg[1] = start + n
            start += n
        B = len(req.grids)
        layout = LocalLayout(
            plan, rows, ang.cos(), ang.sin(),
            [(s, torch.stack(v)) for (s, _), v in sorted(groups.items())],
            [(s, a, b) for s, (a, b) in sorted(segments.items())],
            torch.tensor([g.windows_of_sample(s) for s in range(B)]))
        req.layouts[method] = layout
        return layout

    def ensure_layout(self, x: torch.Tensor, req: Request, current: str, required: str, group: SPGroup,
                      layer: int) -> torch.Tensor:
        if current == required:
            return x
        self.stats.transitions += 1
        key = (current, required)
        if key not in req.transitions:
            req.transitions[key] = build_transition(req.layouts[current].plan.layout,
                                                    req.layouts[required].plan.layout, group.rank)
        tr = req.transitions[key]
        if tr.network_exchange_required:
            self.stats.network_transitions += 1
            self.stats.rows_moved += tr.moved_rows()
        return apply_transition(x, tr, group)

    def gather_canonical(self, x: torch.Tensor, layout: LocalLayout, group: SPGroup) -> torch.Tensor:
        """This rank's rows -> all rows in canonical order (on every rank)."""
        plan = layout.plan
        counts = [int(r.numel()) for r in plan.layout.rank_rows]
        parts = group.all_gather_rows(x, counts)
        out = x.new_empty((plan.layout.num_rows,) + tuple(x.shape[1:]))
        for rows, part in zip(plan.layout.rank_rows, parts):
            out[rows.to(x.device)] = part
        return out

    # ------------------------------------------------------------------ tokenwise pieces
    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.p[f"{name}.weight"], self.p.get(f"{name}.bias"))

    def rms(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.norm_eps)

    def ada(self, emb: torch.Tensor, prefix: str, layer: str, what: str) -> torch.Tensor:
        """(B, dim): emb read as (B, dim, 2, 3) [channel, {attn, mlp}, {shift, scale, gate}] + learned vector."""
        e = emb.view(emb.shape[0], -1, 2, 3)[:, :, ("attn", "mlp").index(layer), ("shift", "scale", "gate").index(what)]
        return e + self.p[f"{prefix}.{layer}_{what}"]

    @staticmethod
    def per_sample(x: torch.Tensor, segments, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        if len(segments) == 1:
            return fn(x, segments[0][0])
        return torch.cat([fn(x[a:b], s) for s, a, b in segments]) if segments else x

    def modulate(self, x, segments, scale, shift):
        return self.per_sample(x, segments, lambda t, s: t * scale[s] + shift[s])

    def mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        if self.cfg.is_3b:
            return F.linear(F.silu(F.linear(x, self.p[f"{prefix}.proj_in_gate.weight"])) *
                            F.linear(x, self.p[f"{prefix}.proj_in.weight"]), self.p[f"{prefix}.proj_out.weight"])
        return self.linear(F.gelu(self.linear(x, f"{prefix}.proj_in"), approximate="tanh"), f"{prefix}.proj_out")

    def time_embedding(self, t: torch.Tensor) -> torch.Tensor:
        half = TIME_FREQ_DIM // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        a = t.float()[:, None] * freqs[None]
        x = torch.cat([a.sin(), a.cos()], -1)
        x = F.silu(self.linear(x, "emb_in.proj_in"))
        x = F.silu(self.linear(x, "emb_in.proj_hid"))
        return self.linear(x, "emb_in.proj_out").to(self.dtype)

    # ------------------------------------------------------------------ attention
    def qkv(self, x: torch.Tensor, layer: int, branch: str):
        cfg = self.cfg
        p = f"blocks.{layer}.attn"
        q, k, v = F.linear(x, self.p[f"{p}.proj_qkv.{branch}.weight"]).view(-1, 3, cfg.heads, cfg.head_dim).unbind(1)
        return self.rms(q, self.p[f"{p}.norm_q.{branch}.weight"]), self.rms(k, self.p[f"{p}.norm_k.{branch}.weight"]), v

    def window_attention(self, vid, txt, req: Request, layout: LocalLayout, layer: int, group: SPGroup):
        cfg = self.cfg
        vb, tb = cfg.branch(layer)
        qv, kv, vv = self.qkv(vid, layer, vb)
        qv, kv = rotate(qv, layout.cos.to(vid.device), layout.sin.to(vid.device)), \
            rotate(kv, layout.cos.to(vid.device), layout.sin.to(vid.device))
        qt, kt, vt = self.qkv(txt, layer, tb)
        if cfg.is_3b:  # mmrope3d rotates text too: position p on every axis
            freqs = self.p[f"blocks.{layer}.attn.rope.freqs"]
            p = torch.cat([torch.arange(L) for L in req.text_lens]).float()[:, None].expand(-1, 3)
            ang = (p[:, :, None] * freqs.float()[None, None]).repeat_interleave(2, -1).reshape(p.shape[0], -1)
            qt, kt = rotate(qt, ang.cos().to(txt.device), ang.sin().to(txt.device)), \
                rotate(kt, ang.cos().to(txt.device), ang.sin().to(txt.device))
        offsets = [0]
        for L in req.text_lens:
            offsets.append(offsets[-1] + L)
        vid_out = torch.empty_like(qv)
        txt_sum = torch.zeros(qt.shape, dtype=qt.dtype, device=qt.device)  # an empty rank contributes these zeros
        for s, idx in layout.groups:
            a, b = offsets[s], offsets[s + 1]
            G, n = idx.shape
            idx = idx.to(vid.device)
            q = torch.cat([qv[idx], qt[a:b].expand(G, -1, -1, -1)], 1).transpose(1, 2)
            k = torch.cat([kv[idx], kt[a:b].expand(G, -1, -1, -1)], 1).transpose(1, 2)
            v = torch.cat([vv[idx], vt[a:b].expand(G, -1, -1, -1)], 1).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)         # (G, n+L, h, d)
            self.stats.attention_calls += 1
            vid_out[idx] = out[:, :n]
            txt_sum[a:b] += self.window_text_sum(out[:, n:], layout, s, n)
        txt_sum = group.all_reduce_sum(txt_sum)
        divisor = torch.repeat_interleave(layout.windows_per_sample, torch.tensor(req.text_lens)).to(txt_sum)
        txt_out = txt_sum / divisor[:, None, None]
        p = f"blocks.{layer}.attn.proj_out"
        return (self.linear(vid_out.reshape(-1, cfg.dim), f"{p}.{vb}"),
                self.linear(txt_out.reshape(-1, cfg.dim), f"{p}.{tb}"))

    def window_text_sum(self, txt_out: torch.Tensor, layout: LocalLayout, sample: int,
                        window_tokens: int) -> torch.Tensor:
        """(G, L, h, d) text outputs of G windows of `window_tokens` video tokens each, all of `sample` -> their
        sum: the numerator of upstream's plain (not token-weighted) mean over the sample's windows. A declared
        seam: parity/families/seedvr2/faults.py plants a token-weighted sum here."""
        return txt_out.sum(0)

    # ------------------------------------------------------------------ forward
    def block(self, vid, txt, emb, req: Request, layout: LocalLayout, layer: int, group: SPGroup, text_rows):
        cfg = self.cfg
        vb, tb = cfg.branch(layer)
        av, at = f"blocks.{layer}.ada.{vb}", f"blocks.{layer}.ada.{tb}"
        seg = layout.segments
        passive = cfg.text_passive(layer)
        a_vid = self.modulate(self.rms(vid), seg, self.ada(emb, av, "attn", "scale"), self.ada(emb, av, "attn", "shift"))
        a_txt = self.rms(txt)
        if not passive:
            a_txt = self.modulate(a_txt, text_rows, self.ada(emb, at, "attn", "scale"), self.ada(emb, at, "attn", "shift"))
        a_vid, a_txt = self.window_attention(a_vid, a_txt, req, layout, layer, group)
        vid = vid + self.modulate(a_vid, seg, self.ada(emb, av, "attn", "gate"), torch.zeros_like(emb[:, :cfg.dim]))
        h = self.modulate(self.rms(vid), seg, self.ada(emb, av, "mlp", "scale"), self.ada(emb, av, "mlp", "shift"))
        vid = vid + self.modulate(self.mlp(h, f"blocks.{layer}.mlp.{vb}"), seg, self.ada(emb, av, "mlp", "gate"),
                                  torch.zeros_like(emb[:, :cfg.dim]))
        if passive:  # 3B last layer: text attention un-gated, no MLP; upstream's skipped MLP doubles it (unused)
            txt = txt + a_txt
            return vid, txt + txt
        zeros = torch.zeros_like(emb[:, :cfg.dim])
        txt = txt + self.modulate(a_txt, text_rows, self.ada(emb, at, "attn", "gate"), zeros)
        h = self.modulate(self.rms(txt), text_rows, self.ada(emb, at, "mlp", "scale"), self.ada(emb, at, "mlp", "shift"))
        return vid, txt + self.modulate(self.mlp(h, f"blocks.{layer}.mlp.{tb}"), text_rows,
                                        self.ada(emb, at, "mlp", "gate"), zeros)

    def patchify_all(self, vid: torch.Tensor, grids_latent) -> torch.Tensor:
        _, ph, pw = self.cfg.patch_size
        out, row = [], 0
        for T, H, W in grids_latent:
            x = vid[row:row + T * H * W].view(T, H // ph, ph, W // pw, pw, -1).permute(0, 1, 3, 2, 4, 5)
            out.append(x.reshape(T * (H // ph) * (W // pw), -1))
            row += T * H * W
        return torch.cat(out)

    def unpatchify_all(self, out: torch.Tensor, grids) -> torch.Tensor:
        _, ph, pw = self.cfg.patch_size
        c = self.cfg.vid_out_channels
        res, row = [], 0
        for T, h, w in grids:
            x = out[row:row + T * h * w].view(T, h, w, ph, pw, c).permute(0, 1, 3, 2, 4, 5)
            res.append(x.reshape(-1, c))
            row += T * h * w
        return torch.cat(res)

    def forward(self, vid, vid_shape, txt, txt_shape, timestep, group: SPGroup | None = None,
                trace: Trace | None = None) -> torch.Tensor:
        """Returns vid_sample (all rows, canonical order) on every rank."""
        cfg = self.cfg
        group = group or SPGroup.single()
        _, ph, pw = cfg.patch_size
        grids_latent = [tuple(int(v) for v in r) for r in vid_shape.tolist()]
        req = Request(tuple((T, H // ph, W // pw) for T, H, W in grids_latent),
                      tuple(int(v) for v in txt_shape[:, 0].tolist()))
        text_rows, a = [], 0
        for s, L in enumerate(req.text_lens):
            text_rows.append((s, a, a + L))
            a += L
        emb = self.time_embedding(timestep)
        txt = self.linear(txt.to(self.dtype), "txt_in")
        current = cfg.schedule[0]
        layout = self.local_layout(req, current, group, 0)
        patches = self.patchify_all(vid.to(self.dtype), grids_latent)
        x = self.linear(patches.index_select(0, layout.rows.to(patches.device)), "vid_in.proj")
        if trace:
            trace("emb", emb[0])
            trace("txt_in", txt)
            trace("vid_in", self.gather_canonical(x, layout, group))
        for i in range(cfg.num_layers):
            required = cfg.schedule[i]
            self.local_layout(req, required, group, i)
            x = self.ensure_layout(x, req, current, required, group, i)
            current, layout = required, req.layouts[required]
            x, txt = self.block(x, txt, emb, req, layout, i, group, text_rows)
            if trace:
                trace(f"blocks.{i}.vid", self.gather_canonical(x, layout, group))
                trace(f"blocks.{i}.txt", txt)
        self.last_rank_tokens = {m: [int(r.numel()) for r in lay.plan.layout.rank_rows] for m, lay in req.layouts.items()}
        if cfg.is_3b:
            # vid_out_ada quirk: upstream's output ada reads the first block's cached 'attn' (shift, scale) of emb
            first = emb.view(emb.shape[0], -1, 2, 3)[:, :, 0]
            x = self.modulate(self.rms(x, self.p["vid_out_norm.weight"]), layout.segments,
                              first[:, :, 1] + self.p["vid_out_ada.out_scale"],
                              first[:, :, 0] + self.p["vid_out_ada.out_shift"])
        out = self.gather_canonical(self.linear(x, "vid_out.proj"), layout, group)
        if trace:
            trace("vid_out", out)
        return self.unpatchify_all(out, req.grids)

    __call__ = forward


def load_fast_nadit(cfg: NaDiTConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                    dtype: torch.dtype = torch.float32, parallel: ParallelPlan | None = None) -> FastNaDiT:
    """Strict: the canonical state dict must match the ComponentSpec exactly (names, shapes)."""
    validate_parallel_plan(parallel or ParallelPlan())
    params = apply_load_transforms(nadit_component(cfg), state, dtype=dtype, device=device)
    return FastNaDiT(cfg, params, dtype, parallel)
