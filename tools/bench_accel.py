"""Accelerations, speed and quality, in one process on the same weights and requests (issue 21 part 6).

    python tools/bench_accel.py [--model golden/trained/wan_shapes] [--requests 4] [--repeats 3] [--steps 30]
                                [--accel cfg_delta --accel ...] [--dbcache-thresholds 0.08,0.15]

Rows (each: wall seconds for the request set, ratio vs diffusers uncached, PSNR of the decoded frames vs the engine's
exact frames of the same request and seed (worst request), prompt adherence on the set when the model is the
trained one):

    diffusers            WanPipeline.from_pretrained(the export: fvconvert export --to diffusers), no cache
    diffusers+fbcache    diffusers 0.42.1 FirstBlockCache hook      (apply_first_block_cache)
    diffusers+taylorseer diffusers 0.42.1 TaylorSeer (lite) hook    (apply_taylorseer_cache)
    cache-dit DBCache    cache-dit 1.5.3 DBCache on the pipeline's transformer, one row per --dbcache-thresholds value
                         (skipped when cache_dit is missing)
    engine exact         optimized Engine, prompt -> frames
    engine+<accel>       the same with each acceleration (same knobs as the diffusers / cache-dit rows), then every
                         --accel (engine-only kinds such as cfg_delta)

(No MagCache row: its ratios are model-dependent and need a calibration run first; the engine's magcache is held to
diffusers' hook by the upstream goldens instead.)

The diffusers pipeline's tokenizer is a shim giving the model directory's own token ids (the trained model's
word-level tokenizer is not a T5 tokenizer diffusers can load); the text encoder, scheduler, DiT, VAE and noise
are diffusers' own. Without --model (or when it cannot be read) a tiny random-weight model is used and the table
says so: random weights have no step redundancy, its quality numbers mean nothing about real models.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ACCELS = {   # one knob set per kind, the same on the engine and the upstream rows
    "fbcache": "fbcache:threshold=0.05",
    "taylorseer": "taylorseer:interval=3,before=4,factors_dtype=float32",   # certified on all 16 at 30 steps
}
DBCACHE = "dbcache:fn=1,bn=0,threshold={t},warmup=2"   # cache-dit's DBCacheConfig with the same knobs per threshold


class IdsTokenizer:
    """Stands in for the T5 tokenizer in diffusers' _get_t5_prompt_embeds: the model directory's own ids."""

    def __init__(self, proc):
        self.proc = proc

    def __call__(self, prompts, padding, max_length, truncation, add_special_tokens, return_attention_mask,
                 return_tensors):
        ids = torch.zeros(len(prompts), max_length, dtype=torch.int64)
        mask = torch.zeros(len(prompts), max_length, dtype=torch.int64)
        for row, p in enumerate(prompts):
            t = self.proc.tokenize(p, max_length).ids[:max_length]
            ids[row, :len(t)], mask[row, :len(t)] = t, 1
        return SimpleNamespace(input_ids=ids, attention_mask=mask)


def random_model(tmp: Path) -> Path:
    from converters.pipeline import convert_pipeline
    from tests.test_model_directory import write_wan_root
    write_wan_root(tmp / "root")
    convert_pipeline("wan", tmp / "root", tmp / "model", skip_parity=True)
    return tmp / "model"


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    from parity.quality.image import psnr as p
    return p(a, b, 1.0) if a.dtype != np.uint8 else p(a, b)


def adherence(clips, captions) -> float | None:
    if captions[0] is None:
        return None
    from parity.quality.adherence import adherence_rate, score_clip
    return adherence_rate([score_clip(c, cap) for c, cap in zip(clips, captions)])


def diffusers_clips(pipe, reqs, size, frames: int, steps: int, guidance: float, max_len: int,
                    per_request_setup=None) -> list[np.ndarray]:
    """WanPipeline on each (caption, seed) request -> uint8 clips [F, H, W, 3] (per_request_setup(pipe) first)."""
    out = []
    for cap, seed in reqs:
        if per_request_setup:
            per_request_setup(pipe)
        with torch.no_grad():
            v = pipe(prompt=cap, negative_prompt="", height=size[0], width=size[1], num_frames=frames,
                     num_inference_steps=steps, guidance_scale=guidance,
                     generator=torch.Generator().manual_seed(seed), output_type="np",
                     max_sequence_length=max_len).frames[0]
        out.append((np.clip(v, 0, 1) * 255).round().astype(np.uint8))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "golden" / "trained" / "wan_shapes")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per row, round-robin over the rows (the best is kept)")
    ap.add_argument("--steps", type=int, default=None,
                    help="denoising steps (default: the evaluation's, parity.quality.evaluate.STEPS)")
    ap.add_argument("--accel", action="append", default=[], metavar="NAME[:knobs]",
                    help="an extra engine row (repeatable), e.g. cfg_delta:warmup=4,interval=4,cooldown=2")
    ap.add_argument("--dbcache-thresholds", default="0.08", metavar="T[,T...]",
                    help="residual_diff_threshold of each engine dbcache / cache-dit DBCache row pair "
                    "(default 0.08, upstream's)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    from manifests.accel import AccelSpecError, parse_accel
    try:
        thresholds = [float(t) for t in a.dbcache_thresholds.split(",") if t.strip()]
        for spec in a.accel + [DBCACHE.format(t=t) for t in thresholds]:
            parse_accel(spec)
        if a.steps is not None and a.steps < 1:
            raise AccelSpecError("--steps must be >= 1")
    except (ValueError, AccelSpecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(0)

    import diffusers

    from converters.export import export_diffusers
    from manifests.checkpoint import read_checkpoint
    from optimized import Engine
    from reference.wan.processor import WanProcessor

    tmp = Path(tempfile.mkdtemp(prefix="bench_accel-"))
    try:
        trained = a.model.is_dir() and (a.model / "model_index.json").is_file()
        model = a.model if trained else random_model(tmp)
        ckpt = read_checkpoint(model)
        cfg = ckpt.typed_config()
        if trained:
            from parity.quality import HELD_OUT
            from parity.quality.evaluate import FRAMES, GUIDANCE, SIZE, STEPS
            reqs = [(r.caption, r.seed) for r in list(HELD_OUT)[:a.requests]]
            frames, size, steps, guidance = FRAMES, SIZE, a.steps or STEPS, GUIDANCE
        else:
            reqs = [(f"a cat number {i}", i) for i in range(a.requests)]
            frames, size, steps, guidance = 5, (32, 32), a.steps or 8, 5.0
        captions = [c if trained else None for c, _ in reqs]
        export_diffusers(model, tmp / "diffusers")
        proc = WanProcessor(ckpt.assets["tokenizer"], cfg.max_sequence_length)

        def diffusers_pipe():
            # the tokenizer passed in: diffusers does not load a word-level tokenizer.json as a T5 tokenizer
            pipe = diffusers.WanPipeline.from_pretrained(tmp / "diffusers", tokenizer=None, torch_dtype=torch.float32)
            pipe.tokenizer = IdsTokenizer(proc)
            pipe.set_progress_bar_config(disable=True)
            return pipe

        def run_diffusers(pipe, per_request_setup=None):
            return diffusers_clips(pipe, reqs, size, frames, steps, guidance, cfg.max_sequence_length,
                                   per_request_setup)

        engine = Engine.from_checkpoint(model)
        engine.__dict__["checkpoint_path"] = str(model)

        def run_engine(accel=None):
            out = []
            for cap, seed in reqs:
                r = engine.generate(prompt=cap, negative_prompt="", num_frames=frames, height=size[0],
                                    width=size[1], num_steps=steps, guidance_scale=guidance, seed=seed,
                                    **({"accel": accel} if accel else {}))
                f = r.frames
                out.append(f.numpy() if hasattr(f, "numpy") else np.asarray(f))
            return out

        # (measurement) every row is warmed up once, then the --repeats timed runs go round-robin over the rows and
        # the best is kept: on a shared machine a load change during one row's runs would otherwise bias that row
        runs = [("engine exact", run_engine, "")]
        engine_specs = [*ACCELS.values(), *(DBCACHE.format(t=t) for t in thresholds), *a.accel]
        runs += [(f"engine+{spec.partition(':')[0]}", (lambda s=spec: run_engine(s)), spec) for spec in engine_specs]
        pipe = diffusers_pipe()
        runs.insert(0, ("diffusers", lambda: run_diffusers(pipe), ""))
        from diffusers.hooks import (
            FirstBlockCacheConfig,
            TaylorSeerCacheConfig,
            apply_first_block_cache,
            apply_taylorseer_cache,
        )
        for kind, apply in (
                ("fbcache", lambda p: apply_first_block_cache(p.transformer, FirstBlockCacheConfig(threshold=0.05))),
                ("taylorseer", lambda p: apply_taylorseer_cache(p.transformer, TaylorSeerCacheConfig(
                    cache_interval=3, disable_cache_before_step=4, taylor_factors_dtype=torch.float32,
                    use_lite_mode=True)))):
            p = diffusers_pipe()
            apply(p)
            runs.append((f"diffusers+{kind}", (lambda p=p: run_diffusers(p)), ACCELS[kind]))
        try:
            import cache_dit
            from cache_dit import DBCacheConfig
            for t in thresholds:
                p = diffusers_pipe()
                # (measurement) num_inference_steps: cache-dit refreshes its context (step counter, warm-up, buffers)
                # every `steps` transformer steps, i.e. per request as the engine's per-request rules do; without it
                # the counter runs on across the request set and only the first request gets its 2 warm-up steps
                cache_dit.enable_cache(p.transformer, cache_config=DBCacheConfig(
                    Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=t, max_warmup_steps=2,
                    enable_separate_cfg=True, num_inference_steps=steps))
                runs.append((f"cache-dit {cache_dit.__version__} DBCache", (lambda p=p: run_diffusers(p)),
                             DBCACHE.format(t=t)))
        except ImportError as e:
            print(f"cache-dit not installed: its row is skipped ({e})", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - an upstream failure is a row that says so, not a crash
            print(f"cache-dit DBCache failed on this pipeline: {type(e).__name__}: {e}", file=sys.stderr)

        best: dict[tuple[str, str], tuple[float, list]] = {}   # (row, accel) -> (best wall, clips)
        for name, fn, spec in runs:                    # warm-up (lazy init, caches)
            try:
                best[name, spec] = (math.inf, fn())
            except Exception as e:  # noqa: BLE001 - an upstream failure is a row that says so, not a crash
                print(f"{name} {spec} failed: {type(e).__name__}: {e}", file=sys.stderr)
        runs = [r for r in runs if (r[0], r[2]) in best]
        for repeat in range(a.repeats):
            for name, fn, spec in runs:
                t0 = time.perf_counter()
                res = fn()
                t = time.perf_counter() - t0
                if t < best[name, spec][0]:
                    best[name, spec] = (t, res)
            print(f"repeat {repeat + 1}/{a.repeats} done", file=sys.stderr, flush=True)
        exact = best["engine exact", ""][1]
        rows = [(name, best[name, spec][0], best[name, spec][1], spec) for name, _, spec in runs]

        base = next(t for n, t, _, _ in rows if n == "diffusers")
        table = []
        for name, t, clips, spec in rows:
            worst = min(psnr(e, c) for e, c in zip(exact, clips))
            table.append({"row": name, "accel": spec, "wall_s": round(t, 3), "speedup_vs_diffusers": round(base / t, 3),
                          "psnr_vs_engine_exact_db": "inf" if math.isinf(worst) else round(worst, 2),
                          "adherence": adherence(clips, captions)})
        meta = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
                "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "diffusers": diffusers.__version__,
                "model": str(model) if trained else "tiny random weights (NOT the trained model)",
                "requests": len(reqs), "frames": frames, "size": list(size), "steps": steps, "guidance": guidance}
        print(json.dumps(meta))
        print("| row | accel | wall s | x vs diffusers | PSNR vs engine exact (dB, worst) | adherence |")
        print("|---|---|---|---|---|---|")
        for r in table:
            ad = "-" if r["adherence"] is None else f"{r['adherence'] * 100:.1f}%"
            print(f"| {r['row']} | {r['accel'] or '-'} | {r['wall_s']} | {r['speedup_vs_diffusers']} | "
                  f"{r['psnr_vs_engine_exact_db']} | {ad} |")
        if a.json:
            a.json.write_text(json.dumps({"meta": meta, "rows": table}, indent=1))
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
