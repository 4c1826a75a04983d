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
from typing import Callable

from converters.engine import (DEFAULT_MAX_SHARD_BYTES, MANIFEST_NAME, REPORT_NAME, ConversionReport, PostCheck,
                               Progress, _prepare, check_output, staged_output, write_component)
from converters.errors import ConversionError
from converters.hooks import MissingPostCheck
from converters.manifest import load_manifest
from converters.readers import open_weights, weight_kind_of
from converters.writer import json_bytes, write_bytes
from manifests.checkpoint import FORMAT_VERSION, MODEL_INDEX, weights_version_of
from manifests.errors import PipelineError
from manifests.layouts import PipelineLayout, family_layouts, pipeline_lists, read_pipeline_json

PIPELINE = "pipeline"
PipelineSpec = PipelineLayout   # how one family's diffusers pipeline root becomes a model directory


def pipeline_families() -> dict[str, PipelineLayout]:
    """{family: its pipeline layout}, from each family's manifests/<family>/layout.py `LAYOUT.pipeline` (no table
    here names a family)."""
    return {name: lay.pipeline for name, lay in family_layouts().items() if lay.pipeline is not None}


def source_aliases(family: str) -> dict[str, tuple[str, ...]]:
    """`--from NAME` aliases of `family` (its layout's `source_aliases`): the formats NAME may mean; detection
    picks one by the source's config / keys."""
    lay = family_layouts().get(family)
    return dict(lay.source_aliases) if lay is not None else {}


def _json(path: Path, what: str) -> dict:
    try:
        return read_pipeline_json(path, what)
    except PipelineError as e:
        raise ConversionError(str(e)) from None


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
    if fmt == "diffusers" and family in pipeline_families() and _is_pipeline_root(src):
        return PIPELINE
    cands = source_aliases(family).get(fmt)
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


_listed = pipeline_lists


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
    known = pipeline_families()
    spec = known.get(family)
    if spec is None:
        raise ConversionError(f"{family}: whole-pipeline conversion is not defined (known: {', '.join(known)})")
    check_output(src, out, force)
    index = _json(src / MODEL_INDEX, "pipeline model_index.json")
    try:
        spec.precheck(index, src)
    except PipelineError as e:
        raise ConversionError(str(e)) from None
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
            if source_aliases(of_family) and fmt != want:   # a family with aliases says which format a folder holds
                raise ConversionError(f"{src / name}: expected a {want} folder for {name!r}, its config says {fmt}")
            prepared[name] = _prepare(of_family, want, src / name, None, dtype, False, None)
        cfgs = {name: p[4].cfg for name, p in prepared.items()}
        try:
            cfg, cls = spec.model_config(index, src, cfgs, variant)
        except PipelineError as e:
            raise ConversionError(str(e)) from None
        reports: dict[str, ConversionReport] = {}
        with staged_output(out) as tmp:
            for name, p in prepared.items():
                manifest = p[1]
                say(f"{name}: converting ({manifest.id})")
                post = None
                if not skip_parity and post_check_for is not None:
                    try:
                        post = post_check_for(manifest.post_check_name)
                    except MissingPostCheck:    # not wired by the family's parity entry yet: its report says so
                        post = None
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


__all__ = ["PIPELINE", "pipeline_families", "source_aliases", "PipelineReport", "PipelineSpec", "convert_pipeline",
           "detect_format"]
