"""Benchmark: the cosmos3 denoise loop, readable reference vs the engine, in one process on one machine.

Measures (wall clock, best of --repeats):
  - 1 request:  reference `generate` vs engine
  - N requests: N sequential reference runs vs N requests submitted together (batched by the scheduler)
  - und-stream cache: engine with the cache vs with it disabled (recompute the text stream every step)
Prints a table and ratios (higher = engine faster). Not a test: speed is never asserted.

    python tools/bench_loop.py                      # CPU-friendly config
    python tools/bench_loop.py --device cuda --dtype bf16 --variant nano --steps 4 --frames 5
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from tabulate import tabulate

from manifests.cosmos3 import canonical_key_shapes, load_variant
from manifests.cosmos3.sampling import Cosmos3GenerateRequest, UniPCConfig
from optimized import Engine
from parity.weights import random_state_dict
from reference.cosmos3 import generate, load_transformer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bench_config(hidden: int, layers: int):
    """A CPU-sized config of the tiny family (so the bench finishes in a minute on 2 cores)."""
    from dataclasses import replace
    base = load_variant("tiny")
    heads = max(hidden // 32, 2)
    return replace(base, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=max(heads // 2, 1),
                   head_dim=32, intermediate_size=hidden * 3, rope_axes_dim=(6, 5, 5)).validate()


def requests(cfg, n: int, steps: int, text_len: int, frames: int, hw: tuple[int, int]):
    g = torch.Generator().manual_seed(0)
    return [Cosmos3GenerateRequest(
        text_ids=torch.randint(0, cfg.vocab_size, (text_len,), generator=g),
        negative_text_ids=torch.randint(0, cfg.vocab_size, (text_len // 4 + 1,), generator=g),
        latent_frames=frames, latent_height=hw[0], latent_width=hw[1], num_steps=steps, guidance_scale=5.0,
        seed=i, scheduler=UniPCConfig(flow_shift=10.0)) for i in range(n)]


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default=None, help="a manifest variant (default: a CPU-sized tiny-family config)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--text-len", type=int, default=64)
    ap.add_argument("--frames", type=int, default=3, help="latent frames")
    ap.add_argument("--hw", type=int, nargs=2, default=(8, 12), help="latent height width")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=DTYPES, default="fp32")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    cfg = load_variant(args.variant) if args.variant else bench_config(args.hidden, args.layers)
    state = random_state_dict(canonical_key_shapes(cfg), 0)
    dtype = DTYPES[args.dtype]
    ref_model = load_transformer(cfg, state, args.device, dtype)
    reqs = requests(cfg, args.concurrent, args.steps, args.text_len, args.frames, tuple(args.hw))

    def engine(**kw):
        return Engine.from_state_dict(cfg, state, args.device, dtype, weights_version="bench", **kw)

    def run_engine(rs, use_cache=True):
        eng = engine()
        eng.model.use_und_cache = use_cache
        handles = [eng.submit(r) for r in rs]
        eng.run_until_idle()
        return [h.result() for h in handles]

    t_ref1 = timed(lambda: generate(ref_model, reqs[0]), args.repeats)
    t_eng1 = timed(lambda: run_engine(reqs[:1]), args.repeats)
    t_refn = timed(lambda: [generate(ref_model, r) for r in reqs], args.repeats)
    t_engn = timed(lambda: run_engine(reqs), args.repeats)
    t_engn_nocache = timed(lambda: run_engine(reqs, use_cache=False), args.repeats)

    n = args.concurrent
    rows = [
        ["1 request", f"{t_ref1:.3f}", f"{t_eng1:.3f}", f"{t_ref1 / t_eng1:.2f}x"],
        [f"{n} requests (ref sequential, engine batched)", f"{t_refn:.3f}", f"{t_engn:.3f}", f"{t_refn / t_engn:.2f}x"],
        [f"{n} requests, engine und cache off vs on", f"{t_engn_nocache:.3f}", f"{t_engn:.3f}",
         f"{t_engn_nocache / t_engn:.2f}x"],
    ]
    print(f"# cosmos3 denoise loop benchmark  {time.strftime('%Y-%m-%d')}  {platform.processor() or platform.machine()}"
          f"  torch {torch.__version__}  threads {torch.get_num_threads()}  device {args.device}  {args.dtype}")
    print(f"# config: hidden {cfg.hidden_size}, layers {cfg.num_layers}, heads {cfg.num_heads}/{cfg.num_kv_heads}, "
          f"text {args.text_len}, latent {args.frames}x{args.hw[0]}x{args.hw[1]}, steps {args.steps}, CFG on")
    print(tabulate(rows, headers=["workload", "baseline s", "engine s", "ratio"]))


if __name__ == "__main__":
    main()
