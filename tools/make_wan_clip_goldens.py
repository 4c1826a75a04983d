#!/usr/bin/env python
"""Make golden cases for probe ``wan.clip_vision``: transformers ``CLIPVisionModel`` + ``CLIPImageProcessor`` (PIL
backend) as WanImageToVideoPipeline.encode_image runs them (``hidden_states[-2]``), tiny configs, seeded random
weights, procedurally drawn images of different aspect ratios.

    python tools/make_wan_clip_goldens.py --out golden              # golden/wan/clip_vision, clip_vision_quick
    python tools/make_wan_clip_goldens.py --out golden --only clip_vision

Each case: case.json (config = the transformers CLIPVisionConfig, params.processor = preprocessor_config.json),
upstream/model.safetensors, inputs image_<k> (uint8 [H, W, 3]), outputs pixel_values, image_embeds and the
intermediates image_embeds@encoder.layers.<i> (hidden_states[i + 1], i < L - 2).
Needs transformers (5.24.0 was used), pillow, torch, safetensors.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

CASES = {
    "clip_vision": dict(seed=700, act="gelu", sizes=((45, 31), (30, 52), (28, 28)), shortest_edge=28, crop=28,
                        description="tiny CLIP vision tower (exact GELU, as Wan 2.1's ViT-H/14), 3 layers: a "
                                    "portrait, a landscape and a square image -> pixel values, hidden_states[-2]"),
    "clip_vision_quick": dict(seed=710, act="quick_gelu", sizes=((20, 33), (61, 40)), shortest_edge=14, crop=21,
                              description="tiny CLIP vision tower with quick GELU; a crop larger than the resized "
                                          "images (upstream zero-pads them, centred) in one or both edges"),
}


def image(seed: int, h: int, w: int) -> np.ndarray:
    g = np.random.RandomState(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([128 + 100 * np.sin(xx / 5 + c) * np.cos(yy / 7 - c) for c in range(3)], -1)
    return np.clip(base + 20 * g.randn(h, w, 3), 0, 255).astype(np.uint8)


def make_case(out: Path, name: str) -> Path:
    import transformers
    from PIL import Image
    from transformers import CLIPVisionConfig, CLIPVisionModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    spec = CASES[name]
    torch.manual_seed(spec["seed"])
    crop = spec["crop"]
    tc = CLIPVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
                          image_size=crop, patch_size=7, hidden_act=spec["act"])
    model = CLIPVisionModel(tc).eval()
    proc = CLIPImageProcessorPil(size={"shortest_edge": spec["shortest_edge"]},
                                 crop_size={"height": tc.image_size, "width": tc.image_size})
    images = [image(spec["seed"] + i, h, w) for i, (h, w) in enumerate(spec["sizes"])]
    pixels = proc(images=[Image.fromarray(im) for im in images], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        hidden = model(pixel_values=pixels, output_hidden_states=True).hidden_states
    outputs = {"pixel_values": pixels.contiguous(), "image_embeds": hidden[-2].contiguous()}
    intermediates = []
    for i in range(tc.num_hidden_layers - 2):   # layer L-2's output is image_embeds itself
        outputs[f"image_embeds@encoder.layers.{i}"] = hidden[i + 1].contiguous()
        intermediates.append(f"image_embeds@encoder.layers.{i}")
    case = out / "wan" / name
    shutil.rmtree(case, ignore_errors=True)
    (case / "upstream").mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(case / "upstream" / "model.safetensors"))
    save_file({f"image_{i}": torch.from_numpy(im) for i, im in enumerate(images)}, str(case / "inputs.safetensors"))
    save_file(outputs, str(case / "outputs.safetensors"))
    config = {k: v for k, v in tc.to_dict().items() if k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size", "patch_size",
        "num_channels", "layer_norm_eps", "hidden_act")}
    meta = {"family": "wan", "probe": "wan.clip_vision",
            "upstream": {"package": "transformers", "version": transformers.__version__,
                         "class": "CLIPVisionModel + CLIPImageProcessor (PIL backend)", "torch": torch.__version__},
            "upstream_format": "transformers", "dtype": "float32", "seed": spec["seed"],
            "tolerance": {"rel_l2": 1e-5}, "config": config,
            "params": {"processor": proc.to_dict() | {"image_processor_type": "CLIPImageProcessor"}},
            "intermediates": intermediates, "description": spec["description"]}
    meta["params"]["processor"] = {k: v for k, v in meta["params"]["processor"].items()
                                   if k in ("do_resize", "size", "resample", "do_center_crop", "crop_size",
                                            "do_rescale", "rescale_factor", "do_normalize", "image_mean",
                                            "image_std", "do_convert_rgb", "image_processor_type")}
    (case / "case.json").write_text(json.dumps(meta, indent=2) + "\n")
    return case


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("golden"))
    ap.add_argument("--only", action="append", choices=sorted(CASES))
    args = ap.parse_args(argv)
    for name in args.only or sorted(CASES):
        print(make_case(args.out, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
