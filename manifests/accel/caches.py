"""Step / residual caches and the guidance interval: their kinds, knobs and defaults as upstream declares them.

Every cache here is decided per request AND per CFG branch (upstream keeps one state per `cache_context("cond")` /
`cache_context("uncond")`, cache-dit one buffer set per separate-CFG transformer call), and every one is lossy:
a reused residual or a predicted output is not what the blocks would have computed.

    fbcache      diffusers 0.42.1 FirstBlockCacheConfig / apply_first_block_cache: block 0 always runs; its residual
                 r = out0 - in0 is compared with the one of the last COMPUTED step,
                 diff = mean|r - r_prev| / mean|r_prev|; diff > threshold -> compute blocks 1..L-1 (and store r and the
                 tail residual out_L - out0); else out = out0 + tail residual (r_prev is not updated).
    dbcache      cache-dit 1.5.3 DBCacheConfig (DBCache): the first Fn blocks always run, their residual
                 (x_Fn - x_0) compared with the stored one as above; steps in range(0, warmup, warmup_interval)
                 compute; max_cached / max_continuous / max_accumulated_diff limit the reuse; diff < threshold
                 (strict) -> x = x_Fn + the middle blocks' residual, then the last Bn blocks run.
    taylorseer   diffusers 0.42.1 TaylorSeerCacheConfig(use_lite_mode=True): on compute steps the DiT runs and its
                 proj_out output updates Taylor factors (stored in factors_dtype); on the other steps the whole
                 output is the Taylor expansion. Compute iff step < before or (step - before - 1) % interval == 0
                 or step >= after. (The default, non-lite patterns "^blocks.*attn" match no Wan module: a no-op.)
    magcache     diffusers 0.42.1 MagCacheConfig: from retention_step = int(retention * steps + 0.5) on, the
                 accumulated ratio *= ratios[step], err += |1 - ratio|; skip (out = in + last whole-stack residual)
                 while err <= threshold and accumulated steps <= max_skip; a refusal resets the accumulators.
    guidance_interval  CFG (the uncond branch) only on steps in [start, end); other steps use the cond velocity.
    cfg_delta    (this project's; FasterCache's CFG-Cache idea without its frequency split) the uncond branch runs on
                 steps < warmup, every `interval` steps after them and the last `cooldown` steps; between them
                 uncond = cond - (cond - uncond) of the last step that ran both. Wan only.
"""

from __future__ import annotations

from manifests.accel import AccelKind, Knob

_DENOISE_LOOPS = ("wan.denoise", "cosmos3.denoise")
_CACHE_KEY = ("accel", "request", "branch", "blocks")   # a residual is valid for one request, branch and block range

KINDS: tuple[AccelKind, ...] = (
    AccelKind(
        name="fbcache", exact=False,
        summary="first-block cache: reuse the tail blocks' residual while block 0's residual changes little",
        knobs=(Knob("threshold", 0.05, float, "relative mean |change| of block 0's residual above which the tail "
                    "blocks run (upstream default 0.05)", low=0.0),),
        cache_key_fields=_CACHE_KEY, loops=_DENOISE_LOOPS,
        upstream="diffusers 0.42.1 FirstBlockCacheConfig / apply_first_block_cache"),
    AccelKind(
        name="dbcache", exact=False,
        summary="dual-block cache: Fn blocks always run and decide; the middle blocks' residual is reused; Bn run",
        knobs=(Knob("fn", 8, int, "Fn_compute_blocks: the first blocks always computed (<= num_layers)", low=1),
               Knob("bn", 0, int, "Bn_compute_blocks: the last blocks always computed", low=0),
               Knob("threshold", 0.08, float, "residual_diff_threshold: reuse while the Fn residual's relative "
                    "change is below it (<= 0: never reuse; >= 1: always)", low=-1.0),
               Knob("warmup", 8, int, "max_warmup_steps: steps range(0, warmup, warmup_interval) always compute",
                    low=0),
               Knob("warmup_interval", 1, int, "warmup_interval", low=1),
               Knob("max_cached", -1, int, "max_cached_steps per branch (-1: unlimited)", low=-1),
               Knob("max_continuous", -1, int, "max_continuous_cached_steps per branch (-1: unlimited)", low=-1),
               Knob("max_accumulated_diff", None, float, "max_accumulated_residual_diff_threshold (None: off)",
                    low=0.0)),
        cache_key_fields=_CACHE_KEY, loops=_DENOISE_LOOPS,
        upstream="cache-dit 1.5.3 DBCacheConfig (separate CFG, cond first)"),
    AccelKind(
        name="taylorseer", exact=False,
        summary="TaylorSeer (lite): predict the DiT output by a Taylor expansion between full steps",
        knobs=(Knob("interval", 5, int, "cache_interval: full steps every `interval` steps after the warmup", low=1),
               Knob("before", 3, int, "disable_cache_before_step: steps before it always compute", low=0),
               Knob("after", None, int, "disable_cache_after_step: steps from it on always compute (None: never)",
                    low=0),
               Knob("order", 1, int, "max_order of the Taylor expansion", low=0, high=4),
               Knob("factors_dtype", "bfloat16", str, "taylor_factors_dtype (upstream default bfloat16)",
                    choices=("bfloat16", "float16", "float32"))),
        # not cosmos3: upstream's lite TaylorSeer on Cosmos3Omni predicts only proj_out and skips no layer
        cache_key_fields=_CACHE_KEY, loops=("wan.denoise",),
        upstream="diffusers 0.42.1 TaylorSeerCacheConfig(use_lite_mode=True)"),
    AccelKind(
        name="magcache", exact=False,
        summary="MagCache: skip the block stack while the accumulated magnitude-ratio error stays small",
        knobs=(Knob("threshold", 0.06, float, "accumulated error bound", low=0.0),
               Knob("max_skip", 3, int, "max_skip_steps: consecutive skipped steps (K)", low=0),
               Knob("retention", 0.2, float, "retention_ratio: the first int(r * steps + 0.5) steps compute",
                    low=0.0, high=1.0),
               Knob("ratios", None, str, "mag_ratios, '/'-separated (required: model-dependent; nearest-"
                    "interpolated to the request's steps as upstream does)")),
        cache_key_fields=_CACHE_KEY, loops=_DENOISE_LOOPS,
        upstream="diffusers 0.42.1 MagCacheConfig (num_inference_steps = the request's num_steps)"),
    AccelKind(
        name="guidance_interval", exact=False,
        summary="run CFG only on steps whose index lies in [start, end); other steps use the cond branch alone",
        knobs=(Knob("start", 0, int, "first step (0-based) that runs CFG", low=0),
               Knob("end", None, int, "first step that no longer runs CFG (None = until the last)", low=0)),
        cache_key_fields=(), loops=_DENOISE_LOOPS),
    AccelKind(
        name="cfg_delta", exact=False,
        summary="CFG delta reuse: the uncond branch runs every `interval` steps; between them uncond = cond - the "
                "last (cond - uncond)",
        knobs=(Knob("warmup", 4, int, "the first steps always run both branches", low=1),
               Knob("interval", 4, int, "after the warmup, the uncond branch runs on every interval-th step", low=1),
               Knob("cooldown", 2, int, "the last steps always run both branches", low=0)),
        cache_key_fields=("accel", "request", "branch"), loops=("wan.denoise",)),
)


def mag_ratios(text: str | None) -> tuple[float, ...]:
    """The magcache `ratios` knob ('1.0/0.98/...') as floats; a clear error when missing or malformed."""
    from manifests.accel import AccelSpecError
    if not text:
        raise AccelSpecError("accel magcache: knob ratios is required (model-dependent mag_ratios, '/'-separated)")
    try:
        values = tuple(float(v) for v in text.split("/"))
    except ValueError:
        raise AccelSpecError(f"accel magcache: ratios must be '/'-separated numbers, got {text!r}") from None
    return values
