"""Group rollout: K SDE samples of one prompt through the engine (one batch, the prompt computed once) vs the same K
through a plain per-sample loop (each sample alone, the prompt recomputed every time: what a vendored trainer-side
sampler does). Prints wall times and the ratio; checks nothing.

    python tools/bench_rollout.py                       # cosmos3 tiny and wan tiny-2.1-t2v, K = 8 and 24, CPU
    python tools/bench_rollout.py --family wan --variant wan2.1-t2v-1.3b --device cuda --dtype bf16 --steps 10
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

import optimized
from manifests.solvers import SDEConfig
from optimized.training.records import CaptureSpec
from optimized.training.recompute import cache_use
from optimized.training.rollout import group, rollout


def cosmos3_setup(variant: str, device: str, dtype: torch.dtype, steps: int):
    from manifests.cosmos3.sampling import Cosmos3GenerateRequest, UniPCConfig
    engine = optimized.Engine.from_variant(variant, seed=0, device=device, dtype=dtype, family="cosmos3", max_batch=64)
    cfg = engine.model.cfg
    g = torch.Generator().manual_seed(0)
    req = Cosmos3GenerateRequest(text_ids=torch.randint(0, cfg.vocab_size, (64,), generator=g),
                                 negative_text_ids=torch.randint(0, cfg.vocab_size, (16,), generator=g),
                                 latent_frames=3, latent_height=8, latent_width=8, num_steps=steps, guidance_scale=5.0,
                                 seed=0, scheduler=UniPCConfig(flow_shift=3.0), sde=SDEConfig(0.7))
    return engine, req


def wan_setup(variant: str, device: str, dtype: torch.dtype, steps: int):
    from manifests.wan.sampling import WanGenerateRequest
    engine = optimized.Engine.from_variant(variant, seed=0, device=device, dtype=dtype, family="wan", max_batch=64)
    cfg = engine.model.cfg
    g = torch.Generator().manual_seed(0)
    vocab, n = cfg.text_encoder.vocab_size, cfg.max_sequence_length
    s = cfg.vae.spatial_compression * cfg.dit.patch_size[1]
    req = WanGenerateRequest(text_ids=torch.randint(1, vocab, (min(64, n),), generator=g), num_frames=5, height=2 * s,
                             width=2 * s, num_steps=steps, guidance_scale=5.0,
                             negative_text_ids=torch.randint(1, vocab, (min(16, n),), generator=g), seed=0,
                             solver="euler", sde=SDEConfig(0.7))
    return engine, req


SETUPS = {"cosmos3": (cosmos3_setup, "tiny"), "wan": (wan_setup, "tiny-2.1-t2v")}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench(family: str, variant: str, device: str, dtype: torch.dtype, steps: int, ks: list[int]) -> None:
    setup, default = SETUPS[family]
    engine, req = setup(variant or default, device, dtype, steps)
    rollout(engine, group(req, 2))  # warm-up
    for k in ks:
        requests = group(replace(req, seed=1000), k)
        sync(device)
        t0 = time.perf_counter()
        rollout(engine, requests, CaptureSpec())
        sync(device)
        grouped = time.perf_counter() - t0
        t0 = time.perf_counter()
        with cache_use(engine.model, False):  # per sample, prompt recomputed: the plain trainer-side loop
            for r in requests:
                rollout(engine, [r], CaptureSpec())
        sync(device)
        plain = time.perf_counter() - t0
        print(f"{family:8s} {variant or default:18s} K={k:3d}  engine group {grouped * 1e3:9.1f} ms   "
              f"per-sample loop {plain * 1e3:9.1f} ms   speed-up x{plain / grouped:5.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(SETUPS), action="append")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--k", type=int, action="append")
    a = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    for fam in a.family or sorted(SETUPS):
        bench(fam, a.variant, a.device, dtype, a.steps, a.k or [8, 24])


if __name__ == "__main__":
    main()
