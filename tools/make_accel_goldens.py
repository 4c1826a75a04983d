"""Make golden/accel/<cache>/: upstream's own step caches on a tiny random-weight diffusers WanTransformer3DModel.

    fbcache     diffusers 0.42.1 apply_first_block_cache(FirstBlockCacheConfig(threshold))
    taylorseer  diffusers 0.42.1 apply_taylorseer_cache(TaylorSeerCacheConfig(use_lite_mode=True, ...))
    magcache    diffusers 0.42.1 apply_mag_cache(MagCacheConfig(mag_ratios=..., num_inference_steps=S))
    dbcache     cache-dit 1.5.3 enable_cache(transformer, DBCacheConfig(Fn, Bn, ..., enable_separate_cfg=True))

A CFG loop of S steps calls the transformer as WanPipeline does (cond inside `cache_context("cond")`, then uncond
inside `cache_context("uncond")`; cache-dit counts the alternating calls itself), combines with guidance g and takes
an Euler step on sigma = t / 1000. Each case stores the DiT weights (canonical = diffusers names) and config, the
inputs of every step (latents x_i, timestep t_i, both text embeddings), the transformer output of every branch at
every step, and the decisions upstream made, observed model-agnostically: which blocks' FFN actually ran in each
call (all: compute; a range: reuse of it; none: TaylorSeer predict / MagCache reuse of the whole stack).
Thresholds are set from an uncached calibration run so that some steps DO hit the cache, and placed mid-gap
between the observed diffs (margin reported). The tests (tests/test_accel_goldens.py) feed each step's stored
inputs to both sides (teacher forcing) and need no diffusers.

    python tools/make_accel_goldens.py [--out golden/accel] [--only fbcache,dbcache]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from make_wan_goldens import randomize_weights

VARIANT, NUM_LAYERS, SEED = "tiny-2.1-t2v", 4, 2101
STEPS, GUIDANCE, TEXT_LEN = 12, 4.0, 8
LATENT = (1, 4, 2, 8, 8)
T_START, T_END = 999.0, 700.0           # small steps: consecutive inputs close, so the caches have something to reuse
MAG_RATIOS = "1.0/0.995/0.99/0.985/0.98/0.975/0.97/0.96/0.95/0.94/0.93/0.92"
CASES = {
    "fbcache": "fbcache:threshold={t}",
    "dbcache": "dbcache:fn=1,bn=1,threshold={t},warmup=2,max_continuous=2",
    "taylorseer": "taylorseer:before=2,interval=3,order=2,factors_dtype=float32",
    "taylorseer_bf16": "taylorseer:before=3,interval=2",   # upstream's default bf16 factors, order 1
    "magcache": f"magcache:ratios={MAG_RATIOS},threshold=0.06,max_skip=2,retention=0.2",
}


def dit_config():
    from dataclasses import replace

    from manifests.wan import load_model_variant
    return replace(load_model_variant(VARIANT).dit, num_layers=NUM_LAYERS)


def build_model():
    import diffusers
    cfg = dit_config()
    torch.manual_seed(SEED)
    model = diffusers.WanTransformer3DModel(**{k: v for k, v in cfg.to_diffusers_config().items()
                                               if k != "_class_name"}).eval()
    randomize_weights(model, SEED)
    return model


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    cfg = dit_config()
    return {"x0": torch.randn(LATENT, generator=g),
            "text": torch.randn(1, TEXT_LEN, cfg.text_dim, generator=g),
            "negative_text": torch.randn(1, TEXT_LEN, cfg.text_dim, generator=g),
            "timesteps": torch.linspace(T_START, T_END, STEPS + 1, dtype=torch.float32)}


class BlockWatch:
    """Which blocks actually ran in each transformer call (a forward hook on every block's FFN)."""

    def __init__(self, model):
        self.ran: set[int] = set()
        for i, block in enumerate(model.blocks):
            block.ffn.register_forward_hook(lambda *_a, i=i: self.ran.add(i))

    def decision(self, step: int, branch: str, kind: str) -> dict:
        L, ran = NUM_LAYERS, sorted(self.ran)
        self.ran = set()
        if len(ran) == L:
            return {"step": step, "branch": branch, "action": "compute", "blocks_computed": [0, L],
                    "blocks_reused": None}
        if not ran:
            action = "predict" if kind == "taylorseer" else "reuse"
            return {"step": step, "branch": branch, "action": action, "blocks_computed": None,
                    "blocks_reused": None if action == "predict" else [0, L]}
        k = next(i for i in range(L) if i not in ran)
        end = next((i for i in range(k, L) if i in ran), L)
        return {"step": step, "branch": branch, "action": "reuse", "blocks_computed": [0, k],
                "blocks_reused": [k, end]}


def run_loop(model, data, kind: str | None, watch: BlockWatch | None):
    """The CFG loop; returns (per-step inputs x_i, cond outputs, uncond outputs, decisions)."""
    x, ts = data["x0"].clone(), data["timesteps"]
    xs, conds, unconds, decisions = [], [], [], []
    contexts = kind is not None and kind != "dbcache"
    for i in range(STEPS):
        t = ts[i:i + 1]
        xs.append(x.clone())
        outs = []
        for branch, text in (("cond", data["text"]), ("uncond", data["negative_text"])):
            with torch.no_grad():
                if contexts:
                    with model.cache_context(branch):
                        out = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
                else:
                    out = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
            outs.append(out.clone())
            if watch is not None:
                decisions.append(watch.decision(i, branch, kind))
        conds.append(outs[0])
        unconds.append(outs[1])
        v = outs[1] + GUIDANCE * (outs[0] - outs[1])
        x = x + (ts[i + 1] - ts[i]) / 1000.0 * v
    return xs, conds, unconds, decisions


def calibrate(data, fn: int) -> list[float]:
    """Per-step relative change of the first-fn-blocks residual (both branches), uncached: where thresholds go."""
    model = build_model()
    captured: dict[str, list[torch.Tensor]] = {"cond": [], "uncond": []}
    state = {"branch": "cond", "input": None}
    model.blocks[0].register_forward_pre_hook(lambda m, a, kw=None: state.update(input=a[0].clone()))
    model.blocks[fn - 1].register_forward_hook(
        lambda m, a, out: captured[state["branch"]].append(out - state["input"]))
    x, ts = data["x0"].clone(), data["timesteps"]
    diffs = []
    for i in range(STEPS):
        outs = []
        for branch, text in (("cond", data["text"]), ("uncond", data["negative_text"])):
            state["branch"] = branch
            with torch.no_grad():
                outs.append(model(hidden_states=x, timestep=ts[i:i + 1], encoder_hidden_states=text,
                                  return_dict=False)[0])
        x = x + (ts[i + 1] - ts[i]) / 1000.0 * (outs[1] + GUIDANCE * (outs[0] - outs[1]))
    for b in captured.values():
        diffs += [float((c - p).abs().mean() / p.abs().mean()) for p, c in itertools.pairwise(b)]
    return sorted(diffs)


def mid_gap(diffs: list[float], quantile: float) -> tuple[float, float]:
    """A threshold in the widest gap between sorted diffs near `quantile`, and its margin to the nearest diff."""
    lo = max(1, int(len(diffs) * quantile) - 3)
    hi = min(len(diffs) - 1, int(len(diffs) * quantile) + 3)
    gaps = [(diffs[i] - diffs[i - 1], i) for i in range(lo, hi + 1)]
    width, i = max(gaps)
    return round((diffs[i] + diffs[i - 1]) / 2, 6), width / 2


def apply_cache(model, kind: str, spec) -> None:
    g = spec.get
    if kind == "fbcache":
        from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
        apply_first_block_cache(model, FirstBlockCacheConfig(threshold=g("threshold")))
    elif kind == "taylorseer":
        from diffusers.hooks import TaylorSeerCacheConfig, apply_taylorseer_cache
        apply_taylorseer_cache(model, TaylorSeerCacheConfig(
            cache_interval=g("interval"), disable_cache_before_step=g("before"),
            disable_cache_after_step=g("after"), max_order=g("order"),
            taylor_factors_dtype=getattr(torch, g("factors_dtype")), use_lite_mode=True))
    elif kind == "magcache":
        from diffusers.hooks import MagCacheConfig, apply_mag_cache
        apply_mag_cache(model, MagCacheConfig(threshold=g("threshold"), max_skip_steps=g("max_skip"),
                                              retention_ratio=g("retention"), num_inference_steps=STEPS,
                                              mag_ratios=[float(r) for r in g("ratios").split("/")]))
    elif kind == "dbcache":
        import cache_dit
        from cache_dit import DBCacheConfig
        acc = g("max_accumulated_diff")
        cache_dit.enable_cache(model, cache_config=DBCacheConfig(
            Fn_compute_blocks=g("fn"), Bn_compute_blocks=g("bn"), residual_diff_threshold=g("threshold"),
            max_warmup_steps=g("warmup"), warmup_interval=g("warmup_interval"), max_cached_steps=g("max_cached"),
            max_continuous_cached_steps=g("max_continuous"), max_accumulated_residual_diff_threshold=acc,
            enable_separate_cfg=True))
    else:
        raise ValueError(kind)


def make_case(name: str, out: Path) -> dict:
    import diffusers

    from manifests.accel import parse_accel
    data = inputs()
    template = CASES[name]
    kind = template.split(":")[0]
    margin = None
    if "{t}" in template:
        threshold, margin = mid_gap(calibrate(data, 1), 0.5)
        template = template.format(t=threshold)
    spec = parse_accel(template)
    model = build_model()
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    watch = BlockWatch(model)
    apply_cache(model, kind, spec)
    xs, conds, unconds, decisions = run_loop(model, data, kind, watch)
    actions = [d["action"] for d in decisions]
    if "compute" not in actions or set(actions) == {"compute"}:
        raise SystemExit(f"{kind}: upstream made no cache hit (or never computed): {actions}")
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "weights.safetensors"))
    tensors = {"x": torch.cat(xs), "timesteps": data["timesteps"][:STEPS].contiguous(),
               "text": data["text"], "negative_text": data["negative_text"]}
    save_file(tensors, str(out / "inputs.safetensors"))
    save_file({"cond": torch.cat(conds), "uncond": torch.cat(unconds)}, str(out / "outputs.safetensors"))
    meta = {"accel": spec.label(), "variant": VARIANT, "num_layers": NUM_LAYERS, "steps": STEPS, "seed": SEED,
            "guidance": GUIDANCE, "upstream": spec.kind.upstream, "diffusers": diffusers.__version__,
            "threshold_margin": margin, "decisions": decisions,
            "made_by": "tools/make_accel_goldens.py"}
    if kind == "dbcache":   # cache-dit records the diff it compared per step and branch: the decisions' metric
        import cache_dit
        meta["cache_dit"] = cache_dit.__version__
        stats = cache_dit.summary(model, logging=False)[0]
        meta["upstream_metrics"] = {"cond": {int(k): float(v) for k, v in stats.residual_diffs.items()},
                                    "uncond": {int(k): float(v) for k, v in stats.cfg_residual_diffs.items()}}
    (out / "accel.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "golden" / "accel")
    ap.add_argument("--only", default=",".join(CASES))
    a = ap.parse_args(argv)
    for kind in a.only.split(","):
        meta = make_case(kind, a.out / kind)
        acts = [d["action"][0] for d in meta["decisions"]]
        print(f"{kind}: {meta['accel']} margin={meta['threshold_margin']} decisions={''.join(acts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
