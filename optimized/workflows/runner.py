"""Run a compiled `WorkflowProgram` through the normal runtime: resolve its model files to one canonical model
directory, bind it to an engine (the request the workflow means, with its text nodes through the workflow cache),
run the engine's video program, write every output node's artifact.

Model files: UNETLoader unet_name, CLIPLoader clip_name and VAELoader vae_name are looked up under a models root as
ROOT/NAME, ROOT/<ComfyUI folder>/NAME (diffusion_models, unet, text_encoders, clip, vae), with or without a weights
suffix (.safetensors, ...). Each must name a canonical model directory written by fvconvert (or a component folder
of one), and all three the same directory: the engine runs one whole model (its own text encoder and VAE).

Outputs: every save node writes the project's lossless artifact, a directory of PNG frames + video.json, under
OUT/<filename_prefix>_<node id>/ (the sidecar's "comfy" entry records the node's class and widgets: fps, codec, ...;
WebP / WebM encoders are not part of the artifact writers). An unknown node fed by the VAEDecode is not executed: its
image input is written the same way (passed through).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from optimized.workflows.cache import WorkflowCache, node_keys
from optimized.workflows.compiler import LATENT_TEMPORAL, ModelFile, WorkflowProgram
from optimized.workflows.graph import NodeError, WorkflowError

COMFY_FOLDERS = {"unet_name": ("diffusion_models", "unet"), "clip_name": ("text_encoders", "clip"),
                 "vae_name": ("vae",)}
WEIGHT_SUFFIXES = (".safetensors", ".sft", ".pt", ".pth", ".ckpt", ".bin", ".gguf")


def _node_error(program: WorkflowProgram, ref: ModelFile | str, input_name: str | None, message: str,
                kind: str = "value_not_supported") -> WorkflowError:
    nid = ref.node_id if isinstance(ref, ModelFile) else ref
    name = ref.input_name if isinstance(ref, ModelFile) else input_name
    return WorkflowError([NodeError(nid, program.workflow.nodes[nid].class_type, name, kind, message)])


def _model_root_of(path: Path) -> Path | None:
    """The canonical model directory `path` is (or is a component folder of); None when it is neither."""
    from manifests.checkpoint import read_checkpoint
    for candidate in (path, path.parent):
        try:
            if read_checkpoint(candidate).is_model:
                return candidate.resolve()
        except Exception:  # noqa: BLE001 - not a model directory: try the next candidate
            continue
    return None


def resolve_model_file(root: Path, ref: ModelFile, program: WorkflowProgram) -> Path:
    name = ref.name
    if not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise _node_error(program, ref, None, f"{name!r}: give a name under the models directory")
    stems = [name] + [name[: -len(s)] for s in WEIGHT_SUFFIXES if name.lower().endswith(s)]
    for folder in ("",) + COMFY_FOLDERS[ref.input_name]:
        for stem in stems:
            p = root / folder / stem
            if p.is_dir():
                found = _model_root_of(p)
                if found is not None:
                    return found
    raise _node_error(program, ref, None, f"{name!r}: no canonical model directory of that name under {root} "
                                          f"(write one with fvconvert)", "value_not_in_list")


def resolve_model_dir(program: WorkflowProgram, models_dir: str | Path) -> Path:
    """The one canonical model directory the workflow's three loaders name (WorkflowError naming the loader)."""
    root = Path(models_dir)
    if not root.is_dir():
        raise WorkflowError([NodeError("", "", None, "invalid_prompt", f"--models-dir {root}: no such directory")])
    unet = resolve_model_file(root, program.unet, program)
    for ref in (program.clip, program.vae):
        other = resolve_model_file(root, ref, program)
        if other != unet:
            raise _node_error(program, ref, None, f"{ref.name!r} is {other.name}, but the UNETLoader's model is "
                                                  f"{unet.name}: the engine runs one whole model directory (its own "
                                                  f"text encoder and VAE)")
    return unet


def served_names(engine: Any) -> set[str]:
    """The model file names that mean the engine's own model: its directory's name (with or without a weights
    suffix is the caller's business) or its variant."""
    names = set()
    ckpt = engine.__dict__.get("checkpoint_path")
    if ckpt:
        names.add(Path(ckpt).resolve().name)
        names.add(Path(ckpt).name)
    variant = engine.__dict__.get("variant")
    if variant:
        names.add(str(variant))
    return names


def check_served_model(program: WorkflowProgram, engine: Any) -> None:
    """For a server with one loaded model: every loader must name it."""
    names = served_names(engine)
    for ref in (program.unet, program.clip, program.vae):
        stem = next((ref.name[: -len(s)] for s in WEIGHT_SUFFIXES if ref.name.lower().endswith(s)), ref.name)
        if Path(stem).name not in names:
            raise _node_error(program, ref, None, f"{ref.name!r} is not the served model (served: "
                                                  f"{', '.join(sorted(names)) or 'none'})", "value_not_in_list")


# ------------------------------------------------------------------------------------------------------ binding
@dataclass
class BoundWorkflow:
    program: WorkflowProgram
    request: Any                                   # the family request the workflow means
    cache_hits: dict[str, bool] = field(default_factory=dict)   # text node id -> served from the workflow cache


def _text_ids(engine: Any, text: str) -> torch.Tensor:
    from optimized.serving.requests import processor_for, tokens_for
    proc = processor_for(engine)
    return proc.encode([text])[0] if proc is not None else tokens_for(engine, text, None)


def bind(program: WorkflowProgram, engine: Any, cache: WorkflowCache | None = None) -> BoundWorkflow:
    """The request `program` means on `engine` (WorkflowError naming the node that cannot map onto it)."""
    from optimized.serving.families import ServingError
    from optimized.serving.requests import build_request
    cfg = engine.model.cfg
    if engine.family.name != program.family:
        raise _node_error(program, program.clip, "type", f"a {program.family} text encoder, but the model is a "
                                                         f"{engine.family.name} model")
    lat = program.latent
    if getattr(cfg, "two_experts", False):
        raise _node_error(program, program.unet, None, "the model has two experts; this workflow shape (one "
                                                       "KSampler) compiles for one-expert models")
    if getattr(cfg, "task", "t2v") != lat.task:
        raise _node_error(program, lat.node_id, None, f"{lat.class_type} is the latent of wan {lat.task} models; "
                                                      f"this model is a {cfg.task} model")
    vae = cfg.vae
    if (vae.temporal_compression, vae.spatial_compression) != (LATENT_TEMPORAL, lat.spatial):
        raise _node_error(program, lat.node_id, None,
                          f"{lat.class_type} makes {LATENT_TEMPORAL}x temporal / {lat.spatial}x spatial latents; "
                          f"this model's VAE compresses {vae.temporal_compression}x / {vae.spatial_compression}x")
    keys = node_keys(program.workflow, str(getattr(engine.model, "weights_version", None) or "unknown"),
                     str(engine.model.dtype).removeprefix("torch."))
    hits: dict[str, bool] = {}
    ids: dict[str, torch.Tensor] = {}
    s = program.sampling
    prompts = [program.positive] + ([program.negative] if s.guidance_scale > 1.0 else [])
    for p in prompts:   # (upstream) the negative prompt is encoded only when CFG runs (guidance_scale > 1)
        got = cache.lookup(keys[p.node_id]) if cache is not None else None
        hits[p.node_id] = got is not None
        if got is None:
            try:
                got = _text_ids(engine, p.text)
            except (ServingError, ValueError) as e:
                raise _node_error(program, p.node_id, "text", str(e)) from None
            if cache is not None:
                cache.remember(keys[p.node_id], got)
        ids[p.node_id] = got
    try:
        request, _ = build_request(
            engine, prompt_ids=ids[program.positive.node_id].tolist(),
            negative_prompt_ids=ids[program.negative.node_id].tolist() if program.negative.node_id in ids else None,
            num_frames=lat.num_frames, height=lat.height, width=lat.width, num_steps=s.steps,
            guidance_scale=s.guidance_scale, seed=s.seed, flow_shift=s.flow_shift)
        request = dataclasses.replace(request, solver=s.solver)
        engine.admit(request)
    except (ServingError, ValueError, TypeError) as e:
        field_name = getattr(e, "field", None) or ""
        target = {"num_frames": (lat.node_id, "length"), "height": (lat.node_id, "height"),
                  "width": (lat.node_id, "width"), "num_steps": (s.node_id, "steps"),
                  "seed": (s.node_id, "seed"), "guidance_scale": (s.node_id, "cfg")}.get(field_name, (s.node_id, None))
        raise _node_error(program, target[0], target[1], str(e)) from None
    return BoundWorkflow(program, request, hits)


# ------------------------------------------------------------------------------------------------------ outputs
def _safe_prefix(prefix: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", prefix.replace("/", "_")).strip("._") or "ComfyUI"


def output_dir_name(output: Any) -> str:
    return f"{_safe_prefix(output.filename_prefix)}_{output.node_id}"


def write_outputs(program: WorkflowProgram, result: Any, out: str | Path) -> dict[str, dict]:
    """Every output node's artifact under OUT (written into a temp directory renamed to OUT: all or nothing);
    {node id: {class_type, paths}}."""
    from optimized.programs import check_out_path, write_video_artifacts
    target = Path(out)
    if target.suffix:
        raise ValueError(f"out: {out} must name a directory (one folder per output node)")
    check_out_path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    written: dict[str, dict] = {}
    try:
        for o in program.outputs:
            name = output_dir_name(o)
            paths = write_video_artifacts(result, tmp / name)
            sidecar = tmp / name / "video.json"
            meta = json.loads(sidecar.read_text())
            meta["comfy"] = {"node_id": o.node_id, "class_type": o.class_type, "filename_prefix": o.filename_prefix,
                             "options": o.options, "passed_through": o.external}
            sidecar.write_text(json.dumps(meta, indent=2, sort_keys=True))
            written[o.node_id] = {"class_type": o.class_type, "dir": name,
                                  "paths": {k: str(target / Path(v).relative_to(tmp)) for k, v in paths.items()}}
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


__all__ = ["BoundWorkflow", "bind", "check_served_model", "output_dir_name", "resolve_model_dir",
           "resolve_model_file", "served_names", "write_outputs"]
