"""Communication of each parallel plan: bytes sent per rank per layer and per denoising step, analytic at released
sizes, checked against the bytes the collectives actually count at tiny sizes on gloo ranks, plus the measured step
time of the tiny layer stack per plan (CPU gloo: latency-bound, printed only).

    python tools/bench_parallel.py                 # released-size table + tiny-size check and timings
    python tools/bench_parallel.py --no-measure    # the analytic table only

Model of one DiT forward on one rank (b = guided rows on this rank: 2 / cfgp; elem = bf16 2 bytes at released
sizes; S = attention tokens padded to a multiple of n_sp = ulysses x ring; t = tp):
    ulysses  per attention: q, k, v to sequence and out back, each sending (u-1)/u of b*S/n_sp*heads*D/t rows
             (KV heads replicated up to u*t when fewer: the GQA rule), + the key mask gather (u-1)*b*S/n_sp bytes
             when S was padded
    ring     per attention: (r-1) shifts of K and V, b*S/r*kv_heads/(u t)*D each, + the mask when padded
    tp       per block: one SUM all-reduce of [b, S/n_sp, hidden] per row-parallel output (wan 3: self, cross,
             FFN; cosmos3 2: attention, MLP), 2(t-1)/t of it each (wan's across-heads q / k RMS norms also
             all-reduce one fp32 sum of squares per row, 4 per block + text rows: < 0.1% of these, not modelled)
    per step the SP output gather of [b, S/n_sp, patch out] (ulysses then ring axis) and the CFG gather of the
             predictions (cfgp-1 padded shares of the latent). Cross-attention (wan's text) moves nothing.
Counted bytes are what AxisGroup logs (the direct-exchange payload; ring / tree algorithms inside NCCL move more).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from optimized.parallel.plan import ParallelPlan  # noqa: E402

PLANS = ("ulysses2", "ulysses4", "ring2", "cfgp2", "tp2", "cfgp2,ulysses2", "ulysses2,ring2")


@dataclass(frozen=True)
class Workload:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int              # attention sequence (video tokens; + text for cosmos3's joint attention)
    patch_out: int           # per-token output width of the final projection
    latent_numel: int        # one prediction (what the CFG gather moves per row)
    tp_reductions: int       # row-parallel outputs per block
    elem: int = 2
    config: object = None    # the model config the family contract checks the plan against


def wan_workload(variant: str, frames: int, height: int, width: int) -> Workload:
    from manifests.wan import load_model_variant
    cfg = load_model_variant(variant)
    d, v = cfg.dit, cfg.vae
    T, h, w = (frames - 1) // v.temporal_compression + 1, height // v.spatial_compression, width // v.spatial_compression
    pt, ph, pw = d.patch_size
    tokens = (T // pt) * (h // ph) * (w // pw)
    return Workload(f"{variant} {height}p {frames}f", d.num_layers, d.hidden_size, d.num_heads, d.num_heads,
                    d.head_dim, tokens, d.out_channels * pt * ph * pw, d.out_channels * T * h * w, 3, config=cfg)


def cosmos3_workload(variant: str, frames: int, height: int, width: int, text: int = 256) -> Workload:
    from manifests.cosmos3 import load_variant
    cfg = load_variant(variant)
    T, h, w = (frames - 1) // 4 + 1, height // 16, width // 16
    p = cfg.patch_size
    gen = T * math.ceil(h / p) * math.ceil(w / p)
    return Workload(f"cosmos3 {variant} {height}p {frames}f (+{text} text)", cfg.num_layers, cfg.hidden_size,
                    cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, gen + text, cfg.patch_latent_dim,
                    cfg.latent_channels * T * h * w, 2, config=cfg)


def analytic(plan: ParallelPlan, wl: Workload, rows: int = 2) -> dict[str, float]:
    """Bytes this rank sends: per layer (ulysses, ring, tp) and per step (layers + gathers)."""
    u, r, t, c = plan.sp_ulysses, plan.sp_ring, plan.tp, plan.cfgp
    b = math.ceil(rows / c)
    n_sp = u * r
    S = math.ceil(wl.tokens / n_sp) * n_sp
    s_loc, padded = S // n_sp, S != wl.tokens
    kv = wl.kv_heads if wl.kv_heads % (u * t) == 0 else u * t       # GQA: replicated up to u * t when fewer
    e, D = wl.elem, wl.head_dim
    uly = 0.0
    if u > 1:
        uly = b * s_loc * D * (2 * wl.heads + 2 * kv) // t * e * (u - 1) / u + (b * s_loc * (u - 1) if padded else 0)
    ring = 0.0
    if r > 1:
        ring = (r - 1) * (2 * b * (S // r) * (kv // (u * t)) * D * e + (b * (S // r) if padded else 0))
    tp = wl.tp_reductions * 2 * (t - 1) / t * b * s_loc * wl.hidden * e if t > 1 else 0.0
    layer = uly + ring + tp
    gather = b * s_loc * wl.patch_out * e * ((u - 1) + u * (r - 1))
    cfg = (c - 1) * b * wl.latent_numel * e if c > 1 else 0.0
    return {"ulysses": uly, "ring": ring, "tp": tp, "layer": layer, "step": wl.layers * layer + gather + cfg}


# ---- counted at tiny sizes ---------------------------------------------------------------------------------------

TINY = Workload("tiny", layers=2, hidden=32, heads=4, kv_heads=4, head_dim=8, tokens=26, patch_out=8,
                latent_numel=8 * 26, tp_reductions=3, elem=4)


def _tiny_worker(group, plan_name: str, steps: int) -> dict:
    """The layer stack of TINY with the real primitives: self-attention through sp_attention, cross-attention on a
    replicated text, TP row-parallel reductions, the SP output gather and the CFG gather; bytes counted per call."""
    from optimized.parallel.cfg_parallel import CFGParallel
    from optimized.parallel.mesh import build_mesh
    from optimized.parallel.sp import key_mask_shard, sp_attention, sp_index

    plan = ParallelPlan.parse(plan_name)
    mesh = build_mesh(plan)
    wl, rows = TINY, 2
    b = math.ceil(rows / plan.cfgp)
    index, n = sp_index(mesh)
    s_loc = math.ceil(wl.tokens / n)
    padded = s_loc * n != wl.tokens
    mask = key_mask_shard(b, wl.tokens, n, index) if padded else None
    heads = wl.heads // plan.tp
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, s_loc, heads, wl.head_dim, generator=g)
    text = torch.randn(b, 6, heads, wl.head_dim, generator=g)
    hidden = torch.randn(b, s_loc, wl.hidden, generator=g)
    out = torch.randn(b, s_loc, wl.patch_out, generator=g)
    log: list = []
    per_step = []
    for step in range(steps):
        mesh.set_log(log if step == 0 else None)
        start = time.perf_counter()
        for layer in range(wl.layers):
            for grp in mesh.groups.values():
                grp.tag = f"layer{layer}"
            sp_attention(q, q, q, mask, mesh)
            sp_attention(q, text, text, None, mesh, kv_replicated=True)
            for _ in range(wl.tp_reductions):
                mesh.axis("tp").all_reduce_sum(hidden.clone())
        for grp in mesh.groups.values():
            grp.tag = "step"
        full = torch.cat(mesh.axis("sp_ulysses").all_gather(out), 1)
        torch.cat(mesh.axis("sp_ring").all_gather(full), 1)
        pred = torch.randn(1, wl.latent_numel)
        CFGParallel(mesh.axis("cfgp")).run(lambda xs: [pred.clone() for _ in xs], [0], [1])
        per_step.append(time.perf_counter() - start)
    layer0 = sum(x[3] for x in log if x[2] == "layer0")
    return {"layer": layer0, "step": sum(x[3] for x in log), "seconds": sorted(per_step)[len(per_step) // 2]}


def measure(plans: tuple[str, ...], steps: int) -> list[tuple[str, float, float, float, float, float]]:
    from optimized.parallel.launch import run_ranks

    rows = []
    for name in plans:
        plan = ParallelPlan.parse(name)
        res = run_ranks(_tiny_worker, plan.world_size, (name, steps), timeout_s=180)
        want = analytic(plan, TINY)
        counted_layer = max(r["layer"] for r in res)
        counted_step = max(r["step"] for r in res)
        rows.append((name, want["layer"], counted_layer, want["step"], counted_step,
                     max(r["seconds"] for r in res)))
    return rows


def _mib(x: float) -> str:
    return f"{x / 2**20:10.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-measure", action="store_true")
    ap.add_argument("--plans", default=",".join(p.replace(",", "+") for p in PLANS))
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    plans = tuple(p.replace("+", ",") for p in args.plans.split(","))
    workloads = [wan_workload("wan2.1-t2v-1.3b", 81, 480, 832), wan_workload("wan2.1-t2v-14b", 81, 720, 1280),
                 cosmos3_workload("nano", 189, 720, 1280)]
    from optimized.models.cosmos3 import PARALLELISM as COSMOS3
    from optimized.models.wan import PARALLELISM as WAN
    print("bytes sent per rank (MiB, bf16, one guided request: 2 CFG rows), analytic; each plan checked against the "
          "family contract at that size")
    for wl in workloads:
        contract = COSMOS3 if wl.name.startswith("cosmos3") else WAN
        print(f"\n{wl.name}: {wl.tokens} tokens, {wl.layers} layers, {wl.heads} heads / {wl.kv_heads} KV")
        print(f"  {'plan':16s} {'ulysses/layer':>13s} {'ring/layer':>10s} {'tp/layer':>10s} {'per layer':>10s} "
              f"{'per step':>10s}")
        for name in plans:
            plan = ParallelPlan.parse(name)
            errs = contract.check(plan, wl.config, require_implemented=False)
            a = analytic(plan, wl)
            print(f"  {name:16s} {_mib(a['ulysses']):>13s} {_mib(a['ring'])} {_mib(a['tp'])} {_mib(a['layer'])} "
                  f"{_mib(a['step'])}" + (f"   REFUSED: {errs[0]}" if errs else ""))
    if args.no_measure:
        return 0
    print(f"\ntiny layer stack on gloo ({TINY.tokens} tokens, {TINY.layers} layers, fp32): analytic vs counted bytes "
          f"per rank, median step time over {args.steps}")
    print(f"  {'plan':16s} {'layer an.':>10s} {'counted':>10s} {'step an.':>10s} {'counted':>10s} {'step ms':>9s}")
    ok = True
    for name, la, lc, sa, sc, sec in measure(plans, args.steps):
        match = abs(la - lc) < 1 and abs(sa - sc) < 1
        ok &= match
        print(f"  {name:16s} {la:10.0f} {lc:10.0f} {sa:10.0f} {sc:10.0f} {sec * 1e3:9.2f}" + ("" if match else "  MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
