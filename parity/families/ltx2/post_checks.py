"""ltx2 component post-checks for fvconvert (FAMILY's component_post_checks).

The component manifests manifests/ltx2/checkpoints/{diffusers-connectors,transformers-gemma3,diffusers-vae,
diffusers-audio-vae,diffusers-vocoder}.json name `ltx2.connectors`, `ltx2.text_encoder`, `ltx2.vae`,
`ltx2.audio_vae`, `ltx2.vocoder`: each is C0 (reference vs optimized, fp32 CPU) on the converted component dir."""

from __future__ import annotations

import torch

from manifests.ltx2.connectors import (
    connector_key_shapes,
    load_connectors_variant,
)
from manifests.ltx2.gemma3 import TINY, gemma3_key_shapes
from optimized.models.ltx2.connectors import load_connectors as fast_connectors
from optimized.models.ltx2.gemma3 import FastGemma3Text
from parity.families.ltx2.media import AUDIO_DECODE, VIDEO_DECODE, VOCODER
from parity.port.kit import PortedSides
from reference.ltx2.connectors import load_connectors as ref_connectors
from reference.ltx2.gemma3 import hidden_states


def connector_inputs(cfg, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 7)
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, :3] = 0                                        # left padding (Gemma's side)
    return {"text_encoder_hidden_states": torch.randn(2, 8, cfg.caption_channels * cfg.text_proj_in_factor,
                                                      generator=g), "attention_mask": mask}


class _Connectors:
    def __init__(self, model):
        self.model = model

    def __call__(self, text_encoder_hidden_states, attention_mask, trace=None):
        vid, aud, _ = self.model(text_encoder_hidden_states, attention_mask, padding_side="left", trace=trace)
        return vid, aud                                    # the output mask is all ones on both sides (upstream)


CONNECTORS = PortedSides(
    family="ltx2", load_variant=load_connectors_variant, key_shapes=connector_key_shapes,
    gains=("norm_q.weight", "norm_k.weight"), make_inputs=connector_inputs,
    reference=lambda cfg, state, device="cpu", dtype=torch.float32: _Connectors(ref_connectors(cfg, state, device,
                                                                                               dtype)),
    optimized=lambda cfg, state, device="cpu", dtype=torch.float32: _Connectors(fast_connectors(cfg, state, device,
                                                                                                dtype)),
    default_variants=("tiny",), fault_key="video_connector.transformer_blocks.1.ff.net.2.weight",
    fault_layer="video_connector.transformer_blocks.1")


def gemma_inputs(cfg, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 11)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _gemma_variant(name: str):
    if name != "tiny":
        from manifests.errors import ManifestError
        raise ManifestError(f"ltx2 text encoder: unknown variant {name!r}; variants: tiny")
    return TINY


def _ref_gemma(cfg, state, device="cpu", dtype=torch.float32):
    state = {k: v.to(device, dtype) for k, v in state.items()}
    return lambda input_ids, attention_mask, trace=None: hidden_states(state, cfg, input_ids, attention_mask)


def _fast_gemma(cfg, state, device="cpu", dtype=torch.float32):
    model = FastGemma3Text(cfg, {k: v.to(device) for k, v in state.items()}, dtype)
    return lambda input_ids, attention_mask, trace=None: model(input_ids, attention_mask)


TEXT_ENCODER = PortedSides(family="ltx2", load_variant=_gemma_variant, key_shapes=gemma3_key_shapes,
                           gains=("<no gain>",), make_inputs=gemma_inputs, reference=_ref_gemma,
                           optimized=_fast_gemma, default_variants=("tiny",),
                           fault_key="layers.1.mlp.down_proj.weight", fault_layer="layers.1")

COMPONENT_POST_CHECKS = {
    "ltx2.connectors": CONNECTORS.check_converted, "ltx2.text_encoder": TEXT_ENCODER.check_converted,
    "ltx2.vae": VIDEO_DECODE.check_converted, "ltx2.audio_vae": AUDIO_DECODE.check_converted,
    "ltx2.vocoder": VOCODER.check_converted,
}
