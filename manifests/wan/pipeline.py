"""How a Wan diffusers pipeline root (WanPipeline, WanImageToVideoPipeline; Wan 2.2 TI2V is a WanPipeline with
expand_timesteps) becomes one canonical model directory: which entries are written with which manifest, which are
copied, and the WanModelConfig read from the pipeline's files. Declared here, next to the family; converters/
pipeline.py runs it (found through manifests/wan/layout.py `LAYOUT.pipeline`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from manifests.errors import ManifestError, PipelineError
from manifests.layouts import PipelineLayout, pipeline_lists, read_pipeline_json

MODEL_INDEX = "model_index.json"

_json, _listed = read_pipeline_json, pipeline_lists   # the pipeline root's files (manifests/layouts.py)


WAN_PIPELINES = {"WanPipeline": "t2v", "WanImageToVideoPipeline": "i2v"}
WAN_COMPONENTS = {"transformer": ("wan", "diffusers-transformer"), "transformer_2": ("wan", "diffusers-transformer"),
                  "text_encoder": ("wan", "transformers-umt5"), "vae": ("wan", "diffusers"),
                  "image_encoder": ("wan", "transformers-clip")}       # 2.1 I2V: transformers CLIPVisionModel
WAN_ASSETS = {"tokenizer": "tokenizer", "scheduler": "scheduler"}
# copied verbatim when the pipeline lists them; 2.1 I2V's CLIPImageProcessor config is also read into the model config
WAN_OPTIONAL_ASSETS = {"image_processor": "image_processor"}
WAN_NOT_CONVERTED: dict[str, str] = {}
PREPROCESSOR_CONFIG = "preprocessor_config.json"
SCHEDULERS = {"UniPCMultistepScheduler": ("unipc", "flow_shift"), "FlowMatchEulerDiscreteScheduler": ("euler", "shift")}


def _wan_precheck(index: dict, root: Path) -> None:
    """A Wan 2.1 I2V root (its DiT has an image branch) must hold the CLIP image encoder and its processor: the model
    computes the image embeddings from each request's image with them (one error naming what is missing)."""
    try:
        image_dim = json.loads((root / "transformer" / "config.json").read_text()).get("image_dim")
    except (OSError, ValueError, AttributeError):
        return      # the transformer's own conversion says what is wrong with it
    if image_dim is None:
        return
    lacking = [f"{name}/ ({what})" for name, what, need in (
        ("image_encoder", "a transformers CLIPVisionModel", "config.json"),
        ("image_processor", "a CLIPImageProcessor", PREPROCESSOR_CONFIG))
        if not (_listed(index, name) and (root / name / need).is_file())]
    if lacking:
        raise PipelineError(f"{root}: a Wan 2.1 I2V pipeline (its transformer has an image branch, image_dim "
                              f"{image_dim}) needs {' and '.join(lacking)}: the model computes each request's image "
                              f"embeddings with them; convert the complete diffusers pipeline root")


def _wan_image_processor(index: dict, root: Path) -> Any:
    from manifests.wan.clip import CLIPImageProcessorConfig
    if not _listed(index, "image_processor"):
        return None
    path = root / "image_processor" / PREPROCESSOR_CONFIG
    try:
        return CLIPImageProcessorConfig.from_preprocessor_config(_json(path, "image processor config"))
    except ManifestError as e:
        raise PipelineError(f"{path}: {e}") from None


def _wan_model_config(index: dict, root: Path, cfgs: dict[str, Any], variant: str | None) -> tuple[Any, str]:
    from manifests.wan.model import WanModelConfig, load_model_variant

    cls = index.get("_class_name")
    if cls not in WAN_PIPELINES:
        raise PipelineError(f"{root / MODEL_INDEX}: _class_name {cls!r} is not a wan pipeline this converter knows "
                              f"({', '.join(WAN_PIPELINES)})")
    expand = bool(index.get("expand_timesteps") or False)
    task = "ti2v" if expand else WAN_PIPELINES[cls]   # Wan2.2 TI2V 5B is a WanPipeline with expand_timesteps
    sched_path = root / "scheduler" / "scheduler_config.json"
    sched = _json(sched_path, "scheduler config")
    if sched.get("_class_name") not in SCHEDULERS:
        raise PipelineError(f"{sched_path}: scheduler {sched.get('_class_name')!r} is not one the wan model knows "
                              f"({', '.join(SCHEDULERS)})")
    solver, shift_field = SCHEDULERS[sched["_class_name"]]
    base = load_model_variant(variant) if variant else None
    try:
        cfg = WanModelConfig(
            task=task, dit=cfgs["transformer"], text_encoder=cfgs["text_encoder"], vae=cfgs["vae"],
            dit_2=cfgs.get("transformer_2"),
            boundary_ratio=index.get("boundary_ratio") if "transformer_2" in cfgs else None,
            expand_timesteps=expand,
            # not in the pipeline files (a __call__ argument, default 512): from --variant when given
            max_sequence_length=base.max_sequence_length if base else 512,
            num_train_timesteps=int(sched.get("num_train_timesteps", 1000)),
            flow_shift=float(sched.get(shift_field, 1.0)), solver=solver,
            image_encoder=cfgs.get("image_encoder"), image_processor=_wan_image_processor(index, root)).validate()
    except ManifestError as e:
        raise PipelineError(f"{root}: the pipeline does not make a valid wan model: {e}") from None
    if base is not None and base != cfg:
        a, b = cfg.to_dict(), base.to_dict()
        diffs = [f"{k}" for k in b if a.get(k) != b.get(k)]
        raise PipelineError(f"{root}: the converted model is not variant {variant!r}: differs in {', '.join(diffs)}")
    return cfg, cls


def _wan_variants() -> list[str]:
    from manifests.wan.model import list_model_variants
    return list_model_variants()


PIPELINE = PipelineLayout(WAN_COMPONENTS, ("transformer", "text_encoder", "vae"), WAN_ASSETS, WAN_NOT_CONVERTED,
                          _wan_model_config, _wan_variants, WAN_OPTIONAL_ASSETS, _wan_precheck)
# `--from NAME` aliases for wan sources: the formats NAME may mean (detected by config / keys)
SOURCE_ALIASES = {"diffusers": ("diffusers", "diffusers-transformer", "transformers-umt5", "transformers-clip"),
                  "transformers": ("transformers-umt5", "transformers-clip"),
                  "original": ("original", "original-dit", "original-umt5")}
