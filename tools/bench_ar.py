"""Benchmark: cosmos3 reasoning (AR decode), readable reference vs the engine, in one process.

  - tokens/s at 1 and N concurrent requests for each --new-tokens: the reference recomputes the whole
    sequence per token and runs requests one by one; the engine uses the block KV cache and batched decode
  - mixed workload: M reasoning + M generation requests submitted together to one engine, against the same
    requests run one by one on the engine
Prints ratios (higher = engine faster). Not a test: speed is never asserted.

    python tools/bench_ar.py
    python tools/bench_ar.py --new-tokens 32 128 --concurrent 8
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from tabulate import tabulate

from manifests.cosmos3 import canonical_key_shapes
from manifests.cosmos3.reasoning import ReasonRequest
from manifests.cosmos3.sampling import Cosmos3GenerateRequest, UniPCConfig
from optimized import Engine
from parity.weights import random_state_dict
from reference.cosmos3 import load_transformer
from reference.cosmos3.reasoner import reason
from bench_loop import bench_config  # tools/ is on sys.path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--mixed", type=int, default=4, help="reasoning and generation requests in the mixed run")
    args = ap.parse_args()

    cfg = bench_config(args.hidden, args.layers)
    state = random_state_dict(canonical_key_shapes(cfg), 0)
    ref_model = load_transformer(cfg, state)
    g = torch.Generator().manual_seed(0)

    def reqs(n: int, new: int) -> list[ReasonRequest]:
        return [ReasonRequest(torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g), new,
                              temperature=0.8, top_k=50, seed=i) for i in range(n)]

    def engine() -> Engine:
        return Engine.from_state_dict(cfg, state, weights_version="bench", kv_blocks=4096)

    rows = []
    for new in args.new_tokens:
        for n in (1, args.concurrent):
            rs = reqs(n, new)
            t0 = time.perf_counter()
            for r in rs:
                reason(ref_model, r, keep_logits=False)
            t_ref = time.perf_counter() - t0
            eng = engine()
            t0 = time.perf_counter()
            hs = [eng.submit_reasoning(r) for r in rs]
            eng.run_until_idle()
            t_eng = time.perf_counter() - t0
            toks = sum(len(h.result()["tokens"]) for h in hs)
            rows.append([f"{n} x {new} new tokens", f"{toks / t_ref:.1f}", f"{toks / t_eng:.1f}", f"{t_ref / t_eng:.2f}x"])

    gens = [Cosmos3GenerateRequest(text_ids=torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g),
                                   negative_text_ids=torch.randint(0, cfg.vocab_size, (8,), generator=g),
                                   latent_frames=3, latent_height=8, latent_width=8, num_steps=8,
                                   guidance_scale=5.0, seed=i, scheduler=UniPCConfig()) for i in range(args.mixed)]
    ars = reqs(args.mixed, 32)
    eng = engine()
    t0 = time.perf_counter()
    for r in ars:
        eng.reason(r)
    for q in gens:
        eng.generate(q)
    t_seq = time.perf_counter() - t0
    eng = engine()
    t0 = time.perf_counter()
    hs = [eng.submit_reasoning(r) for r in ars] + [eng.submit(q) for q in gens]
    eng.run_until_idle()
    t_mix = time.perf_counter() - t0
    assert all(h.status == "completed" for h in hs)
    rows.append([f"mixed {args.mixed} reasoning + {args.mixed} generation (s)", f"{t_seq:.2f}", f"{t_mix:.2f}",
                 f"{t_seq / t_mix:.2f}x"])

    print(f"# cosmos3 AR benchmark  {time.strftime('%Y-%m-%d')}  {platform.machine()}  torch {torch.__version__}"
          f"  threads {torch.get_num_threads()}  CPU fp32  hidden {cfg.hidden_size}  layers {cfg.num_layers}"
          f"  prompt {args.prompt_len}")
    print(tabulate(rows, headers=["workload", "reference tok/s | one-by-one", "engine tok/s | co-scheduled",
                                  "ratio"]))


if __name__ == "__main__":
    main()
