#!/usr/bin/env python
"""Benchmark: Wan VAE decode, reference (whole clip) vs optimized (chunked loop), time and peak memory, in one run.

    python tools/bench_vae.py                                   # tiny-2.2, 13 latent frames (49 video frames), CPU
    python tools/bench_vae.py --variant wan2.2 --frames 6 --hw 8 8 --device cuda --dtype bf16

Each side runs in a fresh subprocess (peak memory is then that process's: ru_maxrss growth on CPU,
torch.cuda.max_memory_allocated on CUDA). Random weights; the clip needs several temporal chunks. Prints
the ratios reference / optimized (> 1 = optimized faster / smaller) and the rel L2 between the two outputs.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def one_side(args) -> dict:
    from manifests.wan import canonical_key_shapes, load_variant
    from parity.weights import random_state_dict

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cfg = load_variant(args.variant)
    state = random_state_dict(canonical_key_shapes(cfg), 0)
    z = torch.randn(1, cfg.z_dim, args.frames, *args.hw, generator=torch.Generator().manual_seed(1))
    z = z.to(args.device, dtype)
    if args.side == "reference":
        import reference.wan as ref
        model = ref.load_vae(cfg, state, args.device, dtype)
        run = lambda: model.decode(z)
    else:
        import optimized.models.wan as opt
        from optimized.runtime.scheduler import run_request
        fast = opt.load_fast_vae(cfg, state, args.device, dtype)
        kernel = opt.WanVaeDecodeKernel(fast)
        run = lambda: run_request(kernel, opt.DecodeRequest("bench", z, args.chunk), memory_budget_bytes=1 << 40)
    del state
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.no_grad():
        t = time.perf_counter()
        out = run()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    torch.save(out.float().cpu(), args.save)
    return {"seconds": dt, "peak_bytes": peak, "shape": list(out.shape)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="tiny-2.2")
    ap.add_argument("--frames", type=int, default=13, help="latent frames (video frames = 4*(frames-1)+1)")
    ap.add_argument("--hw", type=int, nargs=2, default=[8, 8], help="latent height width")
    ap.add_argument("--chunk", type=int, default=1, help="latent frames per optimized step")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--side", choices=["reference", "optimized"], help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        print(json.dumps(one_side(args)))
        return 0
    import tempfile
    res, outs = {}, {}
    with tempfile.TemporaryDirectory() as d:
        for side in ("reference", "optimized"):
            cmd = [sys.executable, __file__, "--side", side, "--save", f"{d}/{side}.pt"] + sys.argv[1:]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            res[side] = json.loads(proc.stdout.strip().splitlines()[-1])
            outs[side] = torch.load(f"{d}/{side}.pt")
    r, o = res["reference"], res["optimized"]
    rel = ((outs["optimized"] - outs["reference"]).norm() / outs["reference"].norm()).item()
    print(f"wan VAE decode {args.variant} {args.dtype} {args.device}: latents [{args.frames}, {args.hw[0]}, "
          f"{args.hw[1]}] -> video {r['shape']}, optimized chunk = {args.chunk} latent frame(s)")
    for name, x in res.items():
        print(f"  {name:10s} {x['seconds']:8.3f} s   peak {x['peak_bytes'] / 2**20:9.1f} MiB")
    print(f"  ratio ref/opt: time {r['seconds'] / o['seconds']:.2f}x, peak memory "
          f"{r['peak_bytes'] / max(o['peak_bytes'], 1):.2f}x; rel L2 opt vs ref {rel:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
