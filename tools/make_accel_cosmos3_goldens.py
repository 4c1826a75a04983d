#!/usr/bin/env python
"""Make golden/accel_cosmos3/<cache>/: diffusers 0.42.1's own step caches on the cosmos3 generation loop.

The model, prompt ids and explicit initial latents are those of the upstream golden golden/cosmos3/gen_t2v (its
upstream/ transformer is read from there, not copied), run for STEPS steps by diffusers' `Cosmos3OmniPipeline`
(through tools/make_generate_goldens.run_probe: cond inside `cache_context("cond")`, uncond inside
`cache_context("uncond")`) with the cache applied by `transformer.enable_cache(config)`:

    fbcache     FirstBlockCacheConfig(threshold)
    magcache    MagCacheConfig(mag_ratios, threshold, max_skip_steps, retention_ratio, num_inference_steps)

Decisions are observed model-agnostically: which decoder layers' gen MLP (`mlp_moe_gen`) ran in each transformer
call (all: compute; layer 0 only: fbcache reuse; none: magcache reuse). Stored per case: accel.json (the spec, the
steps, the decisions, the threshold margin) and outputs.safetensors (vision latents after every step). The
fbcache threshold is placed mid-gap between the reference's uncached per-step diffs (reported as `margin`).
    dbcache     cache-dit 1.5.3 enable_cache(pipe, DBCacheConfig(Fn, Bn=0, ..., enable_separate_cfg=True)) (its own
                Cosmos3OmniPatchFunctor: the decision tracks gen_seq; its patched forward lacks `return_dict`, which
                the pipeline passes: the keyword is dropped for the run)

Upstream quirk (diffusers 0.42.1): the registry declares cosmos3's layer arguments as `gen_seq` / `und_seq`
(TransformerBlockMetadata hidden_states_argument_name / encoder_hidden_states_argument_name), but
FirstBlockCache and MagCache look up the literal names "hidden_states" / "encoder_hidden_states", so both raise on
Cosmos3OmniTransformer (FBCache at the first call, MagCache at the first skip). `arg_name_fix` maps the two literal
names to the declared ones for the run (nothing else changes): the goldens hold upstream's rules as its own
registry says they apply to cosmos3.

    python tools/make_accel_cosmos3_goldens.py [--out golden/accel_cosmos3] [--only fbcache]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

BASE = ROOT / "golden" / "cosmos3" / "gen_t2v"
STEPS = 8
MAG_RATIOS = "1.0/0.995/0.99/0.985/0.98/0.975/0.97/0.96"
CASES = {
    "fbcache": "fbcache:threshold={t}",
    "magcache": f"magcache:ratios={MAG_RATIOS},threshold=0.06,max_skip=2,retention=0.2",
    "dbcache": "dbcache:fn=1,bn=0,threshold={t},warmup=2,max_continuous=2",
}


def base_case():
    from parity.golden import load_case
    return load_case(BASE)


def reference_request(case, spec):
    from dataclasses import replace

    from parity.families.cosmos3.c1 import golden_request
    return replace(golden_request(case), num_steps=STEPS, accel=spec)


def reference_model():
    from converters import convert_diffusers_dir_to_canonical_state_dict
    from reference.cosmos3 import load_transformer
    cfg, state = convert_diffusers_dir_to_canonical_state_dict(BASE / "upstream")
    return cfg, load_transformer(cfg, state)


def calibrate_fbcache() -> tuple[float, float]:
    """Per-step block-0 residual diffs of an always-computing reference run; a threshold mid-gap near the median."""
    from manifests.accel import parse_accel
    from reference.cosmos3 import generate
    case = base_case()
    _, model = reference_model()
    res = generate(model, reference_request(case, parse_accel("fbcache:threshold=0.0")))
    diffs = sorted(d.metric for d in res.accel if d.metric is not None)
    mid = len(diffs) // 2
    gaps = [(diffs[i] - diffs[i - 1], i) for i in range(max(1, mid - 3), min(len(diffs), mid + 4))]
    width, i = max(gaps)
    return round((diffs[i] + diffs[i - 1]) / 2, 6), width / 2


def arg_name_fix() -> None:
    """Upstream's hooks ask for "hidden_states" / "encoder_hidden_states"; cosmos3 declares gen_seq / und_seq."""
    from diffusers.hooks._helpers import TransformerBlockMetadata
    original = TransformerBlockMetadata._get_parameter_from_args_kwargs
    if getattr(original, "_arg_name_fix", False):
        return

    def lookup(self, identifier, args=(), kwargs=None):
        declared = {"hidden_states": self.hidden_states_argument_name,
                    "encoder_hidden_states": self.encoder_hidden_states_argument_name}
        return original(self, declared.get(identifier, identifier), args, kwargs)

    lookup._arg_name_fix = True
    TransformerBlockMetadata._get_parameter_from_args_kwargs = lookup


def make_case(name: str, out_root: Path) -> dict:
    from make_generate_goldens import (
        _import_upstream,
        _setup_determinism,
        load_transformer,
        run_probe,
    )

    from manifests.accel import parse_accel
    up = _import_upstream()
    _setup_determinism()
    arg_name_fix()
    template, margin = CASES[name], None
    if "{t}" in template:
        threshold, margin = calibrate_fbcache()
        template = template.format(t=threshold)
    spec = parse_accel(template)
    g = spec.get
    meta = json.loads((BASE / "case.json").read_text())
    params = copy.deepcopy(meta["params"])
    params["num_inference_steps"] = STEPS
    inputs = load_file(str(BASE / "inputs.safetensors"))
    transformer = load_transformer(up, BASE / "upstream", meta.get("dtype", "float32"))
    if name == "dbcache":   # cache-dit wraps the pipeline (its Cosmos adapter patches the layers' contract)
        import cache_dit
        import make_generate_goldens
        from cache_dit import DBCacheConfig
        build = make_generate_goldens.build_pipeline
        acc = g("max_accumulated_diff")
        config = DBCacheConfig(
            Fn_compute_blocks=int(g("fn")), Bn_compute_blocks=int(g("bn")),
            residual_diff_threshold=float(g("threshold")), max_warmup_steps=int(g("warmup")),
            warmup_interval=int(g("warmup_interval")), max_cached_steps=int(g("max_cached")),
            max_continuous_cached_steps=int(g("max_continuous")), max_accumulated_residual_diff_threshold=acc,
            enable_separate_cfg=True)

        def build_cached(*args, **kwargs):
            pipe = build(*args, **kwargs)
            cache_dit.enable_cache(pipe, cache_config=config)
            # (upstream quirk) cache-dit's patched Cosmos3 forward has no `return_dict`, which the pipeline passes
            # (False: a tuple, what the patched forward returns anyway): drop the keyword, nothing else changes
            forward = pipe.transformer.forward
            pipe.transformer.forward = lambda *a, return_dict=False, **kw: forward(*a, **kw)
            return pipe
        make_generate_goldens.build_pipeline = build_cached
    elif name == "fbcache":
        from diffusers.hooks import FirstBlockCacheConfig
        transformer.enable_cache(FirstBlockCacheConfig(threshold=float(g("threshold"))))
    elif name == "magcache":
        from diffusers.hooks import MagCacheConfig
        transformer.enable_cache(MagCacheConfig(threshold=float(g("threshold")), max_skip_steps=int(g("max_skip")),
                                                retention_ratio=float(g("retention")), num_inference_steps=STEPS,
                                                mag_ratios=[float(r) for r in str(g("ratios")).split("/")]))
    L = len(transformer.layers)
    ran: list[set[int]] = []
    for i, layer in enumerate(transformer.layers):
        layer.mlp_moe_gen.register_forward_hook(lambda *_a, i=i: ran[-1].add(i))
    transformer.register_forward_pre_hook(lambda *_a: ran.append(set()))
    image = bool(params["vision_condition_frames"])
    try:
        res, _ = run_probe(up, transformer, params, inputs, 4242, image)
    finally:
        if name == "dbcache":
            make_generate_goldens.build_pipeline = build
    decisions = []
    for call, layers in enumerate(ran):
        step, branch = divmod(call, 2)
        branch = ("cond", "uncond")[branch]
        if len(layers) == L:
            d = {"action": "compute", "blocks_computed": [0, L], "blocks_reused": None}
        elif not layers:
            d = {"action": "reuse", "blocks_computed": None, "blocks_reused": [0, L]}
        else:
            k = min(set(range(L)) - layers)
            assert layers == set(range(k)), f"call {call}: layers {sorted(layers)} ran"
            d = {"action": "reuse", "blocks_computed": [0, k], "blocks_reused": [k, L]}
        decisions.append({"step": step, "branch": branch, **d})
    assert any(d["action"] == "reuse" for d in decisions), f"{name}: upstream never reused: nothing to check"
    out = out_root / name
    out.mkdir(parents=True, exist_ok=True)
    save_file({"trajectory_vision": res["trajectory_vision"].contiguous()}, str(out / "outputs.safetensors"))
    record = {"accel": spec.label(), "steps": STEPS, "base_case": "golden/cosmos3/gen_t2v", "margin": margin,
              "upstream": {"package": "diffusers", "version": up["diffusers"].__version__,
                           **({"cache_dit": __import__("cache_dit").__version__} if name == "dbcache" else {}),
                           "hook": {"fbcache": "FirstBlockCacheConfig", "magcache": "MagCacheConfig",
                                    "dbcache": "cache-dit DBCacheConfig"}[name],
                           "patched": None if name == "dbcache" else "hook argument names mapped to the "
                                      "registry's gen_seq / und_seq (tools/make_accel_cosmos3_goldens.py arg_name_fix)"},
              "decisions": decisions}
    (out / "accel.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "golden" / "accel_cosmos3")
    ap.add_argument("--only", default=",".join(CASES))
    a = ap.parse_args(argv)
    names = [n for n in a.only.split(",") if n]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        print(f"make_accel_cosmos3_goldens: unknown case(s) {unknown}; known: {sorted(CASES)}", file=sys.stderr)
        return 2
    for n in names:
        rec = make_case(n, a.out)
        acts = "".join({"compute": "C", "reuse": "R"}[d["action"]] for d in rec["decisions"])
        print(f"{n}: {rec['accel']} decisions {acts} margin {rec['margin']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
