"""Format detection for `--from` aliases, and whole-pipeline conversion into one canonical model directory.

    fvconvert wan --from diffusers <pipeline root> OUT      model_index.json + transformer/ [transformer_2/]
                                                             text_encoder/ vae/ tokenizer/ scheduler/
                                                             [image_encoder/ image_processor/] (2.1 I2V: required)
    fvconvert cosmos3 --from diffusers <pipeline root> OUT  model_index.json + transformer/ vae/ (a wan VAE)
                                                             [sound_tokenizer/] tokenizer/ (from text_tokenizer/)
                                                             scheduler/
    OUT/model_index.json   {"family": "wan", "format_version": 1, "config": WanModelConfig.to_dict(),
                            "components": {"transformer": "transformer", ...}, "assets": {"tokenizer": ...},
                            "weights_version": "sha256:<hex>", "source": {...}}
    OUT/<component>/       one canonical single-component dir each (config.json, manifest.json, model*.safetensors,
                           conversion_report.json), written by the (family, format) manifest the family's
                           `PipelineSpec.components` names (the cosmos3 VAE by the wan `diffusers` VAE manifest)
    OUT/tokenizer/, OUT/scheduler/   copied verbatim
    OUT/conversion_report.json       per component: format, weights_version, parity; assets with sha256

`--from diffusers DIR` on a component folder picks the component's format from DIR/config.json (`_class_name`
WanTransformer3DModel / AutoencoderKLWan, or a umt5 `model_type`); `--from original FILE` picks the original
format whose rules match every key of FILE. Everything is checked (every component planned, the model config
built and validated) before a byte is written; OUT appears only when every component is written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from converters.engine import (DEFAULT_MAX_SHARD_BYTES, MANIFEST_NAME, REPORT_NAME, ConversionReport, PostCheck,
                               Progress, _prepare, check_output, staged_output, write_component)
from converters.errors import ConversionError
from converters.manifest import load_manifest
from converters.readers import open_weights, weight_kind_of
from converters.writer import json_bytes, write_bytes
from manifests.checkpoint import FORMAT_VERSION, MODEL_INDEX, weights_version_of
from manifests.errors import ManifestError

PIPELINE = "pipeline"
# `--from NAME` aliases: the formats NAME may mean; detection picks one by the source's config / keys
ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "wan": {"diffusers": ("diffusers", "diffusers-transformer", "transformers-umt5", "transformers-clip"),
            "transformers": ("transformers-umt5", "transformers-clip"),
            "original": ("original", "original-dit", "original-umt5")},
}
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


def _json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{path}: {what} not found") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: unreadable {what} ({e})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return data


def _by_config(family: str, cands: tuple[str, ...], cfg_path: Path) -> str | None:
    """The candidate format whose upstream class / model_type the config names (None: no config or no match)."""
    if not cfg_path.is_file():
        return None
    raw = _json(cfg_path, "config")
    arch = raw.get("architectures") or []
    for fmt in cands:
        m = load_manifest(family, fmt)
        if m.upstream_class_name and raw.get("_class_name") == m.upstream_class_name:
            return fmt
        types = m.upstream.get("model_types")
        if types and (raw.get("model_type") in types or any(a.lower().startswith(t) for t in types for a in arch)):
            return fmt
    return None


def _by_keys(family: str, cands: tuple[str, ...], src: Path) -> str | None:
    """The candidate format whose rules match the most keys of SRC's weights (a file, or the candidate's weight file
    inside the folder); None when no candidate's weights are there."""
    best: tuple[int, str] | None = None
    if src.is_dir():
        holding = [f for f in cands if any((src / w.path).is_file() for w in load_manifest(family, f).weight_files)]
        if len(holding) > 1:
            raise ConversionError(f"{src}: holds the weights of several formats ({', '.join(holding)}); pass the "
                                  f"weights file itself (e.g. the DiT's *.safetensors.index.json) or name the format "
                                  f"with --from {holding[0]}")
    for fmt in cands:
        m = load_manifest(family, fmt)
        if src.is_file():
            kind, path = weight_kind_of(src), src
            if kind is None:
                return None
        else:
            present = [w for w in m.weight_files if (src / w.path).is_file()]
            if not present:
                continue
            kind, path = present[0].kind, src / present[0].path
        with open_weights(kind, path) as reader:
            keys = list(reader.infos())
        n = sum(m.match(m.normalize_key(k))[0] is not None for k in keys)
        if n and (best is None or n > best[0]):
            best = (n, fmt)
    return best[1] if best else None


def _is_pipeline_root(src: Path) -> bool:
    """A diffusers pipeline root: a model_index.json naming the pipeline class (a unified cosmos3 release root may
    hold a model_index.json without one: that stays a transformer source)."""
    if not (src.is_dir() and (src / MODEL_INDEX).is_file()):
        return False
    try:
        return "_class_name" in json.loads((src / MODEL_INDEX).read_text())
    except (OSError, ValueError, TypeError):
        return True     # unreadable: the pipeline conversion says why


def detect_format(family: str, fmt: str, src: str | Path) -> str:
    """The format name `--from fmt` means for SRC, or PIPELINE for a diffusers pipeline root. A name that is no
    alias (or a manifest path) is returned unchanged."""
    src = Path(src)
    if fmt == "diffusers" and family in PIPELINE_FAMILIES and _is_pipeline_root(src):
        return PIPELINE
    cands = ALIASES.get(family, {}).get(fmt)
    if cands is None or not src.exists():
        return fmt
    if len(cands) == 1:
        return cands[0]
    cfg = src / "config.json" if src.is_dir() else src.parent / "config.json"
    found = _by_config(family, cands, cfg) if fmt != "original" else None
    if found is None and fmt == "original":
        found = _by_keys(family, cands, src)
    return found or cands[0]


# ---------------------------------------------------------------------------------------------
# whole pipeline -> model directory


@dataclass
class PipelineReport:
    family: str
    src: str
    out: str
    pipeline_class: str
    config: dict
    components: dict[str, dict]                   # name -> {format, weights_version, parity, num_output_keys, ...}
    assets: dict[str, list[dict]]                 # name -> [{path, bytes, sha256}]
    not_converted: dict[str, str]                 # pipeline entry -> why it is not in OUT
    weights_version: str
    elapsed_s: float = 0.0
    created_utc: str = ""
    reports: dict[str, ConversionReport] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("reports")
        return d


def _listed(index: dict, name: str) -> bool:
    entry = index.get(name)
    return isinstance(entry, list) and entry not in ([None, None], [])


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
        raise ConversionError(f"{root}: a Wan 2.1 I2V pipeline (its transformer has an image branch, image_dim "
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
        raise ConversionError(f"{path}: {e}") from None


def _wan_model_config(index: dict, root: Path, cfgs: dict[str, Any], variant: str | None) -> tuple[Any, str]:
    from manifests.wan.model import WanModelConfig, load_model_variant

    cls = index.get("_class_name")
    if cls not in WAN_PIPELINES:
        raise ConversionError(f"{root / MODEL_INDEX}: _class_name {cls!r} is not a wan pipeline this converter knows "
                              f"({', '.join(WAN_PIPELINES)})")
    expand = bool(index.get("expand_timesteps") or False)
    task = "ti2v" if expand else WAN_PIPELINES[cls]   # Wan2.2 TI2V 5B is a WanPipeline with expand_timesteps
    sched_path = root / "scheduler" / "scheduler_config.json"
    sched = _json(sched_path, "scheduler config")
    if sched.get("_class_name") not in SCHEDULERS:
        raise ConversionError(f"{sched_path}: scheduler {sched.get('_class_name')!r} is not one the wan model knows "
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
        raise ConversionError(f"{root}: the pipeline does not make a valid wan model: {e}") from None
    if base is not None and base != cfg:
        a, b = cfg.to_dict(), base.to_dict()
        diffs = [f"{k}" for k in b if a.get(k) != b.get(k)]
        raise ConversionError(f"{root}: the converted model is not variant {variant!r}: differs in {', '.join(diffs)}")
    return cfg, cls


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
        raise ConversionError(f"{root / MODEL_INDEX}: _class_name {cls!r} is not a cosmos3 pipeline this converter "
                              f"knows ({', '.join(COSMOS3_PIPELINES)})")
    sched_path = root / "scheduler" / "scheduler_config.json"
    try:
        # use_native_flow_schedule is a pipeline option (model_index.json), not a scheduler setting (upstream)
        scheduler = unipc_from_scheduler_config(_json(sched_path, "scheduler config"),
                                                bool(index.get("use_native_flow_schedule") or False))
        cfg = Cosmos3ModelConfig(transformer=cfgs["transformer"], vae=cfgs["vae"],
                                 sound=cfgs.get("sound_tokenizer"), scheduler=scheduler).validate()
    except ManifestError as e:
        raise ConversionError(f"{root}: the pipeline does not make a valid cosmos3 model: {e}") from None
    if variant is not None:
        from manifests.cosmos3.config import load_variant
        if load_variant(variant) != cfg.transformer:
            raise ConversionError(f"{root}: the converted transformer is not variant {variant!r}")
    return cfg, cls


@dataclass(frozen=True)
class PipelineSpec:
    """How one family's diffusers pipeline root becomes a model directory."""
    components: dict[str, tuple[str, str]]        # pipeline entry -> (converter family, format) it is written with
    required: tuple[str, ...]                     # entries the model cannot do without
    assets: dict[str, str]                        # pipeline entry copied verbatim -> its folder in OUT
    not_converted: dict[str, str]                 # entries deliberately left out -> why
    model_config: Callable[..., tuple[Any, str]]  # (model_index, root, {entry: config}, variant) -> (config, class)
    variants: Callable[[], list[str]]             # what --variant may name
    optional_assets: dict[str, str] = field(default_factory=dict)   # copied verbatim when the pipeline lists them
    precheck: Callable[[dict, Path], None] = lambda index, root: None  # (model_index, root): refuse before planning


def _wan_variants() -> list[str]:
    from manifests.wan.model import list_model_variants
    return list_model_variants()


def _cosmos3_variants() -> list[str]:
    from manifests.cosmos3.config import list_variants
    return list_variants()


PIPELINE_FAMILIES: dict[str, PipelineSpec] = {
    "wan": PipelineSpec(WAN_COMPONENTS, ("transformer", "text_encoder", "vae"), WAN_ASSETS, WAN_NOT_CONVERTED,
                        _wan_model_config, _wan_variants, WAN_OPTIONAL_ASSETS, _wan_precheck),
    "cosmos3": PipelineSpec(COSMOS3_COMPONENTS, ("transformer", "vae"), COSMOS3_ASSETS, COSMOS3_NOT_CONVERTED,
                            _cosmos3_model_config, _cosmos3_variants),
}


def _hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_pipeline(family: str, src: str | Path, out: str | Path, *, variant: str | None = None,
                     dtype: str | None = None, force: bool = False, allow_nonfinite: bool = False,
                     skip_parity: bool = False, post_check_for: Callable[[str], PostCheck | None] | None = None,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: Progress | None = None
                     ) -> PipelineReport:
    """Convert every component of a diffusers pipeline root into one canonical model directory OUT (see the module
    doc). post_check_for(name) gives the post-check a component manifest names (`parity.post_check`); a component
    whose check is not wired records {"status": "not run", "reason"} in its report."""
    t0 = time.time()
    say = progress or (lambda _m: None)
    src, out = Path(src), Path(out)
    spec = PIPELINE_FAMILIES.get(family)
    if spec is None:
        raise ConversionError(f"{family}: whole-pipeline conversion is not defined (known: {', '.join(PIPELINE_FAMILIES)})")
    check_output(src, out, force)
    index = _json(src / MODEL_INDEX, "pipeline model_index.json")
    spec.precheck(index, src)
    assets_here = {**spec.assets, **{e: n for e, n in spec.optional_assets.items() if _listed(index, e)}}
    present: dict[str, str] = {}
    not_converted: dict[str, str] = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list):
            continue        # _class_name, _diffusers_version, boundary_ratio, expand_timesteps, ...
        if entry == [None, None] or entry == []:
            continue        # an optional component this release does not have (e.g. transformer_2)
        if name in spec.components:
            present[name] = spec.components[name]
        elif name in spec.not_converted:
            not_converted[name] = spec.not_converted[name]
        elif name not in spec.assets and name not in spec.optional_assets:
            raise ConversionError(f"{src / MODEL_INDEX}: pipeline entry {name!r} ({entry}) is not a {family} component "
                                  f"this converter knows ({', '.join([*spec.components, *spec.assets])})")
    lacking = [n for n in spec.required if n not in present]
    if lacking:
        raise ConversionError(f"{src / MODEL_INDEX}: the pipeline lacks component(s) {', '.join(lacking)}")
    for name in [*present, *assets_here]:
        if not (src / name).is_dir():
            raise ConversionError(f"{src / name}: folder of pipeline entry {name!r} is missing")

    prepared: dict[str, tuple] = {}
    try:
        for name, (of_family, want) in present.items():        # plan everything before writing anything
            fmt = detect_format(of_family, "diffusers", src / name)
            if of_family in ALIASES and fmt != want:       # a family with aliases says which format a folder holds
                raise ConversionError(f"{src / name}: expected a {want} folder for {name!r}, its config says {fmt}")
            prepared[name] = _prepare(of_family, want, src / name, None, dtype, False, None)
        cfgs = {name: p[4].cfg for name, p in prepared.items()}
        cfg, cls = spec.model_config(index, src, cfgs, variant)
        reports: dict[str, ConversionReport] = {}
        with staged_output(out) as tmp:
            for name, p in prepared.items():
                manifest = p[1]
                say(f"{name}: converting ({manifest.id})")
                post = None if skip_parity or post_check_for is None else post_check_for(manifest.post_check_name)
                (tmp / name).mkdir()
                reports[name] = write_component(
                    tmp / name, out / name, p, src=src / name, dtype=dtype, allow_truncate=False,
                    allow_nonfinite=allow_nonfinite, keep_sidecars=False, post_check=post, skip_parity=skip_parity,
                    max_shard_bytes=max_shard_bytes, say=say, progress_every=None, progress_update=None, t0=time.time(),
                    missing_post_check="not run")
            assets: dict[str, list[dict]] = {}
            for entry, name in assets_here.items():
                (tmp / name).mkdir()
                files = []
                for f in sorted((src / entry).iterdir()):
                    if not f.is_file():
                        raise ConversionError(f"{f}: asset folders are copied verbatim and must hold only files")
                    shutil.copyfile(f, tmp / name / f.name)
                    files.append({"path": f"{name}/{f.name}", "bytes": f.stat().st_size, "sha256": _hash(tmp / name / f.name)})
                assets[name] = files
            cfg_dict = cfg.to_dict()
            version = weights_version_of(
                [(f"component:{n}", r.weights_version) for n, r in reports.items()]
                + [("config", hashlib.sha256(json.dumps(cfg_dict, sort_keys=True).encode()).hexdigest())]
                + [(a["path"], a["sha256"]) for files in assets.values() for a in files])
            write_bytes(tmp / MODEL_INDEX, json_bytes({
                "family": family, "format_version": FORMAT_VERSION, "config": cfg_dict,
                "components": {n: n for n in reports}, "assets": {n: n for n in assets}, "weights_version": version,
                "source": {"path": str(src.resolve()), "pipeline_class": cls,
                           "diffusers_version": index.get("_diffusers_version")}}))
            report = PipelineReport(
                family=family, src=str(src.resolve()), out=str(out.resolve()), pipeline_class=cls, config=cfg_dict,
                components={n: {"format": r.format, "component": r.component, "weights_version": r.weights_version,
                                "num_output_keys": r.num_output_keys, "parity": r.parity,
                                "report": f"{n}/{REPORT_NAME}", "manifest": f"{n}/{MANIFEST_NAME}"}
                            for n, r in reports.items()},
                assets=assets, not_converted=not_converted, weights_version=version, reports=reports)
            report.elapsed_s = round(time.time() - t0, 3)
            report.created_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            write_bytes(tmp / REPORT_NAME, json_bytes(report.to_dict()))
    finally:
        for p in prepared.values():
            p[3].close()
    say(f"done: {out} ({len(reports)} components, {report.elapsed_s:.1f}s)")
    return report


__all__ = ["ALIASES", "PIPELINE", "PIPELINE_FAMILIES", "PipelineReport", "PipelineSpec", "convert_pipeline",
           "detect_format"]
