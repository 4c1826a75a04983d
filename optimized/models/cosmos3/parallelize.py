"""cosmos3 under a parallel plan, applied from outside the single-device model (torchtitan style): the family's
`parallelize(fast, mesh)` hook validates the plan against `PARALLELISM` and, when ulysses x ring > 1, attaches a
`GenSequenceParallel` as `fast.sequence_parallel`; the model's only hooks are that attribute (read by
`forward_batch` and `_und_kv`) and the `attention=` argument of `_gen_layer`. The cfgp axis needs nothing here: the
engine runs the CFG-parallel policy (optimized/parallel/cfg_parallel.py) through the loop's existing policy seam.

What is sharded, per gen layer (primitives of optimized/parallel/sp.py):

  * gen tokens (vision | sound | action of every sample, the padded [B, N] gen stream) by sequence: rank (ring i,
    ulysses j) holds chunk i * ulysses + j of every sample's N rows (N padded to a multiple of ulysses x ring, the
    padded keys masked); norms, projections, RoPE, MLP run on local rows only;
  * Ulysses: q / k / v all-to-all from sequence-sharded to head-sharded and back; GQA K/V as `kv_heads_for` says
    (split when ulysses divides the KV heads, else each KV head replicated ulysses / kv times, the declared rule);
  * the und (text) stream runs whole on every rank (causal over a short prompt, then cached), and its cached K/V
    are kept sharded by heads exactly as the gen K/V are (`shard_und`: the same `kv_heads_for` + head group), so
    text keys join each rank's attention with no exchange; cache entries carry the plan hash (set here on the model);
  * ring: each rank attends to [text keys | its own gen keys] with log-sum-exp, then to every other ring rank's
    gen keys passed around the ring, merged exactly (`attention_lse` / `merge_lse`).

The last hidden state is all-gathered back to the whole [B * N, D] stream, so decoding is the single-device code.
The SP step body (`Cosmos3Fast.sp_gen_body`) runs through the model's CompileCache like the single-device one;
under a plan a compiled body breaks its graph at each collective (they run eagerly between compiled regions,
optimized/runtime/compile.py), and every GraphKey names the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from optimized.attention import attend
from optimized.models.cosmos3.model import UndKV
from optimized.models.cosmos3.tp import attach_tp
from optimized.parallel import sp
from optimized.parallel.plan import ParallelismContract


class Cosmos3Parallelism(ParallelismContract):
    """The contract plus cosmos3's attach step: every cache of the instance is keyed on the plan, and with
    ulysses x ring > 1 the gen stream runs sequence-parallel. Applying another plan (a degree-1 one included)
    re-keys and re-attaches, so nothing computed under one layout is served under another."""

    def check(self, plan: Any, cfg: Any = None, world_size: int | None = None,
              require_implemented: bool = True) -> list[str]:
        """The contract's rules plus tp's own KV rule: tp shards the KV heads first (tp.py kv_head_span), so tp alone
        must divide them or be a multiple of them (ulysses then splits or replicates each rank's share)."""
        errs = super().check(plan, cfg, world_size, require_implemented)
        kv = getattr(cfg, "num_kv_heads", None)
        if kv is not None and plan.tp > 1 and kv % plan.tp and plan.tp % kv:
            errs.append(f"cosmos3: {kv} KV heads can be neither split nor replicated over tp = {plan.tp}")
        return errs

    def __call__(self, instance: Any, mesh: Any) -> Any:
        instance = super().__call__(instance, mesh)
        plan = mesh.plan if hasattr(mesh, "plan") else mesh
        # the model reads its plan itself (no instance-level key override that a patch could delete): every und
        # CacheKey and every GraphKey of the step body names the layout
        instance.parallel_plan_hash = plan.hash()
        instance.graph_cache.parallel_plan_hash = plan.hash()
        sequence_parallel = plan.sp_ulysses * plan.sp_ring > 1 and hasattr(mesh, "axis")
        instance.sequence_parallel = GenSequenceParallel(mesh, instance.cfg.num_kv_heads) if sequence_parallel \
            else None
        attach_tp(instance, mesh)   # tp > 1: this rank's slices of every layer (tp.py); also sets the SP's KV heads
        return instance


@dataclass
class GenSequenceParallel:
    """This rank's share of the gen stream under a mesh with axes sp_ulysses / sp_ring (see the module docstring)."""

    mesh: Any                 # optimized.parallel.mesh.ParallelMesh
    kv_heads: int             # the model's KV heads (before the replication rule)

    @property
    def ulysses(self):
        return self.mesh.axis("sp_ulysses")

    @property
    def ring(self):
        return self.mesh.axis("sp_ring")

    # ---- the und (text) K/V, sharded by heads like the gen K/V
    def shard_und(self, kv: UndKV) -> UndKV:
        """A prompt's cached und K/V [layers, L, K, d] -> this Ulysses rank's head group (the same heads its gen
        K/V hold after the all-to-all). Idempotent: an entry already sharded (same head count) is returned as is."""
        u = self.ulysses
        if u.world_size == 1:
            return kv
        local = max(self.kv_heads, u.world_size) // u.world_size
        if kv.k.shape[2] == local:
            return kv

        def heads(t: torch.Tensor) -> torch.Tensor:
            return sp.kv_heads_for(t, u.world_size).chunk(u.world_size, dim=2)[u.rank].contiguous()
        return UndKV(heads(kv.k), heads(kv.v))

    # ---- the gen stream
    def gen_stream(self, fast: Any, G: torch.Tensor, text_k: torch.Tensor, text_v: torch.Tensor,
                   key_mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   per_layer: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        """Every gen layer and the final norm on this rank's rows of G [B * N, D]; returns the whole normed
        [B * N, D] on every rank. The inputs of the single-device step body (the bucket's shapes say B, T, N):
        text_k / text_v [layers, B, T, K_local, d] (already head-sharded), key_mask [B, 1, 1, T + N], cos / sin
        [B * N, d]; `per_layer(li, whole G)` for traces (gathers every layer, so only when tracing)."""
        B, T, D = text_k.shape[1], text_k.shape[2], G.shape[1]
        N = key_mask.shape[-1] - T
        index, n = sp.sp_index(self.mesh)
        rows = lambda t: sp.shard_sequence(t.view(B, N, -1), n, index, 1)  # noqa: E731 - [B, S, *] local rows
        x = rows(G)
        S = x.shape[1]
        x = x.reshape(B * S, D)
        cos, sin = (rows(t).reshape(B * S, -1) for t in (cos, sin))
        mask = key_mask.reshape(B, T + N)
        gen_mask, _ = sp.pad_to_multiple(mask[:, T:], n, 1)               # SP pad rows are keys nobody attends
        attention = GenAttention(self.mesh, mask[:, :T], gen_mask, fast.attention)
        for li, layer in enumerate(fast.layers):
            x = fast._gen_layer(x, layer["gen"], text_k[li], text_v[li], None, cos, sin, attention=attention)
            if per_layer is not None:
                per_layer(li, self.gather(x, B, S, N))
        x = fast._norm(x, fast.params["gen_norm.weight"])
        return self.gather(x, B, S, N)

    def gather(self, x: torch.Tensor, B: int, S: int, N: int) -> torch.Tensor:
        """This rank's [B * S, D] rows -> the whole [B * N, D] (chunk index = ring rank x ulysses + ulysses rank)."""
        x = x.view(B, S, -1)
        x = torch.cat(self.ulysses.all_gather(x.contiguous()), 1)
        x = torch.cat(self.ring.all_gather(x.contiguous()), 1)
        return x[:, :N].reshape(B * N, -1)


@dataclass
class GenAttention:
    """One gen layer's attention of this rank's query rows over [its sample's text keys | every gen key]."""

    mesh: Any
    text_mask: torch.Tensor       # [B, T] bool: real text keys
    gen_mask: torch.Tensor        # [B, N_sp] bool: real gen keys of the whole (SP-padded) gen sequence
    backend: str = "auto"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tk: torch.Tensor,
                 tv: torch.Tensor) -> torch.Tensor:
        """q [B, S, H, d], k / v [B, S, K, d] (this rank's rows, every head); tk / tv [B, T, K_local, d] (this
        rank's text heads) -> [B, S, H, d]."""
        u, r = self.mesh.axis("sp_ulysses"), self.mesh.axis("sp_ring")
        H = q.shape[2]
        if u.world_size > 1:   # sequence-sharded, every head -> head-sharded, the ring chunk's whole sequence
            q = sp.heads_to_sequence(q, u)
            k = sp.heads_to_sequence(sp.kv_heads_for(k, u.world_size), u)
            v = sp.heads_to_sequence(sp.kv_heads_for(v, u.world_size), u)
        if tk.shape[2] != k.shape[2]:
            raise RuntimeError(f"text K/V hold {tk.shape[2]} heads on this rank, gen K/V {k.shape[2]}: the und "
                               f"cache entry is not sharded for this plan")
        chunks = self.gen_mask.chunk(r.world_size, 1)                     # ring chunk i's gen keys
        if r.world_size == 1:
            keys, values = torch.cat([tk, k], 1).transpose(1, 2), torch.cat([tv, v], 1).transpose(1, 2)
            mask = torch.cat([self.text_mask, chunks[0]], 1)[:, None, None, :]
            o = attend(q.transpose(1, 2), keys, values, key_mask=mask, backend=self.backend).transpose(1, 2)
        else:
            o = self._ring(q, k, v, tk, tv, chunks, r)
        if u.world_size > 1:
            o = sp.sequence_to_heads(o, u)
        assert o.shape[2] == H
        return o

    def _ring(self, q, k, v, tk, tv, chunks, ring) -> torch.Tensor:
        """[text | own gen keys] first, then each other ring rank's gen keys as they come round; exact LSE merge."""
        scale = 1.0 / math.sqrt(q.shape[-1])
        n, d = ring.world_size, k.shape[-1]
        out, lse = sp.attention_lse(q, torch.cat([tk, k], 1), torch.cat([tv, v], 1),
                                    torch.cat([self.text_mask, chunks[ring.rank]], 1), scale)
        kv = torch.cat([k, v], -1)                                         # one message per shift
        for step in range(1, n):
            kv = ring.ring_shift(kv)                                       # now ring rank (rank - step)'s keys
            o, l_ = sp.attention_lse(q, kv[..., :d], kv[..., d:], chunks[(ring.rank - step) % n], scale)
            out, lse = sp.merge_lse(out, lse, o, l_)
        return out
