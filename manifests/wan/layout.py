"""wan's canonical layouts (discovered by manifests/layouts.py): the Wan 2.1 / 2.2 VAE (the family's default
component: it was wan's only converted component before components were recorded), the DiT, the UMT5 text encoder,
2.1 I2V's CLIP image encoder, and the whole-model directory (DiT expert(s) + text encoder + VAE [+ image encoder])."""

from __future__ import annotations

import re
from typing import Any, Callable

from manifests.layouts import ComponentLayout, FamilyLayout, ModelLayout
from manifests.wan import clip, pipeline
from manifests.wan import config as wc
from manifests.wan import dit
from manifests.wan import keys as wk


def vae_from_config(c: dict) -> Any:
    """A Wan VAE config.json -> WanVAEConfig: a diffusers `AutoencoderKLWan` config (it has `_class_name` or
    diffusers' `temperal_downsample` spelling), else our own canonical config (WanVAEConfig.to_dict)."""
    cls_name = c.get("_class_name")
    if cls_name is not None and cls_name != "AutoencoderKLWan":
        raise ValueError(f"_class_name is {cls_name!r}, not the AutoencoderKLWan config a Wan VAE needs")
    if cls_name is not None or "temperal_downsample" in c:
        return wc.WanVAEConfig.from_diffusers_config(c)
    return wc.WanVAEConfig.from_dict({k: v for k, v in c.items() if k != "description"})


def dit_from_config(c: dict) -> Any:
    """A DiT config.json -> WanDiTConfig: a diffusers `WanTransformer3DModel` config (`_class_name`, or diffusers'
    `num_attention_heads` spelling), else our own canonical config (WanDiTConfig.to_dict)."""
    cls_name = c.get("_class_name")
    if cls_name is not None and cls_name != "WanTransformer3DModel":
        raise ValueError(f"_class_name is {cls_name!r}, not the WanTransformer3DModel config a Wan DiT needs")
    if cls_name is not None or "num_attention_heads" in c:
        return dit.WanDiTConfig.from_diffusers_config(c)
    return dit.WanDiTConfig.from_dict({k: v for k, v in c.items() if k != "description"})


def umt5_from_config(c: dict) -> Any:
    """A text-encoder config.json -> UMT5Config: a transformers `UMT5Config` (model_type umt5), else ours."""
    if c.get("model_type") is not None or "architectures" in c:
        if c.get("model_type") not in (None, "umt5"):
            raise ValueError(f"model_type is {c.get('model_type')!r}, not the umt5 a Wan text encoder needs")
        return dit.UMT5Config.from_transformers_config(c)
    return dit.UMT5Config.from_dict({k: v for k, v in c.items() if k != "description"})


def clip_from_config(c: dict) -> Any:
    """An image-encoder config.json -> CLIPVisionConfig: a transformers CLIPVisionConfig (model_type
    clip_vision_model, or a CLIPConfig's vision_config), else our own canonical config (CLIPVisionConfig.to_dict)."""
    if c.get("model_type") is not None or "architectures" in c:
        if c.get("model_type") not in (None, "clip_vision_model", "clip"):
            raise ValueError(f"model_type is {c.get('model_type')!r}, not the clip_vision_model a Wan 2.1 I2V image "
                             f"encoder needs")
        return clip.CLIPVisionConfig.from_transformers_config(c)
    return clip.CLIPVisionConfig.from_dict({k: v for k, v in c.items() if k != "description"})


def _clip_variant(name: str) -> Any:
    if name not in clip.CLIP_VARIANTS:
        from manifests.errors import ManifestError
        raise ManifestError(f"wan image_encoder: unknown variant {name!r}; known: {', '.join(sorted(clip.CLIP_VARIANTS))}")
    return clip.CLIP_VARIANTS[name]


def _model_variant(pick: Callable[[Any], Any]) -> Callable[[str], Any]:
    """--variant for a DiT / UMT5 component names a whole wan model variant (manifests/wan/models/)."""
    def load(name: str) -> Any:
        from manifests.wan.model import load_model_variant
        return pick(load_model_variant(name))
    return load


def _model_variants() -> list[str]:
    from manifests.wan.model import list_model_variants
    return list_model_variants()


def _model_config(d: dict) -> Any:
    from manifests.wan.model import WanModelConfig
    return WanModelConfig.from_dict(d)


def _model_components(cfg) -> dict[str, tuple[str, Any]]:
    out = {"transformer": ("transformer", cfg.dit), "text_encoder": ("text_encoder", cfg.text_encoder),
           "vae": ("vae", cfg.vae)}
    if cfg.dit_2 is not None:
        out["transformer_2"] = ("transformer", cfg.dit_2)
    if cfg.image_encoder is not None:
        out["image_encoder"] = ("image_encoder", cfg.image_encoder)
    return out


LAYOUT = FamilyLayout(
    name="wan",
    components=(
        # the VAE (diffusers AutoencoderKLWan names); a VAE has no truncatable layer list (num_res_blocks only read)
        ComponentLayout("wan", "vae", wc.WanVAEConfig.from_dict, wk.canonical_key_shapes,
                        reader_drops_description=True, load_variant=wc.load_variant, list_variants=wc.list_variants,
                        config_mappings={"wan_vae_config": vae_from_config}, num_layers_field="num_res_blocks"),
        # the DiT (diffusers WanTransformer3DModel names)
        ComponentLayout("wan", "transformer", dit.WanDiTConfig.from_dict, dit.dit_key_shapes, dit.dit_fp32_keys,
                        reader_drops_description=True, load_variant=_model_variant(lambda m: m.dit),
                        list_variants=_model_variants, config_mappings={"wan_dit_config": dit_from_config},
                        layer_key=re.compile(r"^blocks\.(\d+)\."), num_layers_field="num_layers"),
        # UMT5 (transformers UMT5EncoderModel names)
        ComponentLayout("wan", "text_encoder", dit.UMT5Config.from_dict, dit.umt5_key_shapes,
                        reader_drops_description=True, load_variant=_model_variant(lambda m: m.text_encoder),
                        list_variants=_model_variants, config_mappings={"wan_umt5_config": umt5_from_config},
                        layer_key=re.compile(r"^encoder\.block\.(\d+)\."), num_layers_field="num_layers"),
        # 2.1 I2V's CLIP vision tower (transformers CLIPVisionModel 5.x names, manifests/wan/clip.py)
        ComponentLayout("wan", "image_encoder", clip.CLIPVisionConfig.from_dict, clip.clip_vision_key_shapes,
                        reader_drops_description=True, load_variant=_clip_variant,
                        list_variants=lambda: sorted(clip.CLIP_VARIANTS),
                        config_mappings={"wan_clip_vision_config": clip_from_config},
                        layer_key=re.compile(r"^encoder\.layers\.(\d+)\."), num_layers_field="num_layers",
                        gains=("layer_norm1.weight", "layer_norm2.weight", "pre_layrnorm.weight",
                               "post_layernorm.weight")),
    ),
    model=ModelLayout(_model_config, _model_components),
    pipeline=pipeline.PIPELINE,               # a diffusers pipeline root -> one model directory (pipeline.py)
    source_aliases=pipeline.SOURCE_ALIASES,
)
