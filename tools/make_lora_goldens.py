"""Make golden/wan/lora_*: diffusers 0.42.1 WanPipeline with a LoRA loaded by `load_lora_weights` (PEFT backend,
`pip install peft`), weighted by `set_adapters`, on the tiny Wan 2.1 T2V model of golden/wan/pipe_t2v.

The LoRA is written by diffusers' own `WanPipeline.save_lora_weights` (diffusers format, rank 4, lora_alpha 8 in the
safetensors metadata, so PEFT's scaling alpha / r = 2 is exercised) with seeded tensors on attn1 q / v, attn2 k /
out, both FFN layers and proj_out of both blocks. Each case stores the LoRA file, the inputs (pipe_t2v's) and the
final latents; the base weights are read from the base case's upstream/ directory (named in case.json).

    python tools/make_lora_goldens.py [--out golden/wan] [--verify]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import make_wan_pipeline_goldens as pipe_goldens  # noqa: E402

BASE = "pipe_t2v"
RANK, ALPHA = 4, 8.0
TARGETS = ("attn1.to_q", "attn1.to_v", "attn2.to_k", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
CASES = {
    "lora_t2v": dict(seed=9201, scale=0.7, fuse=False,
                     description="pipe_t2v + a diffusers-format LoRA (rank 4, alpha 8) at adapter weight 0.7 "
                                 "(load_lora_weights + set_adapters)"),
    "lora_t2v_fused": dict(seed=9202, scale=1.3, fuse=True,
                           description="pipe_t2v + a LoRA fused into the weights at lora_scale 1.3 (fuse_lora)"),
}
REL_L2_TOL = 1e-5


def lora_state(transformer: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Seeded lora_A / lora_B by module name (save_lora_weights adds the `transformer.` prefix)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(len(transformer.blocks)):
        for t in TARGETS + (() if i else ("proj_out",)):
            name = "proj_out" if t == "proj_out" else f"blocks.{i}.{t}"
            layer = transformer.get_submodule(name)
            out[f"{name}.lora_A.weight"] = torch.randn(RANK, layer.in_features, generator=g) * 0.3
            out[f"{name}.lora_B.weight"] = torch.randn(layer.out_features, RANK, generator=g) * 0.3
    return out


def run_case(name: str, lora_dir: Path) -> torch.Tensor:
    from diffusers import WanPipeline

    case = CASES[name]
    base_dir = ROOT / "golden" / "wan" / BASE
    base_case = pipe_goldens.CASES[BASE]
    cfg = pipe_goldens.case_config(base_case)
    comps = pipe_goldens.load_components(base_dir)
    inp = load_file(base_dir / "inputs.safetensors")
    pipe = WanPipeline(tokenizer=None, text_encoder=comps["text_encoder"], vae=comps["vae"],
                       scheduler=pipe_goldens.make_scheduler(base_case, cfg), transformer=comps["transformer"])
    pipe.load_lora_weights(str(lora_dir), adapter_name="style")
    if case["fuse"]:
        pipe.fuse_lora(lora_scale=case["scale"], adapter_names=["style"])
        pipe.unload_lora_weights()   # (upstream) the fused weights stay; the PEFT layers go
    else:
        pipe.set_adapters(["style"], adapter_weights=[case["scale"]])
    return pipe_goldens.run_upstream(base_case, cfg, comps, inp, "latent")["out"].contiguous()


def write_case(out_root: Path, name: str) -> Path:
    from diffusers import WanPipeline, WanTransformer3DModel

    pipe_goldens._setup()
    case = CASES[name]
    tmp, d = out_root / f".{name}.tmp", out_root / name
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "upstream").mkdir(parents=True)   # the upstream artifact of this case: the LoRA file save_lora_weights wrote
    transformer = WanTransformer3DModel.from_pretrained(ROOT / "golden" / "wan" / BASE / "upstream" / "transformer")
    layers = lora_state(transformer, case["seed"])
    modules = sorted({k.split(".lora_")[0] for k in layers})   # as diffusers' get_peft_kwargs
    WanPipeline.save_lora_weights(tmp / "upstream", transformer_lora_layers=layers,
                                  transformer_lora_adapter_metadata={"r": RANK, "lora_alpha": ALPHA,
                                                                     "target_modules": modules})
    latents = run_case(name, tmp / "upstream")
    assert torch.equal(latents, run_case(name, tmp / "upstream")), f"{name}: not reproducible"
    save_file({"latents": latents}, tmp / "outputs.safetensors")
    save_file({}, tmp / "inputs.safetensors")   # the inputs are the base case's (base_case)
    v = pipe_goldens.versions()
    meta = {"family": "wan", "probe": "wan.generate_lora", "base_case": BASE,
            "upstream": {"package": "diffusers", "version": v.get("diffusers"), "class": "WanPipeline",
                         "lora": "load_lora_weights + " + ("fuse_lora" if case["fuse"] else "set_adapters"),
                         "peft": v.get("peft") or _peft_version(), "torch": v.get("torch")},
            "upstream_format": "diffusers", "dtype": "float32", "seed": case["seed"],
            "tolerance": {"rel_l2": REL_L2_TOL},
            "params": {"adapter_name": "style", "scale": case["scale"], "fused": case["fuse"], "rank": RANK,
                       "lora_alpha": ALPHA, "lora_seed": case["seed"], "lora_file": "upstream/pytorch_lora_weights.safetensors"},
            "description": case["description"]}
    (tmp / "case.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    return d


def _peft_version() -> str:
    import peft
    return peft.__version__


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "golden" / "wan")
    ap.add_argument("--verify", action="store_true", help="re-run upstream and compare with the stored latents")
    args = ap.parse_args()
    for name in CASES:
        if args.verify:
            want = load_file(args.out / name / "outputs.safetensors")["latents"]
            got = run_case(name, args.out / name / "upstream")
            print(name, "equal" if torch.equal(got, want) else f"DIFFERS {(got - want).abs().max().item():.3g}")
        else:
            print("wrote", write_case(args.out, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
