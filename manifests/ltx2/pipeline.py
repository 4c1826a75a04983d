"""How a diffusers LTX2Pipeline root becomes one canonical ltx2 model directory: the six weighted components, each
by its own manifest (manifests/ltx2/checkpoints/), the tokenizer and scheduler copied verbatim, and the
Ltx2ModelConfig (manifests/ltx2/model.py) read from the pipeline's files and checked for fit. Declared here;
converters/pipeline.py runs it (found through manifests/ltx2/layout.py `LAYOUT.pipeline`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from manifests.errors import ManifestError, PipelineError
from manifests.layouts import PipelineLayout, read_pipeline_json

MODEL_INDEX = "model_index.json"
LTX2_PIPELINES = ("LTX2Pipeline",)
LTX2_COMPONENTS = {"transformer": ("ltx2", "diffusers"), "connectors": ("ltx2", "diffusers-connectors"),
                   "text_encoder": ("ltx2", "transformers-gemma3"), "vae": ("ltx2", "diffusers-vae"),
                   "audio_vae": ("ltx2", "diffusers-audio-vae"), "vocoder": ("ltx2", "diffusers-vocoder")}
LTX2_ASSETS = {"tokenizer": "tokenizer", "scheduler": "scheduler"}
LTX2_NOT_CONVERTED = {
    "processor": "the prompt enhancer's processor: prompt enhancement is not part of the canonical ltx2 model",
    "prompt_enhancer": "prompt enhancement (Gemma 4) is not part of the canonical ltx2 model",
    "duration_head": "the duration head (predicted num_frames) is not ported; requests give num_frames",
}
SOURCE_ALIASES = {"diffusers": ("diffusers", "diffusers-connectors", "transformers-gemma3", "diffusers-vae",
                                "diffusers-audio-vae", "diffusers-vocoder")}
# max_sequence_length is an LTX2Pipeline.__call__ argument (default 1024), not in the pipeline's files
DEFAULT_MAX_SEQUENCE_LENGTH = 1024


def _ltx2_model_config(index: dict, root: Path, cfgs: dict[str, Any], variant: str | None) -> tuple[Any, str]:
    from manifests.ltx2.model import Ltx2ModelConfig, load_model_variant
    from manifests.ltx2.sampling import Ltx2SchedulerConfig

    cls = index.get("_class_name")
    if cls not in LTX2_PIPELINES:
        raise PipelineError(f"{root / MODEL_INDEX}: _class_name {cls!r} is not an ltx2 pipeline this converter "
                            f"knows ({', '.join(LTX2_PIPELINES)})")
    sched_path = root / "scheduler" / "scheduler_config.json"
    sched = read_pipeline_json(sched_path, "scheduler config")
    if sched.get("_class_name") not in (None, "FlowMatchEulerDiscreteScheduler"):
        raise PipelineError(f"{sched_path}: scheduler {sched.get('_class_name')!r} is not the "
                            f"FlowMatchEulerDiscreteScheduler LTX2Pipeline runs")
    base = load_model_variant(variant) if variant else None
    try:
        cfg = Ltx2ModelConfig(
            **{name: cfgs[name] for name in LTX2_COMPONENTS}, scheduler=Ltx2SchedulerConfig.from_diffusers(sched),
            max_sequence_length=base.max_sequence_length if base else DEFAULT_MAX_SEQUENCE_LENGTH).validate()
    except ManifestError as e:
        raise PipelineError(f"{root}: the pipeline does not make a valid ltx2 model: {e}") from None
    if base is not None and base != cfg:
        a, b = cfg.to_dict(), base.to_dict()
        raise PipelineError(f"{root}: the converted model is not variant {variant!r}: differs in "
                            f"{', '.join(k for k in b if a.get(k) != b.get(k))}")
    return cfg, cls


def _ltx2_variants() -> list[str]:
    from manifests.ltx2.model import list_model_variants
    return list_model_variants()


PIPELINE = PipelineLayout(LTX2_COMPONENTS, tuple(LTX2_COMPONENTS), LTX2_ASSETS, LTX2_NOT_CONVERTED,
                          _ltx2_model_config, _ltx2_variants)
