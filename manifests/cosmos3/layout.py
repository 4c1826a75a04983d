"""cosmos3's canonical layouts (discovered by manifests/layouts.py): the omni transformer (split into parts, so a
reasoner-only release gives a labelled partial checkpoint), the AVAE sound tokenizer, and the whole-model directory
(transformer + a wan VAE + optional sound tokenizer)."""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from manifests.cosmos3 import config as c3
from manifests.cosmos3 import keys as k3
from manifests.cosmos3 import pipeline, sound
from manifests.layouts import ComponentLayout, FamilyLayout, ModelLayout, Part

PARTS: tuple[Part, ...] = (
    ("und", (r"^embed_tokens\.", r"^lm_head\.", r"^und_norm\.", r"^layers\.\d+\.und\.(?!k_norm_for_gen\.)"),
     "understanding (reasoner) pathway: token embedding, und attention/MLP/norms of every layer, final und norm, "
     "lm_head"),
    ("gen", (r"^gen_norm\.", r"^layers\.\d+\.gen\.", r"^layers\.\d+\.und\.k_norm_for_gen\.", r"^time_embed\."),
     "generation pathway: gen attention/MLP/norms of every layer, und k-norm used by gen, final gen norm, "
     "timestep MLP"),
    ("vision_heads", (r"^vision_(in|out)\.",), "vision latent projections in/out"),
    ("sound_heads", (r"^sound_",), "sound latent projections and modality embedding"),
    ("action_heads", (r"^action_",), "action (DomainAwareLinear) projections and modality embedding"),
)
PLACEHOLDER_GAINS = ("norm.weight", "norm_for_gen.weight")   # the placeholder's own rule (k_norm_for_gen too)


def placeholder(key: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Seeded stand-in weights for parts a partial checkpoint lacks (used only inside a parity check)."""
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if key.endswith(PLACEHOLDER_GAINS):
        return 1.0 + 0.1 * x
    if len(shape) == 1 or key.startswith(("action_in.", "action_out.")):
        return 0.1 * x
    if key.startswith(("embed_tokens", "lm_head")):
        return 0.5 * x
    return x / math.sqrt(shape[-1])


def _text_config(c: dict) -> dict:
    tc = c.get("text_config")
    if tc is None:
        return c  # a bare text config
    if not isinstance(tc, dict):
        raise ValueError("text_config must be an object")
    return tc


def from_transformers_config(c: dict) -> dict[str, Any]:
    """transformers reasoner config (`Cosmos3OmniConfig`, Qwen3-VL text tower; or `Cosmos3EdgeConfig`,
    Nemotron-style text tower) -> the Cosmos3Config fields it determines (und pathway only).

    Qwen3-VL text layers always carry q/k RMSNorm and a SiLU-gated MLP; the Edge text tower has neither
    (relu2 fc1/fc2 MLP). Both use interleaved mRoPE with `mrope_section` = rope_axes_dim.
    """
    mt = c.get("model_type")
    tc = _text_config(c)
    edge = mt == "cosmos3_edge" or tc.get("model_type") == "cosmos3_edge_text"
    rp = tc.get("rope_parameters") or {}
    rs = tc.get("rope_scaling") or {}
    theta = rp.get("rope_theta", tc.get("rope_theta", 1e8 if edge else 5e6))
    section = rp.get("mrope_section") or rs.get("mrope_section") or [24, 20, 20]
    rope_type = rp.get("rope_type") or rs.get("rope_type") or "default"
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"rope_type {rope_type!r} is not the plain (default) rotary embedding the canonical model uses")
    fields: dict[str, Any] = {
        "hidden_size": tc.get("hidden_size", 2048 if edge else 4096),
        "num_layers": tc.get("num_hidden_layers", 28 if edge else 32),
        "num_heads": tc.get("num_attention_heads", 16 if edge else 32),
        "num_kv_heads": tc.get("num_key_value_heads") or tc.get("num_attention_heads", 16 if edge else 32),
        "head_dim": tc.get("head_dim", 128),
        "intermediate_size": tc.get("intermediate_size", 9216 if edge else 22016),
        "vocab_size": tc.get("vocab_size", 131072 if edge else 151936),
        "attention_bias": bool(tc.get("attention_bias", False)),
        "rms_norm_eps": tc.get("rms_norm_eps", 1e-5 if edge else 1e-6),
        "hidden_act": tc.get("hidden_act", "relu2" if edge else "silu"),
        "qk_norm_for_text": not edge,
        "rope_theta": float(theta),
        "rope_axes_dim": tuple(section),
    }
    if edge and tc.get("mlp_bias"):
        raise ValueError("mlp_bias=true: the canonical cosmos3 MLP has no biases")
    return fields


def _model_components(cfg) -> dict[str, tuple[str, Any]]:
    # the VAE is a diffusers AutoencoderKLWan: stored (and read) with the wan VAE layout ("family:kind")
    out = {"transformer": ("transformer", cfg.transformer), "vae": ("wan:vae", cfg.vae)}
    if cfg.sound is not None:
        out["sound_tokenizer"] = ("sound", cfg.sound)
    return out


def _model_config(d: dict) -> Any:
    from manifests.cosmos3.model import Cosmos3ModelConfig   # imports the wan VAE config: only when a model dir is read
    return Cosmos3ModelConfig.from_dict(d)


LAYOUT = FamilyLayout(
    name="cosmos3",
    components=(
        ComponentLayout("cosmos3", "transformer", c3.Cosmos3Config.from_dict, k3.canonical_key_shapes, k3.fp32_keys,
                        PARTS, load_variant=c3.load_variant, list_variants=c3.list_variants,
                        config_mappings={"diffusers_transformer_config": c3.Cosmos3Config.from_diffusers_config,
                                         "transformers_reasoner_config": from_transformers_config},
                        layer_key=re.compile(r"^layers\.(\d+)\."), num_layers_field="num_layers",
                        placeholder=placeholder),
        # the AVAE sound tokenizer (diffusers Cosmos3AVAEAudioTokenizer names); no truncatable layer list
        ComponentLayout("cosmos3", "sound", sound.Cosmos3SoundConfig.from_dict, sound.canonical_key_shapes,
                        reader_drops_description=True, load_variant=sound.load_variant,
                        list_variants=sound.list_variants,
                        config_mappings={"cosmos3_sound_config": sound.Cosmos3SoundConfig.from_diffusers_config},
                        num_layers_field="dec_dim"),
    ),
    model=ModelLayout(_model_config, _model_components),
    pipeline=pipeline.PIPELINE,               # a diffusers pipeline root -> one model directory (pipeline.py)
    format_aliases=pipeline.FORMAT_ALIASES,
)
