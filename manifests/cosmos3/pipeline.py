"""How a cosmos3 diffusers pipeline root (Cosmos3OmniPipeline) becomes one canonical model directory: the
transformer, the wan VAE, the optional sound tokenizer, the tokenizer and scheduler copied, the guardrails left out.
Declared here; converters/pipeline.py runs it (found through manifests/cosmos3/layout.py `LAYOUT.pipeline`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from manifests.errors import ManifestError, PipelineError
from manifests.layouts import PipelineLayout, pipeline_lists, read_pipeline_json

MODEL_INDEX = "model_index.json"

_json, _listed = read_pipeline_json, pipeline_lists   # the pipeline root's files (manifests/layouts.py)


COSMOS3_PIPELINES = ("Cosmos3OmniPipeline",)
COSMOS3_COMPONENTS = {"transformer": ("cosmos3", "diffusers"), "vae": ("wan", "diffusers"),  # AutoencoderKLWan
                      "sound_tokenizer": ("cosmos3", "diffusers-sound")}
COSMOS3_ASSETS = {"text_tokenizer": "tokenizer", "scheduler": "scheduler"}   # pipeline entry -> OUT folder
COSMOS3_NOT_CONVERTED = {
    "safety_checker": "the guardrail models are not part of the canonical cosmos3 model",
}


def _cosmos3_model_config(index: dict, root: Path, cfgs: dict[str, Any], variant: str | None) -> tuple[Any, str]:
    from manifests.cosmos3.model import Cosmos3ModelConfig, unipc_from_scheduler_config

    cls = index.get("_class_name")
    if cls not in COSMOS3_PIPELINES:
        raise PipelineError(f"{root / MODEL_INDEX}: _class_name {cls!r} is not a cosmos3 pipeline this converter "
                              f"knows ({', '.join(COSMOS3_PIPELINES)})")
    sched_path = root / "scheduler" / "scheduler_config.json"
    try:
        # use_native_flow_schedule is a pipeline option (model_index.json), not a scheduler setting (upstream)
        scheduler = unipc_from_scheduler_config(_json(sched_path, "scheduler config"),
                                                bool(index.get("use_native_flow_schedule") or False))
        cfg = Cosmos3ModelConfig(transformer=cfgs["transformer"], vae=cfgs["vae"],
                                 sound=cfgs.get("sound_tokenizer"), scheduler=scheduler).validate()
    except ManifestError as e:
        raise PipelineError(f"{root}: the pipeline does not make a valid cosmos3 model: {e}") from None
    if variant is not None:
        from manifests.cosmos3.config import load_variant
        if load_variant(variant) != cfg.transformer:
            raise PipelineError(f"{root}: the converted transformer is not variant {variant!r}")
    return cfg, cls


def _cosmos3_variants() -> list[str]:
    from manifests.cosmos3.config import list_variants
    return list_variants()


PIPELINE = PipelineLayout(COSMOS3_COMPONENTS, ("transformer", "vae"), COSMOS3_ASSETS, COSMOS3_NOT_CONVERTED,
                          _cosmos3_model_config, _cosmos3_variants)
FORMAT_ALIASES = {"cosmos_framework": "framework"}   # cosmos-framework's own name for its layout
