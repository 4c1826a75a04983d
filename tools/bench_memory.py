"""Benchmark: peak memory and wall time of one wan video per offload mode (optimized/runtime/memory.py).

Modes: none (every component resident), idle (one component on the device at a time, diffusers
`enable_model_cpu_offload`), blockwise (also the DiT by blocks, one running + prefetch ahead), blockwise-budget (the
same under the smallest weight budget the model runs in: its largest block-less component, or the DiT's non-block
weights + 2 blocks). Each mode runs in its own process (a fresh peak RSS), one warm-up video then `--rounds` timed.

Printed per mode:
  weights peak    the plane's own accounting: the most weight bytes on the device at once
  cuda peak       torch.cuda.max_memory_allocated over the timed videos (weights + activations; GPU only)
  rss peak        the process's peak resident set (CPU: "device" and "host" are the same RAM, so offload moves
                  bytes between two storages of one memory and RSS does not fall; it is shown to say so)
  wall ratio      median seconds of a video / the resident mode's (the price of the copies)
Outputs are checked bitwise equal to the resident mode's. Not a test: nothing is asserted about speed.

    python tools/bench_memory.py
    python tools/bench_memory.py --layers 16 --size 64x64 --frames 9 --steps 4 --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

MODES = ("none", "idle", "blockwise", "blockwise-budget")


def build(args, mode: str, budget: int | None = None):
    from manifests.wan.model import load_model_variant
    from optimized import Engine
    from optimized.models.wan.instance import WanModelInstance

    cfg = load_model_variant(args.variant)
    if args.layers:
        cfg = dataclasses.replace(cfg, dit=dataclasses.replace(cfg.dit, num_layers=args.layers))
    weights = WanModelInstance.random_weights(cfg, 0)
    offload = "blockwise" if mode == "blockwise-budget" else mode
    return Engine.from_weights(cfg, weights, device=args.device, offload=offload, offload_budget_bytes=budget)


def smallest_budget(engine) -> int:
    """The least weight bytes the model runs blockwise in (with one block prefetched)."""
    need = 0
    for name, c in engine.memory.components.items():
        if c.spec.blocks:
            blocks = sorted((sum(s.nbytes for s in b) for b in engine.memory._block_slots(
                c, getattr(c.spec.obj, c.spec.blocks))), reverse=True)
            fixed = c.nbytes - sum(blocks)
            need = max(need, fixed + sum(blocks[:2]))
        else:
            need = max(need, c.nbytes)
    return need


def request(args):
    from manifests.wan.sampling import WanGenerateRequest
    w, h = (int(v) for v in args.size.split("x"))
    return WanGenerateRequest(text_ids=torch.arange(1, 9), negative_text_ids=torch.arange(1, 4),
                              num_frames=args.frames, height=h, width=w, num_steps=args.steps, guidance_scale=5.0,
                              seed=0)


def one_mode(args) -> dict:
    budget = None
    if args.mode == "blockwise-budget":
        budget = smallest_budget(build(args, "none"))
    engine = build(args, args.mode, budget)
    cuda = args.device.startswith("cuda")
    engine.generate_video(request(args))   # warm-up: tables, kernels
    engine.memory.reset_peak()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, digest = [], None
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        result = engine.generate_video(request(args))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        digest = hashlib.sha256(result.frames.numpy().tobytes() +
                                result.latents["vision"].float().cpu().numpy().tobytes()).hexdigest()[:16]
    s = engine.memory.summary()
    return {"mode": args.mode, "budget": budget, "weights_total": sum(c["bytes"] for c in s["components"].values()),
            "weights_peak": s["weights_peak_device_bytes"],
            "cuda_peak": torch.cuda.max_memory_allocated() if cuda else None,
            "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "seconds": statistics.median(times), "digest": digest,
            "window": s["components"].get("transformer", {}).get("window")}


def mib(n) -> str:
    return "-" if n is None else f"{n / (1 << 20):.2f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="tiny-2.1-t2v")
    p.add_argument("--layers", type=int, default=8, help="DiT blocks (0: the variant's)")
    p.add_argument("--size", default="32x32", help="WIDTHxHEIGHT")
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)   # the child process: one mode, JSON out
    args = p.parse_args()
    if args.mode:
        print(json.dumps(one_mode(args)))
        return
    rows = []
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode] + [a for a in sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(f"{mode}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            sys.exit(3)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(f"wan {args.variant} (DiT {args.layers or 'as released'} blocks), {args.frames} frames {args.size}, "
          f"{args.steps} steps, device {args.device}; weights {mib(base['weights_total'])}")
    print(f"{'mode':<18}{'budget':>12}{'weights peak':>14}{'cuda peak':>13}{'rss peak':>13}{'wall ratio':>12}"
          f"{'window':>8}  bitwise")
    for r in rows:
        print(f"{r['mode']:<18}{mib(r['budget']):>12}{mib(r['weights_peak']):>14}{mib(r['cuda_peak']):>13}"
              f"{mib(r['rss_peak']):>13}{r['seconds'] / base['seconds']:>12.2f}{str(r['window'] or '-'):>8}  "
              f"{'yes' if r['digest'] == base['digest'] else 'NO'}")
    if any(r["digest"] != base["digest"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
