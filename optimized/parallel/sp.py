"""Sequence-parallel attention primitives: Ulysses (all-to-all over heads) and ring attention (K/V passed around a
ring, partial results merged exactly by log-sum-exp), composable as ulysses x ring ("USP").

Layout everywhere: [B, S, H, D] (sequence before heads, as the DiTs hold q / k / v before their attention call).
A sequence of S tokens sharded over n = ulysses x ring ranks is padded to a multiple of n (`pad_to_multiple`) and
split evenly; rank (ring index i, ulysses index j) holds chunk i * ulysses + j; padded keys are masked out.

    out_local = sp_attention(q_local, k_local, v_local, key_mask_local, mesh)   # == SDPA on the whole sequence

`key_mask` is a bool [B, S_local] (True = attend) or None. Cross-attention over a context every rank holds whole
(wan's text) passes `kv_replicated=True`: each query row attends to the whole context locally, nothing is exchanged
(the text K/V projections are computed for every head on every rank: L = 512 rows, cheap next to the video).
Declared seams for negative controls (parity/parallel_faults.py patches them, nothing here knows about faults):
`split_head_groups` (which head group goes to which rank in the forward all-to-all) and `attention_lse` (the
max-shifted partial attention every ring step merges).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from optimized.parallel.group import AxisGroup


# ---- sequence sharding ----------------------------------------------------------------------------------------

def pad_to_multiple(x: torch.Tensor, n: int, dim: int = 1) -> tuple[torch.Tensor, int]:
    """x padded with zeros along `dim` to a multiple of n; (padded, number of pad rows)."""
    pad = -x.shape[dim] % n
    if pad == 0:
        return x, 0
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim), pad


def shard_sequence(x: torch.Tensor, n: int, index: int, dim: int = 1) -> torch.Tensor:
    """Chunk `index` of n of x (padded to a multiple of n)."""
    x, _ = pad_to_multiple(x, n, dim)
    return x.chunk(n, dim)[index]


def key_mask_shard(batch: int, length: int, n: int, index: int, device=None) -> torch.Tensor:
    """The bool key mask of chunk `index` when `length` real tokens are padded to a multiple of n."""
    mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    return shard_sequence(mask, n, index, 1)


def sp_index(mesh) -> tuple[int, int]:
    """(this rank's chunk index, number of chunks) of a sequence sharded over ring x ulysses."""
    u, r = mesh.axis("sp_ulysses"), mesh.axis("sp_ring")
    return r.rank * u.world_size + u.rank, r.world_size * u.world_size


# ---- Ulysses ----------------------------------------------------------------------------------------------------

def split_head_groups(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, S, H, D] -> [n, B, S, H / n, D]: head group d (heads d * H / n ...) is chunk d, sent to rank d."""
    B, S, H, D = x.shape
    return x.reshape(B, S, n, H // n, D).permute(2, 0, 1, 3, 4)


def heads_to_sequence(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """[B, S, H, D] (this rank's sequence chunk, all heads) -> [B, n * S, H / n, D] (the group's whole sequence,
    head group `rank`)."""
    n = group.world_size
    if n == 1:
        return x
    B, S, H, D = x.shape
    chunks = split_head_groups(x, n)                                         # [n (head group = destination), ...]
    got = group.all_to_all_equal(chunks)                                     # [n (source = sequence chunk), B, S, h, D]
    return got.permute(1, 0, 2, 3, 4).reshape(B, n * S, H // n, D)


def sequence_to_heads(y: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """The inverse: [B, n * S, H / n, D] -> [B, S, H, D]."""
    n = group.world_size
    if n == 1:
        return y
    B, nS, h, D = y.shape
    chunks = y.reshape(B, n, nS // n, h, D).permute(1, 0, 2, 3, 4)         # [n (sequence chunk = destination), ...]
    got = group.all_to_all_equal(chunks)                                     # [n (source = head group), B, S, h, D]
    return got.permute(1, 2, 0, 3, 4).reshape(B, nS // n, n * h, D)


def kv_heads_for(x: torch.Tensor, n: int) -> torch.Tensor:
    """GQA under a head split of n: KV heads as they are when n divides them, else each replicated n / kv times
    (the declared KV-replication rule: needs kv to divide n)."""
    kv = x.shape[2]
    if kv % n == 0:
        return x
    if n % kv:
        raise ValueError(f"{kv} KV heads can be neither split nor replicated over {n} ranks")
    return x.repeat_interleave(n // kv, dim=2)


# ---- local attention with log-sum-exp ----------------------------------------------------------------------------

def _expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[2] == heads else k.repeat_interleave(heads // k.shape[2], dim=2)


def attention_lse(q, k, v, key_mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention of [B, Sq, H, D] against [B, Sk, Hkv, D]; (out [B, Sq, H, D], lse [B, H, Sq] fp32).
    Rows whose keys are all masked give out 0 and lse -inf (they merge as empty)."""
    H = q.shape[2]
    qh, kh, vh = q.transpose(1, 2).float(), _expand_kv(k, H).transpose(1, 2).float(), _expand_kv(v, H).transpose(1, 2)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)                 # all-masked rows: shift by 0
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    out = (p @ vh.float()) / denom.clamp_min(torch.finfo(torch.float32).tiny)
    lse = (m + denom.log()).squeeze(-1)
    return out.to(q.dtype).transpose(1, 2), lse


def merge_lse(o_a, lse_a, o_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint key sets -> the attention over their union (exact)."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - base).transpose(1, 2).unsqueeze(-1)               # [B, Sq, H, 1]
    wb = torch.exp(lse_b - base).transpose(1, 2).unsqueeze(-1)
    return (wa * o_a.float() + wb * o_b.float()).to(o_a.dtype), lse


def ring_attention(q, k, v, key_mask, ring: AxisGroup, scale: float) -> torch.Tensor:
    """Forward-only ring attention: this rank's queries against every rank's K/V block, blocks passed to the next
    rank (n - 1 shifts), partials merged by log-sum-exp."""
    n = ring.world_size
    travels = key_mask is not None                                           # no mask: nothing extra on the ring
    if key_mask is None:
        key_mask = torch.ones(k.shape[:2], dtype=torch.bool, device=k.device)
    kv = torch.cat([k, v], -1)                                               # one message per shift
    D = k.shape[-1]
    out = lse = None
    for step in range(n):
        o, l_ = attention_lse(q, kv[..., :D], kv[..., D:], key_mask, scale)
        out, lse = (o, l_) if out is None else merge_lse(out, lse, o, l_)
        if step < n - 1:
            kv = ring.ring_shift(kv)
            if travels:
                key_mask = ring.ring_shift(key_mask.to(torch.uint8)).bool()
    return out


# ---- the attention function -------------------------------------------------------------------------------------

def sp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, mesh,
                 scale: float | None = None, kv_replicated: bool = False) -> torch.Tensor:
    """Attention of this rank's query chunk [B, S, H, D] over the whole (sharded) key sequence; == single-process
    SDPA on the unsharded tensors, restricted to this rank's rows. `mesh` has axes "sp_ulysses" and "sp_ring"
    (a ParallelMesh). `kv_replicated`: k / v (and key_mask) are the whole context on every rank."""
    u, r = mesh.axis("sp_ulysses"), mesh.axis("sp_ring")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if kv_replicated:  # queries are independent given the whole context: this rank's rows, no exchange at all
        return _sdpa(q, k, v, key_mask, scale)
    H = q.shape[2]
    if u.world_size > 1:
        q = heads_to_sequence(q, u)
        k, v = kv_heads_for(k, u.world_size), kv_heads_for(v, u.world_size)
        k, v = heads_to_sequence(k, u), heads_to_sequence(v, u)
        if key_mask is not None:
            key_mask = torch.cat(u.all_gather(key_mask.to(torch.uint8)), 1).bool()
    out = ring_attention(q, k, v, key_mask, r, scale) if r.world_size > 1 else _sdpa(q, k, v, key_mask, scale)
    if u.world_size > 1:
        out = sequence_to_heads(out, u)
    assert out.shape[2] == H
    return out


def _sdpa(q, k, v, key_mask, scale: float) -> torch.Tensor:
    mask = None if key_mask is None else key_mask[:, None, None, :]
    hq = q.shape[2]
    return F.scaled_dot_product_attention(q.transpose(1, 2), _expand_kv(k, hq).transpose(1, 2),
                                          _expand_kv(v, hq).transpose(1, 2), attn_mask=mask,
                                          scale=scale).transpose(1, 2)
