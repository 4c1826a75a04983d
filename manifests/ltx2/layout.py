"""ltx2's canonical layouts (discovered by manifests/layouts.py): the LTX2VideoTransformer3DModel (the family's
default component), the text connectors, the Gemma 3 text encoder, the video VAE, the audio VAE, the vocoder, and
the whole-model directory (all six: manifests/ltx2/model.py) a diffusers LTX2Pipeline root converts into
(manifests/ltx2/pipeline.py)."""

from __future__ import annotations

import re
from typing import Any

from manifests.layouts import ComponentLayout, FamilyLayout, ModelLayout
from manifests.ltx2 import audio_vae as av
from manifests.ltx2 import config as cf
from manifests.ltx2 import connectors as cn
from manifests.ltx2 import gemma3 as gm
from manifests.ltx2 import keys as ks
from manifests.ltx2 import pipeline
from manifests.ltx2 import video_vae as vv
from manifests.ltx2 import vocoder as vc

NO_GAINS = ("<no gain>",)   # a suffix no key has: Gemma's norms are (1 + w), the vocoder has none


def _model_config(d: dict) -> Any:
    from manifests.ltx2.model import Ltx2ModelConfig
    return Ltx2ModelConfig.from_dict(d)


def _model_components(cfg) -> dict[str, tuple[str, Any]]:
    return {name: (name, c) for name, c in cfg.components().items()}


def _gemma_from_dict(d: dict) -> Any:
    from manifests.ltx2.model import gemma_from_dict
    return gemma_from_dict(d)


def _gemma_to_dict(c: Any) -> dict:
    from manifests.ltx2.model import gemma_to_dict
    return gemma_to_dict(c)


def _by_model_variant(pick: str):
    def load(name: str) -> Any:
        from manifests.ltx2.model import load_model_variant
        return getattr(load_model_variant(name), pick)
    return load


def _model_variants() -> list[str]:
    from manifests.ltx2.model import list_model_variants
    return list_model_variants()


LAYOUT = FamilyLayout(
    name="ltx2",
    components=(
        ComponentLayout("ltx2", "transformer", cf.Ltx2Config.from_dict, ks.key_shapes, ks.fp32_keys,
                        load_variant=cf.load_variant, list_variants=cf.list_variants,
                        config_mappings={"ltx2_diffusers_config": cf.Ltx2Config.from_diffusers_config},
                        layer_key=re.compile(r"^transformer_blocks\.(\d+)\."), num_layers_field="num_layers", gains=ks.GAINS),
        ComponentLayout("ltx2", "connectors", cn.Ltx2ConnectorsConfig.from_dict, cn.connector_key_shapes,
                        load_variant=cn.load_connectors_variant, list_variants=lambda: sorted(cn.VARIANTS),
                        config_mappings={"ltx2_connectors_config": cn.Ltx2ConnectorsConfig.from_diffusers_config},
                        num_layers_field="video_connector_num_layers", gains=("norm_q.weight", "norm_k.weight")),
        ComponentLayout("ltx2", "text_encoder", _gemma_from_dict, gm.gemma3_key_shapes, config_to_dict=_gemma_to_dict,
                        load_variant=_by_model_variant("text_encoder"), list_variants=_model_variants,
                        config_mappings={"ltx2_gemma3_config": gm.Gemma3TextSpec.from_transformers_config},
                        layer_key=re.compile(r"^layers\.(\d+)\."), num_layers_field="num_hidden_layers",
                        gains=NO_GAINS),
        ComponentLayout("ltx2", "vae", vv.Ltx2VideoVaeConfig.from_dict, vv.video_vae_key_shapes,
                        load_variant=vv.load_video_vae_variant, list_variants=vv.list_video_vae_variants,
                        config_mappings={"ltx2_video_vae_config": vv.Ltx2VideoVaeConfig.from_diffusers_config},
                        num_layers_field="patch_size", gains=vv.VIDEO_VAE_GAINS),
        ComponentLayout("ltx2", "audio_vae", av.Ltx2AudioVaeConfig.from_dict, av.audio_vae_key_shapes,
                        load_variant=av.load_audio_vae_variant, list_variants=av.list_audio_vae_variants,
                        config_mappings={"ltx2_audio_vae_config": av.Ltx2AudioVaeConfig.from_diffusers_config},
                        num_layers_field="num_res_blocks", gains=av.AUDIO_VAE_GAINS),
        ComponentLayout("ltx2", "vocoder", vc.Ltx2VocoderConfig.from_dict, vc.vocoder_key_shapes,
                        load_variant=vc.load_vocoder_variant, list_variants=vc.list_vocoder_variants,
                        config_mappings={"ltx2_vocoder_config": vc.Ltx2VocoderConfig.from_diffusers_config},
                        num_layers_field="hidden_channels", gains=NO_GAINS),
    ),
    model=ModelLayout(_model_config, _model_components),
    pipeline=pipeline.PIPELINE,               # a diffusers LTX2Pipeline root -> one model directory (pipeline.py)
    source_aliases=pipeline.SOURCE_ALIASES,
)
