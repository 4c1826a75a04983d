"""fvconvert post-check `wan.image_encoder`: C0 (fp32, CPU) of a freshly converted Wan 2.1 I2V CLIP image encoder, the
clip.py rows (processor pixels, image_embeds with the first diverging layer named, solo, cache) on the CONVERTED
weights. A component directory carries no processor config: the rows use a square processor at the encoder's
image_size (the resize / crop rules are the processor's own rows in C0 and its goldens)."""

from __future__ import annotations

from pathlib import Path

import torch

from manifests.wan.clip import CLIPImageProcessorConfig
from parity.errors import SetupError
from parity.families.wan import clip
from parity.families.wan.common import contract_tolerance


def check_converted_image_encoder(out_dir) -> dict:
    from manifests.checkpoint import CheckpointError, load_state, read_checkpoint

    try:
        ckpt = read_checkpoint(Path(out_dir), family="wan")
        kind = "model" if ckpt.is_model else next(iter(ckpt.components.values())).kind
        if kind != "image_encoder":
            return {"status": "error", "level": "C0", "detail": f"{out_dir} holds a wan {kind}, not an image_encoder"}
        cfg = ckpt.typed_config()
        state = {k: t.float() for k, t in load_state(ckpt).items()}
        pcfg = CLIPImageProcessorConfig(shortest_edge=cfg.image_size, crop_height=cfg.image_size,
                                        crop_width=cfg.image_size)
        tol = contract_tolerance("C0", "image_encoder", "fp32", "cpu")
        checks = clip.clip_checks("image_encoder", cfg, pcfg, state, tol, "cpu", torch.float32, 0, None)
    except (CheckpointError, SetupError) as e:
        return {"status": "error", "level": "C0", "detail": str(e)}
    failed = [c.name for c in checks if not c.passed]
    return {"status": "fail" if failed else "pass", "level": "C0", "dtype": "float32", "device": "cpu",
            "checks": len(checks), "failed": failed}
