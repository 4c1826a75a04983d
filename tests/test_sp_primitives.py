"""Sequence-parallel attention primitives (optimized/parallel/sp.py) against single-process SDPA.

In-process: log-sum-exp merge, padding masks, GQA replication. On gloo ranks (`dist`): Ulysses (all-to-all over
heads), ring attention and ulysses x ring equal SDPA on the whole sequence within 1e-6 fp32 for uneven sequence
lengths, key masks, GQA and a replicated (cross-attention) context; negative controls (planted by each rank through
parity/parallel_faults.py, the one fault mechanism): heads permuted in the all-to-all, ring merge without the
max-shift, a TP column shard from the wrong slice - all must fail. In-process: the patches restore the seams.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from optimized.parallel.launch import run_ranks
from optimized.parallel.mesh import build_mesh
from optimized.parallel.plan import ParallelPlan
from optimized.parallel import sp, tp as tp_mod
from optimized.parallel.sp import (attention_lse, key_mask_shard, kv_heads_for, merge_lse, shard_sequence,
                                   sp_attention, sp_index)
from optimized.parallel.tp import column_parallel, row_parallel, row_shard
from parity.parallel_faults import planted

TOL = 1e-6
# at ~200-sigma logits fp32 SDPA itself is ~1e-5 from an fp64 softmax: that case is held to 5e-5
TOLS = {"mqa_large_logits": 5e-5}


def sdpa(q, k, v, mask=None, scale=None):
    """The single-process reference: torch SDPA on [B, S, H, D] with GQA expanded and a bool key mask."""
    H = q.shape[2]
    k, v = k.repeat_interleave(H // k.shape[2], 2), v.repeat_interleave(H // v.shape[2], 2)
    m = None if mask is None else mask[:, None, None, :]
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m,
                                          scale=scale).transpose(1, 2)


def make_case(seed: int, B=2, S=13, Sk=None, H=4, Hkv=4, D=8, logit_scale=1.0, masked=False):
    g = torch.Generator().manual_seed(seed)
    Sk = Sk or S
    q = torch.randn(B, S, H, D, generator=g) * logit_scale
    k, v = torch.randn(B, Sk, Hkv, D, generator=g), torch.randn(B, Sk, Hkv, D, generator=g)
    mask = (torch.rand(B, Sk, generator=g) > 0.3) if masked else None
    if mask is not None:
        mask[:, 0] = True                     # every query keeps at least one key
    return q, k, v, mask


# ---- in-process --------------------------------------------------------------------------------------------------

def test_lse_merge_is_exact_over_key_splits():
    q, k, v, mask = make_case(0, S=9, Sk=11, H=4, Hkv=2, masked=True)
    want = sdpa(q, k, v, mask)
    scale = 1 / math.sqrt(q.shape[-1])
    full, _ = attention_lse(q, k, v, mask, scale)
    assert (full - want).abs().max() < TOL
    parts = [attention_lse(q, k[:, a:b], v[:, a:b], mask[:, a:b], scale) for a, b in ((0, 4), (4, 5), (5, 11))]
    o, lse = parts[0]
    for o2, l2 in parts[1:]:
        o, lse = merge_lse(o, lse, o2, l2)
    assert (o - want).abs().max() < TOL
    empty = torch.zeros_like(mask[:, :4])      # a block with every key masked merges as nothing
    o, lse = merge_lse(o, lse, *attention_lse(q, k[:, :4], v[:, :4], empty, scale))
    assert (o - want).abs().max() < TOL and torch.isfinite(o).all()


def test_fault_patches_restore_their_seams():
    seams = (sp.split_head_groups, sp.attention_lse, tp_mod.column_shard)
    for name in ("ulysses-heads-permuted", "ring-no-max-shift", "tp-column-wrong-slice"):
        with planted(name):
            assert (sp.split_head_groups, sp.attention_lse, tp_mod.column_shard) != seams, name
        assert (sp.split_head_groups, sp.attention_lse, tp_mod.column_shard) == seams, name
    with pytest.raises(KeyError, match="unknown parallel fault"):
        planted("no-such-fault")


def test_padding_and_gqa_rules():
    assert shard_sequence(torch.arange(13).view(1, 13), 4, 3).tolist() == [[12, 0, 0, 0]]
    assert key_mask_shard(1, 13, 4, 3).tolist() == [[True, False, False, False]]
    k = torch.arange(2).view(1, 1, 2, 1).float()
    assert kv_heads_for(k, 4).flatten().tolist() == [0, 0, 1, 1]     # each KV head replicated 4 / 2 times
    assert kv_heads_for(k, 2) is k
    with pytest.raises(ValueError, match="neither split nor replicated"):
        kv_heads_for(torch.zeros(1, 1, 3, 1), 2)


# ---- on gloo ranks -----------------------------------------------------------------------------------------------

CASES = {  # name -> make_case kwargs (+ kv_replicated)
    "mha_uneven": dict(S=13),
    "gqa_masked": dict(S=10, H=4, Hkv=2, masked=True),
    "mqa_large_logits": dict(S=7, H=4, Hkv=1, logit_scale=200.0),
    "cross_replicated": dict(S=11, Sk=5, H=4, Hkv=4, kv_replicated=True),
}


def _case_errors(plan_name: str) -> dict:
    """Every case on this rank: max |sp_attention - SDPA| over this rank's real query rows."""
    mesh = build_mesh(ParallelPlan.parse(plan_name))
    index, n = sp_index(mesh)
    out = {}
    for seed, (name, kw) in enumerate(sorted(CASES.items())):
        kw = dict(kw)
        replicated = kw.pop("kv_replicated", False)
        q, k, v, mask = make_case(seed, **kw)
        full_mask = torch.ones(k.shape[:2], dtype=torch.bool) if mask is None else mask
        # the reference is SDPA on the whole sequence, evaluated in fp64 (fp32 SDPA is itself ~3e-7 from it)
        want = shard_sequence(sdpa(q.double(), k.double(), v.double(), mask), n, index)
        ql = shard_sequence(q, n, index)
        if replicated:
            kl, vl, ml = k, v, mask
        else:  # padded key rows are masked out
            kl, vl = shard_sequence(k, n, index), shard_sequence(v, n, index)
            ml = shard_sequence(full_mask, n, index)
        got = sp_attention(ql, kl, vl, ml, mesh, kv_replicated=replicated)
        rows = min(ql.shape[1], max(0, q.shape[1] - index * ql.shape[1]))   # this rank's real (unpadded) rows
        err = (got[:, :rows].double() - want[:, :rows]).abs().max() if rows else torch.tensor(0.0)
        out[name] = float(err) if torch.isfinite(err) else float("inf")
    out["bytes_sent"] = mesh.bytes_sent()
    return out


def _tp_errors(plan_name: str) -> dict:
    """A tensor-parallel MLP (column then row split, sliced from the whole weights) vs the whole MLP."""
    mesh = build_mesh(ParallelPlan.parse(plan_name))
    tp = mesh.axis("tp")
    g = torch.Generator().manual_seed(3)
    x, w1, b1 = torch.randn(2, 5, 16, generator=g), torch.randn(32, 16, generator=g), torch.randn(32, generator=g)
    w2, b2 = torch.randn(16, 32, generator=g), torch.randn(16, generator=g)
    want = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    h = column_parallel(x, tp_mod.column_shard(w1, tp), tp_mod.column_shard(b1, tp))
    got = row_parallel(F.gelu(h), row_shard(w2, tp), b2, tp)
    return {"tp_mlp": float((got - want).abs().max() / want.abs().max())}


def _sp_worker(group, runs: list) -> list[dict]:
    out = []
    for plan, fault in runs:
        with planted(fault):   # this rank's own patch (parity/parallel_faults.py)
            out.append((_tp_errors if plan.startswith("tp") else _case_errors)(plan))
    return out


def _errors(runs: list[tuple[str, str | None]], ws: int) -> list[dict[str, float]]:
    """One spawn of `ws` ranks running every (plan, fault); per run, the worst error over ranks per case."""
    res = run_ranks(_sp_worker, ws, (runs,), timeout_s=120)
    return [{name: max(r[i][name] for r in res) for name in res[0][i] if name != "bytes_sent"}
            for i in range(len(runs))]


def exact(errs: dict[str, float]) -> bool:
    return all(e < TOLS.get(name, TOL) for name, e in errs.items())


@pytest.mark.dist
def test_ulysses2_and_ring2_equal_sdpa_and_controls_fail():
    """One spawn of 2 ranks: both plans, then the negative controls on the same sizes."""
    good_u, good_r, bad_u, bad_r, good_tp, bad_tp = _errors(
        [("ulysses2", None), ("ring2", None), ("ulysses2", "ulysses-heads-permuted"), ("ring2", "ring-no-max-shift"),
         ("tp2", None), ("tp2", "tp-column-wrong-slice")], 2)
    assert good_tp["tp_mlp"] < TOL and bad_tp["tp_mlp"] > 1e-2, (good_tp, bad_tp)   # a TP shard from the wrong slice
    assert exact(good_u), good_u
    assert exact(good_r), good_r
    assert bad_u["mha_uneven"] > 1e-2 and bad_u["gqa_masked"] > 1e-2, bad_u
    assert bad_r["mqa_large_logits"] > 1e-2, bad_r   # exp of ~200-sigma logits overflows without the running max


@pytest.mark.dist
@pytest.mark.slow
def test_four_ranks_equal_sdpa_and_controls_fail():
    runs = [("ulysses4", None), ("ring4", None), ("ulysses2,ring2", None), ("ulysses2,ring2", "ulysses-heads-permuted"),
            ("ring4", "ring-no-max-shift")]
    *good, bad_u, bad_r = _errors(runs, 4)
    for (plan, _), errs in zip(runs, good):
        assert exact(errs), (plan, errs)
    assert bad_u["mha_uneven"] > 1e-2, bad_u
    assert bad_r["mqa_large_logits"] > 1e-2, bad_r
