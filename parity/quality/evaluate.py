"""Prompt adherence of a model on a request set, generating with the optimized Engine (the serving path: the
family processor tokenises the caption from the model directory's tokenizer, the default solver of the model).

    from optimized import Engine
    report = held_out_adherence(Engine.from_checkpoint("golden/trained/wan_shapes"))
    report.rate, [s.to_dict() for s in report.scores]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity.quality.adherence import AdherenceScore, adherence_rate, score_clip
from parity.quality.shapes import HELD_OUT, HeldOutRequest

# the generation settings a held-out score is quoted at (the trained wan_shapes model's contract)
FRAMES, SIZE, STEPS, GUIDANCE = 9, (32, 32), 12, 4.0


@dataclass
class AdherenceReport:
    scores: list[AdherenceScore]
    settings: dict = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return adherence_rate(self.scores)

    @property
    def all_correct(self) -> float:
        """The fraction of clips with every scored attribute right."""
        return float(np.mean([s.all_ok for s in self.scores]))

    def to_dict(self) -> dict:
        return {"rate": self.rate, "all_correct": self.all_correct, "settings": self.settings,
                "scores": [s.to_dict() for s in self.scores]}


def engine_clip(engine: Any, caption: str, seed: int, frames: int = FRAMES, size: tuple[int, int] = SIZE,
                steps: int = STEPS, guidance: float = GUIDANCE, **options: Any) -> np.ndarray:
    """One decoded clip, uint8 [F, H, W, 3], through `engine.generate(prompt=...)`."""
    result = engine.generate(prompt=caption, num_frames=frames, height=size[0], width=size[1], num_steps=steps,
                             guidance_scale=guidance, seed=seed, **options)
    frames_out = result.frames
    return frames_out.numpy() if hasattr(frames_out, "numpy") else np.asarray(frames_out)


def held_out_adherence(engine: Any, requests: Iterable[HeldOutRequest] = HELD_OUT, frames: int = FRAMES,
                       size: tuple[int, int] = SIZE, steps: int = STEPS, guidance: float = GUIDANCE,
                       **options: Any) -> AdherenceReport:
    scores = [score_clip(engine_clip(engine, r.caption, r.seed, frames, size, steps, guidance, **options), r.caption)
              for r in requests]
    return AdherenceReport(scores, {"frames": frames, "size": list(size), "steps": steps, "guidance": guidance})


def autoencoder_ceiling(model_dir: Any, requests: Iterable[HeldOutRequest] = HELD_OUT, frames: int = FRAMES,
                        size: tuple[int, int] = SIZE) -> AdherenceReport:
    """The held-out adherence of the model's VAE alone: each request's ground-truth clip (`render_clip`) encoded
    (posterior mode) and decoded by the reference VAE of a wan model directory, scored against its caption. What a
    DiT sampling that VAE's latents can be expected to reach at most (the ground-truth clips themselves score 1.0)."""
    import torch

    from manifests.checkpoint import load_state, read_checkpoint
    from parity.quality.shapes import render_clip
    from reference.wan.vae import WanVAE
    ckpt = read_checkpoint(model_dir)
    vae = WanVAE(ckpt.typed_config().vae)
    vae.load_state_dict(load_state(ckpt, component="vae"))
    vae.eval()
    scores = []
    with torch.no_grad():
        for r in requests:
            x = torch.from_numpy(render_clip(r.caption, r.seed, frames, size)).permute(3, 0, 1, 2)[None] * 2 - 1
            y = vae.decode(vae.encode(x).mode())[0].permute(1, 2, 3, 0)          # [F, H, W, 3] in [-1, 1]
            scores.append(score_clip(((y + 1) * 127.5).round().to(torch.uint8).numpy(), r.caption))
    return AdherenceReport(scores, {"frames": frames, "size": list(size), "round_trip": "vae.decode(encode().mode())"})
