"""Where the accelerated step's time goes (issue 21): engine exact vs step caches on one model, one process.

    python tools/profile_accel.py [--model golden/trained/wan_shapes] [--requests 2] [--repeats 3]
                                  [--accel SPEC ...] [--diffusers] [--graph eager|compile] [--profile SPEC]
                                  [--steps N]

Rows (default: tools/bench_accel.py ACCELS; --accel adds / replaces specs): wall seconds for the request set (best
of --repeats, the repeats interleaved round-robin over the rows so a load change on a shared machine hits every row
alike), DiT block-forwards executed (rows x blocks, counted at WanDiTFast._block_forward), the block-forwards the
AccelDecision rows claim (blocks_computed), seconds in the DiT step (guided_velocities) and per executed
block-forward, and the worst PSNR of the frames vs the engine's exact frames. --diffusers adds diffusers' uncached
WanPipeline (the bench's baseline) as a row. --profile SPEC prints torch.profiler's top ops for that row.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.bench_accel import ACCELS, IdsTokenizer, diffusers_clips, psnr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=ROOT / "golden" / "trained" / "wan_shapes")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--accel", action="append", default=None, help="an accel spec row (repeatable)")
    ap.add_argument("--diffusers", action="store_true")
    ap.add_argument("--steps", type=int, default=None,
                    help="denoising steps (default: the evaluation's, parity.quality.evaluate.STEPS)")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--graph", default="eager", choices=("eager", "compile"),
                    help="the engine DiT's graph mode (configure_graph): the exact stack and, since issue 21, the "
                         "accelerated step's block segments run in it")
    a = ap.parse_args(argv)

    from optimized import Engine
    from optimized.models.wan import denoise, transformer
    from parity.quality import HELD_OUT
    from parity.quality.evaluate import FRAMES, GUIDANCE, SIZE, STEPS
    steps = a.steps or STEPS

    engine = Engine.from_checkpoint(a.model)
    engine.model.configure_graph(a.graph)
    reqs = [(r.caption, r.seed) for r in list(HELD_OUT)[:a.requests]]
    counts = {"blocks": 0, "dit_s": 0.0}
    decisions: list = []
    orig_block = transformer.WanDiTFast._block_forward
    orig_gv = denoise.WanDenoiseLoop.guided_velocities
    orig_cf = denoise.cached_forward

    def block(self, w, x, *args, **kw):
        counts["blocks"] += x.shape[0]
        return orig_block(self, w, x, *args, **kw)

    def gv(self, *args, **kw):
        t0 = time.perf_counter()
        try:
            return orig_gv(self, *args, **kw)
        finally:
            counts["dit_s"] += time.perf_counter() - t0

    def cf(*args, **kw):
        out, decs = orig_cf(*args, **kw)
        decisions.extend(decs)
        return out, decs

    if a.graph == "eager":     # a counter inside a compiled graph would be a guard (a recompile per call)
        transformer.WanDiTFast._block_forward = block
    denoise.WanDenoiseLoop.guided_velocities = gv
    denoise.cached_forward = cf

    def run_engine(accel):
        decisions.clear()
        clips = []
        for cap, seed in reqs:
            r = engine.generate(prompt=cap, negative_prompt="", num_frames=FRAMES, height=SIZE[0], width=SIZE[1],
                                num_steps=steps, guidance_scale=GUIDANCE, seed=seed,
                                **({"accel": accel} if accel else {}))
            clips.append(np.asarray(r.frames))
        return clips, list(decisions)

    run_diffusers = None
    if a.diffusers:
        import shutil
        import tempfile

        import diffusers

        from converters.export import export_diffusers
        from manifests.checkpoint import read_checkpoint
        from reference.wan.processor import WanProcessor
        tmp = Path(tempfile.mkdtemp(prefix="profile_accel-"))
        ckpt = read_checkpoint(a.model)
        cfg = ckpt.typed_config()
        export_diffusers(a.model, tmp / "diffusers")
        pipe = diffusers.WanPipeline.from_pretrained(tmp / "diffusers", tokenizer=None, torch_dtype=torch.float32)
        shutil.rmtree(tmp, ignore_errors=True)
        pipe.tokenizer = IdsTokenizer(WanProcessor(ckpt.assets["tokenizer"], cfg.max_sequence_length))
        pipe.set_progress_bar_config(disable=True)

        def run_diffusers(_):
            return diffusers_clips(pipe, reqs, SIZE, FRAMES, steps, GUIDANCE, cfg.max_sequence_length), []

    specs = a.accel if a.accel else list(ACCELS.values())
    rows = [("exact", None, run_engine)] + [(s, s, run_engine) for s in specs]
    if run_diffusers:
        rows.insert(0, ("diffusers", None, run_diffusers))
    for _, spec, fn in rows:       # warm-up
        fn(spec)
    best: dict[str, tuple] = {}
    for _ in range(a.repeats):     # round-robin: every row sees the same machine load
        for name, spec, fn in rows:
            counts.update(blocks=0, dit_s=0.0)
            t0 = time.perf_counter()
            clips, decs = fn(spec)
            t = time.perf_counter() - t0
            if name not in best or t < best[name][0]:
                best[name] = (t, counts["blocks"], counts["dit_s"], decs, clips)
    exact = best["exact"][4]
    base = best["diffusers"][0] if "diffusers" in best else best["exact"][0]
    print(f"engine graph mode {a.graph}; ratios vs {'diffusers uncached' if 'diffusers' in best else 'engine exact'}; "
          f"{len(reqs)} requests, best of {a.repeats}, torch threads {torch.get_num_threads()}")
    print("| row | wall s | x | block-forwards run | claimed | DiT s | ms / block-forward | PSNR vs exact dB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, *_ in rows:
        t, blocks, dit_s, decs, clips = best[name]
        claimed = sum(d.blocks_computed[1] - d.blocks_computed[0] for d in decs if d.blocks_computed) \
            if decs else ("-" if name == "diffusers" else blocks)
        worst = min(psnr(e, c) for e, c in zip(exact, clips))
        per = f"{1000 * dit_s / blocks:.2f}" if blocks else "-"
        ran = blocks if name != "diffusers" and a.graph == "eager" else "-"
        print(f"| {name} | {t:.3f} | {base / t:.2f} | {ran} | {claimed} | "
              f"{dit_s:.3f} | {per} | {'inf' if math.isinf(worst) else round(worst, 2)} |")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        fn = next(f for n, s, f in rows if n == a.profile)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(None if a.profile in ("exact", "diffusers") else a.profile)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
