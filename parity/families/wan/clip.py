"""wan CLIP image encoder (Wan 2.1 I2V) C0: the reference `CLIPVisionEncoder` + `preprocess_image` vs the optimized
`CLIPVisionFast` + `CLIPPixels`, and the upstream golden probe `wan.clip_vision` (transformers CLIPVisionModel +
CLIPImageProcessor).

Rows per model with an image branch, per dtype (two images of different aspect ratios, one portrait, one landscape,
so the resize's long-edge rule and the centre crop both matter):
    pixels           the processor's pixel values, each side its own implementation (exact: uint8 resize by PIL,
                     then the same float32 arithmetic)
    image_embeds     the penultimate layer's hidden states of the batch of two; a failing row names the first
                     encoder layer whose output diverges (both sides traced)
    solo             each image alone equals its row of the batch
    cache            the same images again: served from the content-keyed cache (no encoder call), bitwise equal
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

from manifests.parity import Tolerance
from manifests.wan.clip import (CLIP_VARIANTS, PROCESSOR_VARIANTS, CLIPImageProcessorConfig, CLIPVisionConfig,
                                clip_variant_for, clip_vision_key_shapes)
from parity.errors import SetupError
from parity.family import golden_probe
from parity.localise import first_divergence
from parity.report import CheckResult, tensor_check as check
from parity.weights import random_state_dict

from optimized.models.wan.image_encoder import CLIPPixels, load_fast_clip
from reference.wan.image_encoder import load_clip_vision, preprocess_image

FAULT = "clip-perturbed-weight"
FAULT_LAYER = 0


def test_images(seed: int) -> list[np.ndarray]:
    """A portrait and a landscape uint8 image with smooth structure plus noise (so bicubic resizing matters)."""
    g = np.random.RandomState(seed)
    out = []
    for h, w in ((45, 31), (30, 52)):
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([128 + 100 * np.sin(xx / 5 + c) * np.cos(yy / 7 - c) for c in range(3)], -1)
        out.append(np.clip(base + 20 * g.randn(h, w, 3), 0, 255).astype(np.uint8))
    return out


@contextlib.contextmanager
def planted(fault: str | None, fast) -> Iterator[None]:
    """clip-perturbed-weight: one weight of the optimized encoder's layer-0 MLP nudged."""
    if fault != FAULT:
        yield
        return
    w = fast.params[f"encoder.layers.{FAULT_LAYER}.mlp.fc1.weight"]
    saved = w.clone()
    w.view(-1)[0] += 0.5 * w.abs().max()
    fast._cache.clear()
    try:
        yield
    finally:
        w.copy_(saved)
        fast._cache.clear()


def _traced(run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    records: dict[str, torch.Tensor] = {}
    out = run(lambda name, t: records.__setitem__(name, t.detach().clone()))
    return out, records


def clip_checks(prefix: str, cfg: CLIPVisionConfig, pcfg: CLIPImageProcessorConfig, state: dict, tol: Tolerance,
                device: str, dtype: torch.dtype, seed: int, fault: str | None) -> list[CheckResult]:
    reference = load_clip_vision(cfg, state, device, dtype)
    fast = load_fast_clip(cfg, state, device, dtype)
    images = test_images(seed)
    want_pixels = torch.cat([preprocess_image(im, pcfg) for im in images])
    got_pixels = CLIPPixels(pcfg)(images)
    checks = [check(f"{prefix}/pixels", got_pixels, want_pixels, Tolerance(max_abs=0.0), "image_processor",
                    f"{[list(im.shape) for im in images]} -> {list(want_pixels.shape)} (resize, crop, normalise)")]
    pixels = want_pixels.to(device)
    with torch.no_grad():
        want, ref_trace = _traced(lambda tr: reference(pixels, trace=tr))
    with planted(fault, fast):
        got, fast_trace = _traced(lambda tr: fast.forward(pixels, trace=tr))
        div = first_divergence(fast_trace, ref_trace, tol)
        where = div.name if div is not None else "image_encoder (no traced layer out of tolerance)"
        checks.append(check(f"{prefix}/image_embeds", got, want, tol, where,
                            f"hidden_states[-2] of {list(pixels.shape)} -> {list(want.shape)}"))
        solo = torch.cat([fast.forward(pixels[i:i + 1]) for i in range(len(images))])
        checks.append(CheckResult(f"{prefix}/solo", bool(torch.equal(solo, got)),
                                  detail="each image alone bitwise equal to its row of the batch",
                                  divergence=None if torch.equal(solo, got) else "image_encoder (batch rows mix)"))
        first = fast.encode(pixels)
        calls = fast.forward_calls
        again = fast.encode(pixels)
        ok = fast.forward_calls == calls and torch.equal(first, again) and torch.equal(first, got)
        checks.append(CheckResult(f"{prefix}/cache", ok, detail=f"second encode: {fast.forward_calls - calls} encoder "
                                  f"calls (0 wanted), bitwise equal", divergence=None if ok else "image_encoder.cache"))
    return checks


def clip_rows(prefix: str, image_dim: int, tol: Tolerance, device: str, dtype: torch.dtype, seed: int,
              fault: str | None) -> list[CheckResult]:
    """The rows for a DiT whose image branch is `image_dim` wide, with seeded random encoder weights."""
    name = clip_variant_for(image_dim)
    cfg, pcfg = CLIP_VARIANTS[name], PROCESSOR_VARIANTS[name]
    if name != "tiny":
        raise SetupError(f"CLIP image encoder {name}: C0 runs the tiny encoder on CPU only (a released-size "
                         f"ViT-H/14 is a GPU benchmark)")
    state = random_state_dict(clip_vision_key_shapes(cfg), seed + 7)
    return clip_checks(f"{prefix}/image_encoder", cfg, pcfg, state, tol, device, dtype, seed, fault)


# ------------------------------------------------------------------------------------------------
# Golden probe
# ------------------------------------------------------------------------------------------------

@golden_probe(("pixel_values", "image_embeds"), ("image_embeds@*",))
def golden_clip_probe(case, sides) -> list[CheckResult]:
    """case.config: the transformers CLIPVisionConfig; params.processor: the preprocessor_config.json dict; inputs
    image_<k> (uint8 [H, W, 3]); outputs pixel_values [K, 3, S, S], image_embeds [K, N, D] (hidden_states[-2]) and,
    optionally, image_embeds@encoder.layers.<i> (hidden_states[i + 1]: localisation against upstream)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from parity.golden import intermediate_checks

    try:
        cfg = CLIPVisionConfig.from_transformers_config(case.meta["config"])
        pcfg = CLIPImageProcessorConfig.from_preprocessor_config(case.meta["params"]["processor"])
        state = load_file(str(case.path / "upstream" / "model.safetensors"))
    except KeyError as e:
        raise SetupError(f"golden case {case.path}: missing {e}") from None
    except (OSError, SafetensorError) as e:
        raise SetupError(f"golden case {case.path}: cannot read upstream/model.safetensors ({e})") from None
    images = [case.inputs[k].numpy() for k in sorted(case.inputs) if k.startswith("image_")]
    tol = case.tolerance
    results = []
    for side in sides:
        if side == "reference":
            pixels = torch.cat([preprocess_image(im, pcfg) for im in images])
            model = load_clip_vision(cfg, state)
            embeds, traced = _traced(lambda tr: model(pixels, trace=tr))
        else:
            pixels = CLIPPixels(pcfg)(images)
            fast = load_fast_clip(cfg, state)
            embeds, traced = _traced(lambda tr: fast.forward(pixels, trace=tr))
        exact = Tolerance(max_abs=0.0)  # Tolerance() bounds nothing: within() would pass any pixels
        results.append(check(f"{case.name}/{side}:pixel_values", pixels, case.outputs["pixel_values"], exact,
                             "image_processor"))
        results.append(check(f"{case.name}/{side}:image_embeds", embeds, case.outputs["image_embeds"], tol,
                             "image_encoder"))
        results += intermediate_checks(case, side, "image_embeds", traced, tol)
    return results


PROBES = {"wan.clip_vision": golden_clip_probe}
